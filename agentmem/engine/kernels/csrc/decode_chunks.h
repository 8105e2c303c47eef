/* How both libraries' decode attention (bf16/attention_decode.c, fp32/attention_decode.c) cuts a
   row's keys into chunks and merges them: the keys of a (row, chunk) item, about four chunks a
   thread over all the rows, 32 to DA_MAX keys; and each chunk's weight in the merged output. */
#ifndef AGENTMEM_DECODE_CHUNKS_H
#define AGENTMEM_DECODE_CHUNKS_H
#include <math.h>
#include <stdint.h>

#define DA_MAX 256  /* keys of a chunk at most */
static int64_t da_chunk(int64_t B, int64_t W, int threads) {
    int64_t ch = (W * B + 4 * (int64_t)threads - 1) / (4 * (int64_t)(threads > 0 ? threads : 1));
    ch = (ch + 15) / 16 * 16;
    return ch < 32 ? 32 : ch > DA_MAX ? DA_MAX : ch;
}

/* The weight of each of row b's nc chunk items for head h in the merged output (part: per item
   and head the chunk's score maximum, exp sum and ldp - 2 V sums): exp(max - row max) over the
   row's total exp sum, 0 for a chunk that kept no key (all 0 for a row that kept none). */
static void da_weights(const float *part, int64_t nc, int64_t H, int64_t ldp, int64_t b, int64_t h, float *w) {
    float mx = -INFINITY, L = 0.0f;
    for (int64_t c = 0; c < nc; c++) {
        const float *p = part + ((b * nc + c) * H + h) * ldp;
        if (p[1] > 0.0f && p[0] > mx) mx = p[0];
    }
    for (int64_t c = 0; c < nc; c++) {
        const float *p = part + ((b * nc + c) * H + h) * ldp;
        w[c] = p[1] > 0.0f ? expf(p[0] - mx) : 0.0f;
        L += w[c] * p[1];
    }
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (int64_t c = 0; c < nc; c++) w[c] *= inv;
}
#endif
