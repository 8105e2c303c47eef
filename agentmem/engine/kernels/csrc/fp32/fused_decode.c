/* The fused decode layer for fp32 rows on int8 or 4-bit weights: a whole layer
   (agentmem_avx2_layer_q8) and every layer of a step (agentmem_avx2_layers_q8), each in one team
   of threads. Built from the separate calls' kernels, so it follows them in fp32.c: gemv_q8.c,
   gemv_q4.c, rmsnorm.c, rope.c, attention_decode.c and silu_mul.c. */
#include "common.h"

/* n fp32 values to fp16 (round to nearest even, as torch's .to(float16) rounds); n a multiple of 8. */
static void to_f16(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
}

/* Scratch of the layer functions below for M rows: quantized rows and their steps, the fp32
   intermediates, and the attention's chunk sums (da_part, chunks of ch keys). Allocated once a
   call: `agentmem_avx2_layers_q8` shares it across its layers. */
typedef struct {
    int16_t *xq;
    int8_t *xq8;  /* the q4 products' int8 rows, their steps and group sums */
    float *xs, *xs8, *xsum, *nx, *qkv, *qk, *attn, *h2, *gu, *part;
    int64_t ch;
} LayerScratch;

static LayerScratch layer_scratch(int64_t M, int64_t D, int64_t H, int64_t KV, int64_t hd, int64_t I, int64_t W,
                                  int threads) {
    const int64_t QK = H + KV, NQKV = (QK + KV) * hd, HD = H * hd;
    const int64_t K = D > HD ? (D > I ? D : I) : (HD > I ? HD : I);
    LayerScratch t;
    t.xq = (int16_t *)aligned_alloc(32, (size_t)((M * K * 2 + 31) / 32 * 32));
    t.xs = (float *)malloc(sizeof(float) * (size_t)M);
    t.xq8 = (int8_t *)malloc((size_t)(M * K) + 32);
    t.xs8 = (float *)malloc(sizeof(float) * (size_t)(M * (K / Q8_BLOCK) + 1));
    t.xsum = (float *)malloc(sizeof(float) * (size_t)(M * (K / Q4_GROUP) + 1));
    t.nx = (float *)malloc(sizeof(float) * (size_t)(M * D));
    t.qkv = (float *)malloc(sizeof(float) * (size_t)(M * NQKV));
    t.qk = (float *)malloc(sizeof(float) * (size_t)(M * QK * hd));
    t.attn = (float *)malloc(sizeof(float) * (size_t)(M * HD));
    t.h2 = (float *)malloc(sizeof(float) * (size_t)(M * D));
    t.gu = (float *)malloc(sizeof(float) * (size_t)(M * 2 * I));
    t.ch = da_chunk(M, W, threads);
    t.part = da_part(M, W, H, hd, t.ch);
    return t;
}

static void layer_scratch_free(LayerScratch *t) {
    free(t->part); free(t->gu); free(t->h2); free(t->attn); free(t->qk); free(t->qkv); free(t->nx); free(t->xs);
    free(t->xq); free(t->xq8); free(t->xs8); free(t->xsum);
}

/* Row m of x (K inputs) quantized for the layer's products: int16 for int8 weights, int8 in
   blocks for 4-bit ones (`q4`). */
static inline void quant_row(int q4, const float *x, int64_t K, int64_t m, const LayerScratch *t) {
    if (q4) quantize8(x, K, t->xq8 + m * K, t->xs8 + m * (K / Q8_BLOCK), t->xsum + m * (K / Q4_GROUP));
    else quantize(x, K, t->xq + m * K, t->xs + m);
}

/* For the calling team: one of the layer's products of the rows `quant_row` made (w, s: int8
   weights and their fp32 scales, or with `q4` 4-bit ones and their fp16 d and m). */
static void team_product(int q4, const void *w, const void *s, float *y, const float *b, const float *r, int64_t M,
                         int64_t N, int64_t K, const LayerScratch *t) {
    if (q4) team_groups_q4((const uint8_t *)w, (const uint16_t *)s, t->xq8, t->xs8, t->xsum, y, b, r, M, N, K);
    else team_groups((const int8_t *)w, (const float *)s, t->xq, t->xs, y, b, r, M, N, K);
}

/* For the calling team: one decoder layer of M decode rows (`agentmem_avx2_layer_q8` says what). */
static void team_layer(const float *h, float *out, const float *nw1, const float *nw2, float eps,
                       const void *wqkv, const void *sqkv, const float *bqkv, const float *cs, const float *sn,
                       void *kp, void *vp, int h16, const int64_t *wslot, const int64_t *idx, const uint8_t *keep,
                       int64_t W, float scale, const void *wo, const void *so, const float *bo,
                       const void *wgu, const void *sgu, const void *wd, const void *sd, int64_t M,
                       int64_t D, int64_t H, int64_t KV, int64_t hd, int64_t I, int q4, const LayerScratch *t) {
    const int64_t QK = H + KV, NQKV = (QK + KV) * hd, HD = H * hd, row = KV * hd;
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        agentmem_avx2_rms_norm_f32(h + m * D, D, nw1, t->nx + m * D, 1, D, eps);
        quant_row(q4, t->nx + m * D, D, m, t);
    }
    team_product(q4, wqkv, sqkv, t->qkv, bqkv, NULL, M, NQKV, D, t);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *qkv = t->qkv + m * NQKV;
        float *qk = t->qk + m * QK * hd;
        agentmem_avx2_rope_f32(qkv, NQKV, cs + m * hd, sn + m * hd, qk, 1, QK, hd);
        if (h16) {
            to_f16(qk + HD, (uint16_t *)kp + wslot[m] * row, row);
            to_f16(qkv + QK * hd, (uint16_t *)vp + wslot[m] * row, row);
        } else {
            memcpy((float *)kp + wslot[m] * row, qk + HD, sizeof(float) * (size_t)row);
            memcpy((float *)vp + wslot[m] * row, qkv + QK * hd, sizeof(float) * (size_t)row);
        }
    }
    team_decode_attn(t->qk, QK * hd, kp, vp, idx, keep, t->attn, HD, M, H, KV, hd, W, scale, t->ch, t->part, h16);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) quant_row(q4, t->attn + m * HD, HD, m, t);
    team_product(q4, wo, so, t->h2, bo, h, M, D, HD, t);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        agentmem_avx2_rms_norm_f32(t->h2 + m * D, D, nw2, t->nx + m * D, 1, D, eps);
        quant_row(q4, t->nx + m * D, D, m, t);
    }
    team_product(q4, wgu, sgu, t->gu, NULL, NULL, M, 2 * I, D, t);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float *gu = t->gu + m * 2 * I;
        silu_mul_row(gu, I, gu);  /* in place: y[i..i+8) is written after gu[i..i+8) and gu[I+i..) are read */
        quant_row(q4, gu, I, m, t);
    }
    team_product(q4, wd, sd, out, NULL, t->h2, M, D, I, t);  /* ends in the team's barrier */
}

/* A whole decoder layer for M decode rows (one query each) of fp32 hidden states h [M, D], every
   product int8 on this kernel (packed by cpu_bf16.pack, fp32 scales, optional fp32 biases of qkv
   and o), in one call and one team of threads instead of about fifteen calls and five teams:
     rows normed (nw1) and quantized; qkv = wqkv(.) (+ bqkv) [M, (H + 2 KV) hd];
     q and k heads rotated (tables cs/sn [M, hd]) into qk; the row's rotated k and its v written
       to this layer's pool (kp/vp [slots, KV, hd], fp32, or fp16 where h16) at wslot[m];
     the decode attention of each row over its keys (idx/keep [M, W], as the call above);
     h2 = h + o(attn) (+ bo); rows of h2 normed (nw2); gu = wgu(.); out = h2 + down(silu(gate) * up).
   The same arithmetic as the separate calls (each step's rounding included), in another order
   of threads only where the separate calls also split work. */
void agentmem_avx2_layer_q8(const float *h, float *out, const float *nw1, const float *nw2, float eps,
                            const void *wqkv, const void *sqkv, const float *bqkv, const float *cs, const float *sn,
                            void *kp, void *vp, int h16, const int64_t *wslot, const int64_t *idx, const uint8_t *keep,
                            int64_t W, float scale, const void *wo, const void *so, const float *bo,
                            const void *wgu, const void *sgu, const void *wd, const void *sd, int64_t M,
                            int64_t D, int64_t H, int64_t KV, int64_t hd, int64_t I, int q4, int threads) {
    LayerScratch t = layer_scratch(M, D, H, KV, hd, I, W, threads);
    #pragma omp parallel num_threads(threads)
    team_layer(h, out, nw1, nw2, eps, wqkv, sqkv, bqkv, cs, sn, kp, vp, h16, wslot, idx, keep, W, scale, wo, so, bo,
               wgu, sgu, wd, sd, M, D, H, KV, hd, I, q4, &t);
    layer_scratch_free(&t);
}

/* Every layer of a decode step in one call and one team of threads: `team_layer` for layers
   0..L-1 in turn (the scratch allocated once), each from the last one's output (two rows of
   buffers ping-pong; the last layer writes out). Layer l's weights are w[l * LAYER_PTRS + j] in
   the order of `agentmem_avx2_layer_q8`'s arguments (nw1, nw2, wqkv, sqkv, bqkv, wo, so, bo,
   wgu, sgu, wd, sd; a bias may be NULL), its pool K/V at kp/vp + l * pstride elements (fp16
   where h16). */
#define LAYER_PTRS 12
void agentmem_avx2_layers_q8(const float *h, float *out, int64_t L, void *const *w, float eps, const float *cs,
                             const float *sn, void *kp, void *vp, int64_t pstride, int h16, const int64_t *wslot,
                             const int64_t *idx, const uint8_t *keep, int64_t W, float scale, int64_t M, int64_t D,
                             int64_t H, int64_t KV, int64_t hd, int64_t I, int q4, int threads) {
    LayerScratch t = layer_scratch(M, D, H, KV, hd, I, W, threads);
    float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * M * D));
    const int64_t es = h16 ? 2 : 4;
    #pragma omp parallel num_threads(threads)
    for (int64_t l = 0; l < L; l++) {  /* every thread walks the same layers; team_layer's barriers order them */
        void *const *p = w + l * LAYER_PTRS;
        const float *x = l == 0 ? h : buf + ((l - 1) & 1) * M * D;
        float *y = l == L - 1 ? out : buf + (l & 1) * M * D;
        team_layer(x, y, p[0], p[1], eps, p[2], p[3], p[4], cs, sn, (char *)kp + l * pstride * es,
                   (char *)vp + l * pstride * es, h16, wslot, idx, keep, W, scale, p[5], p[6], p[7], p[8], p[9],
                   p[10], p[11], M, D, H, KV, hd, I, q4, &t);
    }
    free(buf);
    layer_scratch_free(&t);
}
