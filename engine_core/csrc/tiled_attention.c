/*
 * Attention on AMX tiles for rows that attend to the same keys: a run of rows of one
 * sequence (a prompt chunk), or decode rows over the cached prefix they share. Instead
 * of each row walking its keys alone (row_walk.c), 16 query heads of a few
 * rows at a time take the tile unit's 16 x 16 x 32 products against 16 keys, read
 * straight from the cache blocks. Per work item (up to ZS_TILE_ROWS rows, one KV
 * head): the item's K/V are laid out once in the tiles' pair-interleaved form, then
 * for each 16-column query tile (its rows x the KV head's query heads) the scores
 * S = Q Kᵀ go to a scratch row per column, the softmax runs along those rows in fp32
 * (scaled, soft-capped, bottom-right causal and windowed as the row walk is), and
 * P V takes the tile unit again with P rounded to bf16, as torch's tiled attention
 * (SDPA) rounds it; a shared prefix's item leaves its unnormalized sums for the row
 * walk of each row's own keys to merge. Called by zs_paged_attention; AVX-512 builds.
 *
 * Without AMX (or where Linux refuses the tiles) the same layouts feed AVX512-BF16 dot
 * products instead: each 16 x 16 x 32 tile product is 16 pair broadcasts of each of the
 * 16 query columns against one 64-byte row of the B layout, the products a tile would
 * sum, in another order.
 */
#include "kernels.h"

#if ZS_AVX512

#if ZS_AMX
#define ZS_AMX_ATTENTION_SHAPE (1 << 20)

/* Every tile 16 rows of 64 bytes: A (Q or P) in 0, B (Kᵀ or V pairs) in 1, the scores'
 * C in 2, P V's C in 4-7 (64 output dims a pass). */
static void tiles_configure(void) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    zs_amx_load(ZS_AMX_ATTENTION_SHAPE, rows);
}
#endif

/* r[i] (16 dwords each) -> r[j] holds dword j of every r[i]. */
static inline void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i += 2) {
        a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* b[i + e]: element e of each lane, rows i..i+3 */
        b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    for (int e = 0; e < 4; e++) { /* lanes of b[e], b[4 + e], ... transposed 4 x 4 */
        const __m512i t0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x44);
        const __m512i t1 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xEE);
        const __m512i t2 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x44);
        const __m512i t3 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xEE);
        r[e] = _mm512_shuffle_i32x4(t0, t2, 0x88);
        r[4 + e] = _mm512_shuffle_i32x4(t0, t2, 0xDD);
        r[8 + e] = _mm512_shuffle_i32x4(t1, t3, 0x88);
        r[12 + e] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
    }
}

/* The keys [k0, len) row n attends to in this item: its own, or the shared prefix. */
static inline void row_keys(const struct zs_attention_job *j, const struct zs_tile_item *it,
                            int64_t n, int64_t *k0, int64_t *len) {
    if (it->shared) {
        *k0 = 0, *len = it->shared;
    } else {
        *len = j->row_len[n], *k0 = zs_first_key(*len, j->window);
    }
}

/* The cache row of key `pos` of KV head h. */
static inline const bf16 *key_row(const struct zs_attention_job *j, const bf16 *cache,
                                  const int32_t *table, int64_t pos, int64_t h) {
    const int64_t bs = j->block_size;
    return cache + (((int64_t)table[pos / bs] * j->hkv + h) * bs + pos % bs) * j->d;
}

#if ZS_AMX
/* P V for one query tile: dims [dim0, dim0 + 16 nt) over the 32-key groups [g0, g1). */
static inline void pv_pass(const bf16 *pb, int64_t pstride, const bf16 *vn, int64_t d16,
                           int64_t g0, int64_t g1, int64_t c0, int nt, float *o, int64_t d) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t g = g0; g < g1; g++) {
        _tile_loadd(0, pb + g * 32, pstride * (int64_t)sizeof(bf16));
        const bf16 *vg = vn + (g * d16 + c0) * 16 * 32;
        _tile_loadd(1, vg, 64);
        _tile_dpbf16ps(4, 0, 1);
        if (nt > 1) {
            _tile_loadd(1, vg + 16 * 32, 64);
            _tile_dpbf16ps(5, 0, 1);
        }
        if (nt > 2) {
            _tile_loadd(1, vg + 2 * 16 * 32, 64);
            _tile_dpbf16ps(6, 0, 1);
        }
        if (nt > 3) {
            _tile_loadd(1, vg + 3 * 16 * 32, 64);
            _tile_dpbf16ps(7, 0, 1);
        }
    }
    const int64_t ob = d * (int64_t)sizeof(float);
    _tile_stored(4, o + c0 * 16, ob);
    if (nt > 1) _tile_stored(5, o + c0 * 16 + 16, ob);
    if (nt > 2) _tile_stored(6, o + c0 * 16 + 32, ob);
    if (nt > 3) _tile_stored(7, o + c0 * 16 + 48, ob);
}
#endif

/* The tile multiply on vectors: acc[c] (16 fp32 columns) += the 16 pairs of a's row c
 * against the 16 rows of b (each 16 columns x 2). */
static inline __attribute__((always_inline)) void dp_rows(__m512 acc[16], const bf16 *a,
                                                          int64_t astride, const bf16 *b) {
    for (int p = 0; p < 16; p++) {
        const __m512bh bp = (__m512bh)_mm512_loadu_si512(b + p * 32);
        for (int c = 0; c < 16; c++) {
            int32_t pair;
            memcpy(&pair, a + c * astride + 2 * p, sizeof(pair));
            acc[c] = _mm512_dpbf16_ps(acc[c], (__m512bh)_mm512_set1_epi32(pair), bp);
        }
    }
}

/* S = Q Kᵀ of one query tile against 16 keys (their Kᵀ pairs at kt), on vectors. */
static void scores_vec(const bf16 *aq, int64_t d, const bf16 *kt, float *s, int64_t ss) {
    __m512 acc[16];
    for (int c = 0; c < 16; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d / 32; c++) dp_rows(acc, aq + c * 32, d, kt + c * 16 * 32);
    for (int c = 0; c < 16; c++) _mm512_storeu_ps(s + c * ss, acc[c]);
}

/* P V of one query tile for dims [16 t, 16 t + 16) over the 32-key groups [g0, g1). */
static void pv_vec(const bf16 *pb, int64_t pstride, const bf16 *vn, int64_t d16, int64_t g0,
                   int64_t g1, int64_t t, float *o, int64_t d) {
    __m512 acc[16];
    for (int c = 0; c < 16; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t g = g0; g < g1; g++) dp_rows(acc, pb + g * 32, pstride, vn + (g * d16 + t) * 16 * 32);
    for (int c = 0; c < 16; c++) _mm512_storeu_ps(o + c * d + t * 16, acc[c]);
}

static void tiled_item(const struct zs_attention_job *j, const struct zs_tile_item *it) {
    const int64_t count = it->count, h = it->h, d = j->d;
    const int64_t groups = j->hq / j->hkv, per_tile = 16 / groups, d32 = d / 32, d16 = d / 16;
    const int32_t *table = j->tables + it->table * j->table_stride;
    int64_t kb = INT64_MAX, ke = 0; /* the item's keys: [kb, ke), kb 16-aligned */
    for (int64_t i = 0; i < count; i++) {
        int64_t k0, len;
        row_keys(j, it, it->rows[i], &k0, &len);
        if (k0 < kb) kb = k0;
        if (len > ke) ke = len;
    }
    kb -= kb % 16;
    const int64_t nk = ke - kb, nk16 = (nk + 15) / 16, nk32 = (nk + 31) / 32 * 32;
    /* Scratch: Kᵀ pairs [nk16][d32][16 pairs][16 keys x 2], V pairs [nk32/32][d16][16
     * key pairs][16 dims x 2], scores [16][nk32] fp32, P [16][nk32], Q [16][d], out. */
    bf16 *kt = zs_scratch((size_t)(nk16 * 16 * d * 2 + nk32 * d * 2 + 16 * nk32 * 4 +
                                   16 * nk32 * 2 + 16 * d * 2 + 16 * d * 4));
    bf16 *vn = kt + nk16 * 16 * d;
    float *s = (float *)(vn + nk32 * d);
    bf16 *pb = (bf16 *)(s + 16 * nk32), *aq = pb + 16 * nk32;
    float *o = (float *)(aq + 16 * d);
    /* The item's K/V blocks are scattered over the cache: ask for all of them first. */
    for (int64_t i = 0; i < nk16; i++) {
        const char *kr = (const char *)key_row(j, j->k_cache, table, kb + 16 * i, h);
        const char *vr = (const char *)key_row(j, j->v_cache, table, kb + 16 * i, h);
        for (int64_t o = 0; o < 16 * d * (int64_t)sizeof(bf16); o += 64) {
            _mm_prefetch(kr + o, _MM_HINT_T1);
            _mm_prefetch(vr + o, _MM_HINT_T1);
        }
    }
    /* Kᵀ: each 16 keys x 16 dim pairs transposed (keys past ke are masked later). */
    for (int64_t i = 0; i < nk16; i++) {
        const bf16 *k0 = key_row(j, j->k_cache, table, kb + 16 * i, h);
        for (int64_t c = 0; c < d32; c++) {
            __m512i r[16];
            for (int t = 0; t < 16; t++) r[t] = _mm512_loadu_si512(k0 + t * d + c * 32);
            transpose16(r);
            bf16 *dst = kt + (i * d32 + c) * 16 * 32;
            for (int t = 0; t < 16; t++) _mm512_storeu_si512(dst + t * 32, r[t]);
        }
    }
    /* V: rows 2p and 2p + 1 of each 32 keys interleaved (zeros past ke: P is 0 there,
     * and 0 times a stale NaN would not be). */
    __m512i lo_idx, hi_idx;
    {
        uint16_t lo[32], hi[32];
        for (int i = 0; i < 16; i++) {
            lo[2 * i] = i, lo[2 * i + 1] = 32 + i;
            hi[2 * i] = 16 + i, hi[2 * i + 1] = 48 + i;
        }
        lo_idx = _mm512_loadu_si512(lo), hi_idx = _mm512_loadu_si512(hi);
    }
    for (int64_t p = 0; p < nk32 / 2; p++) {
        const int64_t pos = kb + 2 * p;
        const bf16 *va = pos < ke ? key_row(j, j->v_cache, table, pos, h) : NULL;
        const bf16 *vb = pos + 1 < ke ? key_row(j, j->v_cache, table, pos + 1, h) : NULL;
        bf16 *dst = vn + ((p / 16) * d16 * 16 + p % 16) * 32;
        for (int64_t c = 0; c < d32; c++) {
            const __m512i a = va ? _mm512_loadu_si512(va + c * 32) : _mm512_setzero_si512();
            const __m512i b = vb ? _mm512_loadu_si512(vb + c * 32) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + (2 * c) * 16 * 32, _mm512_permutex2var_epi16(a, lo_idx, b));
            _mm512_storeu_si512(dst + (2 * c + 1) * 16 * 32, _mm512_permutex2var_epi16(a, hi_idx, b));
        }
    }
#if ZS_AMX
    const int amx = zs_amx_ready();
    if (amx) tiles_configure();
#endif
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t r0 = 0; r0 < count; r0 += per_tile) {
        const int64_t rows = count - r0 < per_tile ? count - r0 : per_tile, cols = rows * groups;
        int64_t lo = INT64_MAX, hi = 0; /* this tile's keys */
        float inv[16], shift[16];
        for (int64_t c = 0; c < cols; c++) {
            const int64_t n = it->rows[r0 + c / groups];
            memcpy(aq + c * d, j->q + n * j->q_stride + (h * groups + c % groups) * d,
                   (size_t)d * sizeof(bf16));
        }
        for (int64_t r = r0; r < r0 + rows; r++) {
            int64_t k0, len;
            row_keys(j, it, it->rows[r], &k0, &len);
            if (k0 < lo) lo = k0;
            if (len > hi) hi = len;
        }
        const int64_t i0 = (lo - kb) / 16, i1 = (hi - kb + 15) / 16;
        for (int64_t i = i0; i < i1; i++) {
#if ZS_AMX
            if (amx) {
                _tile_zero(2);
                for (int64_t c = 0; c < d32; c++) {
                    _tile_loadd(0, aq + c * 32, d * (int64_t)sizeof(bf16));
                    _tile_loadd(1, kt + (i * d32 + c) * 16 * 32, 64);
                    _tile_dpbf16ps(2, 0, 1);
                }
                _tile_stored(2, s + i * 16, nk32 * (int64_t)sizeof(float));
                continue;
            }
#endif
            scores_vec(aq, d, kt + i * d32 * 16 * 32, s + i * 16, nk32);
        }
        /* Softmax along each column's scores; P as bf16 over whole 32-key groups. */
        const int64_t g0 = i0 / 2, g1 = (i1 + 1) / 2;
        for (int64_t c = 0; c < cols; c++) {
            int64_t k0, len;
            row_keys(j, it, it->rows[r0 + c / groups], &k0, &len);
            float *sc = s + c * nk32;
            bf16 *pc = pb + c * nk32;
            /* The max of the raw scores (the scale is positive); -inf off the row's keys,
             * which only the first and last blocks can hold. Soft-capped scores are
             * scaled and capped here, so their scale below is 1. */
            const int capped = j->softcap > 0.f;
            __m512 best = _mm512_set1_ps(-INFINITY);
            for (int64_t i = i0; i < i1; i++) {
                __m512 x = _mm512_loadu_ps(sc + 16 * i);
                if (capped) {
                    float t[16];
                    _mm512_storeu_ps(t, x);
                    for (int l = 0; l < 16; l++) t[l] = tanhf(t[l] * j->scale / j->softcap) * j->softcap;
                    x = _mm512_loadu_ps(t);
                }
                const int64_t p0 = kb + 16 * i;
                if (p0 < k0 || p0 + 16 > len) {
                    const __m512i pos = _mm512_add_epi32(lane, _mm512_set1_epi32((int)p0));
                    const __mmask16 live =
                        _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32((int)k0), _MM_CMPINT_NLT) &
                        _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32((int)len), _MM_CMPINT_LT);
                    x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, x);
                }
                if (capped || p0 < k0 || p0 + 16 > len) _mm512_storeu_ps(sc + 16 * i, x);
                best = _mm512_max_ps(best, x);
            }
            const float scale = capped ? 1.f : j->scale;
            shift[c] = _mm512_reduce_max_ps(best) * scale;
            const __m512 f = _mm512_set1_ps(scale), shift_v = _mm512_set1_ps(shift[c]);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t i = i0; i < i1; i++) {
                const __m512 x = _mm512_loadu_ps(sc + 16 * i);
                __m512 e = exp512(_mm512_fmsub_ps(x, f, shift_v));
                const int64_t p0 = kb + 16 * i;
                if (p0 < k0 || p0 + 16 > len) /* exp512 of -inf is tiny, not 0 */
                    e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), e);
                sum = _mm512_add_ps(sum, e);
                _mm256_storeu_si256((__m256i *)(pc + 16 * i), (__m256i)_mm512_cvtneps_pbh(e));
            }
            inv[c] = _mm512_reduce_add_ps(sum); /* the sum; its inverse below */
            if (2 * g0 < i0) memset(pc + 32 * g0, 0, 16 * sizeof(bf16));
            if (i1 < 2 * g1) memset(pc + 16 * i1, 0, 16 * sizeof(bf16));
        }
#if ZS_AMX
        if (amx)
            for (int64_t c0 = 0; c0 < d16; c0 += 4)
                pv_pass(pb, nk32, vn, d16, g0, g1, c0, d16 - c0 < 4 ? (int)(d16 - c0) : 4, o, d);
        else
#endif
            for (int64_t t = 0; t < d16; t++) pv_vec(pb, nk32, vn, d16, g0, g1, t, o, d);
        for (int64_t c = 0; c < cols; c++) {
            const int64_t n = it->rows[r0 + c / groups], head = h * groups + c % groups;
            if (it->shared) { /* the sums, for the row walk to finish (row_walk.c) */
                float *dst = j->partial + (n * j->hq + head) * (d + 2);
                memcpy(dst, o + c * d, (size_t)d * sizeof(float));
                dst[d] = shift[c], dst[d + 1] = inv[c];
                continue;
            }
            bf16 *dst = j->out + n * j->out_stride + head * d;
            const __m512 f = _mm512_set1_ps(1.f / inv[c]);
            for (int64_t x = 0; x < d; x += 16) {
                const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(o + c * d + x), f);
                _mm256_storeu_si256((__m256i *)(dst + x), (__m256i)_mm512_cvtneps_pbh(v));
            }
        }
    }
}

struct tiled_job {
    const struct zs_attention_job *job;
    const struct zs_tile_item *items;
};

static void tiled_items(const void *ctx, int64_t begin, int64_t end) {
    const struct tiled_job *t = ctx;
    for (int64_t i = begin; i < end; i++) tiled_item(t->job, t->items + i);
}

int zs_tiled_attention_fits(int64_t hq, int64_t hkv, int64_t d, int64_t block_size) {
    return d % 32 == 0 && d <= ZS_MAX_HEAD_DIM && block_size % 16 == 0 && hq / hkv <= 16;
}

void zs_tiled_attention(const struct zs_attention_job *job, const struct zs_tile_item *items,
                        int64_t num_items) {
    const struct tiled_job t = {job, items};
    zs_parallel(num_items, 1, 1, tiled_items, &t);
}

#endif
