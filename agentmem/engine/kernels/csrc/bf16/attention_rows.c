/* Causal attention of bf16 query rows over a whole K/V on `vdpbf16ps`: agentmem_rows_attn_bf16. */
#include "common.h"

/* Causal attention of query rows over a whole K/V (prefill chunks, CacheBlend's recomputed
   rows): out[i, h] = softmax over keys j <= qpos[i] of (q[i, h] . k[j, h / G] * scale), times V.
   q/out bf16 [Nq, H, hd], qpos int64 [Nq] ascending, k/v bf16 [T, KV, hd] at positions 0..T-1.
   K is first packed per KV head as [T16/16, hd/2, 16, 2] (a key pair of dims for 16 keys in one
   64-byte vector) and V as [T2, hd, 2] (two keys' values of each dim side by side), so both
   products run on vdpbf16ps without horizontal sums: scores for 16 keys of 8 query rows per
   pass over a K block, and P times V two keys per instruction, P (the fp32 softmax
   numerators) as the sum of two bf16 (hi, and the rest), so the weights keep ~16 bits.
   Each task is (KV head, query head of its group, 8 rows): its scores go to a per-thread
   buffer (exact two-pass softmax in fp32), then its outputs are summed over V 4 rows at a
   time (each V load serves 4 rows). Against torch's SDPA in bf16, on 2,048 causal tokens of
   SmolLM2's heads (9 of 64, 3 KV; AMD EPYC, 2 threads): 11.5 against 34.8 ms, and a lower
   mean error against an fp32 reference (7.8e-5 against 1.2e-4). On 2026-11-26 (AMD EPYC Zen 4
   VM, 400 GFLOP/s bf16, 2 threads; 2,048 causal tokens): 22-24 ms, of which P V (two products
   per key pair) ~12 ms; with P as one bf16, 17-19 ms, and through the whole bf16 model the
   same KL against fp32 (512 tokens: 8.01e-4 against 8.03e-4; 2,048: 7.22e-4 against 7.13e-4).
   But `bench memory`'s answers (15 questions, the 135M model, one sampling seed) went 0.60 ->
   0.33 with it (reflected 0.73 -> 0.60), bisected to this change alone; so hi + lo stays until
   a run over several sampling seeds says the drop is noise.
   `share` (NULL: none) [T] fp32 is added to, per key, what it gives the outputs: its attention
   weight times the norm of its value, summed over the rows and heads (the kvreuse probe's
   selection signal, which otherwise materialises every weight in torch). */
#define ROWS 8
#define PV_ROWS 4

/* e[w][d] += sum over key pairs t2 < n2 of row w's weights (ph: bf16 pairs; with `split`, plus
   pl, the rest of each weight) times V's pairs vh [T2][ldv] (uint32: two keys of one dim), for
   16 * nd dims. A constant `split` at the call compiles each case without a branch. */
static inline __attribute__((always_inline)) void ra_pv_bf16(const uint32_t *vh, int64_t ldv, int64_t nd, int64_t n2,
                                                             const uint32_t *const *ph, const uint32_t *const *pl,
                                                             const int split, __m512 e[][4]) {
    for (int64_t t2 = 0; t2 < n2; t2++) {
        __m512bh a[PV_ROWS], al[PV_ROWS];
        for (int w = 0; w < PV_ROWS; w++) {
            a[w] = (__m512bh)_mm512_set1_epi32((int)ph[w][t2]);
            if (split) al[w] = (__m512bh)_mm512_set1_epi32((int)pl[w][t2]);
        }
        const uint32_t *v0 = vh + t2 * ldv;
        for (int d = 0; d < nd; d++) {
            const __m512bh vv = (__m512bh)_mm512_loadu_si512(v0 + 16 * d);
            for (int w = 0; w < PV_ROWS; w++) {
                e[w][d] = _mm512_dpbf16_ps(e[w][d], a[w], vv);
                if (split) e[w][d] = _mm512_dpbf16_ps(e[w][d], al[w], vv);
            }
        }
    }
}
/* |v| of each key's value vector per KV head, for the kvreuse probe's share: vn[kvh * stride + t]
   over v bf16 [T, KV, hd], 0 for t in [T, stride) (the rows and AMX kernels' padded keys). */
static void bf16_value_norms(const uint16_t *v, int64_t T, int64_t KV, int64_t hd, float *vn, int64_t stride,
                             int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < KV * stride; i++) {
        const int64_t kvh = i / stride, t = i % stride;
        __m512 n2 = _mm512_setzero_ps();
        for (int64_t d = 0; t < T && d < hd; d += 16) {
            const __mmask16 m = hd - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (hd - d)) - 1);
            const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                _mm256_maskz_loadu_epi16(m, v + (t * KV + kvh) * hd + d)), 16));
            n2 = _mm512_fmadd_ps(x, x, n2);
        }
        vn[i] = sqrtf(_mm512_reduce_add_ps(n2));
    }
}
void agentmem_rows_attn_bf16(const uint16_t *q, const int64_t *qpos, const uint16_t *k, const uint16_t *v,
                             uint16_t *out, int64_t Nq, int64_t H, int64_t KV, int64_t hd, int64_t T, float scale,
                             int threads, float *share, int split) {
    if (Nq <= 0 || T <= 0) return;
    const int64_t G = H / KV, np = hd / 2, T16 = (T + 15) / 16 * 16, T2 = T16 / 2;
    uint32_t *kpk = (uint32_t *)aligned_alloc(64, (size_t)KV * T16 * np * 4);
    uint32_t *vpk = (uint32_t *)aligned_alloc(64, (size_t)KV * T2 * hd * 4);
    float *vn = share ? (float *)aligned_alloc(64, (size_t)KV * T16 * 4) : NULL;  /* |v| per KV head and key */
    const uint16_t *ku = k, *vu = v;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < KV * (T16 / 16); blk++) {  /* pack K and V, zero past T */
        const int64_t kvh = blk / (T16 / 16), b = blk % (T16 / 16);
        uint32_t *kd = kpk + ((kvh * (T16 / 16) + b) * np) * 16;
        for (int64_t p = 0; p < np; p++)
            for (int64_t t = 0; t < 16; t++) {
                const int64_t j = b * 16 + t;
                kd[p * 16 + t] = j < T ? *(const uint32_t *)(ku + (j * KV + kvh) * hd + 2 * p) : 0u;
            }
        for (int64_t t2 = b * 8; t2 < b * 8 + 8; t2++) {
            uint32_t *vd = vpk + (kvh * T2 + t2) * hd;
            const int64_t j0 = 2 * t2, j1 = 2 * t2 + 1;
            for (int64_t d = 0; d < hd; d++) {
                const uint32_t lo = j0 < T ? vu[(j0 * KV + kvh) * hd + d] : 0u;
                const uint32_t hi = j1 < T ? vu[(j1 * KV + kvh) * hd + d] : 0u;
                vd[d] = lo | (hi << 16);
            }
        }
    }
    if (vn) bf16_value_norms(v, T, KV, hd, vn, T16, threads);
    const int64_t nb = (Nq + ROWS - 1) / ROWS;
    #pragma omp parallel num_threads(threads)
    {
        float *sbuf = (float *)aligned_alloc(64, (size_t)ROWS * T16 * 4);
        uint32_t *pbuf = (uint32_t *)aligned_alloc(64, (size_t)ROWS * T2 * 4);
        uint32_t *plo = split ? (uint32_t *)aligned_alloc(64, (size_t)ROWS * T2 * 4) : NULL;
        float *acc_t = share ? (float *)calloc((size_t)T16, 4) : NULL;  /* this thread's part of `share` */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < KV * G * nb; task++) {
            const int64_t rb = nb - 1 - task / (KV * G), kvh = (task % (KV * G)) / G, g = task % G;
            const int64_t r0 = rb * ROWS, nr = Nq - r0 < ROWS ? Nq - r0 : ROWS, h = kvh * G + g;
            int64_t lim[ROWS];  /* keys each row sees: 0..lim-1 */
            const uint32_t *qr[ROWS];
            for (int64_t r = 0; r < ROWS; r++) {
                const int64_t i = r0 + (r < nr ? r : nr - 1);
                lim[r] = qpos[i] + 1 < T ? qpos[i] + 1 : T;
                qr[r] = (const uint32_t *)(q + (i * H + h) * hd);
            }
            const int64_t nk = (lim[nr - 1] + 15) / 16 * 16;  /* rows ascend: the last sees most */
            const uint32_t *kh = kpk + kvh * (T16 / 16) * np * 16;
            const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            for (int64_t t0 = 0; t0 < nk; t0 += 16) {  /* scores */
                __m512 a[ROWS];
                for (int r = 0; r < ROWS; r++) a[r] = _mm512_setzero_ps();
                const uint32_t *kb = kh + (t0 / 16) * np * 16;
                for (int64_t p = 0; p < np; p++) {
                    const __m512bh kv = (__m512bh)_mm512_load_si512(kb + p * 16);
                    for (int r = 0; r < ROWS; r++)
                        a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32((int)qr[r][p]), kv);
                }
                const __m512i jv = _mm512_add_epi32(lane, _mm512_set1_epi32((int)t0));
                for (int r = 0; r < ROWS; r++) {
                    __mmask16 vis = _mm512_cmplt_epi32_mask(jv, _mm512_set1_epi32((int)lim[r]));
                    _mm512_store_ps(sbuf + r * T16 + t0,
                                    _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), vis, _mm512_mul_ps(a[r], _mm512_set1_ps(scale))));
                }
            }
            float inv[ROWS];
            for (int r = 0; r < nr; r++) {  /* softmax numerators as bf16 key pairs, and their sums */
                float *sr = sbuf + r * T16;
                const int64_t n16 = (lim[r] + 15) / 16 * 16;
                __m512 mv = _mm512_set1_ps(-INFINITY);
                for (int64_t t = 0; t < n16; t += 16) mv = _mm512_max_ps(mv, _mm512_load_ps(sr + t));
                mv = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
                __m512 acc = _mm512_setzero_ps();
                uint32_t *pr = pbuf + r * T2, *pl = split ? plo + r * T2 : NULL;
                for (int64_t t = 0; t < n16; t += 16) {
                    __m512 e = exp16(_mm512_sub_ps(_mm512_load_ps(sr + t), mv));
                    acc = _mm512_add_ps(acc, e);
                    if (share) _mm512_store_ps(sr + t, e);
                    /* e in bf16 (16 bf16 = 8 key pairs); with `split` as hi + lo, both bf16: ~16 bits */
                    __m256bh hi = _mm512_cvtneps_pbh(e);
                    _mm256_storeu_si256((__m256i *)(pr + t / 2), (__m256i)hi);
                    if (split) {
                        __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(e, _mm512_cvtpbh_ps(hi)));
                        _mm256_storeu_si256((__m256i *)(pl + t / 2), (__m256i)lo);
                    }
                }
                inv[r] = 1.0f / _mm512_reduce_add_ps(acc);
                if (share) {  /* weight x |v| of each key this row sees */
                    const __m512 iv = _mm512_set1_ps(inv[r]);
                    const float *vr = vn + kvh * T16;
                    for (int64_t t = 0; t < n16; t += 16)
                        _mm512_storeu_ps(acc_t + t, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_load_ps(sr + t), iv),
                                                                    _mm512_load_ps(vr + t), _mm512_loadu_ps(acc_t + t)));
                }
            }
            const uint32_t *vh = vpk + kvh * T2 * hd;
            for (int r = 0; r < nr; r += PV_ROWS) {  /* P V for PV_ROWS rows at a time: each V load serves them all */
                const int m = nr - r < PV_ROWS ? nr - r : PV_ROWS;
                const int64_t n2 = (lim[r + m - 1] + 15) / 16 * 8;  /* rows ascend: the last sees most */
                const uint32_t *ph[PV_ROWS], *pl[PV_ROWS];
                for (int w = 0; w < PV_ROWS; w++) {
                    const int64_t rw = r + (w < m ? w : m - 1), own = (lim[rw] + 15) / 16 * 8;
                    if (own < n2) {  /* a row's weights past its own keys are 0 */
                        memset(pbuf + rw * T2 + own, 0, (size_t)(n2 - own) * 4);
                        if (split) memset(plo + rw * T2 + own, 0, (size_t)(n2 - own) * 4);
                    }
                    ph[w] = pbuf + rw * T2;
                    pl[w] = split ? plo + rw * T2 : NULL;
                }
                for (int64_t d0 = 0; d0 < hd; d0 += 64) {
                    const int64_t nd = hd - d0 < 64 ? (hd - d0) / 16 : 4;
                    __m512 e[PV_ROWS][4];
                    for (int w = 0; w < PV_ROWS; w++)
                        for (int d = 0; d < 4; d++) e[w][d] = _mm512_setzero_ps();
                    if (split)
                        ra_pv_bf16(vh + d0, hd, nd, n2, ph, pl, 1, e);
                    else
                        ra_pv_bf16(vh + d0, hd, nd, n2, ph, pl, 0, e);
                    for (int w = 0; w < m; w++) {
                        const __m512 iv = _mm512_set1_ps(inv[r + w]);
                        uint16_t *o = out + ((r0 + r + w) * H + h) * hd + d0;
                        for (int d = 0; d < nd; d++) {
                            __m256bh b16 = _mm512_cvtneps_pbh(_mm512_mul_ps(e[w][d], iv));
                            _mm256_storeu_si256((__m256i *)(o + 16 * d), (__m256i)b16);
                        }
                    }
                }
            }
        }
        if (share) {
            #pragma omp critical
            for (int64_t t = 0; t < T; t++) share[t] += acc_t[t];
            free(acc_t);
        }
        free(sbuf);
        free(pbuf);
        free(plo);
    }
    free(kpk);
    free(vpk);
    free(vn);
}
