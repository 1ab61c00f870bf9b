/*
 * RoPE on q (in place, in the packed qkv rows) and k, then k and v into the paged
 * cache: token n goes to cache slot slots[n] = block * block_size + offset, which for
 * head h is row (block * hkv + h) * block_size + offset of a [blocks, hkv, bs, d]
 * cache.
 */
#include "kernels.h"

/* One token's rows of q and k: optional per-head RMSNorm (Qwen3), rotate-half RoPE
 * with that token's cos/sin rows, the result rounded as torch's
 * x * cos + rotate_half(x) * sin rounds it. */
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
#if ZS_AVX512
    if (half % 16 == 0) { /* both halves a vector at a time (GCC's version: 2x the time) */
        for (int64_t j = 0; j < half; j += 16) {
            const __m512 a = _mm512_loadu_ps(v + j), b = _mm512_loadu_ps(v + j + half);
            const __m512 nb = _mm512_sub_ps(_mm512_setzero_ps(), b);
            const __m512 ca = load_bf16_as_f32(cos + j, 0xffff);
            const __m512 sa = load_bf16_as_f32(sin + j, 0xffff);
            const __m512 cb = load_bf16_as_f32(cos + j + half, 0xffff);
            const __m512 sb = load_bf16_as_f32(sin + j + half, 0xffff);
            const __m512 lo =
                _mm512_add_ps(round_bf16(_mm512_mul_ps(a, ca)), round_bf16(_mm512_mul_ps(nb, sa)));
            const __m512 hi =
                _mm512_add_ps(round_bf16(_mm512_mul_ps(b, cb)), round_bf16(_mm512_mul_ps(a, sb)));
            _mm256_storeu_si256((__m256i *)(dst + j), (__m256i)_mm512_cvtneps_pbh(lo));
            _mm256_storeu_si256((__m256i *)(dst + j + half), (__m256i)_mm512_cvtneps_pbh(hi));
        }
        return;
    }
#endif
    for (int64_t j = 0; j < d; j++) {
        const float rot = j < half ? -v[j + half] : v[j - half];
        dst[j] = f2bf(round_bf(v[j] * bf2f(cos[j])) + round_bf(rot * bf2f(sin[j])));
    }
}

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
    zs_parallel(rows, zs_even_grain(rows, 2), rows * (hq + hkv) * d >= ZS_PARALLEL_MIN, rope_rows, &j);
}
