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
 *
 * On CPUs with AMX tiles the same packed tile feeds the tile unit as it is: its
 * 16 K-pairs x 16 columns halves are AMX's B layout (rows 128 bytes apart), so 32
 * rows of x at a time take four tile multiplies per 32 K instead of 64 x 16 vector
 * dot products. AMX's sums are oneDNN's (the same instruction over K in order).
 */
#include "kernels.h"

#if ZS_AVX512

#define ZS_TILE 32
#define ZS_STREAM_AHEAD 4096 /* bytes: how far ahead of the tile unit the weight is fetched */
#define ZS_SPAN_BYTES (1 << 20) /* weight the blocks of x pass over in turn (in L2: 2 MB) */
#define ZS_LINEAR_ROWS 256 /* rows of x per pass of zs_linear over the weight */

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

struct zs_pack_job {
    const bf16 *w;
    int64_t n, k;
    int gated;
    bf16 *out;
};

static void pack_tiles(const void *job, int64_t begin, int64_t end) {
    const struct zs_pack_job *j = job;
    const int64_t n = j->n, k = j->k, pairs = (k + 1) / 2, width = tile_cols(j->gated);
    for (int64_t t = begin; t < end; t++)
        for (int64_t c = 0; c < ZS_TILE; c++) {
            /* The weight row behind tile column c (gated: up rows in the second half). */
            const int64_t col = t * width + (j->gated ? c % width : c);
            const int64_t row = j->gated && c >= width ? n + col : col;
            for (int64_t p = 0; p < pairs; p++)
                for (int64_t e = 0; e < 2; e++) {
                    const int64_t kk = 2 * p + e;
                    j->out[((t * pairs + p) * ZS_TILE + c) * 2 + e] =
                        (col < n && kk < k) ? j->w[row * k + kk] : 0;
                }
        }
}

/* Tile by tile on the pool: a large model's weights pack in a fraction of the time. */
void zs_pack_linear(const bf16 *w, int64_t n, int64_t k, int gated, bf16 *out) {
    const struct zs_pack_job job = {w, n, k, gated, out};
    const int64_t width = tile_cols(gated);
    zs_parallel((n + width - 1) / width, 1, 1, pack_tiles, &job);
}

/* One row's two 16-column sums out: rounded to bf16 at y (with the bias), or widened
 * back to fp32 at yf; gated, silu(gate) * up, or (ZS_GATED_RAW) gate at y and up
 * `up` columns on. */
static inline __attribute__((always_inline)) void store_row(
    __m512 a0, __m512 a1, __m512 bias0, __m512 bias1, bf16 *y, float *yf, __mmask16 m0,
    __mmask16 m1, int gated, int64_t up) {
    if (gated == ZS_GATED_RAW) {
        _mm256_mask_storeu_epi16(y, m0, (__m256i)_mm512_cvtneps_pbh(a0));
        _mm256_mask_storeu_epi16(y + up, m0, (__m256i)_mm512_cvtneps_pbh(a1));
    } else if (gated) {
        _mm256_mask_storeu_epi16(y, m0, silu_mul16(round_bf16(a0), round_bf16(a1)));
    } else {
        const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a0, bias0));
        const __m256i hi = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a1, bias1));
        if (yf) {
            _mm512_mask_storeu_ps(yf, m0, bf16_as_f32(lo));
            _mm512_mask_storeu_ps(yf + 16, m1, bf16_as_f32(hi));
        } else {
            _mm256_mask_storeu_epi16(y, m0, lo);
            _mm256_mask_storeu_epi16(y + 16, m1, hi);
        }
    }
}

/* Rows [0, R) of x against one packed tile into y's 32 columns (masks: the columns
 * that exist), or gated into 16: silu(gate) * up, each rounded where torch's bf16 ops
 * round. With yf (not gated) the rounded values go out widened to fp32 instead, as
 * .float() of the bf16 result would give them. An odd K's last pair takes x's last
 * element alone. Meanwhile it fetches `next` (a tile) into L2: every pair of it, or
 * with `spread` the pairs pf, pf + pf_step, pf + 2 pf_step, ... */
static inline __attribute__((always_inline)) void linear_rows(
    const bf16 *x, int64_t xs, const bf16 *tile, int64_t k, const float *bias, bf16 *y,
    float *yf, int64_t ys, const int R, __mmask16 m0, __mmask16 m1, int gated, int64_t up,
    const bf16 *next, const int spread, int64_t pf, int64_t pf_step) {
    __m512 acc[8][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t full = k / 2;
    for (int64_t p = 0; p < full; p++) {
        if (next && (!spread || p == pf)) {
            _mm_prefetch((const char *)(next + p * 2 * ZS_TILE), _MM_HINT_T1);
            _mm_prefetch((const char *)(next + p * 2 * ZS_TILE + ZS_TILE), _MM_HINT_T1);
            pf += pf_step;
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
    const __m512 bias0 = bias && !gated ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 bias1 = bias && !gated ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++)
        store_row(acc[r][0], acc[r][1], bias0, bias1, y ? y + r * ys : NULL,
                  yf ? yf + r * ys : NULL, m0, m1, gated, up);
}

#if ZS_AMX
/* The tile shapes for up to 32 rows of x, R0 (up to 16) in the first block and R1 in
 * the next: C (R x 16 fp32) for each block and 16-column half in tiles 0-3, A (R x 32
 * bf16) of each block in 4 and 5, B (16 K-pairs x 16 columns) of each half in 6 and 7. */
static void amx_configure(int rows_of_x) {
    const int r0 = rows_of_x < 16 ? rows_of_x : 16, r1 = rows_of_x - r0;
    const uint8_t rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
    zs_amx_load(r0 + 32 * r1 + 1, rows);
}

/* A tile load that does not keep its lines in L1 (TILELOADDT1) where `stream`. Of the
 * two operands only one stays in L1 while the other streams past from L2: x's block,
 * which meets every tile of a span in turn; a lone tile meeting every block of x stays
 * itself instead. The step's matmuls 4-8 % faster on two threads (BENCHMARKS.md §2). */
#define ZS_TILE_LOAD(t, p, stride, stream) \
    do {                                   \
        if (stream)                        \
            _tile_stream_loadd(t, p, stride); \
        else                               \
            _tile_loadd(t, p, stride);     \
    } while (0)

/* A block's sums (32 fp32 a row at acc) waiting for the epilogue: rows [done, rows) are
 * still to go out, from row 0's place in y (or yf). */
struct pending {
    const float *acc;
    int rows, done;
    bf16 *y;
    float *yf;
    int64_t ys, n;
    __m512 bias0, bias1;
    __mmask16 m0, m1;
    int gated;
};

static inline __attribute__((always_inline)) void pending_rows(struct pending *e, int upto) {
    for (; e->done < upto && e->done < e->rows; e->done++) {
        const int r = e->done;
        store_row(_mm512_loadu_ps(e->acc + r * 32), _mm512_loadu_ps(e->acc + r * 32 + 16),
                  e->bias0, e->bias1, e->y ? e->y + r * e->ys : NULL,
                  e->yf ? e->yf + r * e->ys : NULL, e->m0, e->m1, e->gated, e->n);
    }
}

/* linear_rows on the tile unit: R <= 32 rows, K a multiple of 32, each B tile read
 * once for both 16-row blocks; the sums go through `acc` (R x 32 fp32) to the same
 * epilogue. With `prev`, the epilogue of the block before goes out meanwhile, a few
 * rows after each K step's multiplies: the vector units work while the tile unit
 * does, where after its own multiplies it left the tile unit idle (the gated SiLU
 * epilogue longest: gate/up 35 % faster at 128-512 rows, BENCHMARKS.md §2). Each K
 * step fetches 2 KB from `next` on into L2, up to `next_end`. And it asks for the lines
 * its own epilogue will write, row r's at out + r * out_stride (and + out_second where
 * a row writes two places), for writing:
 * owned by the time the stores come, they need not wait on memory (BENCHMARKS.md §2:
 * matmuls 14-18 % faster at 128-2048 rows where y starts out of the cache, a decode
 * step ~3 % faster). */
static inline __attribute__((always_inline)) void linear_rows_amx(
    const bf16 *x, int64_t xs, const bf16 *tile, int64_t k, int R, float *acc,
    const bf16 *next, const char *next_end, const char *out, int64_t out_stride,
    int64_t out_second, struct pending *prev, int stream_x) {
    const int r0 = R < 16 ? R : 16, r1 = R - r0;
    const int64_t xb = xs * (int64_t)sizeof(bf16), bb = 2 * ZS_TILE * sizeof(bf16);
    const int64_t per_step = (R + k / 32 - 1) / (k / 32); /* output rows asked for a K step */
    const int prev_step = prev ? (int)((prev->rows - prev->done + k / 32 - 1) / (k / 32)) : 0;
    _tile_zero(0);
    _tile_zero(1);
    if (r1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t kc = 0; kc < k; kc += 32) {
        const bf16 *b = tile + kc / 2 * 2 * ZS_TILE;
        const char *ahead = next ? (const char *)(next + kc / 2 * 2 * ZS_TILE) : next_end;
        if (ahead < next_end) zs_fetch_l2(ahead, 2048); /* a K step's worth of what comes next */
        for (int64_t r = kc / 32 * per_step; r < R && r < (kc / 32 + 1) * per_step; r++) {
            __builtin_prefetch(out + r * out_stride, 1, 3);
            if (out_second) __builtin_prefetch(out + r * out_stride + out_second, 1, 3);
        }
        /* Each multiply as soon as its tiles are in (3-5 % faster than all loads first). */
        ZS_TILE_LOAD(4, x + kc, xb, stream_x);
        ZS_TILE_LOAD(6, b, bb, !stream_x);
        _tile_dpbf16ps(0, 4, 6);
        ZS_TILE_LOAD(7, b + 16 * 2, bb, !stream_x);
        _tile_dpbf16ps(1, 4, 7);
        if (r1) {
            ZS_TILE_LOAD(5, x + 16 * xs + kc, xb, stream_x);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (prev) pending_rows(prev, prev->done + prev_step);
    }
    if (prev) pending_rows(prev, 32);
    const int64_t cb = 32 * sizeof(float);
    _tile_stored(0, acc, cb);
    _tile_stored(1, acc + 16, cb);
    if (r1) {
        _tile_stored(2, acc + 16 * 32, cb);
        _tile_stored(3, acc + 16 * 32 + 16, cb);
    }
}
#endif

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
    int tiles_unit; /* on AMX tiles (K a multiple of 32, the tiles granted) */
};

#if ZS_AMX
/* linear_tiles on the tile unit: 32 rows at a time through `acc` to the epilogue, each
 * block's during the next block's multiplies where `pipelined` (a constant). The tiles
 * go in spans whose weights stay in L2 (ZS_SPAN_BYTES), and each 32-row block of x meets
 * a whole span in turn from L1, where it met one tile and was read again from L2 for the
 * next: the step's matmuls x0.88 at 128 rows with the weights from L3, x0.92-0.93 at 64
 * and 256 (BENCHMARKS.md §2). */
static inline __attribute__((always_inline)) void tiles_amx(const struct linear_job *j,
                                                            int64_t begin, int64_t end,
                                                            const int pipelined) {
    float acc[2][32 * 32];
    struct pending prev = {.acc = acc[1]};
    int shaped = 0; /* the rows the tiles are configured for (once a call: 1 % of a step) */
    const int64_t pairs = (j->k + 1) / 2, width = tile_cols(j->gated), len = pairs * 2 * ZS_TILE;
    const int64_t span = ZS_SPAN_BYTES / (len * 2) > 1 ? ZS_SPAN_BYTES / (len * 2) : 1;
    /* The first block's pass fetches the weight 4 KB ahead, 2 KB a K step, in the
     * chunk's tiles, which follow one another in memory: a steady stream instead of a
     * burst a tile (at 1-64 rows the step's matmuls 5-13 % faster, BENCHMARKS.md §2). */
    const char *chunk_end = (const char *)(j->packed + end * len);
    for (int64_t s = begin; s < end; s += span) {
        const int64_t e = s + span < end ? s + span : end;
        for (int64_t r0 = 0; r0 < j->m; r0 += 32) {
            const int rows = j->m - r0 < 32 ? (int)(j->m - r0) : 32;
            if (rows != shaped) amx_configure(rows);
            shaped = rows;
            for (int64_t t = s; t < e; t++) {
                const bf16 *tile = j->packed + t * len;
                const int64_t left = j->n - t * width;
                const __mmask16 m0 = lanes16(left),
                                m1 = j->gated || left <= 16 ? 0 : lanes16(left - 16);
                const float *b = j->bias && !j->gated ? j->bias + t * ZS_TILE : NULL;
                const __m512 bias0 = b ? _mm512_maskz_loadu_ps(m0, b) : _mm512_setzero_ps();
                const __m512 bias1 = b ? _mm512_maskz_loadu_ps(m1, b + 16) : _mm512_setzero_ps();
                const bf16 *next =
                    r0 == 0 ? (const bf16 *)((const char *)tile + ZS_STREAM_AHEAD) : NULL;
                /* Where the block's rows go: f32 out, two lines a row; gated raw, a gate
                 * and an up half. */
                const int64_t first = r0 * j->ys + t * width;
                const char *out =
                    j->yf ? (const char *)(j->yf + first) : (const char *)(j->y + first);
                const int64_t second = j->yf ? 64 : j->gated == ZS_GATED_RAW ? j->n * 2 : 0;
                float *sums = acc[prev.acc == acc[0]];
                linear_rows_amx(j->x + r0 * j->xs, j->xs, tile, j->k, rows, sums, next,
                                chunk_end, out, j->ys * (j->yf ? 4 : 2), second,
                                pipelined ? &prev : NULL, e - s == 1 && j->m > 32);
                prev = (struct pending){sums, rows, 0, j->yf ? NULL : j->y + first,
                                        j->yf ? j->yf + first : NULL, j->ys, j->n, bias0, bias1,
                                        m0, m1, j->gated};
                if (!pipelined) pending_rows(&prev, 32);
            }
        }
    }
    pending_rows(&prev, 32);
}

/* A few rows' epilogues are short: they go out at once (pipelined, a batch-1 decode
 * step was 1.5 % slower). */
static void linear_tiles_amx(const struct linear_job *j, int64_t begin, int64_t end) {
    if (j->m > 8) tiles_amx(j, begin, end, 1);
    else tiles_amx(j, begin, end, 0);
}
#endif

/* One pass of up to 8 rows (R fixed in each case, so each gets its own registers). */
static inline __attribute__((always_inline)) void linear_pass(
    const bf16 *x, int64_t xs, const bf16 *tile, int64_t k, const float *bias, bf16 *y,
    float *yf, int64_t ys, int64_t rows, __mmask16 m0, __mmask16 m1, int gated, int64_t up,
    const bf16 *next, const int spread, int64_t pf, int64_t pf_step) {
#define ZS_ROWS(R) \
    linear_rows(x, xs, tile, k, bias, y, yf, ys, R, m0, m1, gated, up, next, spread, pf, pf_step)
    switch (rows < 8 ? rows : 8) {
    case 8: ZS_ROWS(8); break;
    case 7: ZS_ROWS(7); break;
    case 6: ZS_ROWS(6); break;
    case 5: ZS_ROWS(5); break;
    case 4: ZS_ROWS(4); break;
    case 3: ZS_ROWS(3); break;
    case 2: ZS_ROWS(2); break;
    default: ZS_ROWS(1); break;
    }
#undef ZS_ROWS
}

/* Items are tiles. */
static void linear_tiles(const void *job, int64_t begin, int64_t end) {
    const struct linear_job *j = job;
#if ZS_AMX
    if (j->tiles_unit) {
        linear_tiles_amx(j, begin, end);
        return;
    }
#endif
    const bf16 *x = j->x, *packed = j->packed;
    const float *bias = j->bias;
    const int64_t xs = j->xs, m = j->m, n = j->n, k = j->k, ys = j->ys;
    const int gated = j->gated;
    bf16 *y = j->y;
    float *yf = j->yf;
    const int64_t pairs = (k + 1) / 2, width = tile_cols(gated);
    const int64_t tiles = (n + width - 1) / width, passes = (m + 7) / 8;
    /* Threads take tiles in turn, so a thread's next tile is usually `ahead` on. */
    const int64_t ahead = zs_active_threads();
    for (int64_t t = begin; t < end; t++) {
        const bf16 *tile = packed + t * pairs * 2 * ZS_TILE;
        const int64_t left = n - t * width;
        const __mmask16 m0 = lanes16(left), m1 = gated || left <= 16 ? 0 : lanes16(left - 16);
        const float *b = bias ? bias + t * ZS_TILE : NULL;
        /* The passes over a tile also fetch this thread's likely next one (into its own
         * L2), so few tiles start cold from memory: with P passes, pass i the pairs i,
         * i + P, i + 2P, ... The fetches spread over all of the tile's arithmetic
         * instead of crowding its first pass (at 16-32 rows the model's matmuls ran
         * 12-14 % faster, BENCHMARKS.md §2). */
        const bf16 *next = t + ahead < tiles ? tile + ahead * pairs * 2 * ZS_TILE : NULL;
        for (int64_t r0 = 0; r0 < m; r0 += 8) {
            const bf16 *xr = x + r0 * xs;
            bf16 *yr = yf ? NULL : y + r0 * ys + t * width;
            float *yfr = yf ? yf + r0 * ys + t * width : NULL;
            /* One pass (<= 8 rows: a few streams' decode) fetches every pair anyway:
             * it keeps the loop as it was, with no test per pair. */
            if (passes == 1)
                linear_pass(xr, xs, tile, k, b, yr, yfr, ys, m, m0, m1, gated, n, next, 0, 0, 1);
            else
                linear_pass(xr, xs, tile, k, b, yr, yfr, ys, m - r0, m0, m1, gated, n, next, 1,
                            r0 / 8, passes);
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
#if ZS_AMX
    const int tiles_unit = k % 32 == 0 && zs_amx_ready();
    /* The caller's tiles may hold oneDNN's shapes since its last call; the pool's
     * workers run nothing else, so they keep theirs. */
    zs_amx_shape = 0;
#else
    const int tiles_unit = 0;
#endif
    const struct linear_job j = {x, xs, packed, bias, m, n, k, gated, f32 ? NULL : (bf16 *)y,
                                 f32 ? (float *)y : NULL, ys, tiles_unit};
    /* On the tile unit a tile takes a fraction of a microsecond, about what claiming it
     * costs: chunks of several, still at least 8 per thread to share out. */
    const int64_t per = 8 * zs_active_threads(), grain = tiles_unit ? (tiles + per - 1) / per : 1;
    /* Long inputs a block of rows at a time, so the block's x stays in L2 while the
     * weight streams past it (once per block, not once per 32 rows). */
    const int64_t rows = ZS_LINEAR_ROWS;
    for (int64_t r0 = 0; r0 < m; r0 += rows) {
        struct linear_job part = j;
        part.x = x + r0 * xs;
        part.m = m - r0 < rows ? m - r0 : rows;
        if (f32) part.yf = (float *)y + r0 * ys;
        else part.y = (bf16 *)y + r0 * ys;
        zs_parallel(tiles, grain, part.m * n * k >= 16 * ZS_PARALLEL_MIN, linear_tiles, &part);
    }
    zs_amx_release();
}

/* Whether zs_linear runs on the tile unit here (K a multiple of 32). */
int zs_linear_amx(void) {
#if ZS_AMX
    return zs_amx_ready();
#else
    return 0;
#endif
}
#endif
