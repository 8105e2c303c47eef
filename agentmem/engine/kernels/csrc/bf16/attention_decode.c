/* Decode attention of one bf16 query per row over its keys in the paged pool: agentmem_decode_attn_bf16. */
#include "common.h"

/* The lane sums of 16 vectors at once: lane j of the result is the sum of v[j]'s 16 lanes.
   A tree of in-lane unpacks and 128-bit shuffles, ~3 instructions a vector where a reduction
   of each alone takes ~9 (scores of 16 keys: 16 dot products, one sum pass). */
static inline __m512 hsum16(const __m512 v[16]) {
    __m512 x[8], y[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit chunk: v[2i]'s partial sums at lanes 0 and 2, v[2i+1]'s at 1 and 3 */
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per chunk c: the chunk sums of v[4i .. 4i+3] */
        const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* y[i] holds 4 chunks of v[4i .. 4i+3]'s sums: add the chunks, y[i]'s total into chunk i */
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x44), _mm512_shuffle_f32x4(y[0], y[1], 0xEE));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x44), _mm512_shuffle_f32x4(y[2], y[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

/* One decode query per sequence over its keys in the paged pool: out[b, h] = softmax(q[b, h] . K
   * scale) V over the keys j of row b with keep[b, j], at flat pool slots idx[b, j]. q/out bf16
   [B, H, hd]; kp/vp bf16 [slots, KV, hd]; hd a multiple of 32 (at most 256), H a multiple of KV.
   The scores are fp32 sums of exact bf16 products (vdpbf16ps), the softmax and the weighted sum
   of V fp32.
   A row's keys are cut into chunks of `ch` (`da_chunk`: about four chunks a thread over all the
   rows, 32 to DA_MAX keys), and each (row, chunk) item computes, for every head, the chunk's
   score maximum, its sum of exp(score - max) and the unnormalised sum of V (`da_item`); a merge
   rescales the chunks to the row's maximum (`da_merge`). So one row's long history is shared by
   all the threads (it used to be one task per (row, KV head): 3 tasks for 2 threads at one
   stream), each item reads whole pool rows (all KV heads of a key) while they are in cache, the
   next keys are prefetched while the scores of these are summed, and the weighted sum of V keeps
   its accumulators in registers (`pv_heads`, unrolled per head count and width). With one chunk
   the result is that of a single softmax pass. 2-core AMX Xeon VM, 2026-11-27, SmolLM2-135M's
   heads (9 of 64, 3 KV), the layer's pool cold: see docs/engine.md. */
#include "../decode_chunks.h"

/* acc[g][d] += s[g][t] * v_t over the n keys, for GN heads (score rows ls apart) and ND x 16
   dims of V from `off` in each pool row (ldv elements); the sums go to o (heads ldo apart).
   Inlined with constant GN, ND: the accumulators stay in registers. */
static inline __attribute__((always_inline)) void pv_heads(const uint16_t *vp, const int64_t *slot, int64_t n,
                                                           int64_t ldv, int64_t off, const float *s, int64_t ls,
                                                           const int GN, const int ND, float *o, int64_t ldo) {
    __m512 acc[16];
    for (int i = 0; i < GN * ND; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *v = vp + slot[t] * ldv + off;
        for (int d = 0; d < ND; d++) {
            const __m512 vv = load_bf16(v + 16 * d);
            for (int g = 0; g < GN; g++)
                acc[g * ND + d] = _mm512_fmadd_ps(_mm512_set1_ps(s[g * ls + t]), vv, acc[g * ND + d]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int d = 0; d < ND; d++) _mm512_storeu_ps(o + g * ldo + 16 * d, acc[g * ND + d]);
}

static void pv_any(const uint16_t *vp, const int64_t *slot, int64_t n, int64_t ldv, int64_t off, const float *s,
                   int64_t ls, int gn, int nd, float *o, int64_t ldo) {
    #define PV(GN, ND) case GN * 8 + ND: pv_heads(vp, slot, n, ldv, off, s, ls, GN, ND, o, ldo); break;
    switch (gn * 8 + nd) {
        PV(1, 2) PV(2, 2) PV(3, 2) PV(4, 2) PV(1, 4) PV(2, 4) PV(3, 4) PV(4, 4)
    }
    #undef PV
}

/* The scores of 16 keys (pool rows ldv elements apart, from `off`) against one query head qg of
   NK x 32 dims, times sc, into s[0..15]. Inlined with constant NK: q stays in registers. */
static inline __attribute__((always_inline)) void scores16(const uint16_t *kp, const int64_t *slot, int64_t ldv,
                                                           int64_t off, const uint16_t *qg, const int NK,
                                                           __m512 sc, float *s) {
    __m512bh qv[8];
    for (int d = 0; d < NK; d++) qv[d] = (__m512bh)_mm512_loadu_si512(qg + 32 * d);
    __m512 a[16];
    for (int j = 0; j < 16; j++) {
        const uint16_t *k = kp + slot[j] * ldv + off;
        a[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(k), qv[0]);
        for (int d = 1; d < NK; d++) a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_loadu_si512(k + 32 * d), qv[d]);
    }
    _mm512_storeu_ps(s, _mm512_mul_ps(hsum16(a), sc));
}

static void scores_any(const uint16_t *kp, const int64_t *slot, int64_t ldv, int64_t off, const uint16_t *qg,
                       int nk, __m512 sc, float *s) {
    #define SC(NK) case NK: scores16(kp, slot, ldv, off, qg, NK, sc, s); break;
    switch (nk) { SC(1) SC(2) SC(3) SC(4) SC(5) SC(6) SC(7) SC(8) }
    #undef SC
}

/* The pool's K and V rows of one key (all KV heads: ldv elements each) fetched into L1. The first
   pass of an item (KV head 0) fetches whole rows DA_AHEAD keys ahead, so the passes of the other
   KV heads and the weighted sum of V find them in cache: a decode step's pool is cold (the layer
   weights streamed through the caches since this layer's last step). Zen 4 VM, 2026-11-27, all
   30 layers of a step in one call, best of 5: 1 row over 2,048 keys 8.39 -> 7.43 ms, 8 rows over
   400 keys 11.18 -> 9.61; 16 keys ahead by KV head (before) was the slowest, 64 and 128 whole
   rows no better than 32, nor prefetching into L2 only. */
#define DA_AHEAD 32
static inline void da_fetch(const uint16_t *kp, const uint16_t *vp, int64_t slot, int64_t ldv) {
    for (int64_t l = 0; l < (ldv * 2 + 63) / 64; l++) {
        _mm_prefetch((const char *)(kp + slot * ldv) + 64 * l, _MM_HINT_T0);
        _mm_prefetch((const char *)(vp + slot * ldv) + 64 * l, _MM_HINT_T0);
    }
}

/* Item (b, c): row b's keys [c * ch, (c + 1) * ch) of W; per head h, part[h * (hd + 2)] holds the
   chunk's score maximum, its exp sum and its unnormalised V sum [hd] (sum 0: no key kept). */
static void da_item(const uint16_t *q, int64_t ldq, const uint16_t *kp, const uint16_t *vp, const int64_t *idx,
                    const uint8_t *keep, int64_t b, int64_t c, int64_t ch, int64_t H, int64_t KV, int64_t hd,
                    int64_t W, float scale, float *part) {
    const int64_t G = H / KV, lo = c * ch, hi = lo + ch < W ? lo + ch : W, ldv = KV * hd, ldp = hd + 2;
    int64_t slot[DA_MAX], n = 0;
    for (int64_t j = lo; j < hi; j++)
        if (keep[b * W + j]) slot[n++] = idx[b * W + j];
    for (int64_t j = 0; j < DA_AHEAD && j < n; j++) da_fetch(kp, vp, slot[j], ldv);
    if (n == 0) {
        for (int64_t h = 0; h < H; h++) part[h * ldp] = -INFINITY, part[h * ldp + 1] = 0.0f;
        return;
    }
    float s[G * ch + 16];
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t kvh = 0; kvh < KV; kvh++) {
        const uint16_t *qg = q + b * ldq + kvh * G * hd;
        int64_t t0 = 0;
        for (; t0 + 16 <= n; t0 += 16) {  /* scores of 16 keys at a time, summed across lanes together */
            if (kvh == 0)  /* whole pool rows (every KV head's K and V) DA_AHEAD keys ahead */
                for (int64_t j = t0 + DA_AHEAD; j < t0 + DA_AHEAD + 16 && j < n; j++) da_fetch(kp, vp, slot[j], ldv);
            for (int64_t g = 0; g < G; g++)
                scores_any(kp, slot + t0, ldv, kvh * hd, qg + g * hd, (int)(hd / 32), sc, s + g * ch + t0);
        }
        for (int64_t t = t0; t < n; t++) {  /* the last keys one at a time, each read once for the G heads */
            const uint16_t *k = kp + slot[t] * ldv + kvh * hd;
            for (int64_t g = 0; g < G; g++) {
                __m512 a = _mm512_setzero_ps();
                for (int64_t d = 0; d < hd; d += 32)
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(k + d),
                                         (__m512bh)_mm512_loadu_si512(qg + g * hd + d));
                s[g * ch + t] = _mm512_reduce_add_ps(a) * scale;
            }
        }
        for (int64_t g = 0; g < G; g++) {  /* softmax numerators in place, their maximum and sum */
            float *sg = s + g * ch, *p = part + (kvh * G + g) * ldp;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            int64_t t = 0;
            for (; t + 16 <= n; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + t));
            if (t < n) mx = _mm512_mask_max_ps(mx, (__mmask16)((1u << (n - t)) - 1), mx, _mm512_maskz_loadu_ps((__mmask16)((1u << (n - t)) - 1), sg + t));
            const float m = _mm512_reduce_max_ps(mx);
            __m512 acc = _mm512_setzero_ps(), mv = _mm512_set1_ps(m);
            t = 0;
            for (; t + 16 <= n; t += 16) {
                __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mv));
                _mm512_storeu_ps(sg + t, e);
                acc = _mm512_add_ps(acc, e);
            }
            if (t < n) {
                __mmask16 mk = (__mmask16)((1u << (n - t)) - 1);
                __m512 e = _mm512_maskz_mov_ps(mk, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sg + t), mv)));
                _mm512_mask_storeu_ps(sg + t, mk, e);
                acc = _mm512_add_ps(acc, e);
            }
            p[0] = m;
            p[1] = _mm512_reduce_add_ps(acc);
        }
        for (int64_t g0 = 0; g0 < G; g0 += 4)  /* the weighted sum of V, up to 4 heads and 64 dims a pass */
            for (int64_t d0 = 0; d0 < hd; d0 += 64)
                pv_any(vp, slot, n, ldv, kvh * hd + d0, s + g0 * ch, ch, G - g0 < 4 ? (int)(G - g0) : 4,
                       hd - d0 >= 64 ? 4 : 2, part + (kvh * G + g0) * ldp + 2 + d0, ldp);
    }
}

/* out[b, h] from row b's nc chunk items: each chunk's sums rescaled to the row's maximum. */
static void da_merge(const float *part, int64_t nc, int64_t H, int64_t hd, int64_t b, int64_t h, uint16_t *out,
                     int64_t ldo) {
    const int64_t ldp = hd + 2, nd = hd / 16;
    float w[nc + 1];
    da_weights(part, nc, H, ldp, b, h, w);
    __m512 o[16];
    for (int64_t d = 0; d < nd; d++) o[d] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
        if (w[c] == 0.0f) continue;
        const float *p = part + ((b * nc + c) * H + h) * ldp;
        const __m512 wv = _mm512_set1_ps(w[c]);
        for (int64_t d = 0; d < nd; d++) o[d] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(p + 2 + 16 * d), o[d]);
    }
    uint16_t *oh = out + b * ldo + h * hd;
    float tmp[16];
    for (int64_t d = 0; d < nd; d++) {
        _mm512_storeu_ps(tmp, o[d]);
        for (int i = 0; i < 16; i++) oh[16 * d + i] = to_bf16(tmp[i]);
    }
}

/* The decode attention of B rows for the calling team of threads: the items shared out as they
   come (rows may keep different numbers of keys), then the merge; part: B * nc * H * (hd + 2)
   floats, nc = ceil(W / ch). out's rows ldo elements apart. */
static void team_decode_attn(const uint16_t *q, int64_t ldq, const uint16_t *kp, const uint16_t *vp,
                             const int64_t *idx, const uint8_t *keep, uint16_t *out, int64_t ldo, int64_t B,
                             int64_t H, int64_t KV, int64_t hd, int64_t W, float scale, int64_t ch, float *part) {
    const int64_t nc = (W + ch - 1) / ch;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < B * nc; it++)
        da_item(q, ldq, kp, vp, idx, keep, it / nc, it % nc, ch, H, KV, hd, W, scale, part + it * H * (hd + 2));
    #pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; bh++) da_merge(part, nc, H, hd, bh / H, bh % H, out, ldo);
}

static float *da_part(int64_t B, int64_t W, int64_t H, int64_t hd, int64_t ch) {
    return (float *)malloc(sizeof(float) * (size_t)(B * ((W + ch - 1) / ch) * H * (hd + 2) + 1));
}

void agentmem_decode_attn_bf16(const uint16_t *q, const uint16_t *kp, const uint16_t *vp, const int64_t *idx,
                               const uint8_t *keep, uint16_t *out, int64_t B, int64_t H, int64_t KV,
                               int64_t hd, int64_t W, float scale, int threads) {
    if (B <= 0) return;
    const int64_t ch = da_chunk(B, W, threads);
    float *part = da_part(B, W, H, hd, ch);
    #pragma omp parallel num_threads(threads)
    team_decode_attn(q, H * hd, kp, vp, idx, keep, out, H * hd, B, H, KV, hd, W, scale, ch, part);
    free(part);
}
