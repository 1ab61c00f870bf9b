/*
 * Sampling's last step for each row of fp32 logits (temperature, top-k/p and the
 * processors already applied; -inf = excluded): softmax, then the inverse-CDF draw
 * with that row's uniform u in [0, 1): the first token whose cumulative mass passes
 * u times the row's total, found through sums of 16-token blocks. The target stays
 * strictly below the total, and a token without mass is never the answer.
 *
 * And greedy's pick, each row's argmax, as torch answers it: the first NaN where the
 * row has one, else the first index of the largest value (torch's own reduction takes
 * ~1.5 ns an element on this project's CPUs, one vector pass here ~0.1).
 */
#include "kernels.h"

#define ZS_DRAW_SPAN 256 /* tokens a partial sum covers (a multiple of 16) */

#if ZS_AVX512

/* e[i] = exp(x[i] - m), 0 where x[i] is -inf (a masked token keeps no mass); the sums
 * of each ZS_DRAW_SPAN tokens, one horizontal sum each (one per 16 tokens took 45 %
 * longer, BENCHMARKS.md §2). */
static void softmax_numerators(const float *x, float m, float *e, float *span_sums, int64_t vocab) {
    const __m512 mx = _mm512_set1_ps(m), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t s = 0; s * ZS_DRAW_SPAN < vocab; s++) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t i = s * ZS_DRAW_SPAN; i < (s + 1) * ZS_DRAW_SPAN && i < vocab; i += 16) {
            const __m512 v = _mm512_mask_loadu_ps(ninf, lanes16(vocab - i), x + i);
            const __mmask16 live = _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ);
            const __m512 ex = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(v, mx)));
            _mm512_storeu_ps(e + i, ex);
            sum = _mm512_add_ps(sum, ex);
        }
        span_sums[s] = _mm512_reduce_add_ps(sum);
    }
}

/* The sum of e's 16 tokens from i (their vector, padded with zeros). */
static float block_sum(const float *e, int64_t i) {
    return _mm512_reduce_add_ps(_mm512_loadu_ps(e + i));
}

static float row_max(const float *x, int64_t vocab) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= vocab; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
    float best = _mm512_reduce_max_ps(m);
    for (; i < vocab; i++) best = x[i] > best ? x[i] : best;
    return best;
}

/* The first index of the row's largest value, in one pass: each lane keeps its own
 * best and where it was; -1 where the row holds a NaN. */
static int64_t row_argmax(const float *x, int64_t vocab) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 best = ninf;
    __m512i where = _mm512_setzero_si512(), at = _mm512_setr_epi32(
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    for (int64_t i = 0; i < vocab; i += 16) {
        const __mmask16 lane = lanes16(vocab - i);
        const __m512 v = _mm512_mask_loadu_ps(ninf, lane, x + i);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_mask_mov_ps(best, gt, v);
        where = _mm512_mask_mov_epi32(where, gt, at);
        at = _mm512_add_epi32(at, step);
    }
    if (nan) return -1;
    const float m = _mm512_reduce_max_ps(best);
    const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
    return _mm512_mask_reduce_min_epi32(top, where);
}

#else /* portable */

static void softmax_numerators(const float *x, float m, float *e, float *span_sums, int64_t vocab) {
    for (int64_t i = 0; i < vocab; i += 16)
        for (int64_t k = i; k < i + 16; k++)
            e[k] = (k < vocab && x[k] != -INFINITY) ? expf(x[k] - m) : 0.f;
    for (int64_t s = 0; s * ZS_DRAW_SPAN < vocab; s++) {
        float sum = 0.f;
        for (int64_t k = s * ZS_DRAW_SPAN; k < (s + 1) * ZS_DRAW_SPAN && k < vocab; k++)
            sum += e[k];
        span_sums[s] = sum;
    }
}

static float block_sum(const float *e, int64_t i) {
    float sum = 0.f;
    for (int64_t k = i; k < i + 16; k++) sum += e[k];
    return sum;
}

static float row_max(const float *x, int64_t vocab) {
    float best = -INFINITY;
    for (int64_t i = 0; i < vocab; i++) best = x[i] > best ? x[i] : best;
    return best;
}

static int64_t row_argmax(const float *x, int64_t vocab) {
    int64_t pick = 0;
    for (int64_t i = 0; i < vocab; i++) {
        if (x[i] != x[i]) return -1;
        if (x[i] > x[pick]) pick = i;
    }
    return pick;
}

#endif

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
    const int64_t blocks = (vocab + 15) / 16, spans = (vocab + ZS_DRAW_SPAN - 1) / ZS_DRAW_SPAN;
    float *e = zs_scratch(sizeof(float) * (blocks * 16 + spans));
    float *span_sums = e + blocks * 16;
    for (int64_t r = begin; r < end; r++) {
        const float *x = logits + r * stride;
        const float m = row_max(x, vocab);
        softmax_numerators(x, m, e, span_sums, vocab);
        float total = 0.f;
        for (int64_t s = 0; s < spans; s++) total += span_sums[s];
        float target = u[r] * total;
        const float below = total * (1.f - 1.f / 1048576.f);
        if (target > below) target = below;
        /* The span, then the 16-token block, whose sum takes the running total past the
         * target (the last one if rounding leaves none). */
        float acc = 0.f;
        int64_t s = 0;
        while (s < spans - 1 && acc + span_sums[s] <= target) acc += span_sums[s++];
        int64_t j = s * (ZS_DRAW_SPAN / 16);
        const int64_t span_end = (s + 1) * (ZS_DRAW_SPAN / 16);
        const int64_t last_block = (span_end < blocks ? span_end : blocks) - 1;
        for (float b; j < last_block && acc + (b = block_sum(e, j * 16)) <= target; j++) acc += b;
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

struct argmax_job {
    const float *logits;
    int64_t stride, vocab;
    int64_t *out;
};

static void argmax_rows(const void *job, int64_t begin, int64_t end) {
    const struct argmax_job *jb = job;
    for (int64_t r = begin; r < end; r++) {
        const float *x = jb->logits + r * jb->stride;
        int64_t pick = row_argmax(x, jb->vocab);
        if (pick < 0)  /* torch's answer where a row holds a NaN: the first one */
            for (pick = 0; x[pick] == x[pick]; pick++) {}
        jb->out[r] = pick;
    }
}

void zs_argmax(const float *logits, int64_t stride, int64_t rows, int64_t vocab, int64_t *out) {
    const struct argmax_job j = {logits, stride, vocab, out};
    zs_parallel(rows, 1, rows * vocab >= 4 * ZS_PARALLEL_MIN, argmax_rows, &j);
}
