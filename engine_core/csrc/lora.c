/*
 * LoRA for a step's rows, many adapters at once: a segmented low-rank matmul. The
 * rows of each adapter are one segment (the runner packs them together); for every
 * segment, t = x Aᵀ (the shrink, into a scratch of rank columns) and then
 * y += t Bᵀ in place (the expand), each rounded to bf16 where torch's
 * `y += (x @ A.T) @ B.T` in bf16 rounds. Rows of no segment (the base model's) are
 * not touched. One call covers one module of one layer for every adapter in the step.
 *
 * An adapter's module is described by an int64 array (cpu_kernels.py builds it):
 *   [0] R, its total rank; [1] A's address: pairs [ceil(k/2)][R][2] (A [R, k] with
 *   each two consecutive k of one row side by side, k padded to even with zeros);
 *   [2] S, its sub-blocks (a fused projection has several: q, k, v), then per
 *   sub-block five values: first output column, columns, first column of its rank
 *   in t, its rank (even), B's address: pairs [rank/2][columns][2].
 * So the pair layout of linear.c: one 32-bit broadcast of x feeds 16 columns.
 */
#include "kernels.h"

#define ZS_LORA_ROWS 8  /* rows per pass: 8 x 2 accumulators stay in registers */
#define ZS_LORA_COLS 32 /* output columns per pass */
#define ZS_LORA_AHEAD 8 /* pairs ahead that pair_rows prefetches */
/* Multiply-adds below which a phase runs on the calling thread alone: a decode step's
 * LoRA (~0.2-1.5M per projection) takes 20-40 us there, less than waking the pool,
 * and a woken worker the OS deschedules mid-chunk stalls the step (BENCHMARKS.md §7). */
#define ZS_LORA_PARALLEL_MIN (8 << 20)

struct lora_item {
    int32_t seg, sub, r0, c0; /* sub -1: the shrink */
};

struct lora_job {
    const bf16 *x;
    int64_t xs;
    bf16 *y;
    int64_t ys;
    int64_t k;
    const int32_t *bounds;     /* segment s: rows bounds[s] .. bounds[s + 1] */
    const int64_t *const *desc; /* per segment its module's description (NULL: none) */
    bf16 *t;
    int64_t ts;
    const struct lora_item *items;
};

/* The value pair (v[2p], v[2p + 1]) of a row, the second 0 past the row's end. */
static inline int32_t pair_at(const bf16 *v, int64_t p, int64_t k) {
    if (2 * p + 1 < k) {
        int32_t pair;
        memcpy(&pair, v + 2 * p, sizeof(pair));
        return pair;
    }
    return (int32_t)v[2 * p];
}

#if ZS_AVX512

/* rows [0, R) of x (stride xs, k values) against pair-packed W [pairs][ncols][2] at
 * columns c0 .. c0 + 32 → 2 x 16 fp32 accumulators per row. */
static inline __attribute__((always_inline)) void pair_rows(
    const bf16 *x, int64_t xs, int64_t k, const bf16 *w, int64_t ncols, int64_t c0, const int R,
    __m512 acc[ZS_LORA_ROWS][2]) {
    const int64_t left = ncols - c0;
    const __mmask32 m0 = lanes32(2 * (left < 16 ? left : 16));
    const __mmask32 m1 = left > 16 ? lanes32(2 * (left - 16)) : 0;
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t pairs = (k + 1) / 2;
    for (int64_t p = 0; p < pairs; p++) {
        const bf16 *wp = w + (p * ncols + c0) * 2;
        /* The weights stream from memory (a step's adapters do not stay in cache):
         * ask for the pairs a few iterations ahead. */
        _mm_prefetch((const char *)(wp + ZS_LORA_AHEAD * ncols * 2), _MM_HINT_T0);
        _mm_prefetch((const char *)(wp + ZS_LORA_AHEAD * ncols * 2 + 32), _MM_HINT_T0);
        const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi16(m0, wp);
        const __m512bh b1 = (__m512bh)_mm512_maskz_loadu_epi16(m1, wp + 32);
        for (int r = 0; r < R; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair_at(x + r * xs, p, k));
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
        }
    }
}

/* t = bf16(acc) (add 0), or y = bf16(y + bf16(acc)) (add 1), 32 columns of R rows. */
static inline __attribute__((always_inline)) void store_rows(
    bf16 *out, int64_t os, int64_t left, const int R, int add, __m512 acc[ZS_LORA_ROWS][2]) {
    const __mmask16 m0 = lanes16(left), m1 = left > 16 ? lanes16(left - 16) : 0;
    for (int r = 0; r < R; r++) {
        bf16 *o = out + r * os;
        for (int h = 0; h < 2; h++) {
            const __mmask16 m = h ? m1 : m0;
            if (!m) continue;
            __m256i v = (__m256i)_mm512_cvtneps_pbh(acc[r][h]);
            if (add) {
                const __m512 sum = _mm512_add_ps(bf16_as_f32(v), load_bf16_as_f32(o + 16 * h, m));
                v = (__m256i)_mm512_cvtneps_pbh(sum);
            }
            _mm256_mask_storeu_epi16(o + 16 * h, m, v);
        }
    }
}

static inline __attribute__((always_inline)) void lora_block(
    const bf16 *x, int64_t xs, int64_t k, const bf16 *w, int64_t ncols, int64_t c0, bf16 *out,
    int64_t os, const int R, int add) {
    __m512 acc[ZS_LORA_ROWS][2];
    pair_rows(x, xs, k, w, ncols, c0, R, acc);
    store_rows(out, os, ncols - c0, R, add, acc);
}

static void lora_pass(const bf16 *x, int64_t xs, int64_t k, const bf16 *w, int64_t ncols,
                      int64_t c0, bf16 *out, int64_t os, int rows, int add) {
    switch (rows) {
    case 8: lora_block(x, xs, k, w, ncols, c0, out, os, 8, add); break;
    case 7: lora_block(x, xs, k, w, ncols, c0, out, os, 7, add); break;
    case 6: lora_block(x, xs, k, w, ncols, c0, out, os, 6, add); break;
    case 5: lora_block(x, xs, k, w, ncols, c0, out, os, 5, add); break;
    case 4: lora_block(x, xs, k, w, ncols, c0, out, os, 4, add); break;
    case 3: lora_block(x, xs, k, w, ncols, c0, out, os, 3, add); break;
    case 2: lora_block(x, xs, k, w, ncols, c0, out, os, 2, add); break;
    default: lora_block(x, xs, k, w, ncols, c0, out, os, 1, add); break;
    }
}

#else /* portable */

static void lora_pass(const bf16 *x, int64_t xs, int64_t k, const bf16 *w, int64_t ncols,
                      int64_t c0, bf16 *out, int64_t os, int rows, int add) {
    const int64_t cols = ncols - c0 < ZS_LORA_COLS ? ncols - c0 : ZS_LORA_COLS;
    const int64_t pairs = (k + 1) / 2;
    for (int r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            float acc = 0.f;
            for (int64_t p = 0; p < pairs; p++) {
                const bf16 *wp = w + (p * ncols + c0 + c) * 2;
                const float x1 = 2 * p + 1 < k ? bf2f(x[r * xs + 2 * p + 1]) : 0.f;
                acc += bf2f(x[r * xs + 2 * p]) * bf2f(wp[0]) + x1 * bf2f(wp[1]);
            }
            bf16 *o = out + r * os + c;
            *o = add ? f2bf(round_bf(acc) + bf2f(*o)) : f2bf(acc);
        }
}

#endif

static void lora_item(const struct lora_job *j, struct lora_item it) {
    const int64_t *d = j->desc[it.seg];
    const int64_t last = j->bounds[it.seg + 1];
    const int rows = (int)(last - it.r0 < ZS_LORA_ROWS ? last - it.r0 : ZS_LORA_ROWS);
    if (it.sub < 0) { /* t[rows, c0..] = x Aᵀ */
        lora_pass(j->x + it.r0 * j->xs, j->xs, j->k, (const bf16 *)(intptr_t)d[1], d[0], it.c0,
                  j->t + it.r0 * j->ts + it.c0, j->ts, rows, 0);
        return;
    }
    const int64_t *s = d + 3 + 5 * it.sub; /* col, ncols, toff, rank, B */
    lora_pass(j->t + it.r0 * j->ts + s[2], j->ts, s[3], (const bf16 *)(intptr_t)s[4], s[1], it.c0,
              j->y + it.r0 * j->ys + s[0] + it.c0, j->ys, rows, 1);
}

static void lora_items(const void *job, int64_t begin, int64_t end) {
    const struct lora_job *j = job;
    for (int64_t i = begin; i < end; i++) lora_item(j, j->items[i]);
}

/* The items of one phase, shrink (sub -1) or expand (every sub-block): counted, written
 * to `items`, or (without a table) run here one by one. */
static int64_t each_item(const struct lora_job *j, int64_t nseg, int expand,
                         struct lora_item *items, int run, int64_t *work) {
    int64_t n = 0;
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t *d = j->desc[s];
        if (!d) continue;
        const int64_t subs = expand ? d[2] : 1;
        for (int64_t b = 0; b < subs; b++) {
            const int64_t cols = expand ? d[3 + 5 * b + 1] : d[0];
            const int64_t depth = expand ? d[3 + 5 * b + 3] : j->k;
            if (work) *work += (j->bounds[s + 1] - j->bounds[s]) * cols * depth;
            for (int64_t r0 = j->bounds[s]; r0 < j->bounds[s + 1]; r0 += ZS_LORA_ROWS)
                for (int64_t c0 = 0; c0 < cols; c0 += ZS_LORA_COLS) {
                    const struct lora_item it = {(int32_t)s, expand ? (int32_t)b : -1,
                                                 (int32_t)r0, (int32_t)c0};
                    if (items) items[n] = it;
                    if (run) lora_item(j, it);
                    n++;
                }
        }
    }
    return n;
}

/* x [M, k] (stride xs), y [M, N] (stride ys) updated in place; t a scratch of at least
 * M rows (stride ts) and every segment's rank columns. Segment s is rows bounds[s] ..
 * bounds[s + 1] with module desc[s] (NULL: skip). Items are (segment, 8 rows, 32
 * columns), handed to whichever thread is free. */
void zs_lora(const bf16 *x, int64_t xs, bf16 *y, int64_t ys, int64_t k, int64_t nseg,
             const int32_t *bounds, const int64_t *const *desc, bf16 *t, int64_t ts) {
    struct lora_job j = {x, xs, y, ys, k, bounds, desc, t, ts, NULL};
    for (int expand = 0; expand < 2; expand++) {
        int64_t work = 0;
        const int64_t n = each_item(&j, nseg, expand, NULL, 0, &work);
        if (!n) return;
        /* The caller's scratch holds the table; the workers only read it meanwhile. */
        struct lora_item *items = zs_scratch((size_t)n * sizeof(*items));
        if (!items) { /* no memory for the table: one thread, item by item */
            each_item(&j, nseg, expand, NULL, 1, NULL);
            continue;
        }
        each_item(&j, nseg, expand, items, 0, NULL);
        j.items = items;
        /* Chunks of at least ~64k multiply-adds: an expand item alone is a few k. */
        const int64_t grain = 1 + (int64_t)((65536 * n) / (work + 1));
        zs_parallel(n, grain, work >= ZS_LORA_PARALLEL_MIN, lora_items, &j);
    }
}
