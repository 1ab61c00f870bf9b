/*
 * Structured outputs' mask over fp32 logits: -inf on every token whose bit in its row
 * of the token bitmask is 0 (xgrammar's layout: int32 words, bit t % 32 of word t / 32
 * set = token t allowed). Only the listed rows are touched, in place; a word with every
 * bit set is skipped whole, one with none set is a plain fill.
 */
#include "kernels.h"

struct mask_job {
    float *logits;
    int64_t stride;
    const uint32_t *bitmask;
    int64_t words;  /* row stride of the bitmask, in words */
    const int64_t *rows;
    int64_t vocab;
};

#if ZS_AVX512

static void mask_row(float *x, const uint32_t *bits, int64_t vocab) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t base = 0; base < vocab; base += 32) {
        const uint32_t b = bits[base / 32];
        if (b == 0xffffffffu) continue;
        const int64_t left = vocab - base;
        _mm512_mask_storeu_ps(x + base, (__mmask16)~b & lanes16(left), ninf);
        if (left > 16) _mm512_mask_storeu_ps(x + base + 16, (__mmask16)(~b >> 16) & lanes16(left - 16), ninf);
    }
}

#else /* portable */

static void mask_row(float *x, const uint32_t *bits, int64_t vocab) {
    for (int64_t base = 0; base < vocab; base += 32) {
        const uint32_t b = bits[base / 32];
        if (b == 0xffffffffu) continue;
        const int64_t n = vocab - base < 32 ? vocab - base : 32;
        for (int64_t k = 0; k < n; k++)
            if (!((b >> k) & 1u)) x[base + k] = -INFINITY;
    }
}

#endif

static void mask_rows(const void *job, int64_t begin, int64_t end) {
    const struct mask_job *j = job;
    for (int64_t r = begin; r < end; r++) {
        const int64_t row = j->rows[r];
        mask_row(j->logits + row * j->stride, j->bitmask + row * j->words, j->vocab);
    }
}

void zs_apply_bitmask(float *logits, int64_t stride, const int32_t *bitmask, int64_t words,
                      const int64_t *rows, int64_t num_rows, int64_t vocab) {
    const struct mask_job j = {logits, stride, (const uint32_t *)bitmask, words, rows, vocab};
    /* Mostly skipped words: a second thread pays off only on large vocabularies. */
    zs_parallel(num_rows, 1, num_rows * vocab >= 64 * ZS_PARALLEL_MIN, mask_rows, &j);
}
