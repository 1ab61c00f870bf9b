/*
 * Paged attention, one query token per row, decode and prefill alike: row n attends
 * to the first row_len[n] positions of the sequence whose block table is
 * tables[row_table[n]] (bottom-right causal: the row's own position is
 * row_len[n] - 1), the last `window` of them when window > 0. Each (row, KV head) item
 * walks its keys (row_walk.c); runs of rows of one sequence, and the prefixes that rows
 * share, take the tiles (tiled_attention.c).
 */
#include "kernels.h"

int zs_tiled_attention_ready(int64_t hq, int64_t hkv, int64_t d, int64_t block_size);

/* The first key row n walks (a sliding window starts late; a shared prefix is done). */
static inline int64_t item_start(const struct zs_attention_job *j, int64_t n, int64_t len) {
    if (j->shared && j->shared[n]) return j->shared[n];
    return zs_first_key(len, j->window);
}

/* Items are (row, KV head) pairs. Each item's rows fetch their own next blocks: fetching
 * the whole next item as well, ahead, cost 10 % with K/V in L3 and gained nothing with
 * them in DRAM (BENCHMARKS.md §2). */
static void attention_items(const void *job, int64_t begin, int64_t end) {
    const struct zs_attention_job *j = job;
    const int64_t hkv = j->hkv, groups = j->hq / hkv, d = j->d;
    float *s = zs_scratch(sizeof(float) * ZS_PAD_GROUPS(groups) * j->s_stride);
    for (int64_t item = begin; item < end; item++) {
        const int64_t n = j->walk ? j->walk[item / hkv] : item / hkv, h = item % hkv;
        const int64_t len = j->row_len[n];
        const int64_t start = item_start(j, n, len);
        const float *part = j->shared && j->shared[n] ? j->partial + (n * j->hq + h * groups) * (d + 2) : NULL;
        zs_attend_row(j->q + n * j->q_stride + h * groups * d, j->k_cache, j->v_cache,
                      j->tables + (int64_t)j->row_table[n] * j->table_stride, start, len, h, hkv,
                      groups, d, j->block_size, j->scale, j->softcap,
                      j->out + n * j->out_stride + h * groups * d, s, j->s_stride, part);
    }
}

#if ZS_AVX512
static int by_first_block(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Adds the tiled work items of `count` rows (ZS_TILE_ROWS at most each), one per KV head. */
static struct zs_tile_item *add_items(struct zs_tile_item *it, const int32_t *rows, int64_t count,
                                      int64_t hkv, int64_t table, int64_t shared) {
    for (int64_t a = 0; a < count; a += ZS_TILE_ROWS)
        for (int64_t h = 0; h < hkv; h++, it++) {
            it->rows = rows + a;
            it->count = count - a < ZS_TILE_ROWS ? count - a : ZS_TILE_ROWS;
            it->h = h, it->table = table, it->shared = shared;
        }
    return it;
}

/* zs_paged_attention on an AVX-512 CPU: runs of ZS_TILED_MIN_ROWS or more rows of one table
 * (prompt chunks) on tiles; of the other rows, those whose tables start with the same
 * blocks (a cached prefix: the prefix cache shares a block only by its content) attend
 * to those blocks together on tiles, as many rows a tile as its 16 columns hold, then
 * walk only their own keys and merge the two. Not with a sliding window (it moves with
 * each row). */
static void tiled_then_walked(struct zs_attention_job *j, int64_t rows) {
    const int64_t hkv = j->hkv, bs = j->block_size, stride = j->table_stride;
    int32_t *lists = malloc(sizeof(int32_t) * (size_t)rows * 3), *walk = lists + rows;
    int32_t *grouped = walk + rows, *shared = calloc((size_t)rows, sizeof(int32_t));
    uint64_t *keyed = malloc(sizeof(uint64_t) * (size_t)rows);
    struct zs_tile_item *items = malloc(sizeof(*items) * (size_t)(rows + 1) * (size_t)hkv);
    if (!lists || !shared || !keyed || !items) abort();
    struct zs_tile_item *it = items;
    int64_t walked = 0, in_groups = 0;
    for (int64_t n = 0; n < rows; n++) lists[n] = (int32_t)n;
    for (int64_t a = 0, b; a < rows; a = b) {
        for (b = a + 1; b < rows && j->row_table[b] == j->row_table[a];) b++;
        if (b - a >= ZS_TILED_MIN_ROWS) it = add_items(it, lists + a, b - a, hkv, j->row_table[a], 0);
        else
            for (int64_t n = a; n < b; n++) walk[walked++] = (int32_t)n;
    }
    /* With a sliding window no two rows attend to the same keys: nothing is shared. */
    if (j->window <= 0) {
        for (int64_t i = 0; i < walked; i++) {
            const int32_t *t = j->tables + (int64_t)j->row_table[walk[i]] * stride;
            keyed[i] = (uint64_t)(uint32_t)t[0] << 32 | (uint32_t)walk[i];
        }
        qsort(keyed, (size_t)walked, sizeof(uint64_t), by_first_block);
        for (int64_t a = 0, b; a < walked; a = b) {
            for (b = a + 1; b < walked && keyed[b] >> 32 == keyed[a] >> 32;) b++;
            if (b - a < 2) continue;
            /* The leading blocks all of them share, each before its row's own last block. */
            const int32_t *t0 = j->tables + (int64_t)j->row_table[(int32_t)keyed[a]] * stride;
            int64_t m = INT64_MAX;
            for (int64_t i = a; i < b; i++) {
                const int32_t n = (int32_t)keyed[i], *t = j->tables + (int64_t)j->row_table[n] * stride;
                const int64_t own = (j->row_len[n] - 1) / bs;
                int64_t k = 0;
                while (k < own && k < m && t[k] == t0[k]) k++;
                m = k;
            }
            if (m * bs < ZS_SHARED_MIN_KEYS) continue;
            int32_t *group = grouped + in_groups;
            for (int64_t i = a; i < b; i++) {
                group[i - a] = (int32_t)keyed[i];
                shared[(int32_t)keyed[i]] = (int32_t)(m * bs);
            }
            it = add_items(it, group, b - a, hkv, j->row_table[group[0]], m * bs);
            in_groups += b - a;
        }
    }
    if (in_groups && !(j->partial = malloc(sizeof(float) * (size_t)(rows * j->hq * (j->d + 2)))))
        abort();
    j->shared = in_groups ? shared : NULL;
    if (it > items) zs_tiled_attention(j, items, it - items);
    j->walk = walk;
    if (walked) zs_parallel(walked * hkv, 4, 1, attention_items, j);
    free(j->partial);
    free(items);
    free(keyed);
    free(shared);
    free(lists);
    zs_amx_release(); /* as zs_linear: the caller's tiles go back */
}
#endif

void zs_paged_attention(const bf16 *q, int64_t q_stride, const bf16 *k_cache,
                        const bf16 *v_cache, const int32_t *tables, int64_t table_stride,
                        const int32_t *row_table, const int32_t *row_len, int64_t rows,
                        int64_t hq, int64_t hkv, int64_t d, int64_t block_size, int64_t window,
                        float scale, float softcap, bf16 *out, int64_t out_stride,
                        int64_t max_len) {
    /* Score rows padded to 16 floats (the vector width) per query head. */
    struct zs_attention_job j = {q, q_stride, k_cache, v_cache, tables, table_stride,
                                 row_table, row_len, hq, hkv, d, block_size, window,
                                 scale, softcap, out, out_stride, (max_len + 15) / 16 * 16,
                                 NULL, NULL, NULL};
#if ZS_AVX512
    /* Runs of rows of one sequence (prompt chunks) take the tiles, and so do the
     * prefixes that several walked rows share (cached prompts); the rest walk. */
    if (rows > 1 && zs_tiled_attention_ready(hq, hkv, d, block_size)) {
        tiled_then_walked(&j, rows);
        return;
    }
#endif
    zs_parallel(rows * hkv, 4, 1, attention_items, &j);
}

static int tiled_enabled = 1;

/* Turns the tiles for prompt chunks on or off (the tests compare them with the row
 * walks); answers whether they were on. */
int zs_tiled_attention_enable(int on) {
    const int was = tiled_enabled;
    tiled_enabled = on;
    return was;
}

/* Whether zs_paged_attention takes the tiles for prompt chunks of this shape. */
int zs_tiled_attention_ready(int64_t hq, int64_t hkv, int64_t d, int64_t block_size) {
#if ZS_AVX512
    return tiled_enabled && zs_tiled_attention_fits(hq, hkv, d, block_size);
#else
    (void)hq, (void)hkv, (void)d, (void)block_size;
    return 0;
#endif
}
