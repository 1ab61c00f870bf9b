/*
 * zserve's CPU kernels: the fused elementwise steps and the paged attention of the
 * native bf16 forward. engine_core/cpu_kernels.py compiles this file for the machine
 * it runs on (gcc -O3 -march=native -fopenmp) and calls it through ctypes.
 *
 * Tensors are bf16 (as uint16 bit patterns) with fp32 arithmetic. Each kernel rounds
 * to bf16 wherever torch's op-by-op bf16 path rounds, so it reproduces those ops up
 * to the order of a sum; attention is the exception: its scores and probabilities
 * stay fp32 (torch rounds both to bf16), which is closer to the exact result.
 *
 * OpenMP resolves to the libgomp torch has already loaded into the engine process,
 * so torch.set_num_threads governs these loops as well.
 *
 * Two builds of every kernel: AVX-512 (with AVX512-BF16 dot products), and portable
 * C for any other CPU. ZS_PORTABLE forces the portable one (the tests compare both).
 */
#include <math.h>
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

typedef uint16_t bf16;

#define ZS_MAX_HEAD_DIM 256
#define ZS_MAX_GROUP 16
/* Query heads per KV head, padded to a divisor of 16 (the AVX-512 scores' layout). */
#define ZS_PAD_GROUPS(g) ((g) <= 4 ? 4 : (g) <= 8 ? 8 : 16)
/* Below this many elements a loop runs on one thread: waking the others costs more. */
#define ZS_PARALLEL_MIN 16384

int zs_abi(void) { return 1; }
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
 * RMSNorm, optionally after a residual add (transformers' order: normalise in fp32,
 * round, then scale by the weight and round again).
 *   residual == NULL: out = norm(x)
 *   otherwise:        residual = residual + x (rounded); out = norm(residual)
 */
void zs_rms_norm(const bf16 *x, int64_t x_stride, bf16 *residual, int64_t res_stride,
                 const bf16 *weight, bf16 *out, int64_t out_stride, int64_t rows,
                 int64_t hidden, float eps) {
#pragma omp parallel for schedule(static) if (rows * hidden >= ZS_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
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
void zs_rope_store(bf16 *qkv, int64_t row_stride, const int64_t *positions, const bf16 *cos,
                   const bf16 *sin, int64_t rows, int64_t hq, int64_t hkv, int64_t d,
                   const bf16 *q_norm, const bf16 *k_norm, float eps, bf16 *k_cache,
                   bf16 *v_cache, const int64_t *slots, int64_t block_size) {
#pragma omp parallel for schedule(static) if (rows * (hq + hkv) * d >= ZS_PARALLEL_MIN)
    for (int64_t n = 0; n < rows; n++) {
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

static inline __m512 load_bf16_as_f32(const bf16 *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline __m512 bf16_as_f32(__m256i raw) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
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
        const __mmask16 lane = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);
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

static inline void prefetch_block(const bf16 *p, int64_t bytes) {
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
            const __mmask32 m = left >= 32 ? 0xffffffffu : ((1u << left) - 1u);
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
    for (int64_t t = 0; t < n; t++) {
        const int64_t pos = start + t;
        if (pos % bs == 0 || t == 0) {
            const int64_t b = pos / bs, base = ((int64_t)table[b] * hkv + h) * bs * d;
            prefetch_block(v_cache + base, block_bytes);
            if ((b + 1) * bs < len)
                prefetch_block(k_cache + (((int64_t)table[b + 1] * hkv + h) * bs) * d, block_bytes);
        }
        const bf16 *kr = cache_row(k_cache, table, pos, h, hkv, bs, d);
        __m512bh kv[ZS_MAX_HEAD_DIM / 32];
        for (int64_t c = 0; c < dk; c++) {
            const int64_t left = d - c * 32;
            const __mmask32 m = left >= 32 ? 0xffffffffu : ((1u << left) - 1u);
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
    for (int64_t t = 0; t < n; t++) {
        const int64_t pos = start + t;
        const bf16 *vr = cache_row(v_cache, table, pos, h, hkv, bs, d);
        __m512 vv[ZS_MAX_HEAD_DIM / 16];
        for (int64_t c = 0; c < dv; c++) {
            const int64_t left = d - c * 16;
            vv[c] = load_bf16_as_f32(vr + c * 16, left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u));
        }
        for (int64_t g = 0; g < groups; g++) {
            const __m512 p = _mm512_set1_ps(s[t * gp + g]);
            for (int64_t c = 0; c < dv; c++) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
        }
    }
    for (int64_t g = 0; g < groups; g++) {
        const __m512 f = _mm512_set1_ps(inv[g]);
        for (int64_t c = 0; c < dv; c++) {
            const int64_t left = d - c * 16;
            const __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);
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
void zs_silu_mul(const bf16 *gate_up, int64_t in_stride, bf16 *out, int64_t out_stride,
                 int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter >= ZS_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row(gate_up + r * in_stride, gate_up + r * in_stride + inter, out + r * out_stride, inter);
}

void zs_paged_attention(const bf16 *q, int64_t q_stride, const bf16 *k_cache,
                        const bf16 *v_cache, const int32_t *tables, int64_t table_stride,
                        const int32_t *row_table, const int32_t *row_len, int64_t rows,
                        int64_t hq, int64_t hkv, int64_t d, int64_t block_size, int64_t window,
                        float scale, float softcap, bf16 *out, int64_t out_stride,
                        int64_t max_len) {
    const int64_t groups = hq / hkv;
    /* Score rows padded to 16 floats (the vector width) per query head. */
    const int64_t s_stride = (max_len + 15) / 16 * 16;
    const int64_t g4 = ZS_PAD_GROUPS(groups);
#pragma omp parallel if (rows * hkv > 1)
    {
        float *s = (float *)malloc(sizeof(float) * g4 * s_stride);
#pragma omp for schedule(dynamic, 4)
        for (int64_t item = 0; item < rows * hkv; item++) {
            const int64_t n = item / hkv, h = item % hkv;
            const int64_t len = row_len[n];
            const int64_t start = (window > 0 && len > window) ? len - window : 0;
            attend_row(q + n * q_stride + h * groups * d, k_cache, v_cache,
                       tables + (int64_t)row_table[n] * table_stride, start, len, h, hkv, groups,
                       d, block_size, scale, softcap, out + n * out_stride + h * groups * d, s,
                       s_stride);
        }
        free(s);
    }
}

/* ---------------------------------------------------------------------------------
 * Sampling's last step for each row of fp32 logits (temperature, top-k/p and the
 * processors already applied; -inf = excluded): softmax, then the inverse-CDF draw
 * with that row's uniform u in [0, 1): the first token whose cumulative mass passes
 * u times the row's total, found through sums of 16-token blocks. The target stays
 * strictly below the total, and a token without mass is never the answer.
 */
void zs_softmax_draw(const float *logits, int64_t stride, const float *u, int64_t rows,
                     int64_t vocab, int64_t *out) {
    const int64_t blocks = (vocab + 15) / 16;
#pragma omp parallel if (rows * vocab >= 4 * ZS_PARALLEL_MIN)
    {
        float *e = (float *)malloc(sizeof(float) * (blocks * 16 + blocks));
        float *block_sums = e + blocks * 16;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
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
        free(e);
    }
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
 * whichever thread is free (schedule dynamic), so a thread the OS descheduled holds
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
#pragma omp parallel for schedule(static)
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
 * round. An odd K's last pair takes x's last element alone. */
static inline __attribute__((always_inline)) void linear_rows(
    const bf16 *x, int64_t xs, const bf16 *tile, int64_t k, const float *bias, bf16 *y,
    int64_t ys, const int R, __mmask16 m0, __mmask16 m1, int gated) {
    __m512 acc[8][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t full = k / 2;
    for (int64_t p = 0; p < full; p++) {
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
        _mm256_mask_storeu_epi16(y + r * ys, m0, lo);
        _mm256_mask_storeu_epi16(y + r * ys + 16, m1, hi);
    }
}

/* x [M, K] (row stride xs), packed W, bias fp32 [N] or NULL -> y [M, N] (stride ys);
 * gated (no bias): y = silu(x Gᵀ) * (x Uᵀ). */
void zs_linear(const bf16 *x, int64_t xs, const bf16 *packed, const float *bias, int64_t m,
               int64_t n, int64_t k, int gated, bf16 *y, int64_t ys) {
    const int64_t pairs = (k + 1) / 2, width = tile_cols(gated), tiles = (n + width - 1) / width;
#pragma omp parallel for schedule(dynamic, 1) if (m * n * k >= 16 * ZS_PARALLEL_MIN)
    for (int64_t t = 0; t < tiles; t++) {
        const bf16 *tile = packed + t * pairs * 2 * ZS_TILE;
        const int64_t left = n - t * width;
        const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);
        const __mmask16 m1 = gated || left <= 16 ? 0
                             : left >= 32      ? 0xffff
                                               : (__mmask16)((1u << (left - 16)) - 1u);
        const float *b = bias ? bias + t * ZS_TILE : NULL;
        for (int64_t r0 = 0; r0 < m; r0 += 8) {
            const bf16 *xr = x + r0 * xs;
            bf16 *yr = y + r0 * ys + t * width;
            switch (m - r0 < 8 ? m - r0 : 8) {
            case 8: linear_rows(xr, xs, tile, k, b, yr, ys, 8, m0, m1, gated); break;
            case 7: linear_rows(xr, xs, tile, k, b, yr, ys, 7, m0, m1, gated); break;
            case 6: linear_rows(xr, xs, tile, k, b, yr, ys, 6, m0, m1, gated); break;
            case 5: linear_rows(xr, xs, tile, k, b, yr, ys, 5, m0, m1, gated); break;
            case 4: linear_rows(xr, xs, tile, k, b, yr, ys, 4, m0, m1, gated); break;
            case 3: linear_rows(xr, xs, tile, k, b, yr, ys, 3, m0, m1, gated); break;
            case 2: linear_rows(xr, xs, tile, k, b, yr, ys, 2, m0, m1, gated); break;
            default: linear_rows(xr, xs, tile, k, b, yr, ys, 1, m0, m1, gated); break;
            }
        }
    }
}
#endif
