/*
 * RMSNorm, optionally after a residual add (transformers' order: normalise in fp32,
 * round, then scale by the weight and round again).
 *   residual == NULL: out = norm(x)
 *   otherwise:        residual = residual + x (rounded); out = norm(residual)
 */
#include "kernels.h"

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
/* Stored masked only where a row ends, as load_bf16_as_f32 loads (with every store
 * masked, 128 rows of 512 took x1.05 as long; BENCHMARKS.md §2). */
static inline void store16(bf16 *p, __mmask16 m, __m256i v) {
    if (m == 0xffff) _mm256_storeu_si256((__m256i *)p, v);
    else _mm256_mask_storeu_epi16(p, m, v);
}

/* 16 lanes at a time, with the portable version's roundings; only the order of the
 * sum of squares differs. The second pass re-reads the rounded input (bf16 holds it exactly)
 * instead of keeping a float copy. */
static void rms_rows(const void *job, int64_t begin, int64_t end) {
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
                store16(res + i, m, sum);
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
            store16(o + i, m, (__m256i)_mm512_cvtneps_pbh(scaled));
        }
    }
}

#else /* portable */

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

#endif

void zs_rms_norm(const bf16 *x, int64_t x_stride, bf16 *residual, int64_t res_stride,
                 const bf16 *weight, bf16 *out, int64_t out_stride, int64_t rows,
                 int64_t hidden, float eps) {
    const struct rms_job j = {x, x_stride, residual, res_stride, weight, out, out_stride, hidden, eps};
    zs_parallel(rows, zs_even_grain(rows, 2), rows * hidden >= ZS_PARALLEL_MIN, rms_rows, &j);
}
