/*
 * Linear layers, y = x Wᵀ (+ b), on AVX512-BF16 dot products (AVX-512 build only:
 * elsewhere oneDNN's matmul stays). Each product sums in fp32 and rounds to bf16
 * once, as oneDNN's does; only the order of the sum differs.
 *
 * The weight [N, K] is packed once into tiles of 32 output columns, each tile
 * K/2 pairs x 32 columns x 2: one pair of K for 32 columns is two vector loads, and
 * one 32-bit broadcast of x feeds both. A tile is one unit of work, taken by
 * whichever thread is free (zs_parallel), so a thread the OS descheduled holds
 * up at most its current tile, not half of the matmul; the tile stays in L1/L2
 * while all M rows pass over it, 8 rows at a time (16 accumulators in registers).
 */
#include "kernels.h"

#if ZS_AVX512

#define ZS_TILE 32

/* `gated` of a gate/up weight packed gated: 1 gives silu(gate) * up [M, n]; this gives
 * the projection itself, [M, 2n] gate then up (for what must come between, LoRA). */
#define ZS_GATED_RAW 2

/* Output columns of one tile: 32, or 16 gated ones (16 gate and 16 up weight rows). */
static inline int64_t tile_cols(int gated) { return gated ? ZS_TILE / 2 : ZS_TILE; }

/* n: the output columns (gated: the weight has 2n rows, gate then up). */
int64_t zs_linear_packed_len(int64_t n, int64_t k, int gated) {
    const int64_t w = tile_cols(gated);
    return (n + w - 1) / w * ((k + 1) / 2) * 2 * ZS_TILE;
}

void zs_pack_linear(const bf16 *w, int64_t n, int64_t k, int gated, bf16 *out) {
    const int64_t pairs = (k + 1) / 2, width = tile_cols(gated), tiles = (n + width - 1) / width;
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t c = 0; c < ZS_TILE; c++) {
            /* The weight row behind tile column c (gated: up rows in the second half). */
            const int64_t col = t * width + (gated ? c % width : c);
            const int64_t row = gated && c >= width ? n + col : col;
            for (int64_t p = 0; p < pairs; p++)
                for (int64_t e = 0; e < 2; e++) {
                    const int64_t kk = 2 * p + e;
                    out[((t * pairs + p) * ZS_TILE + c) * 2 + e] =
                        (col < n && kk < k) ? w[row * k + kk] : 0;
                }
        }
}

/* Rows [0, R) of x against one packed tile into y's 32 columns (masks: the columns
 * that exist), or gated into 16: silu(gate) * up, each rounded where torch's bf16 ops
 * round. With yf (not gated) the rounded values go out widened to fp32 instead, as
 * .float() of the bf16 result would give them. An odd K's last pair takes x's last
 * element alone. */
static inline __attribute__((always_inline)) void linear_rows(
    const bf16 *x, int64_t xs, const bf16 *tile, int64_t k, const float *bias, bf16 *y,
    float *yf, int64_t ys, const int R, __mmask16 m0, __mmask16 m1, int gated, int64_t up,
    const bf16 *next) {
    __m512 acc[8][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t full = k / 2;
    for (int64_t p = 0; p < full; p++) {
        if (next) {
            _mm_prefetch((const char *)(next + p * 2 * ZS_TILE), _MM_HINT_T1);
            _mm_prefetch((const char *)(next + p * 2 * ZS_TILE + ZS_TILE), _MM_HINT_T1);
        }
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(tile + p * 2 * ZS_TILE);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(tile + p * 2 * ZS_TILE + ZS_TILE);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, x + r * xs + 2 * p, sizeof(pair));
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
        }
    }
    if (k % 2) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(tile + full * 2 * ZS_TILE);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(tile + full * 2 * ZS_TILE + ZS_TILE);
        for (int r = 0; r < R; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int32_t)x[r * xs + k - 1]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
        }
    }
    if (gated == ZS_GATED_RAW) { /* gate at y, up `up` columns on */
        for (int r = 0; r < R; r++) {
            _mm256_mask_storeu_epi16(y + r * ys, m0, (__m256i)_mm512_cvtneps_pbh(acc[r][0]));
            _mm256_mask_storeu_epi16(y + r * ys + up, m0, (__m256i)_mm512_cvtneps_pbh(acc[r][1]));
        }
        return;
    }
    if (gated) {
        for (int r = 0; r < R; r++) {
            const __m512 g = bf16_as_f32((__m256i)_mm512_cvtneps_pbh(acc[r][0]));
            const __m512 u = bf16_as_f32((__m256i)_mm512_cvtneps_pbh(acc[r][1]));
            _mm256_mask_storeu_epi16(y + r * ys, m0, silu_mul16(g, u));
        }
        return;
    }
    const __m512 bias0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 bias1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
        const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][0], bias0));
        const __m256i hi = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][1], bias1));
        if (yf) {
            _mm512_mask_storeu_ps(yf + r * ys, m0, bf16_as_f32(lo));
            _mm512_mask_storeu_ps(yf + r * ys + 16, m1, bf16_as_f32(hi));
        } else {
            _mm256_mask_storeu_epi16(y + r * ys, m0, lo);
            _mm256_mask_storeu_epi16(y + r * ys + 16, m1, hi);
        }
    }
}

struct linear_job {
    const bf16 *x;
    int64_t xs;
    const bf16 *packed;
    const float *bias;
    int64_t m, n, k;
    int gated;
    bf16 *y;
    float *yf; /* instead of y: fp32 out */
    int64_t ys;
};

/* Items are tiles. */
static void linear_tiles(const void *job, int64_t begin, int64_t end) {
    const struct linear_job *j = job;
    const bf16 *x = j->x, *packed = j->packed;
    const float *bias = j->bias;
    const int64_t xs = j->xs, m = j->m, n = j->n, k = j->k, ys = j->ys;
    const int gated = j->gated;
    bf16 *y = j->y;
    float *yf = j->yf;
    const int64_t pairs = (k + 1) / 2, width = tile_cols(gated);
    const int64_t tiles = (n + width - 1) / width;
    /* Threads take tiles in turn, so a thread's next tile is usually `ahead` on. */
    const int64_t ahead = zs_active_threads();
    for (int64_t t = begin; t < end; t++) {
        const bf16 *tile = packed + t * pairs * 2 * ZS_TILE;
        const int64_t left = n - t * width;
        const __mmask16 m0 = lanes16(left), m1 = gated || left <= 16 ? 0 : lanes16(left - 16);
        const float *b = bias ? bias + t * ZS_TILE : NULL;
        for (int64_t r0 = 0; r0 < m; r0 += 8) {
            /* The first pass over a tile also fetches this thread's likely next one
             * (into its own L2), so few tiles start cold from memory. */
            const bf16 *next =
                r0 == 0 && t + ahead < tiles ? tile + ahead * pairs * 2 * ZS_TILE : NULL;
            const bf16 *xr = x + r0 * xs;
            bf16 *yr = yf ? NULL : y + r0 * ys + t * width;
            float *yfr = yf ? yf + r0 * ys + t * width : NULL;
            switch (m - r0 < 8 ? m - r0 : 8) {
            case 8: linear_rows(xr, xs, tile, k, b, yr, yfr, ys, 8, m0, m1, gated, n, next); break;
            case 7: linear_rows(xr, xs, tile, k, b, yr, yfr, ys, 7, m0, m1, gated, n, next); break;
            case 6: linear_rows(xr, xs, tile, k, b, yr, yfr, ys, 6, m0, m1, gated, n, next); break;
            case 5: linear_rows(xr, xs, tile, k, b, yr, yfr, ys, 5, m0, m1, gated, n, next); break;
            case 4: linear_rows(xr, xs, tile, k, b, yr, yfr, ys, 4, m0, m1, gated, n, next); break;
            case 3: linear_rows(xr, xs, tile, k, b, yr, yfr, ys, 3, m0, m1, gated, n, next); break;
            case 2: linear_rows(xr, xs, tile, k, b, yr, yfr, ys, 2, m0, m1, gated, n, next); break;
            default: linear_rows(xr, xs, tile, k, b, yr, yfr, ys, 1, m0, m1, gated, n, next); break;
            }
        }
    }
}

/* x [M, K] (row stride xs), packed W, bias fp32 [N] or NULL -> y [M, N] (stride ys),
 * bf16, or with out_f32 fp32 (the bf16-rounded values; not gated); gated (no bias):
 * y = silu(x Gᵀ) * (x Uᵀ), or with ZS_GATED_RAW y [M, 2N] = [x Gᵀ, x Uᵀ]. */
void zs_linear(const bf16 *x, int64_t xs, const bf16 *packed, const float *bias, int64_t m,
               int64_t n, int64_t k, int gated, void *y, int64_t ys, int out_f32) {
    const int64_t tiles = (n + tile_cols(gated) - 1) / tile_cols(gated);
    const int f32 = out_f32 && !gated;
    const struct linear_job j = {
        x, xs, packed, bias, m, n, k, gated, f32 ? NULL : (bf16 *)y, f32 ? (float *)y : NULL, ys};
    zs_parallel(tiles, 1, m * n * k >= 16 * ZS_PARALLEL_MIN, linear_tiles, &j);
}
#endif
