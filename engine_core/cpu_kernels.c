/*
 * zserve's CPU kernels: the fused elementwise steps and the paged attention of the
 * native bf16 forward. engine_core/cpu_kernels.py compiles this file for the machine
 * it runs on (gcc -O3 -march=native) and calls it through ctypes.
 *
 * Tensors are bf16 (as uint16 bit patterns) with fp32 arithmetic. Each kernel rounds
 * to bf16 wherever torch's op-by-op bf16 path rounds, so it reproduces those ops up
 * to the order of a sum; attention is the exception: its scores and probabilities
 * stay fp32 (torch rounds both to bf16), which is closer to the exact result.
 *
 * The kernels split their work over a pool of their own threads (zs_set_threads),
 * not OpenMP: a parallel loop here never waits for a thread that has not started
 * on it (see zs_parallel), so a worker the OS descheduled costs its share of speed,
 * not a stall, and idle workers sleep after a short spin instead of burning the
 * core that the API server and the load generator share with the engine.
 *
 * Two builds of every kernel: AVX-512 (with AVX512-BF16 dot products), and portable
 * C for any other CPU. ZS_PORTABLE forces the portable one (the tests compare both).
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512DQ__) && !defined(ZS_PORTABLE)
#define ZS_AVX512 1
#include <immintrin.h>
#else
#define ZS_AVX512 0
#endif

typedef uint16_t bf16;

#define ZS_MAX_HEAD_DIM 256
#define ZS_MAX_GROUP 16
/* Query heads per KV head, padded to a divisor of 16 (the AVX-512 scores' layout). */
#define ZS_PAD_GROUPS(g) ((g) <= 4 ? 4 : (g) <= 8 ? 8 : 16)
/* Below this many elements a loop runs on one thread: waking the others costs more. */
#define ZS_PARALLEL_MIN 16384

int zs_abi(void) { return 3; }
int zs_has_avx512(void) { return ZS_AVX512; }

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

/* ---------------------------------------------------------------------------------
 * The thread pool. zs_parallel(n, grain, ...) runs task(ctx, begin, end) over [0, n)
 * in chunks of `grain`, on the calling thread and the pool's workers. Chunks are
 * claimed one at a time from a counter tagged with the job's epoch, so a worker
 * that wakes late finds nothing left (or a newer job) and claims nothing; the
 * caller then waits only for chunks that were claimed and are still running. The
 * caller spins briefly for those and then sleeps, which frees its core for a
 * descheduled worker to finish on. Workers spin ZS_SPIN_NS for the next job, then
 * sleep on a futex. One job runs at a time (the mutex); jobs do not nest.
 */
typedef void (*zs_task)(const void *ctx, int64_t begin, int64_t end);

#define ZS_MAX_THREADS 256
#define ZS_SPIN_NS 50000

static struct {
    pthread_mutex_t lock;   /* one job at a time; held by the caller throughout */
    _Atomic uint64_t claim; /* epoch << 32 | next chunk */
    _Atomic int64_t done;   /* chunks finished in the current epoch */
    _Atomic uint32_t wake;  /* futex: bumped when a job starts and sleepers wait */
    _Atomic uint32_t finished; /* futex: bumped when a sleeping caller must look */
    _Atomic int sleepers, caller_sleeps;
    _Atomic(zs_task) fn;
    const void *_Atomic ctx;
    _Atomic int64_t n, grain, chunks;
    uint32_t epoch;
    int workers; /* started so far */
    _Atomic int active; /* threads a job may use, the caller included */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .active = 1};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *word, uint32_t seen) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, 1 << 30, NULL, NULL, 0);
}

/* Claim and run chunks of job `epoch` until none is left. */
static void run_chunks(uint32_t epoch) {
    for (;;) {
        uint64_t c = atomic_load(&pool.claim);
        if ((uint32_t)(c >> 32) != epoch || (int64_t)(uint32_t)c >= atomic_load(&pool.chunks))
            return;
        if (!atomic_compare_exchange_weak(&pool.claim, &c, c + 1)) continue;
        /* A claimed chunk keeps its job current until it is counted done, so the
         * job's fields below are still this epoch's. */
        const int64_t i = (int64_t)(uint32_t)c, g = atomic_load(&pool.grain), n = atomic_load(&pool.n);
        atomic_load(&pool.fn)(atomic_load(&pool.ctx), i * g, (i + 1) * g < n ? (i + 1) * g : n);
        if (atomic_fetch_add(&pool.done, 1) + 1 == atomic_load(&pool.chunks) &&
            atomic_load(&pool.caller_sleeps)) {
            atomic_fetch_add(&pool.finished, 1);
            futex_wake(&pool.finished);
        }
    }
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg; /* 1.. (0 is the caller) */
    uint32_t seen = (uint32_t)(atomic_load(&pool.claim) >> 32);
    for (;;) {
        int64_t spin_until = now_ns() + ZS_SPIN_NS;
        for (int i = 0;; i++) {
            const uint32_t e = (uint32_t)(atomic_load(&pool.claim) >> 32);
            if (e != seen && index < atomic_load(&pool.active)) {
                seen = e;
                run_chunks(e);
                spin_until = now_ns() + ZS_SPIN_NS;
                continue;
            }
            seen = e;
            if (i % 64 || now_ns() < spin_until) {
                cpu_relax();
                continue;
            }
            const uint32_t w = atomic_load(&pool.wake);
            atomic_fetch_add(&pool.sleepers, 1);
            if ((uint32_t)(atomic_load(&pool.claim) >> 32) == seen) futex_wait(&pool.wake, w);
            atomic_fetch_sub(&pool.sleepers, 1);
            spin_until = now_ns() + ZS_SPIN_NS;
        }
    }
    return NULL;
}

/* Threads the kernels use, the caller included (1: no workers). Workers start on
 * first need and stay; a smaller count leaves the extra ones asleep. */
int zs_set_threads(int threads) {
    if (threads < 1) threads = 1;
    if (threads > ZS_MAX_THREADS) threads = ZS_MAX_THREADS;
    pthread_mutex_lock(&pool.lock);
    int ok = 1;
    while (pool.workers < threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(pool.workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            ok = 0;
            break;
        }
        pool.workers++;
    }
    const int in_effect = ok ? threads : pool.workers + 1;
    atomic_store(&pool.active, in_effect);
    pthread_mutex_unlock(&pool.lock);
    return in_effect;
}

static void zs_parallel(int64_t n, int64_t grain, int parallel, zs_task fn, const void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (!parallel || atomic_load(&pool.active) < 2 || n <= grain) {
        fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&pool.lock);
    const int64_t chunks = (n + grain - 1) / grain;
    atomic_store(&pool.fn, fn);
    atomic_store(&pool.ctx, ctx);
    atomic_store(&pool.n, n);
    atomic_store(&pool.grain, grain);
    atomic_store(&pool.chunks, chunks);
    atomic_store(&pool.done, 0);
    const uint32_t epoch = ++pool.epoch;
    atomic_store(&pool.claim, (uint64_t)epoch << 32);
    if (atomic_load(&pool.sleepers)) {
        atomic_fetch_add(&pool.wake, 1);
        futex_wake(&pool.wake);
    }
    run_chunks(epoch);
    /* Only chunks other threads claimed can still be running. */
    const int64_t spin_until = now_ns() + ZS_SPIN_NS / 5;
    for (int i = 0; atomic_load(&pool.done) < chunks; i++) {
        if (i % 64 || now_ns() < spin_until) {
            cpu_relax();
            continue;
        }
        const uint32_t f = atomic_load(&pool.finished);
        atomic_store(&pool.caller_sleeps, 1);
        if (atomic_load(&pool.done) < chunks) futex_wait(&pool.finished, f);
        atomic_store(&pool.caller_sleeps, 0);
    }
    pthread_mutex_unlock(&pool.lock);
}

/* A per-thread scratch buffer of at least `bytes`, kept for the thread's next use. */
static void *scratch(size_t bytes) {
    static _Thread_local void *buf;
    static _Thread_local size_t size;
    if (bytes > size) {
        free(buf);
        buf = malloc(bytes);
        size = buf ? bytes : 0;
    }
    return buf;
}

/* ---------------------------------------------------------------------------------
 * RMSNorm, optionally after a residual add (transformers' order: normalise in fp32,
 * round, then scale by the weight and round again).
 *   residual == NULL: out = norm(x)
 *   otherwise:        residual = residual + x (rounded); out = norm(residual)
 */
struct rms_job {
    const bf16 *x;
    int64_t x_stride;
    bf16 *residual;
    int64_t res_stride;
    const bf16 *weight;
    bf16 *out;
    int64_t out_stride, hidden;
    float eps;
};

#if ZS_AVX512
/* Defined below, beside the AVX-512 helpers it uses. */
static void rms_rows_avx512(const void *job, int64_t begin, int64_t end);
#define ZS_RMS_ROWS rms_rows_avx512
#else
static void rms_rows(const void *job, int64_t begin, int64_t end) {
    const struct rms_job *j = job;
    const bf16 *x = j->x, *weight = j->weight;
    bf16 *residual = j->residual, *out = j->out;
    const int64_t x_stride = j->x_stride, res_stride = j->res_stride, out_stride = j->out_stride;
    const int64_t hidden = j->hidden;
    const float eps = j->eps;
    for (int64_t r = begin; r < end; r++) {
        const bf16 *xr = x + r * x_stride;
        bf16 *o = out + r * out_stride;
        float h[8192];
        float *buf = hidden <= 8192 ? h : (float *)malloc(sizeof(float) * hidden);
        float ss = 0.f;
        if (residual) {
            bf16 *res = residual + r * res_stride;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < hidden; i++) {
                bf16 s = f2bf(bf2f(res[i]) + bf2f(xr[i]));
                res[i] = s;
                buf[i] = bf2f(s);
                ss += buf[i] * buf[i];
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < hidden; i++) {
                buf[i] = bf2f(xr[i]);
                ss += buf[i] * buf[i];
            }
        }
        const float inv = 1.f / sqrtf(ss / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++)
            o[i] = f2bf(bf2f(weight[i]) * round_bf(buf[i] * inv));
        if (buf != h) free(buf);
    }
}
#define ZS_RMS_ROWS rms_rows
#endif

void zs_rms_norm(const bf16 *x, int64_t x_stride, bf16 *residual, int64_t res_stride,
                 const bf16 *weight, bf16 *out, int64_t out_stride, int64_t rows,
                 int64_t hidden, float eps) {
    const struct rms_job j = {x, x_stride, residual, res_stride, weight, out, out_stride, hidden, eps};
    zs_parallel(rows, 2, rows * hidden >= ZS_PARALLEL_MIN, ZS_RMS_ROWS, &j);
}

/* ---------------------------------------------------------------------------------
 * One token's rows of q and k: optional per-head RMSNorm (Qwen3), rotate-half RoPE
 * with that token's cos/sin rows, the result rounded as torch's
 * x * cos + rotate_half(x) * sin rounds it.
 */
static void norm_rope_head(const bf16 *x, bf16 *dst, const bf16 *norm_w, float eps,
                           const bf16 *cos, const bf16 *sin, int64_t d) {
    float v[ZS_MAX_HEAD_DIM];
    for (int64_t j = 0; j < d; j++) v[j] = bf2f(x[j]);
    if (norm_w) {
        float ss = 0.f;
        for (int64_t j = 0; j < d; j++) ss += v[j] * v[j];
        const float inv = 1.f / sqrtf(ss / (float)d + eps);
        for (int64_t j = 0; j < d; j++) v[j] = round_bf(bf2f(norm_w[j]) * round_bf(v[j] * inv));
    }
    const int64_t half = d / 2;
    for (int64_t j = 0; j < d; j++) {
        const float rot = j < half ? -v[j + half] : v[j - half];
        dst[j] = f2bf(round_bf(v[j] * bf2f(cos[j])) + round_bf(rot * bf2f(sin[j])));
    }
}

/*
 * RoPE on q (in place, in the packed qkv rows) and k, then k and v into the paged
 * cache: token n goes to cache slot slots[n] = block * block_size + offset, which for
 * head h is row (block * hkv + h) * block_size + offset of a [blocks, hkv, bs, d]
 * cache.
 */
struct rope_job {
    bf16 *qkv;
    int64_t row_stride;
    const int64_t *positions;
    const bf16 *cos, *sin;
    int64_t hq, hkv, d;
    const bf16 *q_norm, *k_norm;
    float eps;
    bf16 *k_cache, *v_cache;
    const int64_t *slots;
    int64_t block_size;
};

static void rope_rows(const void *job, int64_t begin, int64_t end) {
    const struct rope_job *j = job;
    bf16 *qkv = j->qkv, *k_cache = j->k_cache, *v_cache = j->v_cache;
    const int64_t *positions = j->positions, *slots = j->slots;
    const bf16 *cos = j->cos, *sin = j->sin, *q_norm = j->q_norm, *k_norm = j->k_norm;
    const int64_t row_stride = j->row_stride, hq = j->hq, hkv = j->hkv, d = j->d;
    const int64_t block_size = j->block_size;
    const float eps = j->eps;
    for (int64_t n = begin; n < end; n++) {
        bf16 *row = qkv + n * row_stride;
        const bf16 *c = cos + positions[n] * d;
        const bf16 *s = sin + positions[n] * d;
        const int64_t block = slots[n] / block_size, offset = slots[n] % block_size;
        for (int64_t h = 0; h < hq; h++) norm_rope_head(row + h * d, row + h * d, q_norm, eps, c, s, d);
        for (int64_t h = 0; h < hkv; h++) {
            const int64_t dst = ((block * hkv + h) * block_size + offset) * d;
            norm_rope_head(row + (hq + h) * d, k_cache + dst, k_norm, eps, c, s, d);
            memcpy(v_cache + dst, row + (hq + hkv + h) * d, sizeof(bf16) * d);
        }
    }
}

void zs_rope_store(bf16 *qkv, int64_t row_stride, const int64_t *positions, const bf16 *cos,
                   const bf16 *sin, int64_t rows, int64_t hq, int64_t hkv, int64_t d,
                   const bf16 *q_norm, const bf16 *k_norm, float eps, bf16 *k_cache,
                   bf16 *v_cache, const int64_t *slots, int64_t block_size) {
    const struct rope_job j = {qkv, row_stride, positions, cos, sin, hq, hkv, d, q_norm,
                               k_norm, eps, k_cache, v_cache, slots, block_size};
    zs_parallel(rows, 2, rows * (hq + hkv) * d >= ZS_PARALLEL_MIN, rope_rows, &j);
}

/* Row `pos` of KV head h of a sequence in a [blocks, hkv, bs, d] cache, through its table. */
static inline const bf16 *cache_row(const bf16 *cache, const int32_t *table, int64_t pos,
                                    int64_t h, int64_t hkv, int64_t bs, int64_t d) {
    return cache + (((int64_t)table[pos / bs] * hkv + h) * bs + pos % bs) * d;
}

/* ---------------------------------------------------------------------------------
 * Paged attention, one query token per row, decode and prefill alike: row n attends
 * to the first row_len[n] positions of the sequence whose block table is
 * tables[row_table[n]] (bottom-right causal: the row's own position is
 * row_len[n] - 1), the last `window` of them when window > 0. The query heads of
 * one KV head (GQA) share every K/V row read. Scores are scaled, soft-capped when
 * softcap > 0, and soft-maxed in fp32.
 */
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

/* The sums of four vectors: [sum a, sum b, sum c, sum d]. */
static inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    const __m256 z = _mm256_add_ps(_mm512_castps512_ps256(y), _mm512_extractf32x8_ps(y, 1));
    return _mm_add_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1));
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

static inline __m512 load_bf16_as_f32(const bf16 *p, __mmask16 m) {
    return bf16_as_f32(_mm256_maskz_loadu_epi16(m, p));
}

/* rms_rows with 16 lanes at a time: the same roundings; only the order of the sum of
 * squares differs. The second pass re-reads the rounded input (bf16 holds it exactly)
 * instead of keeping a float copy. */
static void rms_rows_avx512(const void *job, int64_t begin, int64_t end) {
    const struct rms_job *j = job;
    const int64_t hidden = j->hidden;
    for (int64_t r = begin; r < end; r++) {
        const bf16 *xr = j->x + r * j->x_stride;
        bf16 *res = j->residual ? j->residual + r * j->res_stride : NULL;
        bf16 *o = j->out + r * j->out_stride;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t i = 0; i < hidden; i += 16) {
            const __mmask16 m = lanes16(hidden - i);
            __m512 v = load_bf16_as_f32(xr + i, m);
            if (res) {
                const __m256i sum =
                    (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(load_bf16_as_f32(res + i, m), v));
                _mm256_mask_storeu_epi16(res + i, m, sum);
                v = bf16_as_f32(sum);
            }
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        const __m512 inv =
            _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(squares) / (float)hidden + j->eps));
        const bf16 *src = res ? res : xr;
        for (int64_t i = 0; i < hidden; i += 16) {
            const __mmask16 m = lanes16(hidden - i);
            const __m512 normed = bf16_as_f32(
                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(load_bf16_as_f32(src + i, m), inv)));
            const __m512 scaled = _mm512_mul_ps(load_bf16_as_f32(j->weight + i, m), normed);
            _mm256_mask_storeu_epi16(o + i, m, (__m256i)_mm512_cvtneps_pbh(scaled));
        }
    }
}

/* silu(g) rounded, times u, rounded: torch's two bf16 ops, on 16 values each (g and
 * u already bf16 values). e^-x for x < 0 can overflow exp512's range; silu is then
 * -0 to within bf16, as torch gives. */
static inline __m256i silu_mul16(__m512 g, __m512 u) {
    const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(88.f)));
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    const __m512 sr = bf16_as_f32((__m256i)_mm512_cvtneps_pbh(silu));
    return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sr, u));
}

static void silu_mul_row(const bf16 *g, const bf16 *u, bf16 *o, int64_t inter) {
    int64_t i = 0;
    for (; i + 16 <= inter; i += 16)
        _mm256_storeu_si256((__m256i *)(o + i),
                            silu_mul16(load_bf16_as_f32(g + i, 0xffff), load_bf16_as_f32(u + i, 0xffff)));
    for (; i < inter; i++) {
        const float x = bf2f(g[i]);
        o[i] = f2bf(round_bf(x / (1.f + expf(-x))) * bf2f(u[i]));
    }
}

/* e[i] = exp(x[i] - m), 0 where x[i] is -inf (a masked token keeps no mass). */
static void softmax_numerators(const float *x, float m, float *e, float *block_sums, int64_t vocab) {
    const __m512 mx = _mm512_set1_ps(m), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0, j = 0; i < vocab; i += 16, j++) {
        const int64_t left = vocab - i;
        const __mmask16 lane = lanes16(left);
        const __m512 v = _mm512_mask_loadu_ps(ninf, lane, x + i);
        const __mmask16 live = _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ);
        const __m512 ex = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(v, mx)));
        _mm512_storeu_ps(e + i, ex);
        block_sums[j] = _mm512_reduce_add_ps(ex);
    }
}

static float row_max(const float *x, int64_t vocab) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= vocab; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
    float best = _mm512_reduce_max_ps(m);
    for (; i < vocab; i++) best = x[i] > best ? x[i] : best;
    return best;
}

/* Always inlined: GCC takes a function that only prefetches for one without
 * effects, and drops the calls to it. */
static inline __attribute__((always_inline)) void prefetch_block(const bf16 *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}

/* Inlined into callers with constant d and groups, so the common shapes keep q and
 * the accumulators in registers (a generic loop spills them: 4x slower). */
static inline __attribute__((always_inline)) void attend_row_impl(
    const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int32_t *table,
    int64_t start, int64_t len, int64_t h, int64_t hkv, const int64_t groups, const int64_t d,
    int64_t bs, float scale, float softcap, bf16 *out, float *s, int64_t s_stride) {
    const int64_t n = len - start;
    const int64_t dk = (d + 31) / 32;  /* 32-bf16 chunks of a row (dot products) */
    const int64_t dv = (d + 15) / 16;  /* 16-float chunks of a row (accumulation) */
    __m512bh qv[ZS_MAX_GROUP][ZS_MAX_HEAD_DIM / 32];
    for (int64_t g = 0; g < ZS_PAD_GROUPS(groups); g++)
        for (int64_t c = 0; c < dk; c++) {
            const int64_t left = d - c * 32;
            const __mmask32 m = lanes32(left);
            qv[g][c] = g < groups ? (__m512bh)_mm512_maskz_loadu_epi16(m, q + g * d + c * 32)
                                  : (__m512bh)_mm512_setzero_si512();
        }
    /* Scores go key-major, s[t * gp + g], gp a divisor of 16: each key's scores are
     * one store, and the softmax below runs on whole vectors. */
    const int64_t gp = ZS_PAD_GROUPS(groups);
    __m128 best[ZS_MAX_GROUP / 4];
    for (int64_t g = 0; g < gp; g += 4) best[g / 4] = _mm_set1_ps(-INFINITY);
    /* The cache blocks are scattered, so the hardware prefetcher starts cold at each
     * one: ask for the next K block and this block's V rows ahead of their use. */
    const int64_t row_bytes = d * (int64_t)sizeof(bf16), block_bytes = bs * row_bytes;
    prefetch_block(k_cache + (((int64_t)table[start / bs] * hkv + h) * bs) * d, block_bytes);
    /* Block by block, so finding a row takes no division. */
    for (int64_t t = 0, b = start / bs; t < n; b++) {
        const int64_t base = ((int64_t)table[b] * hkv + h) * bs * d;
        prefetch_block(v_cache + base, block_bytes);
        if ((b + 1) * bs < len)
            prefetch_block(k_cache + (((int64_t)table[b + 1] * hkv + h) * bs) * d, block_bytes);
        const int64_t first = start + t - b * bs, stop = len - b * bs < bs ? len - b * bs : bs;
        for (int64_t off = first; off < stop; off++, t++) {
            const bf16 *kr = k_cache + base + off * d;
            __m512bh kv[ZS_MAX_HEAD_DIM / 32];
            for (int64_t c = 0; c < dk; c++) {
                const int64_t left = d - c * 32;
                const __mmask32 m = lanes32(left);
                kv[c] = (__m512bh)_mm512_maskz_loadu_epi16(m, kr + c * 32);
            }
            for (int64_t g = 0; g < gp; g += 4) {
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t c = 0; c < dk; c++) {
                    a0 = _mm512_dpbf16_ps(a0, qv[g][c], kv[c]);
                    a1 = _mm512_dpbf16_ps(a1, qv[g + 1][c], kv[c]);
                    a2 = _mm512_dpbf16_ps(a2, qv[g + 2][c], kv[c]);
                    a3 = _mm512_dpbf16_ps(a3, qv[g + 3][c], kv[c]);
                }
                __m128 r = _mm_mul_ps(hsum4(a0, a1, a2, a3), _mm_set1_ps(scale));
                if (softcap > 0.f) {
                    float x[4];
                    _mm_storeu_ps(x, r);
                    for (int j = 0; j < 4; j++) x[j] = tanhf(x[j] / softcap) * softcap;
                    r = _mm_loadu_ps(x);
                }
                _mm_storeu_ps(s + t * gp + g, r);
                best[g / 4] = _mm_max_ps(best[g / 4], r);
            }
        }
    }
    /* Softmax numerators in place, a whole vector (16 / gp keys) at a time; the
     * padding past the last key is -inf and contributes nothing. */
    const int64_t flat = n * gp, padded = (flat + 15) / 16 * 16;
    for (int64_t i = flat; i < padded; i++) s[i] = -INFINITY;
    float lane_max[16], lane_sum[16];
    for (int64_t l = 0; l < 16; l += 4) _mm_storeu_ps(lane_max + l, best[(l % gp) / 4]);
    const __m512 mx = _mm512_loadu_ps(lane_max), ninf = _mm512_set1_ps(-INFINITY);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < padded; i += 16) {
        const __m512 x = _mm512_loadu_ps(s + i);
        const __mmask16 live = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(x, mx)));
        _mm512_storeu_ps(s + i, e);
        sum = _mm512_add_ps(sum, e);
    }
    _mm512_storeu_ps(lane_sum, sum);
    float inv[ZS_MAX_GROUP];
    for (int64_t g = 0; g < groups; g++) {
        float total = 0.f;
        for (int64_t l = g; l < 16; l += gp) total += lane_sum[l];
        inv[g] = 1.f / total;
    }
    /* Weighted V rows, each read once for the whole group. */
    __m512 acc[ZS_MAX_GROUP][ZS_MAX_HEAD_DIM / 16];
    for (int64_t g = 0; g < groups; g++)
        for (int64_t c = 0; c < dv; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0, b = start / bs; t < n; b++) {
        const bf16 *vb = v_cache + ((int64_t)table[b] * hkv + h) * bs * d;
        const int64_t first = start + t - b * bs, stop = len - b * bs < bs ? len - b * bs : bs;
        for (int64_t off = first; off < stop; off++, t++) {
            const bf16 *vr = vb + off * d;
            __m512 vv[ZS_MAX_HEAD_DIM / 16];
            for (int64_t c = 0; c < dv; c++) {
                const int64_t left = d - c * 16;
                vv[c] = load_bf16_as_f32(vr + c * 16, lanes16(left));
            }
            for (int64_t g = 0; g < groups; g++) {
                const __m512 p = _mm512_set1_ps(s[t * gp + g]);
                for (int64_t c = 0; c < dv; c++) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
            }
        }
    }
    for (int64_t g = 0; g < groups; g++) {
        const __m512 f = _mm512_set1_ps(inv[g]);
        for (int64_t c = 0; c < dv; c++) {
            const int64_t left = d - c * 16;
            const __mmask16 m = lanes16(left);
            const __m256i o = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], f));
            _mm256_mask_storeu_epi16(out + g * d + c * 16, m, o);
        }
    }
}

#define ZS_ATTEND(D, G) \
    attend_row_impl(q, k_cache, v_cache, table, start, len, h, hkv, G, D, bs, scale, softcap, out, s, s_stride)

static void attend_row(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache,
                       const int32_t *table, int64_t start, int64_t len, int64_t h,
                       int64_t hkv, int64_t groups, int64_t d, int64_t bs, float scale,
                       float softcap, bf16 *out, float *s, int64_t s_stride) {
    if (d == 64 && groups == 4) ZS_ATTEND(64, 4);
    else if (d == 64 && groups == 8) ZS_ATTEND(64, 8);
    else if (d == 64 && groups == 2) ZS_ATTEND(64, 2);
    else if (d == 128 && groups == 4) ZS_ATTEND(128, 4);
    else if (d == 128 && groups == 8) ZS_ATTEND(128, 8);
    else if (d == 128 && groups == 2) ZS_ATTEND(128, 2);
    else if (d == 128 && groups == 7) ZS_ATTEND(128, 7);
    else if (d == 16 && groups == 2) ZS_ATTEND(16, 2);
    else ZS_ATTEND(d, groups);
}

#else /* portable */

static void softmax_numerators(const float *x, float m, float *e, float *block_sums, int64_t vocab) {
    for (int64_t i = 0, j = 0; i < vocab; i += 16, j++) {
        float sum = 0.f;
        for (int64_t k = i; k < i + 16; k++) {
            e[k] = (k < vocab && x[k] != -INFINITY) ? expf(x[k] - m) : 0.f;
            sum += e[k];
        }
        block_sums[j] = sum;
    }
}

static float row_max(const float *x, int64_t vocab) {
    float best = -INFINITY;
    for (int64_t i = 0; i < vocab; i++) best = x[i] > best ? x[i] : best;
    return best;
}

static void silu_mul_row(const bf16 *g, const bf16 *u, bf16 *o, int64_t inter) {
#pragma omp simd
    for (int64_t i = 0; i < inter; i++) {
        const float x = bf2f(g[i]);
        o[i] = f2bf(round_bf(x / (1.f + expf(-x))) * bf2f(u[i]));
    }
}

static void attend_row(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache,
                       const int32_t *table, int64_t start, int64_t len, int64_t h,
                       int64_t hkv, int64_t groups, int64_t d, int64_t bs, float scale,
                       float softcap, bf16 *out, float *s, int64_t s_stride) {
    const int64_t n = len - start;
    float qf[ZS_MAX_GROUP][ZS_MAX_HEAD_DIM];
    for (int64_t g = 0; g < groups; g++)
        for (int64_t j = 0; j < d; j++) qf[g][j] = bf2f(q[g * d + j]);
    float best[ZS_MAX_GROUP];
    for (int64_t g = 0; g < groups; g++) best[g] = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        const int64_t pos = start + t;
        const bf16 *kr = cache_row(k_cache, table, pos, h, hkv, bs, d);
        float kf[ZS_MAX_HEAD_DIM];
        for (int64_t j = 0; j < d; j++) kf[j] = bf2f(kr[j]);
        for (int64_t g = 0; g < groups; g++) {
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < d; j++) dot += qf[g][j] * kf[j];
            float x = dot * scale;
            if (softcap > 0.f) x = tanhf(x / softcap) * softcap;
            s[g * s_stride + t] = x;
            if (x > best[g]) best[g] = x;
        }
    }
    float inv[ZS_MAX_GROUP];
    for (int64_t g = 0; g < groups; g++) {
        float *sg = s + g * s_stride, sum = 0.f;
        for (int64_t t = 0; t < n; t++) {
            sg[t] = expf(sg[t] - best[g]);
            sum += sg[t];
        }
        inv[g] = 1.f / sum;
    }
    float acc[ZS_MAX_GROUP][ZS_MAX_HEAD_DIM];
    memset(acc, 0, sizeof(acc));
    for (int64_t t = 0; t < n; t++) {
        const int64_t pos = start + t;
        const bf16 *vr = cache_row(v_cache, table, pos, h, hkv, bs, d);
        float vf[ZS_MAX_HEAD_DIM];
        for (int64_t j = 0; j < d; j++) vf[j] = bf2f(vr[j]);
        for (int64_t g = 0; g < groups; g++) {
            const float p = s[g * s_stride + t];
#pragma omp simd
            for (int64_t j = 0; j < d; j++) acc[g][j] += p * vf[j];
        }
    }
    for (int64_t g = 0; g < groups; g++)
        for (int64_t j = 0; j < d; j++) out[g * d + j] = f2bf(acc[g][j] * inv[g]);
}

#endif

/* ---------------------------------------------------------------------------------
 * out = silu(gate) * up, gate and up being the two halves of each row of gate_up.
 */
struct silu_job {
    const bf16 *gate_up;
    int64_t in_stride;
    bf16 *out;
    int64_t out_stride, inter;
};

static void silu_rows(const void *job, int64_t begin, int64_t end) {
    const struct silu_job *j = job;
    for (int64_t r = begin; r < end; r++) {
        const bf16 *g = j->gate_up + r * j->in_stride;
        silu_mul_row(g, g + j->inter, j->out + r * j->out_stride, j->inter);
    }
}

void zs_silu_mul(const bf16 *gate_up, int64_t in_stride, bf16 *out, int64_t out_stride,
                 int64_t rows, int64_t inter) {
    const struct silu_job j = {gate_up, in_stride, out, out_stride, inter};
    zs_parallel(rows, 2, rows * inter >= ZS_PARALLEL_MIN, silu_rows, &j);
}

struct attention_job {
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
};

/* The first key an item's row attends to (a sliding window starts late). */
static inline int64_t item_start(const struct attention_job *j, int64_t len) {
    return (j->window > 0 && len > j->window) ? len - j->window : 0;
}

/* Ask for all of one item's K and V blocks into L2: the blocks are scattered over
 * the cache, so an item that starts cold waits on memory for each one. */
static inline __attribute__((always_inline)) void prefetch_item(const struct attention_job *j,
                                                                 int64_t item) {
    const int64_t hkv = j->hkv, n = item / hkv, h = item % hkv, len = j->row_len[n];
    const int64_t bs = j->block_size, bytes = bs * j->d * (int64_t)sizeof(bf16);
    const int32_t *table = j->tables + (int64_t)j->row_table[n] * j->table_stride;
    for (int64_t b = item_start(j, len) / bs; b * bs < len; b++) {
        const int64_t base = ((int64_t)table[b] * hkv + h) * bs * j->d;
        for (int64_t o = 0; o < bytes; o += 64) {
            __builtin_prefetch((const char *)(j->k_cache + base) + o, 0, 2);
            __builtin_prefetch((const char *)(j->v_cache + base) + o, 0, 2);
        }
    }
}

/* Items are (row, KV head) pairs; each one fetches the next while it computes. */
static void attention_items(const void *job, int64_t begin, int64_t end) {
    const struct attention_job *j = job;
    const int64_t hkv = j->hkv, groups = j->hq / hkv, d = j->d;
    float *s = scratch(sizeof(float) * ZS_PAD_GROUPS(groups) * j->s_stride);
    for (int64_t item = begin; item < end; item++) {
        if (item + 1 < end) prefetch_item(j, item + 1);
        const int64_t n = item / hkv, h = item % hkv;
        const int64_t len = j->row_len[n];
        const int64_t start = item_start(j, len);
        attend_row(j->q + n * j->q_stride + h * groups * d, j->k_cache, j->v_cache,
                   j->tables + (int64_t)j->row_table[n] * j->table_stride, start, len, h, hkv,
                   groups, d, j->block_size, j->scale, j->softcap,
                   j->out + n * j->out_stride + h * groups * d, s, j->s_stride);
    }
}

void zs_paged_attention(const bf16 *q, int64_t q_stride, const bf16 *k_cache,
                        const bf16 *v_cache, const int32_t *tables, int64_t table_stride,
                        const int32_t *row_table, const int32_t *row_len, int64_t rows,
                        int64_t hq, int64_t hkv, int64_t d, int64_t block_size, int64_t window,
                        float scale, float softcap, bf16 *out, int64_t out_stride,
                        int64_t max_len) {
    /* Score rows padded to 16 floats (the vector width) per query head. */
    const struct attention_job j = {q, q_stride, k_cache, v_cache, tables, table_stride,
                                    row_table, row_len, hq, hkv, d, block_size, window,
                                    scale, softcap, out, out_stride, (max_len + 15) / 16 * 16};
    zs_parallel(rows * hkv, 4, 1, attention_items, &j);
}

/* ---------------------------------------------------------------------------------
 * Sampling's last step for each row of fp32 logits (temperature, top-k/p and the
 * processors already applied; -inf = excluded): softmax, then the inverse-CDF draw
 * with that row's uniform u in [0, 1): the first token whose cumulative mass passes
 * u times the row's total, found through sums of 16-token blocks. The target stays
 * strictly below the total, and a token without mass is never the answer.
 */
struct draw_job {
    const float *logits;
    int64_t stride;
    const float *u;
    int64_t vocab;
    int64_t *out;
};

static void draw_rows(const void *job, int64_t begin, int64_t end) {
    const struct draw_job *jb = job;
    const float *logits = jb->logits, *u = jb->u;
    const int64_t stride = jb->stride, vocab = jb->vocab;
    int64_t *out = jb->out;
    const int64_t blocks = (vocab + 15) / 16;
    float *e = scratch(sizeof(float) * (blocks * 16 + blocks));
    float *block_sums = e + blocks * 16;
    for (int64_t r = begin; r < end; r++) {
        const float *x = logits + r * stride;
        const float m = row_max(x, vocab);
        softmax_numerators(x, m, e, block_sums, vocab);
        float total = 0.f;
        for (int64_t j = 0; j < blocks; j++) total += block_sums[j];
        float target = u[r] * total;
        const float below = total * (1.f - 1.f / 1048576.f);
        if (target > below) target = below;
        float acc = 0.f;
        int64_t j = 0;
        while (j < blocks - 1 && acc + block_sums[j] <= target) acc += block_sums[j++];
        int64_t pick = -1, last = -1;
        for (int64_t i = j * 16; i < j * 16 + 16 && i < vocab; i++) {
            if (e[i] <= 0.f) continue;
            last = i;
            acc += e[i];
            if (acc > target) {
                pick = i;
                break;
            }
        }
        if (pick < 0) pick = last;  /* rounding left the target past the block */
        if (pick < 0)               /* ... in a block without mass: the best token */
            for (int64_t i = 0; i < vocab; i++)
                if (x[i] == m) {
                    pick = i;
                    break;
                }
        out[r] = pick;
    }
}

void zs_softmax_draw(const float *logits, int64_t stride, const float *u, int64_t rows,
                     int64_t vocab, int64_t *out) {
    const struct draw_job j = {logits, stride, u, vocab, out};
    zs_parallel(rows, 1, rows * vocab >= 4 * ZS_PARALLEL_MIN, draw_rows, &j);
}

#if ZS_AVX512
/* ---------------------------------------------------------------------------------
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
#define ZS_TILE 32

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
    float *yf, int64_t ys, const int R, __mmask16 m0, __mmask16 m1, int gated,
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
    const int64_t ahead = atomic_load(&pool.active);
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
            case 8: linear_rows(xr, xs, tile, k, b, yr, yfr, ys, 8, m0, m1, gated, next); break;
            case 7: linear_rows(xr, xs, tile, k, b, yr, yfr, ys, 7, m0, m1, gated, next); break;
            case 6: linear_rows(xr, xs, tile, k, b, yr, yfr, ys, 6, m0, m1, gated, next); break;
            case 5: linear_rows(xr, xs, tile, k, b, yr, yfr, ys, 5, m0, m1, gated, next); break;
            case 4: linear_rows(xr, xs, tile, k, b, yr, yfr, ys, 4, m0, m1, gated, next); break;
            case 3: linear_rows(xr, xs, tile, k, b, yr, yfr, ys, 3, m0, m1, gated, next); break;
            case 2: linear_rows(xr, xs, tile, k, b, yr, yfr, ys, 2, m0, m1, gated, next); break;
            default: linear_rows(xr, xs, tile, k, b, yr, yfr, ys, 1, m0, m1, gated, next); break;
            }
        }
    }
}

/* x [M, K] (row stride xs), packed W, bias fp32 [N] or NULL -> y [M, N] (stride ys),
 * bf16, or with out_f32 fp32 (the bf16-rounded values; not gated); gated (no bias):
 * y = silu(x Gᵀ) * (x Uᵀ). */
void zs_linear(const bf16 *x, int64_t xs, const bf16 *packed, const float *bias, int64_t m,
               int64_t n, int64_t k, int gated, void *y, int64_t ys, int out_f32) {
    const int64_t tiles = (n + tile_cols(gated) - 1) / tile_cols(gated);
    const int f32 = out_f32 && !gated;
    const struct linear_job j = {
        x, xs, packed, bias, m, n, k, gated, f32 ? NULL : (bf16 *)y, f32 ? (float *)y : NULL, ys};
    zs_parallel(tiles, 1, m * n * k >= 16 * ZS_PARALLEL_MIN, linear_tiles, &j);
}
#endif
