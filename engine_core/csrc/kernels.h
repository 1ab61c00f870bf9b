/*
 * zserve's CPU kernels: the fused elementwise steps, the paged attention, the final
 * softmax-and-draw and the linear layers of the native bf16 forward, one op per file
 * in this folder, each op's AVX-512 and portable versions side by side.
 * engine_core/cpu_kernels.py compiles every .c here into one library for the machine
 * it runs on (gcc -O3 -march=native) and calls it through ctypes.
 *
 * Tensors are bf16 (as uint16 bit patterns) with fp32 arithmetic. Each kernel rounds
 * to bf16 wherever torch's op-by-op bf16 path rounds, so it reproduces those ops up
 * to the order of a sum; attention is the exception: its scores and probabilities
 * stay fp32 (torch rounds both to bf16), which is closer to the exact result.
 *
 * The kernels split their work over a pool of their own threads (pool.c), not OpenMP.
 *
 * Two builds of every kernel: AVX-512 (with AVX512-BF16 dot products, and the
 * matmul on AMX tiles where the compiler and CPU have them), and portable C for any
 * other CPU. ZS_PORTABLE forces the portable one (the tests compare both).
 * This header holds what the ops share: the types, the limits, bf16 conversions, the
 * pool's interface and the AVX-512 helpers.
 */
#ifndef ZS_KERNELS_H
#define ZS_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512DQ__) && !defined(ZS_PORTABLE)
#define ZS_AVX512 1
#include <immintrin.h>
#else
#define ZS_AVX512 0
#endif

/* AMX tiles (the matmul's and the tiled attention's), where compiler and CPU have them. */
#if ZS_AVX512 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ZS_AMX 1
#else
#define ZS_AMX 0
#endif

typedef uint16_t bf16;

#define ZS_MAX_HEAD_DIM 256
#define ZS_MAX_GROUP 16
/* Below this many elements a loop runs on one thread: waking the others costs more. */
#define ZS_PARALLEL_MIN 16384

/* Shared between the files of the library, not part of its interface. */
#define ZS_INTERNAL __attribute__((visibility("hidden")))

static inline float bf2f(bf16 x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

/* Round to nearest even, as torch converts float to bfloat16. */
static inline bf16 f2bf(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t u = v.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

static inline float round_bf(float f) { return bf2f(f2bf(f)); }

/* The thread pool (pool.c). zs_parallel(n, grain, parallel, fn, ctx) runs
 * fn(ctx, begin, end) over [0, n) in chunks of `grain`, on the calling thread and
 * the pool's workers (on the caller alone when `parallel` is 0). */
typedef void (*zs_task)(const void *ctx, int64_t begin, int64_t end);
ZS_INTERNAL void zs_parallel(int64_t n, int64_t grain, int parallel, zs_task fn, const void *ctx);

/* The ops the decoder (decoder.c) chains; each file documents its own. */
void zs_rms_norm(const bf16 *x, int64_t x_stride, bf16 *residual, int64_t res_stride,
                 const bf16 *weight, bf16 *out, int64_t out_stride, int64_t rows,
                 int64_t hidden, float eps);
void zs_rope_store(bf16 *qkv, int64_t row_stride, const int64_t *positions, const bf16 *cos,
                   const bf16 *sin, int64_t rows, int64_t hq, int64_t hkv, int64_t d,
                   const bf16 *q_norm, const bf16 *k_norm, float eps, bf16 *k_cache,
                   bf16 *v_cache, const int64_t *slots, int64_t block_size);
void zs_paged_attention(const bf16 *q, int64_t q_stride, const bf16 *k_cache,
                        const bf16 *v_cache, const int32_t *tables, int64_t table_stride,
                        const int32_t *row_table, const int32_t *row_len, int64_t rows,
                        int64_t hq, int64_t hkv, int64_t d, int64_t block_size, int64_t window,
                        float scale, float softcap, bf16 *out, int64_t out_stride,
                        int64_t max_len);
void zs_linear(const bf16 *x, int64_t xs, const bf16 *packed, const float *bias, int64_t m,
               int64_t n, int64_t k, int gated, void *y, int64_t ys, int out_f32);
/* Threads a job may use now, the caller included. */
ZS_INTERNAL int zs_active_threads(void);
/* The grain for n items of even, cheap work (a norm's rows): about 8 chunks a thread,
 * at least `least` items each, so claiming chunks stays a small part of the work (a
 * 2048-row prompt step's norms were 1024 claims each). */
static inline int64_t zs_even_grain(int64_t n, int64_t least) {
    const int64_t per = 8 * (int64_t)zs_active_threads(), g = (n + per - 1) / per;
    return g > least ? g : least;
}
/* The first key a row of row_len `len` attends to: a sliding window starts late. */
static inline int64_t zs_first_key(int64_t len, int64_t window) {
    return (window > 0 && len > window) ? len - window : 0;
}

/* One call of zs_paged_attention, as its row walks (row_walk.c) and its tiles
 * (tiled_attention.c) both read it. */
struct zs_attention_job {
    const bf16 *q;
    int64_t q_stride;
    const bf16 *k_cache, *v_cache;
    const int32_t *tables;
    int64_t table_stride;
    const int32_t *row_table, *row_len;
    int64_t hq, hkv, d, block_size, window;
    float scale, softcap;
    bf16 *out;
    int64_t out_stride, s_stride;
    const int32_t *walk;   /* the rows to walk, or NULL: all of them */
    const int32_t *shared; /* per row: keys already attended to on tiles, or NULL */
    float *partial;        /* the tiles' sums for those: [row][query head][d + 2] */
};
#if ZS_AVX512
/* Runs of at least this many rows of one sequence take the tiled attention. */
#define ZS_TILED_MIN_ROWS 8
/* Decode rows sharing at least this many cached keys (a prefix) take them on tiles. */
#define ZS_SHARED_MIN_KEYS 64
/* Query rows per tiled work item. */
#define ZS_TILE_ROWS 64
/* One tiled work item: `count` rows (indices into the step's) and KV head h, over the
 * block table `table`; each row attends to its own keys, or with `shared` > 0 all to
 * the first `shared` keys, their unnormalized sums going to the job's `partial`. */
struct zs_tile_item {
    const int32_t *rows;
    int64_t count, h, table, shared;
};
ZS_INTERNAL int zs_tiled_attention_fits(int64_t hq, int64_t hkv, int64_t d, int64_t block_size);
ZS_INTERNAL void zs_tiled_attention(const struct zs_attention_job *job,
                                    const struct zs_tile_item *items, int64_t num_items);
#endif
/* Query heads per KV head, padded to a divisor of 16 (the AVX-512 scores' layout). */
#define ZS_PAD_GROUPS(g) ((g) <= 4 ? 4 : (g) <= 8 ? 8 : 16)
/* Row n of a job attends, query heads h * groups on, to keys [start, len) of KV head h
 * through its block table (row_walk.c); s: scratch of ZS_PAD_GROUPS(groups) * s_stride
 * floats; part: the shared prefix's sums to merge, or NULL. */
ZS_INTERNAL void zs_attend_row(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache,
                               const int32_t *table, int64_t start, int64_t len, int64_t h,
                               int64_t hkv, int64_t groups, int64_t d, int64_t bs, float scale,
                               float softcap, bf16 *out, float *s, int64_t s_stride,
                               const float *part);
#if ZS_AMX
/* Whether this process may use the tile registers (asked of Linux once). */
ZS_INTERNAL int zs_amx_ready(void);
/* The tile shape this thread has loaded (0: none): each user loads its own when it
 * differs (linear.c's are 1..529, the tiled attention's ZS_AMX_ATTENTION_SHAPE). */
ZS_INTERNAL extern __thread int zs_amx_shape;
/* Loads tile shape `shape` unless it is this thread's already: tile t of rows[t] rows of
 * 64 bytes (0: unused). */
ZS_INTERNAL void zs_amx_load(int shape, const uint8_t rows[8]);
/* Gives the calling thread's tiles back (a caller's, after a job; the pool's workers
 * keep theirs). */
ZS_INTERNAL void zs_amx_release(void);
#else
static inline void zs_amx_release(void) {} /* no tiles to give back */
#endif
/* A per-thread scratch buffer of at least `bytes`, kept for the thread's next use. */
ZS_INTERNAL void *zs_scratch(size_t bytes);

#if ZS_AVX512
/* e^x for x <= 0 (softmax arguments): x = n ln2 + r, e^r by a degree-6 polynomial
 * (Cephes' coefficients), 2^n by scalef; under 2 ulp. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

/* `bytes` from p fetched into L2, not L1: asked for in L1, a whole block a time, decode
 * attention's lines crowded out the rows in use and held the fill buffers the demand
 * loads wait on (BENCHMARKS.md §2: 10-17 % slower with K/V in L3). Always inlined: GCC
 * takes a function that only prefetches for one without effects, and drops the calls. */
static inline __attribute__((always_inline)) void zs_fetch_l2(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T1);
}

/* The first `left` lanes (all of them from the vector's width on); left > 0. */
static inline __mmask16 lanes16(int64_t left) {
    return left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);
}

static inline __mmask32 lanes32(int64_t left) {
    return left >= 32 ? 0xffffffffu : (__mmask32)((1u << left) - 1u);
}

static inline __m512 bf16_as_f32(__m256i raw) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* Masked only where m leaves lanes out: with masked loads throughout, RMSNorm of 128
 * rows of 512 took x1.12 as long (BENCHMARKS.md §2; a constant m folds the test). */
static inline __m512 load_bf16_as_f32(const bf16 *p, __mmask16 m) {
    if (m == 0xffff) return bf16_as_f32(_mm256_loadu_si256((const __m256i *)p));
    return bf16_as_f32(_mm256_maskz_loadu_epi16(m, p));
}

/* round_bf on 16 values: rounded to bf16 and widened back. */
static inline __m512 round_bf16(__m512 x) { return bf16_as_f32((__m256i)_mm512_cvtneps_pbh(x)); }

/* silu(g) rounded, times u, rounded: torch's two bf16 ops, on 16 values each (g and
 * u already bf16 values). e^-x for x < 0 can overflow exp512's range; silu is then
 * -0 to within bf16, as torch gives. */
static inline __m256i silu_mul16(__m512 g, __m512 u) {
    const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(88.f)));
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(round_bf16(silu), u));
}
#endif

#endif
