/*
 * A long decode row's walk on the tile unit, for the rows zs_row_tiles picks
 * (row_walk.c walks the rest on the vector units): one row's query heads of
 * one KV head against its keys, 16-key block by block.
 *
 * The scores go as S = K Qᵀ: each block's 16 keys are the A operand, read straight from
 * the cache, and the heads are the B operand, a column of K-pairs each, so each key's
 * sums come out whole, with none to add across lanes. P V interleaves two keys' V rows
 * as the vector walk does and takes them as B, against the weights as A. Here an
 * AVX512-BF16 dot product retires once per 2 cycles; 2 tile multiplies do a block's 128
 * of them (d = 64, 4 heads). The sums' order differs from the vector walk's, as the
 * tiles' always does from torch's; P is rounded to bf16 in both.
 */
#include "kernels.h"

/* Rows of at least this many keys walk on the tiles: a decode step ran 3-9 % faster at
 * 32 x 512 and 8 x 1536 keys, where at 96 keys (the standard load) one layer ran 13 %
 * slower, two tile shapes loaded an item and a last tile half empty (BENCHMARKS.md §2). */
#define ZS_ROW_TILES_MIN_KEYS 384

int zs_row_tiles(int64_t start, int64_t len, int64_t groups, int64_t d, int64_t block_size,
                 float softcap) {
#if ZS_AMX
    return len - start >= ZS_ROW_TILES_MIN_KEYS && start % 16 == 0 && block_size == 16 &&
           d % 32 == 0 && d <= 128 && groups <= 16 && softcap <= 0.f && zs_amx_ready();
#else
    (void)start, (void)len, (void)groups, (void)d, (void)block_size, (void)softcap;
    return 0;
#endif
}

#if ZS_AMX
#define ZS_SCORES_SHAPE (2 << 20) /* + the bytes of a key's scores */
#define ZS_VALUES_SHAPE (3 << 20) /* + gp */

/* One block's scores: C (tile 2 or 3) = the 16 keys (A, tiles 0-1, d * 2 bytes apart)
 * times the heads (B, tiles 4-7, a tile each 32 dims), stored `width` bytes a key. */
#define ZS_BLOCK_SCORES(C, keys, d, out, width)              \
    do {                                                     \
        const int64_t stride_ = (d) * (int64_t)sizeof(bf16); \
        _tile_zero(C);                                       \
        _tile_loadd(0, (keys), stride_);                     \
        _tile_dpbf16ps(C, 0, 4);                             \
        if ((d) > 32) {                                      \
            _tile_loadd(1, (keys) + 32, stride_);            \
            _tile_dpbf16ps(C, 1, 5);                         \
        }                                                    \
        if ((d) > 64) {                                      \
            _tile_loadd(0, (keys) + 64, stride_);            \
            _tile_dpbf16ps(C, 0, 6);                         \
        }                                                    \
        if ((d) > 96) {                                      \
            _tile_loadd(1, (keys) + 96, stride_);            \
            _tile_dpbf16ps(C, 1, 7);                         \
        }                                                    \
        _tile_stored(C, (out), (width));                     \
    } while (0)

/* Blocks alternate between two sum tiles, so one's store overlaps the next one's
 * multiplies. Each block asks, as the vector walk does, for the K block two on and for
 * its own V rows (P V's, after). */
void zs_row_scores(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache,
                   const int32_t *table, int64_t start, int64_t len, int64_t h, int64_t hkv,
                   int64_t groups, int64_t gp, int64_t d, float scale, float *s, float *best) {
    const int64_t width = gp * (int64_t)sizeof(float), pairs = d / 2;
    const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    const uint16_t colsb[8] = {64, 64, width, width, width, width, width, width};
    zs_amx_load(ZS_SCORES_SHAPE + (int)width, rows, colsb);
    int32_t qt[64 * 16] __attribute__((aligned(64))); /* [pair][head]: B's layout */
    memset(qt, 0, sizeof(int32_t) * (size_t)(pairs * gp));
    for (int64_t g = 0; g < groups; g++)
        for (int64_t p = 0; p < pairs; p++) memcpy(qt + p * gp + g, q + g * d + 2 * p, 4);
    _tile_loadd(4, qt, width);
    if (d > 32) _tile_loadd(5, qt + 16 * gp, width);
    if (d > 64) _tile_loadd(6, qt + 32 * gp, width);
    if (d > 96) _tile_loadd(7, qt + 48 * gp, width);
    const int64_t block_bytes = 16 * d * (int64_t)sizeof(bf16);
    for (int64_t b = start / 16; b * 16 < len; b++) {
        const int64_t at = ((int64_t)table[b] * hkv + h) * 16 * d;
        if ((b + 2) * 16 < len)
            zs_fetch_l2(k_cache + ((int64_t)table[b + 2] * hkv + h) * 16 * d, block_bytes);
        zs_fetch_l2(v_cache + at, block_bytes);
        float *out = s + (b * 16 - start) * gp; /* a last block's spare keys: see the walk */
        if (b % 2) ZS_BLOCK_SCORES(3, k_cache + at, d, out, width);
        else ZS_BLOCK_SCORES(2, k_cache + at, d, out, width);
    }
    /* Scaled in place, and each lane's maximum (lane l holds head l % gp). */
    const int64_t total = (len - start) * gp;
    const __m512 f = _mm512_set1_ps(scale);
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < total; i += 16) {
        const __mmask16 live = lanes16(total - i);
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, s + i), f);
        _mm512_mask_storeu_ps(s + i, live, x);
        m = _mm512_mask_max_ps(m, live, m, x);
    }
    float lane[16];
    _mm512_storeu_ps(lane, m);
    for (int64_t g = 0; g < gp; g++) {
        best[g] = lane[g];
        for (int64_t l = g + gp; l < 16; l += gp) best[g] = lane[l] > best[g] ? lane[l] : best[g];
    }
}

/* Key t's V row (t from the row's first key). */
static inline const bf16 *v_row(const bf16 *v_cache, const int32_t *table, int64_t key,
                                int64_t h, int64_t hkv, int64_t d) {
    return v_cache + (((int64_t)table[key / 16] * hkv + h) * 16 + key % 16) * d;
}

/* 32 keys at a time: the heads' weights as A (tile 0, gp rows of 16 key pairs, gathered
 * from the walk's pair-major w), each 16 dims of the keys' V row pairs as B (tile 1),
 * into a sum tile a 16 dims (2-5); d = 128 in two passes of 64 dims. Keys past the last
 * are zero rows at weight zero. */
void zs_row_values(const bf16 *v_cache, const int32_t *table, int64_t start, int64_t len,
                   int64_t h, int64_t hkv, int64_t gp, int64_t d, const int32_t *w, float *acc) {
    const uint8_t g8 = (uint8_t)gp, rows[8] = {g8, 16, g8, g8, g8, g8, 0, 0};
    zs_amx_load(ZS_VALUES_SHAPE + (int)gp, rows, NULL);
    const int64_t n = len - start, pairs = (n + 1) / 2, out = d * (int64_t)sizeof(float);
    int32_t pa[16 * 16] __attribute__((aligned(64)));
    bf16 vb[4][16 * 32] __attribute__((aligned(64)));
    const __m512i heads = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)gp));
    for (int64_t half = 0; half * 64 < d; half++) {
        const int wide = half * 64 + 32 < d; /* this pass has 64 dims, not 32 */
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        for (int64_t j0 = 0; j0 < pairs; j0 += 16) {
            const __mmask16 live = lanes16(pairs - j0);
            for (int64_t g = 0; g < gp; g++)
                _mm512_store_si512(pa + g * 16, _mm512_mask_i32gather_epi32(
                    _mm512_setzero_si512(), live, heads, w + j0 * gp + g, 4));
            for (int64_t j = 0; j < 16; j++) {
                const int64_t t = 2 * (j0 + j);
                const bf16 *ra = t < n ? v_row(v_cache, table, start + t, h, hkv, d) : NULL;
                const bf16 *rb = t + 1 < n ? v_row(v_cache, table, start + t + 1, h, hkv, d) : NULL;
                for (int64_t c = 0; c <= wide; c++) {
                    const int64_t at = half * 64 + c * 32;
                    const __m512i a = ra ? _mm512_loadu_si512(ra + at) : _mm512_setzero_si512();
                    const __m512i z = rb ? _mm512_loadu_si512(rb + at) : _mm512_setzero_si512();
                    _mm512_store_si512(vb[2 * c] + j * 32, _mm512_unpacklo_epi16(a, z));
                    _mm512_store_si512(vb[2 * c + 1] + j * 32, _mm512_unpackhi_epi16(a, z));
                }
            }
            _tile_loadd(0, pa, 64);
            _tile_loadd(1, vb[0], 64);
            _tile_dpbf16ps(2, 0, 1);
            _tile_loadd(1, vb[1], 64);
            _tile_dpbf16ps(3, 0, 1);
            if (wide) {
                _tile_loadd(1, vb[2], 64);
                _tile_dpbf16ps(4, 0, 1);
                _tile_loadd(1, vb[3], 64);
                _tile_dpbf16ps(5, 0, 1);
            }
        }
        _tile_stored(2, acc + half * 64, out);
        _tile_stored(3, acc + half * 64 + 16, out);
        if (wide) {
            _tile_stored(4, acc + half * 64 + 32, out);
            _tile_stored(5, acc + half * 64 + 48, out);
        }
    }
}
#elif ZS_AVX512 /* never called: zs_row_tiles says no */
void zs_row_scores(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache,
                   const int32_t *table, int64_t start, int64_t len, int64_t h, int64_t hkv,
                   int64_t groups, int64_t gp, int64_t d, float scale, float *s, float *best) {
    (void)q, (void)k_cache, (void)v_cache, (void)table, (void)start, (void)len, (void)h;
    (void)hkv, (void)groups, (void)gp, (void)d, (void)scale, (void)s, (void)best;
}

void zs_row_values(const bf16 *v_cache, const int32_t *table, int64_t start, int64_t len,
                   int64_t h, int64_t hkv, int64_t gp, int64_t d, const int32_t *w, float *acc) {
    (void)v_cache, (void)table, (void)start, (void)len, (void)h, (void)hkv, (void)gp, (void)d;
    (void)w, (void)acc;
}
#endif
