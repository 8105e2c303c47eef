/* Causal attention of fp32 query rows over a whole K/V: agentmem_avx2_rows_attn_f32. */
#include "common.h"

/* Causal attention of fp32 query rows over a whole fp32 K/V (prefill chunks, CacheBlend's
   recomputed rows), on AVX-512 (`vnni512` and `avx512bw` builds) and on AVX2 (below): out[i, h] =
   softmax over keys j <= qpos[i] of (q[i, h] . k[j, h / G] * scale), times V. q/out [Nq, H, hd], qpos int64 [Nq] ascending, k/v [T, KV, hd] at positions
   0..T-1, hd a multiple of 16 up to 256. K is packed per KV head as [T16/16, hd, 16] (16 keys in
   the lanes of one vector), so the scores of 32 keys and 8 query rows are 16 accumulators fed by two
   K loads and 8 broadcast FMAs a dim, with no horizontal sums; each task (KV head, query head, 8
   rows) sees only the keys up to its last row (rows ascend) and takes an exact two-pass softmax in
   fp32; P V runs the 8 rows and 32 dims a pass over V, each V row loaded once for them. Returns 1
   where it ran. */
#ifdef AGENTMEM_AVX512
/* P V of `n4` (1-8) rows (p: their softmax numerators, ldp apart; inv: 1 / their sums) over keys
   0..kmax-1 for ND (1-2, a constant: the accumulators stay in registers) 16-dim vectors of V (v: key
   0's, keys ldv apart) into out (rows ldo apart). */
static inline __attribute__((always_inline)) void ra_pv(const float *v, int64_t ldv, const float *p, int64_t ldp,
                                                        int64_t kmax, const int n4, const float *inv, float *out,
                                                        int64_t ldo, const int ND) {
    __m512 o[8][2];
    for (int r = 0; r < 8; r++)
        for (int d = 0; d < ND; d++) o[r][d] = _mm512_setzero_ps();
    for (int64_t t = 0; t < kmax; t++) {
        __m512 vv[2];
        for (int d = 0; d < ND; d++) vv[d] = _mm512_loadu_ps(v + t * ldv + 16 * d);
        for (int r = 0; r < n4; r++) {
            const __m512 pr = _mm512_set1_ps(p[r * ldp + t]);
            for (int d = 0; d < ND; d++) o[r][d] = _mm512_fmadd_ps(pr, vv[d], o[r][d]);
        }
    }
    for (int r = 0; r < n4; r++) {
        const __m512 iv = _mm512_set1_ps(inv[r]);
        for (int d = 0; d < ND; d++) _mm512_storeu_ps(out + r * ldo + 16 * d, _mm512_mul_ps(o[r][d], iv));
    }
}
#endif

/* A row of `nk` scores (nk a multiple of 8, 32-byte aligned; masked keys -inf) to its softmax
   numerators in place, exp(s - max); returns 1 / their sum. */
static inline float softmax_numerators(float *sr, int64_t nk) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < nk; t += 8) mx = _mm256_max_ps(mx, _mm256_load_ps(sr + t));
    const __m256 m8 = _mm256_set1_ps(hmax8(mx));
    __m256 acc = _mm256_setzero_ps();
    for (int64_t t = 0; t < nk; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(sr + t), m8));
        _mm256_store_ps(sr + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    return 1.0f / hsum8(acc);
}

/* The rows kernel's packed K: a buffer kept by the calling thread and grown as needed (a fresh
   1.5 MB for 2k keys each call cost its page faults and unmapping at every layer); NULL where it
   cannot be had. */
static float *packed_k_buffer(size_t floats) {
    static __thread float *buf = NULL;
    static __thread size_t cap = 0;
    if (floats > cap) {
        free(buf);
        buf = (float *)aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
        cap = buf ? floats : 0;
    }
    return buf;
}

int agentmem_avx2_rows_attn_f32(const float *q, const int64_t *qpos, const float *k, const float *v, float *out,
                                int64_t Nq, int64_t H, int64_t KV, int64_t hd, int64_t T, float scale, int threads,
                                float *share) {
#ifdef AGENTMEM_AVX512
    if (share) return 0;  /* each key's share: the AVX2 build's (the caller computes it with torch) */
    if (Nq <= 0 || T <= 0) return 1;
    if (hd % 16 || hd > 256 || H % KV) return 0;
    /* only the keys the last row sees are read */
    if (qpos[Nq - 1] + 1 < T) T = qpos[Nq - 1] + 1;
    const int64_t G = H / KV, T16 = (T + 15) / 16 * 16, nblk = T16 / 16, nd = hd / 16;
    float *kpk = packed_k_buffer((size_t)KV * T16 * hd);
    if (!kpk) return 0;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < KV * nblk; blk++) {  /* pack K, zero past T: 16 keys x 16 dims at a time */
        const int64_t kvh = blk / nblk, b = blk % nblk;
        float *kd = kpk + (kvh * nblk + b) * hd * 16;
        for (int64_t d0 = 0; d0 < hd; d0 += 16) {
            float tile[16][16] __attribute__((aligned(64)));
            for (int64_t t = 0; t < 16; t++) {
                const int64_t j = b * 16 + t;
                _mm512_store_ps(tile[t], j < T ? _mm512_loadu_ps(k + (j * KV + kvh) * hd + d0) : _mm512_setzero_ps());
            }
            for (int64_t d = 0; d < 16; d++) {
                const __m512i col = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
                _mm512_store_ps(kd + (d0 + d) * 16, _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32((int)d)), &tile[0][0], 4));
            }
        }
    }
    const int64_t nb = (Nq + 7) / 8;
    #pragma omp parallel num_threads(threads)
    {
        float *sbuf = (float *)aligned_alloc(64, (size_t)8 * T16 * 4);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < KV * G * nb; task++) {
            const int64_t rb = nb - 1 - task / (KV * G), kvh = (task % (KV * G)) / G, g = task % G;
            const int64_t r0 = rb * 8, nr = Nq - r0 < 8 ? Nq - r0 : 8, h = kvh * G + g;
            int64_t lim[8];
            const float *qr[8];
            for (int64_t r = 0; r < 8; r++) {
                const int64_t i = r0 + (r < nr ? r : nr - 1);
                lim[r] = qpos[i] + 1 < T ? qpos[i] + 1 : T;
                qr[r] = q + (i * H + h) * hd;
            }
            const int64_t nk = (lim[nr - 1] + 15) / 16 * 16;
            const float *kh = kpk + kvh * nblk * hd * 16;
            const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
            const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            for (int64_t t0 = 0; t0 < nk; t0 += 32) {  /* scores of 32 keys (16 at the end) for the 8 rows */
                const int two = t0 + 16 < nk;
                __m512 a[8], b[8];
                for (int r = 0; r < 8; r++) a[r] = b[r] = _mm512_setzero_ps();
                const float *kb = kh + (t0 / 16) * hd * 16;
                if (two)
                    for (int64_t d = 0; d < hd; d++) {
                        const __m512 k0 = _mm512_load_ps(kb + d * 16), k1 = _mm512_load_ps(kb + hd * 16 + d * 16);
                        for (int r = 0; r < 8; r++) {
                            const __m512 x = _mm512_set1_ps(qr[r][d]);
                            a[r] = _mm512_fmadd_ps(x, k0, a[r]);
                            b[r] = _mm512_fmadd_ps(x, k1, b[r]);
                        }
                    }
                else
                    for (int64_t d = 0; d < hd; d++) {
                        const __m512 k0 = _mm512_load_ps(kb + d * 16);
                        for (int r = 0; r < 8; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), k0, a[r]);
                    }
                const __m512i kpos = _mm512_add_epi32(lane, _mm512_set1_epi32((int)t0));
                const __m512i kpos1 = _mm512_add_epi32(kpos, _mm512_set1_epi32(16));
                for (int r = 0; r < 8; r++) {
                    const __m512i lr = _mm512_set1_epi32((int)lim[r]);
                    _mm512_store_ps(sbuf + r * T16 + t0, _mm512_mask_mul_ps(ninf, _mm512_cmplt_epi32_mask(kpos, lr), a[r], sc));
                    if (two)
                        _mm512_store_ps(sbuf + r * T16 + t0 + 16,
                                        _mm512_mask_mul_ps(ninf, _mm512_cmplt_epi32_mask(kpos1, lr), b[r], sc));
                }
            }
            float inv[8];
            for (int64_t r = 0; r < nr; r++) inv[r] = softmax_numerators(sbuf + r * T16, nk);
            for (int64_t d0 = 0; d0 < nd; d0 += 2) {  /* P V, the 8 rows and 32 dims a pass over V */
                const float *vb = v + kvh * hd + 16 * d0;
                float *ob = out + r0 * H * hd + h * hd + 16 * d0;
                if (nd - d0 >= 2 && nr == 8) ra_pv(vb, KV * hd, sbuf, T16, lim[7], 8, inv, ob, H * hd, 2);
                else if (nd - d0 >= 2) ra_pv(vb, KV * hd, sbuf, T16, lim[nr - 1], (int)nr, inv, ob, H * hd, 2);
                else ra_pv(vb, KV * hd, sbuf, T16, lim[nr - 1], (int)nr, inv, ob, H * hd, 1);
            }
        }
        free(sbuf);
    }
    return 1;
#else
    /* AVX2: the same two-pass softmax with 8 keys in a vector. K is packed per KV head as [T8/8, hd,
       8]; the scores of 16 keys and 4 query rows are 8 accumulators fed by two K loads and 4
       broadcast FMAs a dim. A task is 8 rows of one KV head with all its query heads, each 4 rows
       in turn over the same 16 keys (in L1); P V runs 4 rows and 16 dims a pass over V. */
    if (Nq <= 0 || T <= 0) return 1;
    if (hd % 16 || hd > 256 || H % KV) return 0;
    if (qpos[Nq - 1] + 1 < T) T = qpos[Nq - 1] + 1;
    const int64_t G = H / KV, T8 = (T + 7) / 8 * 8, nblk = T8 / 8;
    float *kpk = packed_k_buffer((size_t)KV * T8 * hd);
    if (!kpk) return 0;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < KV * nblk; blk++) {  /* pack K, zero past T: an 8 x 8 transpose at a time */
        const int64_t kvh = blk / nblk, b = blk % nblk;
        float *kd = kpk + (kvh * nblk + b) * hd * 8;
        for (int64_t d0 = 0; d0 < hd; d0 += 8) {
            __m256 r[8];
            for (int t = 0; t < 8; t++) {
                const int64_t j = b * 8 + t;
                r[t] = j < T ? _mm256_loadu_ps(k + (j * KV + kvh) * hd + d0) : _mm256_setzero_ps();
            }
            const __m256 a0 = _mm256_unpacklo_ps(r[0], r[1]), a1 = _mm256_unpackhi_ps(r[0], r[1]);
            const __m256 a2 = _mm256_unpacklo_ps(r[2], r[3]), a3 = _mm256_unpackhi_ps(r[2], r[3]);
            const __m256 a4 = _mm256_unpacklo_ps(r[4], r[5]), a5 = _mm256_unpackhi_ps(r[4], r[5]);
            const __m256 a6 = _mm256_unpacklo_ps(r[6], r[7]), a7 = _mm256_unpackhi_ps(r[6], r[7]);
            const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
            const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
            const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
            const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
            float *o = kd + d0 * 8;
            _mm256_store_ps(o + 0, _mm256_permute2f128_ps(b0, b4, 0x20));
            _mm256_store_ps(o + 8, _mm256_permute2f128_ps(b1, b5, 0x20));
            _mm256_store_ps(o + 16, _mm256_permute2f128_ps(b2, b6, 0x20));
            _mm256_store_ps(o + 24, _mm256_permute2f128_ps(b3, b7, 0x20));
            _mm256_store_ps(o + 32, _mm256_permute2f128_ps(b0, b4, 0x31));
            _mm256_store_ps(o + 40, _mm256_permute2f128_ps(b1, b5, 0x31));
            _mm256_store_ps(o + 48, _mm256_permute2f128_ps(b2, b6, 0x31));
            _mm256_store_ps(o + 56, _mm256_permute2f128_ps(b3, b7, 0x31));
        }
    }
    const int64_t nb = (Nq + 7) / 8, T16 = (T8 + 15) / 16 * 16;
    /* with `share`: what each key adds to the rows' outputs (the blend's probe), the attention paid
       to it times its value's norm, summed over rows and heads, added into share[0..T-1]; each
       thread sums its tasks' into its own row of `part`, added up after */
    float *vnorm = NULL, *part = NULL;
    if (share) {
        vnorm = (float *)aligned_alloc(32, (size_t)KV * T16 * 4);
        part = (float *)aligned_alloc(32, (size_t)threads * T16 * 4);
        if (!vnorm || !part) { free(vnorm); free(part); return 0; }
        memset(part, 0, (size_t)threads * T16 * 4);
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < T16; t++)  /* each key's value norm per KV head, 8 dims a step */
            for (int64_t kvh = 0; kvh < KV; kvh++) {
                __m256 ss = _mm256_setzero_ps();
                if (t < T)
                    for (int64_t d = 0; d < hd; d += 8) {
                        const __m256 x = _mm256_loadu_ps(v + (t * KV + kvh) * hd + d);
                        ss = _mm256_fmadd_ps(x, x, ss);
                    }
                vnorm[kvh * T16 + t] = sqrtf(hsum8(ss));
            }
    }
    #pragma omp parallel num_threads(threads)
    {
        /* a task is (8 rows, KV head) with every query head of that KV head: each 16-key block of K
           (4 KB) serves G x 8 rows from L1, and V's slices serve them from L2 */
        float *sbuf = (float *)aligned_alloc(32, (size_t)G * 8 * T16 * 4);
        float *inv = (float *)malloc(sizeof(float) * (size_t)G * 8);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < KV * nb; task++) {
            const int64_t rb = nb - 1 - task / KV, kvh = task % KV;
            const int64_t r0 = rb * 8, nr = Nq - r0 < 8 ? Nq - r0 : 8;
            int64_t lim[8], row[8];
            for (int64_t r = 0; r < 8; r++) {
                row[r] = r0 + (r < nr ? r : nr - 1);
                lim[r] = qpos[row[r]] + 1 < T ? qpos[row[r]] + 1 : T;
            }
            const int64_t nk = (lim[nr - 1] + 7) / 8 * 8;
            const float *kh = kpk + kvh * nblk * hd * 8;
            const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            for (int64_t t0 = 0; t0 < nk; t0 += 16) {  /* scores of 16 keys (8 at the end), 4 rows at a time */
                const int two = t0 + 8 < nk;
                const float *kb = kh + (t0 / 8) * hd * 8;
                const __m256i kpos = _mm256_add_epi32(lane, _mm256_set1_epi32((int)t0));
                const __m256i kpos1 = _mm256_add_epi32(kpos, _mm256_set1_epi32(8));
                for (int64_t g = 0; g < G; g++)
                    for (int r4 = 0; r4 < nr; r4 += 4) {
                        const float *q0 = q + (row[r4] * H + kvh * G + g) * hd, *q1 = q + (row[r4 + 1] * H + kvh * G + g) * hd;
                        const float *q2 = q + (row[r4 + 2] * H + kvh * G + g) * hd, *q3 = q + (row[r4 + 3] * H + kvh * G + g) * hd;
                        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
                        if (two)
                            for (int64_t d = 0; d < hd; d++) {
                                const __m256 k0 = _mm256_load_ps(kb + d * 8), k1 = _mm256_load_ps(kb + hd * 8 + d * 8);
                                __m256 x = _mm256_broadcast_ss(q0 + d);
                                a0 = _mm256_fmadd_ps(x, k0, a0); b0 = _mm256_fmadd_ps(x, k1, b0);
                                x = _mm256_broadcast_ss(q1 + d);
                                a1 = _mm256_fmadd_ps(x, k0, a1); b1 = _mm256_fmadd_ps(x, k1, b1);
                                x = _mm256_broadcast_ss(q2 + d);
                                a2 = _mm256_fmadd_ps(x, k0, a2); b2 = _mm256_fmadd_ps(x, k1, b2);
                                x = _mm256_broadcast_ss(q3 + d);
                                a3 = _mm256_fmadd_ps(x, k0, a3); b3 = _mm256_fmadd_ps(x, k1, b3);
                            }
                        else
                            for (int64_t d = 0; d < hd; d++) {
                                const __m256 k0 = _mm256_load_ps(kb + d * 8);
                                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(q0 + d), k0, a0);
                                a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(q1 + d), k0, a1);
                                a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(q2 + d), k0, a2);
                                a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(q3 + d), k0, a3);
                            }
                        const __m256 a[4] = {a0, a1, a2, a3}, b[4] = {b0, b1, b2, b3};
                        for (int r = 0; r < 4; r++) {
                            const __m256i lr = _mm256_set1_epi32((int)lim[r4 + r]);
                            float *sr = sbuf + (g * 8 + r4 + r) * T16 + t0;
                            _mm256_store_ps(sr, _mm256_blendv_ps(ninf, _mm256_mul_ps(a[r], sc),
                                                                 _mm256_castsi256_ps(_mm256_cmpgt_epi32(lr, kpos))));
                            if (two)
                                _mm256_store_ps(sr + 8, _mm256_blendv_ps(ninf, _mm256_mul_ps(b[r], sc),
                                                                         _mm256_castsi256_ps(_mm256_cmpgt_epi32(lr, kpos1))));
                        }
                    }
            }
            for (int64_t g = 0; g < G; g++)
                for (int64_t r = 0; r < nr; r++) inv[g * 8 + r] = softmax_numerators(sbuf + (g * 8 + r) * T16, nk);
            if (share) {
                float *mine = part + (int64_t)omp_get_thread_num() * T16;
                const float *vn = vnorm + kvh * T16;
                for (int64_t t = 0; t < nk; t += 8) {
                    __m256 acc = _mm256_setzero_ps();
                    for (int64_t g = 0; g < G; g++)
                        for (int64_t r = 0; r < nr; r++)
                            acc = _mm256_fmadd_ps(_mm256_load_ps(sbuf + (g * 8 + r) * T16 + t), _mm256_set1_ps(inv[g * 8 + r]), acc);
                    _mm256_store_ps(mine + t, _mm256_fmadd_ps(acc, _mm256_load_ps(vn + t), _mm256_load_ps(mine + t)));
                }
            }
            /* P V: 4 rows and 16 dims a pass over V's keys; each 16-dim slice of V (64 bytes a key)
               serves every query head's rows while it is in L2 */
            for (int64_t d0 = 0; d0 < hd; d0 += 16) {
                const float *vb = v + kvh * hd + d0;
                for (int64_t g = 0; g < G; g++)
                    for (int r4 = 0; r4 < nr; r4 += 4) {
                        const int n4 = nr - r4 < 4 ? (int)(nr - r4) : 4;
                        const int64_t kmax = lim[r4 + n4 - 1];
                        const float *pr = sbuf + (g * 8 + r4) * T16;
                        __m256 o[4][2];
                        if (n4 == 4) {  /* the accumulators named, so that they stay in registers */
                            __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, e0 = c0, e1 = c0, e2 = c0, e3 = c0;
                            for (int64_t t = 0; t < kmax; t++) {
                                const __m256 v0 = _mm256_loadu_ps(vb + t * KV * hd), v1 = _mm256_loadu_ps(vb + t * KV * hd + 8);
                                __m256 p = _mm256_broadcast_ss(pr + t);
                                c0 = _mm256_fmadd_ps(p, v0, c0); e0 = _mm256_fmadd_ps(p, v1, e0);
                                p = _mm256_broadcast_ss(pr + T16 + t);
                                c1 = _mm256_fmadd_ps(p, v0, c1); e1 = _mm256_fmadd_ps(p, v1, e1);
                                p = _mm256_broadcast_ss(pr + 2 * T16 + t);
                                c2 = _mm256_fmadd_ps(p, v0, c2); e2 = _mm256_fmadd_ps(p, v1, e2);
                                p = _mm256_broadcast_ss(pr + 3 * T16 + t);
                                c3 = _mm256_fmadd_ps(p, v0, c3); e3 = _mm256_fmadd_ps(p, v1, e3);
                            }
                            o[0][0] = c0; o[0][1] = e0; o[1][0] = c1; o[1][1] = e1;
                            o[2][0] = c2; o[2][1] = e2; o[3][0] = c3; o[3][1] = e3;
                        } else {
                            for (int r = 0; r < 4; r++) o[r][0] = o[r][1] = _mm256_setzero_ps();
                            for (int64_t t = 0; t < kmax; t++) {
                                const __m256 v0 = _mm256_loadu_ps(vb + t * KV * hd), v1 = _mm256_loadu_ps(vb + t * KV * hd + 8);
                                for (int r = 0; r < n4; r++) {
                                    const __m256 p = _mm256_broadcast_ss(pr + r * T16 + t);
                                    o[r][0] = _mm256_fmadd_ps(p, v0, o[r][0]);
                                    o[r][1] = _mm256_fmadd_ps(p, v1, o[r][1]);
                                }
                            }
                        }
                        for (int r = 0; r < n4; r++) {
                            const __m256 iv = _mm256_set1_ps(inv[g * 8 + r4 + r]);
                            float *ob = out + ((r0 + r4 + r) * H + kvh * G + g) * hd + d0;
                            _mm256_storeu_ps(ob, _mm256_mul_ps(o[r][0], iv));
                            _mm256_storeu_ps(ob + 8, _mm256_mul_ps(o[r][1], iv));
                        }
                    }
            }
        }
        free(inv);
        free(sbuf);
    }
    if (share) {
        for (int i = 0; i < threads; i++)
            for (int64_t t = 0; t < T; t++) share[t] += part[(int64_t)i * T16 + t];
        free(part);
        free(vnorm);
    }
    return 1;
#endif
}
