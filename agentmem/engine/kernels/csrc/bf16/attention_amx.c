/* Causal attention of bf16 query rows on AMX tiles: agentmem_rows_attn_amx, and agentmem_amx_ok,
   which asks Linux for the tiles. Follows attention_rows.c in bf16.c (its bf16_value_norms). */
#include "common.h"

/* ---- Causal attention of query rows on AMX tiles (`rows_attention_amx`) ----
   What `agentmem_rows_attn_bf16` computes (without `share`), flash-attention style with the
   products on the tile unit (TDPBF16PS) and the softmax on AVX-512. A task is one query head
   and 16 query rows (rows past Nq repeat the last one; heaviest row blocks first); it runs over
   key blocks of AMX_KB = 64 keys up to its last row's position. All in the transposed
   orientation, so that a row's softmax is one lane of a zmm and needs no horizontal max or sum:
     S^T [64 keys x 16 rows] = K . Q^T: K's rows straight from k (A tiles, 16 keys x 32 dims,
       KV*hd apart; the partial last block from a zero-padded copy), Q^T packed per task as
       [hd/2, 16 rows, 2] (the B-tile layout), stored fp32;
     online softmax: 2^(s c - M) with c = scale*log2 e, M the running max per row lane (times c),
       set from block 0 and raised only where a block's scores pass it by more than 8: the
       weights stay below 2^8 and O is rescaled (and the block's weights redone) only then,
       rarely after block 0; the check is a max fused into the weights loop. 2^x is a degree-4
       polynomial (relative error 2.7e-6). Keys past a row's position are masked only in the
       blocks that reach past the task's first row;
     P^T as bf16 key pairs [32, 16 rows, 2] (a B tile per 32 keys): the weight truncated to bf16
       (its upper half, paired by one vpermt2w) and the exact remainder as a second bf16,
       truncated too (hi + lo within 2^-16 of the weight: the vdpbf16ps kernel's
       ~16 bits, and the same errors against an fp32 reference);
     O^T [hd x 16 rows] += V^T . P^T (+ V^T . P_lo^T): V^T packed per call as [KV, TP/32, hd, 32]
       (A tiles of 16 dims x 32 keys, 1 KB contiguous); O^T in an fp32 buffer, each 16-dim tile
       loaded, accumulated over the block's two 32-key halves and stored back.
   The tile work is split into key tiles (S) and dim tiles (P V) and interleaved with the
   weights: after each 16 keys' weights of block kb come one key tile of block kb+1's scores
   and a share of block kb-1's P V, for the tile unit to run while the vector units go on.
   The AMX Xeon VM, 2026-11-27 (2 threads; 2,048 tokens of 9/3 heads of 64 in four 512-row chunks,
   as `choose_rows_route` times them): 4.75 ms against 12 for bf16 SDPA and 39 for the vdpbf16ps
   kernel; a first version (a separate max pass, degree-6 2^x, whole blocks in turn) took 6.0,
   the whole-block order with the scores one block ahead 4.9. Measured there with the parts
   left out, the weights take ~1.8 ms and the tile work ~2.3 (their sum: they hardly overlap),
   of which ~1 ms is K and V coming from L2. Tried and dropped: 128- or 32-key blocks, two row
   tiles stepping through the keys together (K/V reused from L1), software prefetch of the next
   block, separate hi and lo O tiles: each no faster or slower. One bf16 a weight (no lo part)
   took 4.1 ms but 1.3-1.5x the mean error of hi + lo, a little above bf16 SDPA's.
   With `share` (the kvreuse probe's signal: per key, its weight times |v| summed over the rows
   and heads), a row tile whose softmax is final goes over its keys once more: the scores again
   on the tiles, the normalised weights, summed over the row lanes into the thread's own [T]
   buffer, added to `share` once the team is done (2026-11-29, AMX Xeon VM: 24 probe rows over
   2,056 keys 0.52 ms a layer against 3.8 for torch's bmm and softmax and 1.06 for the vdpbf16ps
   kernel's share).
   Tile config (all 8 tiles 16 rows x 64 bytes) is loaded by each thread of the team, released
   at its end. AMX needs the process's permission first: `agentmem_amx_ok`. */
#include <unistd.h>
#include <sys/syscall.h>

int agentmem_amx_ok(void) {  /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: 1 if granted */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

#ifndef AMX_KB
#define AMX_KB 64  /* keys a block: 4 S tiles */
#endif
#ifndef AMX_AHEAD
#define AMX_AHEAD 1  /* blocks whose scores are computed ahead of the weights */
#endif
#ifndef AMX_RT
#define AMX_RT 1  /* 16-row tiles a task steps through the keys with */
#endif
#define AMX_TGT __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

typedef struct {
    uint8_t palette, start_row, rsv[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

/* 2^x for 16 floats: 2^n * p(r), r = x - n in [-1/2, 1/2], p the degree-6 Taylor series of
   2^r (relative error ~1.2e-7); x = -inf gives NaN (callers mask those lanes after) */
static inline __m512 exp2_16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618129107628477e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550410866482158e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.2402265069591007f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931471805599453f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 2^x for the weights: as exp2_16 with a near-minimax polynomial of degree 4 (relative error
   2.7e-6, below the 2^-16 that hi + lo keep) */
static inline __m512 exp2w_16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(0.009570101276040077f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.05591786280274391f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.240247443318367f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931217908859253f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.9999992847442627f));
    return _mm512_scalef_ps(p, n);
}

typedef struct {
    const uint16_t *q, *k, *kt, *vt;
    const int64_t *qpos;
    uint16_t *out;
    int64_t Nq, H, KV, hd, T, TP;
    float c;  /* scale * log2 e */
    const float *vn;  /* |v| per KV head and key ([KV][TP]), where a share is asked for */
    float *share;     /* [T]: added to, per key, its weight times |v| over the rows and heads; or NULL */
} amx_args;

/* The weights of keys j0..j1-1 of a block (S^T in sb, [KB][16] fp32; j0, j1 even) as
   2^(s c - M) (M: the running max per row lane, times c) into pb: bf16 key pairs
   [KB/2][16][2], then the remainders ([KB/2][16][2] more). The hi part is p truncated to bf16
   (its upper 16 bits, paired by one vpermt2w), the lo part the exact rest truncated too: hi +
   lo within 2^-16 of p.
   Adds the weights to *l and raises *xm to the max of s c - M over the visible keys (diag:
   keys past a row's lim masked, their weights 0). */
AMX_TGT static inline void amx_weights(const float *sb, uint32_t *pb, __m512 cv, __m512 M, int diag,
                                       __m512i limv, int64_t k0, int j0, int j1, __m512 *l, __m512 *xm) {
    /* upper words of p0 (0-31) and p1 (32-63) paired: (p0[r] >> 16, p1[r] >> 16) */
    const __m512i upper = _mm512_set_epi16(63, 31, 61, 29, 59, 27, 57, 25, 55, 23, 53, 21, 51, 19, 49, 17,
                                           47, 15, 45, 13, 43, 11, 41, 9, 39, 7, 37, 5, 35, 3, 33, 1);
    const __m512i himask = _mm512_set1_epi32((int)0xffff0000u);
    __m512 x0m = *xm, x1m = x0m, s0 = _mm512_setzero_ps(), s1 = s0;
    for (int j = j0; j < j1; j += 2) {
        const __m512 x0 = _mm512_fmsub_ps(_mm512_load_ps(sb + j * 16), cv, M);
        const __m512 x1 = _mm512_fmsub_ps(_mm512_load_ps(sb + (j + 1) * 16), cv, M);
        __m512 p0 = exp2w_16(x0), p1 = exp2w_16(x1);
        if (diag) {
            const __mmask16 v0 = _mm512_cmpgt_epi32_mask(limv, _mm512_set1_epi32((int)(k0 + j)));
            const __mmask16 v1 = _mm512_cmpgt_epi32_mask(limv, _mm512_set1_epi32((int)(k0 + j + 1)));
            x0m = _mm512_mask_max_ps(x0m, v0, x0m, x0);
            x1m = _mm512_mask_max_ps(x1m, v1, x1m, x1);
            p0 = _mm512_maskz_mov_ps(v0, p0);
            p1 = _mm512_maskz_mov_ps(v1, p1);
        } else {
            x0m = _mm512_max_ps(x0m, x0);
            x1m = _mm512_max_ps(x1m, x1);
        }
        s0 = _mm512_add_ps(s0, p0);
        s1 = _mm512_add_ps(s1, p1);
        const __m512i i0 = _mm512_castps_si512(p0), i1 = _mm512_castps_si512(p1);
        _mm512_store_si512(pb + j / 2 * 16, _mm512_permutex2var_epi16(i0, upper, i1));
        const __m512 r0 = _mm512_sub_ps(p0, _mm512_castsi512_ps(_mm512_and_si512(i0, himask)));
        const __m512 r1 = _mm512_sub_ps(p1, _mm512_castsi512_ps(_mm512_and_si512(i1, himask)));
        _mm512_store_si512(pb + AMX_KB / 2 * 16 + j / 2 * 16,
                           _mm512_permutex2var_epi16(_mm512_castps_si512(r0), upper, _mm512_castps_si512(r1)));
    }
    *l = _mm512_add_ps(*l, _mm512_add_ps(s0, s1));
    *xm = _mm512_max_ps(x0m, x1m);
}

#define AMX_PB (AMX_KB / 2 * 16 * 2)  /* uint32 of a block's weights (hi and lo) */

/* Tiles: 0 an S^T tile (16 keys x 16 rows), 1 a Q^T tile (32 dims), 2 a K tile; 3 an O^T tile
   (16 dims x 16 rows), 4 and 5 P^T tiles (32 keys, hi and lo), 6 a V^T tile. The S and P V
   work of a block is split into the key tiles and dim tiles that make it, so that the two can
   be interleaved with the weights on the vector units (`amx_attn_team`). */

/* S^T of the 16 keys k0 + 16 i.. into sb + 16 i * 16 */
AMX_TGT static inline void amx_score_tile(const amx_args *a, const uint32_t *qt, float *sb, int64_t k0, int64_t kvh,
                                          int i) {
    const int64_t hd = a->hd;
    const uint8_t *kb;
    int64_t ks;  /* bytes between keys */
    if (k0 + AMX_KB <= a->T) {
        kb = (const uint8_t *)(a->k + ((k0 + 16 * i) * a->KV + kvh) * hd);
        ks = a->KV * hd * 2;
    } else {  /* the partial last block, zero padded */
        kb = (const uint8_t *)(a->kt + (kvh * AMX_KB + 16 * i) * hd);
        ks = hd * 2;
    }
    _tile_zero(0);
    if (hd == 64 && AMX_RT == 1) {  /* Q^T in tiles 1 and 7 since the task began */
        _tile_loadd(2, kb, ks);
        _tile_dpbf16ps(0, 2, 1);
        _tile_loadd(2, kb + 64, ks);
        _tile_dpbf16ps(0, 2, 7);
    } else {
        for (int64_t cc = 0; cc < hd; cc += 32) {
            _tile_loadd(1, qt + cc / 2 * 16, 64);
            _tile_loadd(2, kb + cc * 2, ks);
            _tile_dpbf16ps(0, 2, 1);
        }
    }
    _tile_stored(0, sb + 16 * i * 16, 64);
}

/* O^T dims 16 t.. (ob, [hd][16] fp32) += V^T P^T over the keys k0.. (AMX_KB) */
AMX_TGT static inline void amx_pv_tile(const amx_args *a, const uint32_t *pb, float *ob, int64_t k0, int64_t kvh,
                                       int64_t t) {
    float *o = ob + t * 16 * 16;
    _tile_loadd(3, o, 64);
    for (int j = 0; j < AMX_KB; j += 32) {
        _tile_loadd(6, a->vt + ((kvh * (a->TP / 32) + (k0 + j) / 32) * a->hd + 16 * t) * 32, 64);
        _tile_loadd(4, pb + j / 2 * 16, 64);
        _tile_dpbf16ps(3, 6, 4);
        _tile_loadd(5, pb + AMX_KB / 2 * 16 + j / 2 * 16, 64);
        _tile_dpbf16ps(3, 6, 5);
    }
    _tile_stored(3, o, 64);
}

/* Each key's share of a finished row tile (rows r0.. of head h, its final M and 1/l per row
   lane): the keys' scores again, a tile at a time, their normalised weights 2^(s c - M) / l
   (masked past each row's position and in the lanes past its nr rows), summed over the lanes
   and times |v|, added to acc[key]. */
AMX_TGT static void amx_share_pass(const amx_args *a, const uint32_t *qt, float *sb, int64_t kvh, int64_t nkb,
                                   __m512 M, __m512 inv, __m512i limv, int64_t nr, float *acc) {
    const __m512 cv = _mm512_set1_ps(a->c);
    const __mmask16 live = (__mmask16)((1u << nr) - 1);
    const float *vn = a->vn + kvh * a->TP;
    for (int64_t kb = 0; kb < nkb; kb++) {
        const int64_t k0 = kb * AMX_KB;
        for (int i = 0; i < AMX_KB / 16; i++) amx_score_tile(a, qt, sb, k0, kvh, i);
        const int64_t nj = a->T - k0 < AMX_KB ? a->T - k0 : AMX_KB;
        for (int64_t j = 0; j < nj; j++) {
            const __mmask16 vis = live & _mm512_cmpgt_epi32_mask(limv, _mm512_set1_epi32((int)(k0 + j)));
            const __m512 x = _mm512_fmsub_ps(_mm512_load_ps(sb + j * 16), cv, M);
            const __m512 p = _mm512_maskz_mul_ps(vis, exp2w_16(x), inv);
            acc[k0 + j] += _mm512_reduce_add_ps(p) * vn[k0 + j];
        }
    }
}

/* One 16-row tile of a task: its rows' state while the task steps through the key blocks */
typedef struct {
    int64_t r0, nr, lmin, nkb;  /* first row, rows (the rest repeat the last), keys the first row sees, blocks */
    __m512i limv;               /* keys each row sees */
    __m512 M, l;                /* running max (times c) and sum of weights, per row lane */
    float *sbuf, *ob;           /* S^T ring [AHEAD+1][KB][16]; O^T [hd][16] */
    uint32_t *pt, *qt;          /* P^T (hi, lo) of two blocks; Q^T [hd/2][16] */
} amx_rows;

AMX_TGT static void amx_attn_team(const amx_args *a) {
    const int64_t H = a->H, KV = a->KV, hd = a->hd, T = a->T, G = H / KV, np = hd / 2, ndt = hd / 16;
    const int64_t nb = (a->Nq + 16 * AMX_RT - 1) / (16 * AMX_RT);
    enum { NKT = AMX_KB / 16 };  /* key tiles a block */
    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
    amx_rows R[AMX_RT];
    for (int u = 0; u < AMX_RT; u++) {
        R[u].sbuf = (float *)aligned_alloc(64, (AMX_AHEAD + 1) * AMX_KB * 16 * 4);
        R[u].pt = (uint32_t *)aligned_alloc(64, 2 * AMX_PB * 4);
        R[u].qt = (uint32_t *)aligned_alloc(64, (size_t)np * 16 * 4);
        R[u].ob = (float *)aligned_alloc(64, (size_t)hd * 16 * 4);
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 cv = _mm512_set1_ps(a->c), th = _mm512_set1_ps(8.0f);
    float *acc = a->share ? (float *)calloc((size_t)T, 4) : NULL;  /* this thread's shares */
    #pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < H * nb; task++) {
        const int64_t rb = nb - 1 - task / H, h = task % H, kvh = h / G;
        int nu = 0;  /* row tiles of this task */
        int64_t nkb = 0;
        for (int u = 0; u < AMX_RT; u++) {
            amx_rows *x = &R[u];
            x->r0 = (rb * AMX_RT + u) * 16;
            if (x->r0 >= a->Nq) break;
            nu++;
            x->nr = a->Nq - x->r0 < 16 ? a->Nq - x->r0 : 16;
            int32_t lim[16];
            for (int r = 0; r < 16; r++) {
                const int64_t p = a->qpos[x->r0 + (r < x->nr ? r : x->nr - 1)] + 1;
                lim[r] = (int32_t)(p < T ? p : T);
            }
            x->limv = _mm512_loadu_si512(lim);
            x->lmin = lim[0];
            x->nkb = (lim[15] + AMX_KB - 1) / AMX_KB;  /* rows ascend: the last sees most */
            nkb = x->nkb;
            /* Q^T: dims (2p, 2p+1) of the 16 rows */
            const uint32_t *qb = (const uint32_t *)(a->q + (x->r0 * H + h) * hd);
            const __m512i rows = _mm512_min_epi32(lane, _mm512_set1_epi32((int)x->nr - 1));
            const __m512i idx = _mm512_mullo_epi32(rows, _mm512_set1_epi32((int)(H * np)));
            for (int64_t p = 0; p < np; p++)
                _mm512_store_si512(x->qt + p * 16, _mm512_i32gather_epi32(_mm512_add_epi32(idx, _mm512_set1_epi32((int)p)), qb, 4));
            if (hd == 64 && AMX_RT == 1) {
                _tile_loadd(1, x->qt, 64);
                _tile_loadd(7, x->qt + 256, 64);
            }
            for (int64_t d = 0; d < hd; d++) _mm512_store_ps(x->ob + d * 16, _mm512_setzero_ps());
            x->l = _mm512_setzero_ps();
            for (int64_t kb = 0; kb < AMX_AHEAD && kb < x->nkb; kb++)
                for (int i = 0; i < NKT; i++) amx_score_tile(a, x->qt, x->sbuf + kb * AMX_KB * 16, kb * AMX_KB, kvh, i);
        }
        /* block kb of each row tile: its weights on the vector units, a key tile at a time, and
           after each, a key tile of block kb + AMX_AHEAD's scores and a share of block kb - 1's
           P V dims on the tile unit, which runs them while the vector units go on; the row tiles
           take each block in turn, the second reading its keys and values from L1 */
        for (int64_t kb = 0; kb < nkb; kb++) {
            const int64_t k0 = kb * AMX_KB;
            for (int u = 0; u < nu; u++) {
                amx_rows *x = &R[u];
                if (kb >= x->nkb) continue;
                const float *sb = x->sbuf + (kb % (AMX_AHEAD + 1)) * AMX_KB * 16;
                uint32_t *pb = x->pt + (kb & 1) * AMX_PB;
                const uint32_t *pprev = x->pt + ((kb + 1) & 1) * AMX_PB;
                float *snext = x->sbuf + ((kb + AMX_AHEAD) % (AMX_AHEAD + 1)) * AMX_KB * 16;
                const int diag = k0 + AMX_KB > x->lmin;  /* some row does not see the whole block */
                if (kb == 0) {  /* the running max from block 0's scores (every row sees key 0) */
                    __m512 bm = _mm512_set1_ps(-INFINITY);
                    for (int j = 0; j < AMX_KB; j++) {
                        const __mmask16 vis = _mm512_cmpgt_epi32_mask(x->limv, _mm512_set1_epi32(j));
                        bm = _mm512_mask_max_ps(bm, vis, bm, _mm512_load_ps(sb + j * 16));
                    }
                    x->M = _mm512_mul_ps(bm, cv);
                }
                __m512 lb = _mm512_setzero_ps(), xm = _mm512_set1_ps(-INFINITY);
                for (int i = 0; i < NKT; i++) {
                    amx_weights(sb, pb, cv, x->M, diag, x->limv, k0, 16 * i, 16 * i + 16, &lb, &xm);
                    if (kb + AMX_AHEAD < x->nkb) amx_score_tile(a, x->qt, snext, k0 + AMX_AHEAD * AMX_KB, kvh, i);
                    if (kb > 0)
                        for (int64_t t = i; t < ndt; t += NKT) amx_pv_tile(a, pprev, x->ob, k0 - AMX_KB, kvh, t);
                }
                /* the max stays where it is unless a row's scores pass it by more than 8 (2^8): then
                   O (through block kb - 1) is rescaled and this block's weights redone (rare after block 0) */
                const __mmask16 up = _mm512_cmp_ps_mask(xm, th, _CMP_GT_OQ);
                if (up) {
                    const __m512 Mn = _mm512_mask_add_ps(x->M, up, x->M, xm);
                    const __m512 al = exp2_16(_mm512_sub_ps(x->M, Mn));
                    x->l = _mm512_mul_ps(x->l, al);
                    for (int64_t d = 0; d < hd; d++)
                        _mm512_store_ps(x->ob + d * 16, _mm512_mul_ps(_mm512_load_ps(x->ob + d * 16), al));
                    x->M = Mn;
                    lb = _mm512_setzero_ps();
                    amx_weights(sb, pb, cv, x->M, diag, x->limv, k0, 0, AMX_KB, &lb, &xm);
                }
                x->l = _mm512_add_ps(x->l, lb);
                if (kb + 1 < x->nkb) continue;
                /* the row tile's last block: its P V, then the rows out */
                for (int64_t t = 0; t < ndt; t++) amx_pv_tile(a, pb, x->ob, k0, kvh, t);
                const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), x->l);
                for (int64_t d = 0; d < hd; d++)
                    _mm512_store_ps(x->ob + d * 16, _mm512_mul_ps(_mm512_load_ps(x->ob + d * 16), inv));
                if (acc) amx_share_pass(a, x->qt, x->sbuf, kvh, x->nkb, x->M, inv, x->limv, x->nr, acc);
                const __m512i didx = _mm512_mullo_epi32(lane, _mm512_set1_epi32(16));
                for (int64_t r = 0; r < x->nr; r++) {  /* O^T -> the rows of out */
                    uint16_t *orow = a->out + ((x->r0 + r) * H + h) * hd;
                    for (int64_t d0 = 0; d0 < hd; d0 += 16) {
                        const __m512 o = _mm512_i32gather_ps(_mm512_add_epi32(didx, _mm512_set1_epi32((int)r)), x->ob + d0 * 16, 4);
                        _mm256_storeu_si256((__m256i *)(orow + d0), (__m256i)_mm512_cvtneps_pbh(o));
                    }
                }
            }
        }
    }
    _tile_release();
    if (acc) {  /* after the loop's barrier: every task is done */
        #pragma omp critical
        for (int64_t t = 0; t < T; t++) a->share[t] += acc[t];
        free(acc);
    }
    for (int u = 0; u < AMX_RT; u++) {
        free(R[u].sbuf);
        free(R[u].pt);
        free(R[u].qt);
        free(R[u].ob);
    }
}
#undef AMX_PB

/* q/out bf16 [Nq, H, hd], qpos [Nq] ascending, k/v bf16 [T, KV, hd]; hd a multiple of 32 up to
   256, H a multiple of KV, scale > 0. Only where `agentmem_amx_ok` returned 1. */
void agentmem_rows_attn_amx(const uint16_t *q, const int64_t *qpos, const uint16_t *k, const uint16_t *v,
                            uint16_t *out, int64_t Nq, int64_t H, int64_t KV, int64_t hd, int64_t T, float scale,
                            int threads, float *share) {
    if (Nq <= 0 || T <= 0) return;
    const int64_t TP = (T + AMX_KB - 1) / AMX_KB * AMX_KB, np = hd / 2, nc = TP / 32;
    uint16_t *vt = (uint16_t *)aligned_alloc(64, (size_t)KV * TP * hd * 2);
    float *vn = share ? (float *)aligned_alloc(64, (size_t)KV * TP * 4) : NULL;  /* |v| per KV head and key */
    if (vn) bf16_value_norms(v, T, KV, hd, vn, TP, threads);
    uint16_t *kt = (uint16_t *)aligned_alloc(64, (size_t)KV * AMX_KB * hd * 2);
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                          30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < KV * nc; blk++) {  /* V^T in 32-key chunks: [KV][TP/32][hd][32] */
        const int64_t kvh = blk / nc, t0 = (blk % nc) * 32;
        uint16_t *dst = vt + blk * hd * 32;
        const int64_t n = T - t0;  /* keys of the chunk that exist */
        const __mmask16 m0 = n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
        const __mmask16 m1 = n >= 32 ? 0xffff : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1);
        const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32((int)(KV * np)));
        const uint32_t *b0 = (const uint32_t *)(v + (t0 * KV + kvh) * hd);
        const uint32_t *b1 = (const uint32_t *)(v + ((t0 + 16) * KV + kvh) * hd);
        for (int64_t p = 0; p < np; p++) {
            const __m512i ip = _mm512_add_epi32(idx, _mm512_set1_epi32((int)p));
            const __m512i g0 = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m0, ip, b0, 4);
            const __m512i g1 = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m1, ip, b1, 4);
            _mm512_store_si512(dst + 2 * p * 32, _mm512_permutex2var_epi16(g0, even, g1));
            _mm512_store_si512(dst + (2 * p + 1) * 32, _mm512_permutex2var_epi16(g0, odd, g1));
        }
    }
    const int64_t tail0 = T / AMX_KB * AMX_KB;  /* the partial block's keys, zero padded: [KV][KB][hd] */
    for (int64_t kvh = 0; kvh < KV; kvh++)
        for (int64_t j = 0; j < AMX_KB; j++) {
            uint16_t *dst = kt + (kvh * AMX_KB + j) * hd;
            if (tail0 + j < T) memcpy(dst, k + ((tail0 + j) * KV + kvh) * hd, (size_t)hd * 2);
            else memset(dst, 0, (size_t)hd * 2);
        }
    amx_args a = {q, k, kt, vt, qpos, out, Nq, H, KV, hd, T, TP, scale * 1.4426950408889634f, vn, share};
    #pragma omp parallel num_threads(threads)
    amx_attn_team(&a);
    free(vt);
    free(kt);
    free(vn);
}
