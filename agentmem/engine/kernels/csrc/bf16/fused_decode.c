/* The fused decode layer for bf16 rows on the u8 and q4 routes: a layer's halves (agentmem_qkv_q8u8,
   agentmem_finish_q8u8), a whole layer (agentmem_layer_q8u8) and every layer of a step
   (agentmem_layers_q8u8), each in one team of threads. Built from the separate calls' kernels, so
   it follows them in bf16.c: gemv_q8u8.c, gemv_q4.c, rope.c, silu_mul.c, rmsnorm.c and
   attention_decode.c. */
#include "common.h"

/* u8-route products of the few bf16 rows in x [M, K] (M <= 8) into y [M, N] bf16, for the
   calling team of threads: xq/xs/corr are the rows quantized by one thread, then the 16-output
   groups are shared out (`omp for`, which ends on a barrier). */
__attribute__((target("avx512vnni")))
static void team_q8u8(const uint8_t *w, const float *scale, const uint16_t *x, int64_t ldx, uint16_t *y,
                      int64_t M, int64_t N, int64_t K, int8_t *xq, float *xs, float *corr) {
    const int64_t nb = K / U8_BLOCK;
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) quantize_i8(x + m * ldx, K, xq + m * K, xs + m * nb, corr + m);
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < N / 16; g++) {
        #define TILE(mb) tile_u8(w + g * 16 * K, K, xq, K, mb, y, N, g * 16, scale, xs, corr, 0, 0)
        BY_ROWS(M, TILE)
        #undef TILE
    }
}

__attribute__((target("avx512vnni")))
static void team_q4u8(const uint8_t *w, const uint16_t *dm, const uint16_t *x, int64_t ldx, uint16_t *y,
                      int64_t M, int64_t N, int64_t K, int8_t *xq, float *xs, float *xsum) {
    const int64_t nb = K / U8_BLOCK, ng = K / Q4_GROUP;
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) quantize_q4(x + m * ldx, K, xq + m * K, xs + m * nb, xsum + m * ng);
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < N / 16; g++) {
        #define TILE(mb) tile_q4(w + g * 8 * K, dm + g * K, K, xq, K, mb, y, N, g * 16, xs, xsum, 0, 0)
        BY_ROWS(M, TILE)
        #undef TILE
    }
}

/* Scratch of the fused layer functions for M <= 8 rows of at most K inputs (K >= every
   product's input and output width it is used for): the quantized rows and their scales, and
   the bf16 intermediates. */
typedef struct {
    int8_t *xq;
    float *xs, *xsum, corr[8];
    uint16_t *nx, *h2, *gu, *sx, *qkv, *qk, *attn;
} Scratch;

static Scratch scratch_new(int64_t M, int64_t K, int64_t I, int64_t NQKV) {
    Scratch t;
    t.xq = (int8_t *)aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    t.xs = (float *)malloc(sizeof(float) * (size_t)(M * (K / U8_BLOCK) + 1));
    t.xsum = (float *)malloc(sizeof(float) * (size_t)(M * (K / Q4_GROUP) + 1));
    t.nx = (uint16_t *)malloc(2 * (size_t)(M * K));
    t.h2 = (uint16_t *)malloc(2 * (size_t)(M * K));
    t.gu = (uint16_t *)malloc(4 * (size_t)(M * I));
    t.sx = (uint16_t *)malloc(2 * (size_t)(M * I));
    t.qkv = (uint16_t *)malloc(2 * (size_t)(M * NQKV + 1));
    t.qk = (uint16_t *)malloc(2 * (size_t)(M * NQKV + 1));
    t.attn = (uint16_t *)malloc(2 * (size_t)(M * NQKV + 1));
    return t;
}

static void scratch_free(Scratch *t) {
    free(t->xq); free(t->xs); free(t->xsum); free(t->nx); free(t->h2); free(t->gu); free(t->sx);
    free(t->qkv); free(t->qk); free(t->attn);
}

/* One product of the fused layer functions for the calling team: u8 (int8 weights, fp32 scales
   `s`) or, with `q4`, 4-bit weights (`s`: their fp16 scales and minima). */
__attribute__((target("avx512vnni")))
static void team_proj(int q4, const uint8_t *w, const void *s, const uint16_t *x, int64_t ldx, uint16_t *y,
                      int64_t M, int64_t N, int64_t K, Scratch *t) {
    if (q4) team_q4u8(w, (const uint16_t *)s, x, ldx, y, M, N, K, t->xq, t->xs, t->xsum);
    else team_q8u8(w, (const float *)s, x, ldx, y, M, N, K, t->xq, t->xs, t->corr);
}

/* For the calling team: qkv = wqkv(rms_norm(h)) [M, NQKV] bf16, then the first QK heads of
   each row (q and k) rotated into qk [M, QK, hd] (`agentmem_rope_bf16`'s tables and rounding). */
__attribute__((target("avx512vnni")))
static void team_qkv(const uint16_t *h, const uint16_t *nw, float eps, const uint8_t *w, const void *s,
                     const float *cs, const float *sn, uint16_t *qkv, uint16_t *qk, int64_t M, int64_t D,
                     int64_t NQKV, int64_t QK, int64_t hd, int q4, Scratch *t) {
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) agentmem_rms_norm_bf16(h + m * D, D, nw, t->nx + m * D, 1, D, eps);
    team_proj(q4, w, s, t->nx, D, qkv, M, NQKV, D, t);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        agentmem_rope_bf16(qkv + m * NQKV, NQKV, cs + m * hd, sn + m * hd, qk + m * QK * hd, 1, QK, hd);
}

/* For the calling team, `Block.finish`: h2 = h + o(a); out = h2 + down(silu(gate) * up) of
   rms_norm(h2), gate/up = gu(norm), each step rounded to bf16 where the separate calls round. */
__attribute__((target("avx512vnni")))
static void team_finish(const uint16_t *a, int64_t lda, const uint16_t *h, uint16_t *out, const uint8_t *wo,
                        const void *so, const uint16_t *nw, float eps, const uint8_t *wgu, const void *sgu,
                        const uint8_t *wd, const void *sd, int64_t M, int64_t HD, int64_t D, int64_t I,
                        int q4, Scratch *t) {
    team_proj(q4, wo, so, a, lda, t->h2, M, D, HD, t);  /* o(a), then h2 = h + o(a) */
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        uint16_t *r = t->h2 + m * D;
        for (int64_t i = 0; i < D; i++) r[i] = to_bf16(bf16_to_f32(h[m * D + i]) + bf16_to_f32(r[i]));
        agentmem_rms_norm_bf16(r, D, nw, t->nx + m * D, 1, D, eps);
    }
    team_proj(q4, wgu, sgu, t->nx, D, t->gu, M, 2 * I, D, t);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) agentmem_silu_mul_bf16(t->gu + m * 2 * I, 2 * I, t->sx + m * I, 1, I);
    team_proj(q4, wd, sd, t->sx, I, out, M, D, I, t);  /* down, then out = h2 + down */
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < M * D; i++) out[i] = to_bf16(bf16_to_f32(t->h2[i]) + bf16_to_f32(out[i]));
}

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* The first half of a decoder layer's products for M <= 8 bf16 rows on the u8 route, in one
   call and one team of threads (`team_qkv`), bit-identical to the three separate calls. */
__attribute__((target("avx512vnni")))
void agentmem_qkv_q8u8(const uint16_t *h, const uint16_t *nw, float eps, const uint8_t *w, const void *s,
                       const float *cs, const float *sn, uint16_t *qkv, uint16_t *qk, int64_t M, int64_t D,
                       int64_t NQKV, int64_t QK, int64_t hd, int q4, int threads) {
    Scratch t = scratch_new(M, D, 1, 1);
    #pragma omp parallel num_threads(threads)
    team_qkv(h, nw, eps, w, s, cs, sn, qkv, qk, M, D, NQKV, QK, hd, q4, &t);
    scratch_free(&t);
}

/* The second half of a decoder layer (`Block.finish`) for M <= 8 bf16 rows with every weight
   on the u8 route, in one call and one team of threads instead of seven calls and three
   (`team_finish`), bit-identical to them. a [M, HD] (rows lda apart), h/out [M, D], nw [D]
   bf16; o [D, HD], gu [2I, D], down [D, I] packed by `pack_u8` with their scales. */
__attribute__((target("avx512vnni")))
void agentmem_finish_q8u8(const uint16_t *a, int64_t lda, const uint16_t *h, uint16_t *out,
                          const uint8_t *wo, const void *so, const uint16_t *nw, float eps,
                          const uint8_t *wgu, const void *sgu, const uint8_t *wd, const void *sd,
                          int64_t M, int64_t HD, int64_t D, int64_t I, int q4, int threads) {
    Scratch t = scratch_new(M, max3(HD, D, I), I, 1);
    #pragma omp parallel num_threads(threads)
    team_finish(a, lda, h, out, wo, so, nw, eps, wgu, sgu, wd, sd, M, HD, D, I, q4, &t);
    scratch_free(&t);
}

/* A whole decoder layer for M <= 8 decode rows (one query each) on the u8 route, for the calling
   team of threads: `team_qkv`; each row's rotated k and its v written to the paged pool at
   wslot[m] (kp/vp: this layer's pool, [slots, KV, hd]); the decode attention of each row over its
   keys (idx/keep [M, W], as `agentmem_decode_attn_bf16`: `team_decode_attn`, its item buffer
   `part` for chunks of ch keys); `team_finish`. Ends on the barrier of its last `omp for`. */
__attribute__((target("avx512vnni")))
static void team_layer_u8(const uint16_t *h, uint16_t *out, const uint16_t *nw1, const uint16_t *nw2, float eps,
                          const uint8_t *wqkv, const void *sqkv, const float *cs, const float *sn,
                          uint16_t *kp, uint16_t *vp, const int64_t *wslot, const int64_t *idx, const uint8_t *keep,
                          int64_t W, float scale, const uint8_t *wo, const void *so, const uint8_t *wgu,
                          const void *sgu, const uint8_t *wd, const void *sd, int64_t M, int64_t D, int64_t H,
                          int64_t KV, int64_t hd, int64_t I, int64_t ch, float *part, int q4, Scratch *t) {
    const int64_t NQKV = (H + 2 * KV) * hd, QK = H + KV, row = KV * hd;
    team_qkv(h, nw1, eps, wqkv, sqkv, cs, sn, t->qkv, t->qk, M, D, NQKV, QK, hd, q4, t);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        memcpy(kp + wslot[m] * row, t->qk + m * QK * hd + H * hd, 2 * (size_t)row);
        memcpy(vp + wslot[m] * row, t->qkv + m * NQKV + QK * hd, 2 * (size_t)row);
    }
    team_decode_attn(t->qk, QK * hd, kp, vp, idx, keep, t->attn, H * hd, M, H, KV, hd, W, scale, ch, part);
    team_finish(t->attn, H * hd, h, out, wo, so, nw2, eps, wgu, sgu, wd, sd, M, H * hd, D, I, q4, t);
}

/* A whole decoder layer (`team_layer_u8`) in one call and one team of threads, bit-identical to
   the separate calls. */
__attribute__((target("avx512vnni")))
void agentmem_layer_q8u8(const uint16_t *h, uint16_t *out, const uint16_t *nw1, const uint16_t *nw2, float eps,
                         const uint8_t *wqkv, const void *sqkv, const float *cs, const float *sn,
                         uint16_t *kp, uint16_t *vp, const int64_t *wslot, const int64_t *idx, const uint8_t *keep,
                         int64_t W, float scale, const uint8_t *wo, const void *so, const uint8_t *wgu,
                         const void *sgu, const uint8_t *wd, const void *sd, int64_t M, int64_t D, int64_t H,
                         int64_t KV, int64_t hd, int64_t I, int q4, int threads) {
    Scratch t = scratch_new(M, max3(H * hd, D, I), I, (H + 2 * KV) * hd);
    const int64_t ch = da_chunk(M, W, threads);
    float *part = da_part(M, W, H, hd, ch);
    #pragma omp parallel num_threads(threads)
    team_layer_u8(h, out, nw1, nw2, eps, wqkv, sqkv, cs, sn, kp, vp, wslot, idx, keep, W, scale, wo, so, wgu, sgu,
                  wd, sd, M, D, H, KV, hd, I, ch, part, q4, &t);
    free(part);
    scratch_free(&t);
}

/* Every layer of a decode step in one call and one team of threads: `team_layer_u8` for layers
   0..L-1 in turn, the scratch and the attention's item buffer allocated once, each layer from
   the last one's output (two rows of buffers ping-pong; the last layer writes out). Layer l's
   weights are w[l * U8_LAYER_PTRS + j] in the order of `agentmem_layer_q8u8`'s arguments (nw1,
   nw2, wqkv, sqkv, wo, so, wgu, sgu, wd, sd), its pool K/V at kp/vp + l * pstride elements.
   Bit-identical to the layers one by one: the per-layer call's work, without a team started, nine
   buffers allocated and a Python call made 30 times a step. */
#define U8_LAYER_PTRS 10
__attribute__((target("avx512vnni")))
void agentmem_layers_q8u8(const uint16_t *h, uint16_t *out, int64_t L, void *const *w, float eps,
                          const float *cs, const float *sn, uint16_t *kp, uint16_t *vp, int64_t pstride,
                          const int64_t *wslot, const int64_t *idx, const uint8_t *keep, int64_t W, float scale,
                          int64_t M, int64_t D, int64_t H, int64_t KV, int64_t hd, int64_t I, int q4, int threads) {
    Scratch t = scratch_new(M, max3(H * hd, D, I), I, (H + 2 * KV) * hd);
    const int64_t ch = da_chunk(M, W, threads);
    float *part = da_part(M, W, H, hd, ch);
    uint16_t *buf = (uint16_t *)malloc(2 * (size_t)(2 * M * D));
    #pragma omp parallel num_threads(threads)
    for (int64_t l = 0; l < L; l++) {  /* every thread walks the same layers; the layer's barriers order them */
        void *const *p = w + l * U8_LAYER_PTRS;
        const uint16_t *x = l == 0 ? h : buf + ((l - 1) & 1) * M * D;
        uint16_t *y = l == L - 1 ? out : buf + (l & 1) * M * D;
        team_layer_u8(x, y, p[0], p[1], eps, p[2], p[3], cs, sn, kp + l * pstride, vp + l * pstride, wslot, idx,
                      keep, W, scale, p[4], p[5], p[6], p[7], p[8], p[9], M, D, H, KV, hd, I, ch, part, q4, &t);
    }
    free(buf);
    free(part);
    scratch_free(&t);
}
