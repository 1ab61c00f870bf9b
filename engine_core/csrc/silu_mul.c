/*
 * out = silu(gate) * up, gate and up being the two halves of each row of gate_up.
 */
#include "kernels.h"

#if ZS_AVX512

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

#else /* portable */

static void silu_mul_row(const bf16 *g, const bf16 *u, bf16 *o, int64_t inter) {
#pragma omp simd
    for (int64_t i = 0; i < inter; i++) {
        const float x = bf2f(g[i]);
        o[i] = f2bf(round_bf(x / (1.f + expf(-x))) * bf2f(u[i]));
    }
}

#endif

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
    zs_parallel(rows, zs_even_grain(rows, 2), rows * inter >= ZS_PARALLEL_MIN, silu_rows, &j);
}
