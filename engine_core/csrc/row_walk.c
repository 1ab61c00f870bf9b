/*
 * One decode row's attention on the vector units (paged_attention.c hands out the rows):
 * the query heads of one KV head (GQA) share every K/V row read. Scores are scaled,
 * soft-capped when softcap > 0, and soft-maxed in fp32; the weights are rounded to bf16
 * for the sum of V rows (as the tiles and SDPA do).
 */
#include "kernels.h"

#if ZS_AVX512

/* The products' arithmetic. A bf16 dot product does two products a lane, half the
 * instructions of fp32 FMAs, and on Zen 5 the walk ran faster on them (BENCHMARKS.md
 * §2). The cores with the tile unit retire a 512-bit one once per 2 cycles and an FMA
 * twice a cycle, so there the walk widens each bf16 row to floats (even and odd
 * elements: a shift and a mask) and runs FMAs: x0.57 for P V, x0.68 for the scores in
 * a microbenchmark (BENCHMARKS.md §2). A row vector is `zs_wv`, ZS_WV of them a 32-bf16
 * chunk; both products are exact, only the order of the sums differs. */
#define ZS_WALK_FMA ZS_AMX
#if ZS_WALK_FMA
typedef __m512 zs_wv;
#define ZS_WV 2
#define ZS_DOT(acc, a, b) _mm512_fmadd_ps(a, b, acc)
static inline void widen(__m512i raw, zs_wv *out) {
    out[0] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    out[1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xffff0000u)));
}
#else
typedef __m512bh zs_wv;
#define ZS_WV 1
#define ZS_DOT(acc, a, b) _mm512_dpbf16_ps(acc, a, b)
static inline void widen(__m512i raw, zs_wv *out) { out[0] = (__m512bh)raw; }
#endif

/* A cache row of d bf16 as row vectors (ZS_WV a 32-bf16 chunk). */
static inline __attribute__((always_inline)) void widen_row(const bf16 *row, int64_t d, zs_wv *out) {
    for (int64_t c = 0; c < (d + 31) / 32; c++)
        widen(_mm512_maskz_loadu_epi16(lanes32(d - c * 32), row + c * 32), out + c * ZS_WV);
}

/* The sums of four vectors: [sum a, sum b, sum c, sum d]. */
static inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    const __m256 z = _mm256_add_ps(_mm512_castps512_ps256(y), _mm512_extractf32x8_ps(y, 1));
    return _mm_add_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1));
}

/* K blocks a row's walk asks for ahead of the one it reads: two against one, 3-6 %
 * faster over 256-1536 keys and from DRAM, level over 96 (BENCHMARKS.md §2). */
#define ZS_KEYS_AHEAD 2

/* Inlined into callers with constant d and groups, so the common shapes keep q and
 * the accumulators in registers (a generic loop spills them, several times slower:
 * BENCHMARKS.md §2, "Figures behind the code"). */
static inline __attribute__((always_inline)) void attend_row_impl(
    const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int32_t *table,
    int64_t start, int64_t len, int64_t h, int64_t hkv, const int64_t groups, const int64_t d,
    int64_t bs, float scale, float softcap, bf16 *out, float *s, int64_t s_stride,
    const float *part) {
    const int64_t n = len - start;
    const int64_t dk = (d + 31) / 32;  /* 32-bf16 chunks of a row (dot products) */
    const int64_t dv = (d + 15) / 16;  /* 16-float chunks of a row (accumulation) */
    zs_wv qv[ZS_MAX_GROUP][ZS_MAX_HEAD_DIM / 32 * ZS_WV];
    for (int64_t g = 0; g < ZS_PAD_GROUPS(groups); g++)
        for (int64_t c = 0; c < dk; c++) {
            const __mmask32 m = g < groups ? lanes32(d - c * 32) : 0;
            widen(_mm512_maskz_loadu_epi16(m, q + g * d + c * 32), qv[g] + c * ZS_WV);
        }
    /* Scores go key-major, s[t * gp + g], gp a divisor of 16: each key's scores are
     * one store, and the softmax below runs on whole vectors. */
    const int64_t gp = ZS_PAD_GROUPS(groups);
    __m128 best[ZS_MAX_GROUP / 4];
    for (int64_t g = 0; g < gp; g += 4) best[g / 4] = _mm_set1_ps(-INFINITY);
    /* The cache blocks are scattered, so the hardware prefetcher starts cold at each
     * one: each key asks for its share of the K block ZS_KEYS_AHEAD blocks on and for
     * its own V row (for the weighted sum after), where a block's lines were asked for
     * all at once at its start: decode attention 9-14 % faster with K/V in L3, 13 % in
     * DRAM (BENCHMARKS.md §2). */
    const int64_t row_bytes = d * (int64_t)sizeof(bf16), block_bytes = bs * row_bytes;
    const int64_t lines = block_bytes / 64, per_key = (lines + bs - 1) / bs;
    for (int64_t b = start / bs; b < start / bs + ZS_KEYS_AHEAD && b * bs < len; b++)
        zs_fetch_l2(k_cache + (((int64_t)table[b] * hkv + h) * bs) * d, block_bytes);
    /* Block by block, so finding a row takes no division. */
    for (int64_t t = 0, b = start / bs; t < n; b++) {
        const int64_t base = ((int64_t)table[b] * hkv + h) * bs * d;
        const char *v_rows = (const char *)(v_cache + base), *k_ahead = NULL;
        if ((b + ZS_KEYS_AHEAD) * bs < len)
            k_ahead = (const char *)(k_cache + ((int64_t)table[b + ZS_KEYS_AHEAD] * hkv + h) * bs * d);
        const int64_t first = start + t - b * bs, stop = len - b * bs < bs ? len - b * bs : bs;
        for (int64_t off = first; off < stop; off++, t++) {
            for (int64_t i = off * per_key; i < (off + 1) * per_key && i < lines; i++) {
                _mm_prefetch(v_rows + i * 64, _MM_HINT_T1);
                if (k_ahead) _mm_prefetch(k_ahead + i * 64, _MM_HINT_T1);
            }
            const bf16 *kr = k_cache + base + off * d;
            zs_wv kv[ZS_MAX_HEAD_DIM / 32 * ZS_WV];
            widen_row(kr, d, kv);
            for (int64_t g = 0; g < gp; g += 4) {
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t c = 0; c < dk * ZS_WV; c++) {
                    a0 = ZS_DOT(a0, qv[g][c], kv[c]);
                    a1 = ZS_DOT(a1, qv[g + 1][c], kv[c]);
                    a2 = ZS_DOT(a2, qv[g + 2][c], kv[c]);
                    a3 = ZS_DOT(a3, qv[g + 3][c], kv[c]);
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
    /* Softmax numerators in place, a whole vector (16 / gp keys) at a time, rounded to
     * bf16 for the products with V below (their sums too, so the weights sum to one);
     * the padding past the last key, to whole pairs of vectors, is -inf and gives 0. */
    const int64_t flat = n * gp, padded = (flat + 31) / 32 * 32;
    for (int64_t i = flat; i < padded; i++) s[i] = -INFINITY;
    float lane_max[16], lane_sum[16];
    for (int64_t l = 0; l < 16; l += 4) _mm_storeu_ps(lane_max + l, best[(l % gp) / 4]);
    const __m512 mx = _mm512_loadu_ps(lane_max), ninf = _mm512_set1_ps(-INFINITY);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < padded; i += 16) {
        const __m512 x = _mm512_loadu_ps(s + i);
        const __mmask16 live = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(x, mx)));
        const __m512 r = round_bf16(e);
        _mm512_storeu_ps(s + i, r);
        sum = _mm512_add_ps(sum, r);
    }
    _mm512_storeu_ps(lane_sum, sum);
    float inv[ZS_MAX_GROUP];
    for (int64_t g = 0; g < groups; g++) {
        float total = 0.f;
        for (int64_t l = g; l < 16; l += gp) total += lane_sum[l];
        inv[g] = 1.f / total;
    }
#if !ZS_WALK_FMA /* FMAs take the weights as they are */
    /* The weights as bf16 pairs of consecutive keys, pair-major: w[j * gp + g] holds
     * keys 2j and 2j + 1 of query head g (in place: each 32 floats become 16 pairs). */
    const int32_t *w = (const int32_t *)s;
    int16_t pick[32];
    for (int64_t e = 0; e < 32; e++) {
        const int64_t j = e / 2, key = 2 * (j / gp) + e % 2;
        pick[e] = (int16_t)(key * gp + j % gp);
    }
    const __m512i order = _mm512_loadu_si512(pick);
    for (int64_t i = 0; i < padded; i += 32) {
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + i + 16),
                                                          _mm512_loadu_ps(s + i));
        _mm512_storeu_si512((int32_t *)s + i / 2, _mm512_permutexvar_epi16(order, both));
    }
#endif
    /* Weighted V rows. On bf16 dot products two keys at a time: rows t and t + 1 unpacked
     * within each 128-bit lane, so accumulator 2c holds dims {0-3, 8-11, 16-19, 24-27} of
     * chunk c and 2c + 1 the others; a last odd key pairs with itself at weight 0. On
     * FMAs a key at a time, 2c the even dims and 2c + 1 the odd. */
    __m512 acc[ZS_MAX_GROUP][ZS_MAX_HEAD_DIM / 16];
    for (int64_t g = 0; g < groups; g++)
        for (int64_t c = 0; c < 2 * dk; c++) acc[g][c] = _mm512_setzero_ps();
#if !ZS_WALK_FMA
    const bf16 *held = NULL;
    int64_t pair = 0;
#endif
    for (int64_t t = 0, b = start / bs; t < n; b++) {
        const bf16 *vb = v_cache + ((int64_t)table[b] * hkv + h) * bs * d;
        const int64_t first = start + t - b * bs, stop = len - b * bs < bs ? len - b * bs : bs;
        for (int64_t off = first; off < stop; off++, t++) {
            const bf16 *vr = vb + off * d;
#if ZS_WALK_FMA
            zs_wv vw[ZS_MAX_HEAD_DIM / 16];
            widen_row(vr, d, vw);
            for (int64_t g = 0; g < groups; g++) {
                const __m512 p = _mm512_set1_ps(s[t * gp + g]);
                for (int64_t c = 0; c < 2 * dk; c++) acc[g][c] = _mm512_fmadd_ps(p, vw[c], acc[g][c]);
            }
#else
            if (!held && t + 1 < n) {
                held = vr;
                continue;
            }
            const bf16 *v0 = held ? held : vr;
            held = NULL;
            __m512i vp[ZS_MAX_HEAD_DIM / 16];
            for (int64_t c = 0; c < dk; c++) {
                const __mmask32 m = lanes32(d - c * 32);
                const __m512i a = _mm512_maskz_loadu_epi16(m, v0 + c * 32);
                const __m512i z = _mm512_maskz_loadu_epi16(m, vr + c * 32);
                vp[2 * c] = _mm512_unpacklo_epi16(a, z);
                vp[2 * c + 1] = _mm512_unpackhi_epi16(a, z);
            }
            for (int64_t g = 0; g < groups; g++) {
                const __m512bh p = (__m512bh)_mm512_set1_epi32(w[pair * gp + g]);
                for (int64_t c = 0; c < 2 * dk; c++)
                    acc[g][c] = _mm512_dpbf16_ps(acc[g][c], p, (__m512bh)vp[c]);
            }
            pair++;
#endif
        }
    }
    /* Back in dim order, into another array in loops unrolled whole: `acc` is read only at
     * constant indices, so it stays in registers above (else GCC stores it every pair). */
#if ZS_WALK_FMA
    const __m512i lo_dims = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_dims = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
#else
    const __m512i lo_dims = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_dims = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#endif
    __m512 res[ZS_MAX_GROUP][ZS_MAX_HEAD_DIM / 16];
#pragma GCC unroll 16
    for (int64_t g = 0; g < groups; g++)
#pragma GCC unroll 8
        for (int64_t c = 0; c < dk; c++) {
            res[g][2 * c] = _mm512_permutex2var_ps(acc[g][2 * c], lo_dims, acc[g][2 * c + 1]);
            res[g][2 * c + 1] = _mm512_permutex2var_ps(acc[g][2 * c], hi_dims, acc[g][2 * c + 1]);
        }
    for (int64_t g = 0; g < groups; g++) {
        __m512 f = _mm512_set1_ps(inv[g]), fp = _mm512_setzero_ps();
        if (part) { /* merge the shared prefix's sums (tiled_attention.c), by their maxima */
            const float *pg = part + g * (d + 2), m = pg[d] > lane_max[g] ? pg[d] : lane_max[g];
            const float a = expf(pg[d] - m), b = expf(lane_max[g] - m);
            const float total = 1.f / (pg[d + 1] * a + b / inv[g]);
            f = _mm512_set1_ps(b * total), fp = _mm512_set1_ps(a * total);
        }
        for (int64_t c = 0; c < dv; c++) {
            const int64_t left = d - c * 16;
            const __mmask16 m = lanes16(left);
            __m512 r = _mm512_mul_ps(res[g][c], f);
            if (part) r = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, part + g * (d + 2) + c * 16), fp, r);
            _mm256_mask_storeu_epi16(out + g * d + c * 16, m, (__m256i)_mm512_cvtneps_pbh(r));
        }
    }
}

#define ZS_ATTEND(D, G)                                                                      \
    attend_row_impl(q, k_cache, v_cache, table, start, len, h, hkv, G, D, bs, scale, softcap, \
                    out, s, s_stride, part)

void zs_attend_row(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int32_t *table,
                   int64_t start, int64_t len, int64_t h, int64_t hkv, int64_t groups, int64_t d,
                   int64_t bs, float scale, float softcap, bf16 *out, float *s, int64_t s_stride,
                   const float *part) {
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

/* Row `pos` of KV head h of a sequence in a [blocks, hkv, bs, d] cache, through its table. */
static inline const bf16 *cache_row(const bf16 *cache, const int32_t *table, int64_t pos,
                                    int64_t h, int64_t hkv, int64_t bs, int64_t d) {
    return cache + (((int64_t)table[pos / bs] * hkv + h) * bs + pos % bs) * d;
}

/* That row widened to floats. */
static inline void row_floats(const bf16 *cache, const int32_t *table, int64_t pos, int64_t h,
                              int64_t hkv, int64_t bs, int64_t d, float *out) {
    const bf16 *row = cache_row(cache, table, pos, h, hkv, bs, d);
    for (int64_t j = 0; j < d; j++) out[j] = bf2f(row[j]);
}

void zs_attend_row(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int32_t *table,
                   int64_t start, int64_t len, int64_t h, int64_t hkv, int64_t groups, int64_t d,
                   int64_t bs, float scale, float softcap, bf16 *out, float *s, int64_t s_stride,
                   const float *part) {
    (void)part; /* the tiles for shared prefixes: AVX-512 builds only */
    const int64_t n = len - start;
    float qf[ZS_MAX_GROUP][ZS_MAX_HEAD_DIM];
    for (int64_t g = 0; g < groups; g++)
        for (int64_t j = 0; j < d; j++) qf[g][j] = bf2f(q[g * d + j]);
    float best[ZS_MAX_GROUP];
    for (int64_t g = 0; g < groups; g++) best[g] = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        float kf[ZS_MAX_HEAD_DIM];
        row_floats(k_cache, table, start + t, h, hkv, bs, d, kf);
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
        for (int64_t t = 0; t < n; t++) { /* bf16 weights, as the AVX-512 build's */
            sg[t] = round_bf(expf(sg[t] - best[g]));
            sum += sg[t];
        }
        inv[g] = 1.f / sum;
    }
    float acc[ZS_MAX_GROUP][ZS_MAX_HEAD_DIM];
    memset(acc, 0, sizeof(acc));
    for (int64_t t = 0; t < n; t++) {
        float vf[ZS_MAX_HEAD_DIM];
        row_floats(v_cache, table, start + t, h, hkv, bs, d, vf);
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
