/* Decode attention of one fp32 query per row over its keys in the paged pool, fp32 or fp16:
   agentmem_avx2_decode_attn_f32, agentmem_avx2_decode_attn_f16kv. */
#include "common.h"

/* The sums of 8 vectors, as one vector (lane j: the sum of a[j]'s lanes). */
static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* One fp32 decode query per row over its keys read from the paged pool: q [B, H, hd], pools
   [slots, KV, hd], idx [B, W] flat slots, keep [B, W] which of them row b sees; out [B, H, hd]
   (zeros for a row that keeps no key). hd a multiple of 8, up to 256; any number of query
   heads per KV head. The design of the bf16 library's `agentmem_decode_attn_bf16` in AVX2: a row's
   keys are cut into chunks of `ch` (`da_chunk`: about four chunks a thread over all the rows,
   32 to DA_MAX keys), and each (row, chunk) item computes, for every head, the chunk's score
   maximum, its sum of exp(score - max) and the unnormalised sum of V (`da_item`); a merge
   rescales the chunks to the row's maximum (`da_merge`). Items are shared out as they come
   (dynamic, 1), the merge statically. So one row's long history is shared by all the threads
   (it used to be one task per (row, KV head): SmolLM2's 3 KV heads at one stream are 3 tasks
   for 2 threads), each item reads whole pool rows (all KV heads of a key) while they are in
   cache, the next 8 keys' K and V lines are prefetched while the scores of these are summed, the
   scores' maximum is taken 8 at a time (it was a scalar loop; a kept-key count not a multiple of
   8 is padded with the last key, scored -inf), and the weighted sum of V reads each key's V once
   for up to 4 heads, its accumulators in registers (`pv_heads`, unrolled per head count and
   width; at most 10 accumulators, as 3 heads x 24 dims: 3 x 32 spilled some of AVX2's 16
   registers and was 5-10% slower). With one chunk the result is that of a single softmax pass.
   Measured here on the AVX2 code path of the 2-core AMX Xeon VM (2 threads, SmolLM2's 9 heads
   of 64 over 3 KV, pools of 16,384 slots (12 MB each, in L3), rows of whole 16-slot blocks;
   us a call from Python with ctypes (~1 us of it), best of 5 x 200, two alternated runs):
   B=1 W=300 15-16 -> 11; B=1 W=2000 157-171 -> 52-71; B=8 W=100 27-28 -> 22; B=8 W=1000
   420-458 -> 289-319 (pools of 256 slots, in L2: 216 -> 166). Prefetching every other line
   (B=8 W=1000 ~10% slower), 16 keys ahead, whole pool rows at the first KV head, or chunks of at
   most 128 keys gained nothing. */
#include "../decode_chunks.h"

#define DA_HB 16    /* query heads of a KV head scored together (the score buffer on the stack) */

/* 8 pool elements from element i of a pool of fp32 (H16 = 0) or fp16 (H16 = 1: F16C's vcvtph2ps)
   values. The pool functions below take H16 as a constant (inlined down from `da_item_f32` and
   `da_item_f16`), so each element type has its own code and no branch per load. */
static inline __attribute__((always_inline)) __m256 ld8(const void *pool, int64_t i, const int H16) {
    return H16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)pool + i)))
               : _mm256_loadu_ps((const float *)pool + i);
}

/* acc[g][d] += s[g][t] * v_t over the n keys, for GN heads (score rows ls apart) and ND x 8
   dims of V from `off` in each pool row (ldv elements); the sums go to o (heads ldo apart).
   Inlined with constant GN, ND: the accumulators stay in registers. */
static inline __attribute__((always_inline)) void pv_heads(const void *vp, const int64_t *slot, int64_t n,
                                                           int64_t ldv, int64_t off, const float *s, int64_t ls,
                                                           const int GN, const int ND, float *o, int64_t ldo,
                                                           const int H16) {
    __m256 acc[10];
    for (int i = 0; i < GN * ND; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        const int64_t v = slot[t] * ldv + off;
        __m256 p[4];
        for (int g = 0; g < GN; g++) p[g] = _mm256_broadcast_ss(s + g * ls + t);
        for (int d = 0; d < ND; d++) {
            const __m256 vv = ld8(vp, v + 8 * d, H16);
            for (int g = 0; g < GN; g++) acc[g * ND + d] = _mm256_fmadd_ps(p[g], vv, acc[g * ND + d]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int d = 0; d < ND; d++) _mm256_storeu_ps(o + g * ldo + 8 * d, acc[g * ND + d]);
}

/* The widest pass of V (in 8-dim vectors) for gn heads: GN * ND <= 10 accumulators, the broadcast
   scores and one V vector in AVX2's 16 registers. */
static inline int pv_width(int gn) { return gn == 1 ? 8 : gn == 2 ? 5 : gn == 3 ? 3 : 2; }

static inline __attribute__((always_inline)) void pv_any(const void *vp, const int64_t *slot, int64_t n,
                                                         int64_t ldv, int64_t off, const float *s, int64_t ls, int gn,
                                                         int nd, float *o, int64_t ldo, const int H16) {
    #define PV(GN, ND) case GN * 16 + ND: pv_heads(vp, slot, n, ldv, off, s, ls, GN, ND, o, ldo, H16); break;
    switch (gn * 16 + nd) {
        PV(1, 1) PV(1, 2) PV(1, 3) PV(1, 4) PV(1, 5) PV(1, 6) PV(1, 7) PV(1, 8)
        PV(2, 1) PV(2, 2) PV(2, 3) PV(2, 4) PV(2, 5) PV(3, 1) PV(3, 2) PV(3, 3) PV(4, 1) PV(4, 2)
    }
    #undef PV
}

/* The scores of 8 keys (pool rows ldv elements apart, from `off`) against one query head qg of
   ND x 8 dims, times sc, into s[0..7]: one transposed sum of 8 dot products. */
static inline __attribute__((always_inline)) void scores8(const void *kp, const int64_t *slot, int64_t ldv,
                                                          int64_t off, const float *qg, const int64_t ND,
                                                          __m256 sc, float *s, const int H16) {
    int64_t k[8];
    for (int j = 0; j < 8; j++) k[j] = slot[j] * ldv + off;
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < ND; d++) {
        const __m256 qv = _mm256_loadu_ps(qg + 8 * d);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(ld8(kp, k[j] + 8 * d, H16), qv, a[j]);
    }
    _mm256_storeu_ps(s, _mm256_mul_ps(hsum8x8(a), sc));
}

static inline __attribute__((always_inline)) void scores_any(const void *kp, const int64_t *slot, int64_t ldv,
                                                             int64_t off, const float *qg, int64_t nd, __m256 sc,
                                                             float *s, const int H16) {
    switch (nd) {  /* SmolLM2's 64 dims and 128 unrolled; others by a loop */
        case 8: scores8(kp, slot, ldv, off, qg, 8, sc, s, H16); break;
        case 16: scores8(kp, slot, ldv, off, qg, 16, sc, s, H16); break;
        default: scores8(kp, slot, ldv, off, qg, nd, sc, s, H16); break;
    }
}

#ifdef AGENTMEM_AVX512
/* The same two steps 16 dims a vector, in the library built for AVX-512 (`vnni512`, `avx512bw`), for a head
   dimension that is a multiple of 16: a key's dot product takes half the instructions, and the
   weighted sum of V holds up to 4 heads x 64 dims in registers (16 of AVX-512's 32), one pass
   over the keys where AVX2 made three for SmolLM2's 3 heads of 64. Their sums run in another
   order than the AVX2 code's (16 lanes folded to 8), so the bits differ from that build's by
   rounding; within this build the fused layer and the separate calls agree as before. */
static inline __attribute__((always_inline)) __m512 ld16(const void *pool, int64_t i, const int H16) {
    return H16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)pool + i)))
               : _mm512_loadu_ps((const float *)pool + i);
}

static inline __attribute__((always_inline)) __m256 fold16(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

static inline __attribute__((always_inline)) void scores8_16(const void *kp, const int64_t *slot, int64_t ldv,
                                                             int64_t off, const float *qg, const int64_t N16,
                                                             __m256 sc, float *s, const int H16) {
    int64_t k[8];
    for (int j = 0; j < 8; j++) k[j] = slot[j] * ldv + off;
    __m512 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < N16; d++) {
        const __m512 qv = _mm512_loadu_ps(qg + 16 * d);
        for (int j = 0; j < 8; j++) a[j] = _mm512_fmadd_ps(ld16(kp, k[j] + 16 * d, H16), qv, a[j]);
    }
    __m256 h[8];
    for (int j = 0; j < 8; j++) h[j] = fold16(a[j]);
    _mm256_storeu_ps(s, _mm256_mul_ps(hsum8x8(h), sc));
}

static inline __attribute__((always_inline)) void scores_any16(const void *kp, const int64_t *slot, int64_t ldv,
                                                               int64_t off, const float *qg, int64_t n16,
                                                               __m256 sc, float *s, const int H16) {
    switch (n16) {
        case 4: scores8_16(kp, slot, ldv, off, qg, 4, sc, s, H16); break;
        case 8: scores8_16(kp, slot, ldv, off, qg, 8, sc, s, H16); break;
        default: scores8_16(kp, slot, ldv, off, qg, n16, sc, s, H16); break;
    }
}

static inline __attribute__((always_inline)) void pv_heads16(const void *vp, const int64_t *slot, int64_t n,
                                                             int64_t ldv, int64_t off, const float *s, int64_t ls,
                                                             const int GN, const int ND, float *o, int64_t ldo,
                                                             const int H16) {
    __m512 acc[16];
    for (int i = 0; i < GN * ND; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        const int64_t v = slot[t] * ldv + off;
        __m512 p[4];
        for (int g = 0; g < GN; g++) p[g] = _mm512_set1_ps(s[g * ls + t]);
        for (int d = 0; d < ND; d++) {
            const __m512 vv = ld16(vp, v + 16 * d, H16);
            for (int g = 0; g < GN; g++) acc[g * ND + d] = _mm512_fmadd_ps(p[g], vv, acc[g * ND + d]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int d = 0; d < ND; d++) _mm512_storeu_ps(o + g * ldo + 16 * d, acc[g * ND + d]);
}

#define PV16_WIDTH 4  /* 16-dim vectors a pass: 4 heads x 4 accumulators, 4 scores and one V in 32 registers */
static inline __attribute__((always_inline)) void pv_any16(const void *vp, const int64_t *slot, int64_t n,
                                                           int64_t ldv, int64_t off, const float *s, int64_t ls,
                                                           int gn, int nd, float *o, int64_t ldo, const int H16) {
    #define PV(GN, ND) case GN * 16 + ND: pv_heads16(vp, slot, n, ldv, off, s, ls, GN, ND, o, ldo, H16); break;
    switch (gn * 16 + nd) {
        PV(1, 1) PV(1, 2) PV(1, 3) PV(1, 4) PV(2, 1) PV(2, 2) PV(2, 3) PV(2, 4)
        PV(3, 1) PV(3, 2) PV(3, 3) PV(3, 4) PV(4, 1) PV(4, 2) PV(4, 3) PV(4, 4)
    }
    #undef PV
}
#endif

/* Item (b, c): row b's keys [c * ch, (c + 1) * ch) of W; per head h, part[h * (hd + 2)] holds the
   chunk's score maximum, its exp sum and its unnormalised V sum [hd] (sum 0: no key kept). The
   kept keys' slots are padded to a multiple of 8 with the last one, so every 8 keys are scored
   together; the padding's scores are set to -inf (exp 0) and the V sums stop at n. */
static inline __attribute__((always_inline)) void da_item(const float *q, int64_t ldq, const void *kp,
                                                          const void *vp, const int64_t *idx, const uint8_t *keep,
                                                          int64_t b, int64_t c, int64_t ch, int64_t H, int64_t KV,
                                                          int64_t hd, int64_t W, float scale, float *part,
                                                          const int H16) {
    const int64_t G = H / KV, lo = c * ch, hi = lo + ch < W ? lo + ch : W, ldv = KV * hd, ldp = hd + 2;
    const int64_t es = H16 ? 2 : 4, nd = hd / 8, lines = hd * es / 64 > 0 ? hd * es / 64 : 1;
    int64_t slot[DA_MAX + 8], n = 0;
    for (int64_t j = lo; j < hi; j++)
        if (keep[b * W + j]) slot[n++] = idx[b * W + j];
    if (n == 0) {
        for (int64_t h = 0; h < H; h++) part[h * ldp] = -INFINITY, part[h * ldp + 1] = 0.0f;
        return;
    }
    const int64_t n8 = (n + 7) / 8 * 8;  /* <= ch: ch is a multiple of 16 */
    for (int64_t j = n; j < n8; j++) slot[j] = slot[n - 1];
    const int64_t hb = G < DA_HB ? G : DA_HB;
    float s[hb * ch + 8];
    const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t kvh = 0; kvh < KV; kvh++)
        for (int64_t g0 = 0; g0 < G; g0 += hb) {
            const int64_t gb = G - g0 < hb ? G - g0 : hb, h0 = kvh * G + g0;
            const float *qg = q + b * ldq + h0 * hd;
            for (int64_t t0 = 0; t0 < n8; t0 += 8) {
                if (g0 == 0)
                    for (int64_t j = t0 + 8; j < t0 + 16 && j < n; j++)  /* the next keys, while these are summed */
                        for (int64_t l = 0; l < lines; l++) {
                            _mm_prefetch((const char *)kp + (slot[j] * ldv + kvh * hd) * es + 64 * l, _MM_HINT_T0);
                            _mm_prefetch((const char *)vp + (slot[j] * ldv + kvh * hd) * es + 64 * l, _MM_HINT_T0);
                        }
#ifdef AGENTMEM_AVX512
                if (hd % 16 == 0) {
                    for (int64_t g = 0; g < gb; g++)
                        scores_any16(kp, slot + t0, ldv, kvh * hd, qg + g * hd, hd / 16, sc, s + g * ch + t0, H16);
                    continue;
                }
#endif
                for (int64_t g = 0; g < gb; g++) scores_any(kp, slot + t0, ldv, kvh * hd, qg + g * hd, nd, sc, s + g * ch + t0, H16);
            }
            for (int64_t g = 0; g < gb; g++) {  /* softmax numerators in place, their maximum and sum */
                float *sg = s + g * ch, *p = part + (h0 + g) * ldp;
                for (int64_t t = n; t < n8; t++) sg[t] = -INFINITY;
                __m256 mx = ninf;
                for (int64_t t = 0; t < n8; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + t));
                const float m = hmax8(mx);
                const __m256 mv = _mm256_set1_ps(m);
                __m256 acc = _mm256_setzero_ps();
                for (int64_t t = 0; t < n8; t += 8) {
                    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
                    _mm256_storeu_ps(sg + t, e);
                    acc = _mm256_add_ps(acc, e);
                }
                p[0] = m;
                p[1] = hsum8(acc);
            }
            for (int64_t i = 0; i < gb;) {  /* the weighted sum of V: up to 4 heads a pass over the keys */
                const int64_t left = gb - i, gn = left <= 4 ? left : left == 5 || left == 6 ? 3 : 4;
#ifdef AGENTMEM_AVX512
                if (hd % 16 == 0) {
                    const int64_t n16 = hd / 16;
                    for (int64_t d0 = 0; d0 < n16; d0 += PV16_WIDTH)
                        pv_any16(vp, slot, n, ldv, kvh * hd + 16 * d0, s + i * ch, ch, (int)gn,
                                 (int)(n16 - d0 < PV16_WIDTH ? n16 - d0 : PV16_WIDTH), part + (h0 + i) * ldp + 2 + 16 * d0,
                                 ldp, H16);
                    i += gn;
                    continue;
                }
#endif
                const int64_t w = pv_width((int)gn);
                for (int64_t d0 = 0; d0 < nd; d0 += w)
                    pv_any(vp, slot, n, ldv, kvh * hd + 8 * d0, s + i * ch, ch, (int)gn,
                           (int)(nd - d0 < w ? nd - d0 : w), part + (h0 + i) * ldp + 2 + 8 * d0, ldp, H16);
                i += gn;
            }
        }
}

static void da_item_f32(const float *q, int64_t ldq, const void *kp, const void *vp, const int64_t *idx,
                       const uint8_t *keep, int64_t b, int64_t c, int64_t ch, int64_t H, int64_t KV, int64_t hd,
                       int64_t W, float scale, float *part) {
    da_item(q, ldq, kp, vp, idx, keep, b, c, ch, H, KV, hd, W, scale, part, 0);
}

static void da_item_f16(const float *q, int64_t ldq, const void *kp, const void *vp, const int64_t *idx,
                       const uint8_t *keep, int64_t b, int64_t c, int64_t ch, int64_t H, int64_t KV, int64_t hd,
                       int64_t W, float scale, float *part) {
    da_item(q, ldq, kp, vp, idx, keep, b, c, ch, H, KV, hd, W, scale, part, 1);
}

/* out[b, h] from row b's nc chunk items: each chunk's sums rescaled to the row's maximum. */
static void da_merge(const float *part, int64_t nc, int64_t H, int64_t hd, int64_t b, int64_t h, float *out,
                     int64_t ldo) {
    const int64_t ldp = hd + 2, nd = hd / 8;
    float w[nc + 1];
    da_weights(part, nc, H, ldp, b, h, w);
    __m256 o[32];
    for (int64_t d = 0; d < nd; d++) o[d] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
        if (w[c] == 0.0f) continue;
        const float *p = part + ((b * nc + c) * H + h) * ldp;
        const __m256 wv = _mm256_set1_ps(w[c]);
        for (int64_t d = 0; d < nd; d++) o[d] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(p + 2 + 8 * d), o[d]);
    }
    float *oh = out + b * ldo + h * hd;
    for (int64_t d = 0; d < nd; d++) _mm256_storeu_ps(oh + 8 * d, o[d]);
}

/* For the calling team: the decode attention of B query rows (q: rows ldq apart, heads hd apart)
   into out (rows ldo apart), chunks of ch keys, part: B * nc * H * (hd + 2) floats. */
static void team_decode_attn(const float *q, int64_t ldq, const void *kp, const void *vp, const int64_t *idx,
                             const uint8_t *keep, float *out, int64_t ldo, int64_t B, int64_t H, int64_t KV,
                             int64_t hd, int64_t W, float scale, int64_t ch, float *part, int h16) {
    const int64_t nc = (W + ch - 1) / ch;
    void (*item)(const float *, int64_t, const void *, const void *, const int64_t *, const uint8_t *, int64_t,
                 int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float *) = h16 ? da_item_f16 : da_item_f32;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < B * nc; it++)
        item(q, ldq, kp, vp, idx, keep, it / nc, it % nc, ch, H, KV, hd, W, scale, part + it * H * (hd + 2));
    #pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; bh++) da_merge(part, nc, H, hd, bh / H, bh % H, out, ldo);
}

static float *da_part(int64_t B, int64_t W, int64_t H, int64_t hd, int64_t ch) {
    return (float *)malloc(sizeof(float) * (size_t)(B * ((W + ch - 1) / ch) * H * (hd + 2) + 1));
}

static void decode_attn(const float *q, const void *kp, const void *vp, const int64_t *idx, const uint8_t *keep,
                        float *out, int64_t B, int64_t H, int64_t KV, int64_t hd, int64_t W, float scale, int threads,
                        int h16) {
    if (B <= 0) return;
    const int64_t ch = da_chunk(B, W, threads);
    float *part = da_part(B, W, H, hd, ch);
    #pragma omp parallel num_threads(threads)
    team_decode_attn(q, H * hd, kp, vp, idx, keep, out, H * hd, B, H, KV, hd, W, scale, ch, part, h16);
    free(part);
}

void agentmem_avx2_decode_attn_f32(const float *q, const float *kp, const float *vp, const int64_t *idx,
                                   const uint8_t *keep, float *out, int64_t B, int64_t H, int64_t KV, int64_t hd,
                                   int64_t W, float scale, int threads) {
    decode_attn(q, kp, vp, idx, keep, out, B, H, KV, hd, W, scale, threads, 0);
}

/* The same over an fp16 pool (fp32 queries and output): half the bytes of K and V read a step. */
void agentmem_avx2_decode_attn_f16kv(const float *q, const uint16_t *kp, const uint16_t *vp, const int64_t *idx,
                                     const uint8_t *keep, float *out, int64_t B, int64_t H, int64_t KV, int64_t hd,
                                     int64_t W, float scale, int threads) {
    decode_attn(q, kp, vp, idx, keep, out, B, H, KV, hd, W, scale, threads, 1);
}
