/*
 * How close the CPU kernels' matmul inner loop (engine_core/csrc/linear.c, linear_rows)
 * runs to this CPU's bf16 dot-product peak: one core, one packed tile of K = 512 that
 * stays in L1/L2, GFLOP/s of four loop shapes (BENCHMARKS.md §1, seventeenth session).
 *
 *   gcc -O3 -march=native -o /tmp/dpp benchmarks/scripts/dot_product_peak.c && /tmp/dpp
 *
 * Needs AVX512-BF16. A: the kernel's shape, 8 rows x 32 columns (8 broadcasts of x and
 * 2 tile loads per 16 dot products); B: 4 rows x 64 columns (half the broadcasts);
 * C: the dot products alone (one broadcast for the whole call); D: the pairs of x
 * permuted out of registers instead of broadcast from memory.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define K 512
#define PAIRS (K / 2)
static uint16_t tile[PAIRS * 64 * 2] __attribute__((aligned(64)));
static uint16_t x[8 * K] __attribute__((aligned(64)));
float sink[64 * 16];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline __m512bh bcast(const uint16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof(v));
    return (__m512bh)_mm512_set1_epi32(v);
}

static inline void store8(__m512 acc[8][2]) {
    for (int r = 0; r < 8; r++) {
        _mm512_storeu_ps(sink + r * 32, acc[r][0]);
        _mm512_storeu_ps(sink + r * 32 + 16, acc[r][1]);
    }
}

/* 8 rows x 32 columns; `each_pair`: x's pair broadcast for every row and pair (the
 * kernel's loop), else one broadcast for the whole call (the dot products alone). */
static inline __attribute__((always_inline)) void rows8(const int each_pair) {
    __m512 acc[8][2];
    for (int r = 0; r < 8; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const __m512bh fixed = bcast(x);
    for (int p = 0; p < PAIRS; p++) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(tile + p * 64);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(tile + p * 64 + 32);
        for (int r = 0; r < 8; r++) {
            const __m512bh a = each_pair ? bcast(x + r * K + 2 * p) : fixed;
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
        }
    }
    store8(acc);
}

__attribute__((noinline)) static void rows8_cols32(void) { rows8(1); }

__attribute__((noinline)) static void dot_products_only(void) { rows8(0); }

__attribute__((noinline)) static void rows4_cols64(void) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int p = 0; p < PAIRS; p++) {
        __m512bh b[4];
        for (int c = 0; c < 4; c++) b[c] = (__m512bh)_mm512_loadu_si512(tile + p * 128 + 32 * c);
        for (int r = 0; r < 4; r++) {
            const __m512bh a = bcast(x + r * K + 2 * p);
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(sink + (r * 4 + c) * 16, acc[r][c]);
}

__attribute__((noinline)) static void rows8_permuted(void) {
    __m512 acc[8][2];
    for (int r = 0; r < 8; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int p0 = 0; p0 < PAIRS; p0 += 16) {
        __m512i xr[8];
        for (int r = 0; r < 8; r++) xr[r] = _mm512_loadu_si512(x + r * K + 2 * p0);
        for (int q = 0; q < 16; q++) {
            const int p = p0 + q;
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(tile + p * 64);
            const __m512bh b1 = (__m512bh)_mm512_loadu_si512(tile + p * 64 + 32);
            const __m512i idx = _mm512_set1_epi32(q);
            for (int r = 0; r < 8; r++) {
                const __m512bh a = (__m512bh)_mm512_permutexvar_epi32(idx, xr[r]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
            }
        }
    }
    store8(acc);
}

int main(void) {
    for (size_t i = 0; i < sizeof(tile) / sizeof(tile[0]); i++) tile[i] = 0x3f80; /* 1.0 */
    for (int i = 0; i < 8 * K; i++) x[i] = 0x3f80;
    void (*const fns[])(void) = {rows8_cols32, rows4_cols64, dot_products_only, rows8_permuted};
    const char *names[] = {"A 8 rows x 32 cols (the kernel's)", "B 4 rows x 64 cols",
                           "C dot products alone", "D pairs permuted from registers"};
    const int calls = 20000;
    for (int round = 0; round < 3; round++)
        for (int v = 0; v < 4; v++) {
            double t = now();
            for (int i = 0; i < calls; i++) fns[v]();
            t = now() - t;
            const double flop = (double)calls * PAIRS * 16 * 64; /* 16 dot products a pair, 64 FLOP each */
            printf("%-36s %6.1f GFLOP/s  %.2f ns per 16 dot products\n", names[v],
                   flop / t * 1e-9, t / calls / PAIRS * 1e9);
        }
    return 0;
}
