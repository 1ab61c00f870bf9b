/*
 * A Llama-family model's decoder layers in one call (AVX-512 build: it runs on the
 * kernels' matmul): per layer the same kernels, in the same order, as the forward's
 * Python loop calls one at a time (native_llama._forward_kernels), so the results are
 * the same bit for bit; one call instead of ~9 per layer saves the Python and ctypes
 * around each (a few microseconds apiece, a tenth of a one-row decode step).
 * zs_decoder_logits, the entry point, wraps the layers in the forward's first and last
 * steps too (the embedding, the sampled rows' last residual add and norm, the LM head),
 * which cost a one-row step as much again from Python.
 */
#include "kernels.h"

#if ZS_AVX512

/* Mirrors cpu_decoder.LayerWeights. */
struct zs_layer {
    const bf16 *input_norm, *post_norm, *q_norm, *k_norm; /* q/k norms may be NULL */
    const bf16 *qkv, *o, *gate_up, *down;                  /* packed (zs_pack_linear) */
    const float *qkv_bias;                                 /* may be NULL */
    bf16 *k_cache, *v_cache;                               /* [blocks, hkv, bs, d] */
    int64_t window;                                        /* 0: full attention */
};

/* Mirrors cpu_decoder.ModelShape. */
struct zs_shape {
    int64_t layers, hidden, inter, hq, hkv, d, block_size;
    float eps, scale, softcap;
};

/* Mirrors cpu_decoder.StepRows: the step's rows, as the kernels' attention reads them. */
struct zs_rows {
    int64_t rows, table_stride, max_len;
    const int64_t *positions, *slots;
    const int32_t *tables, *row_table, *row_len;
    const bf16 *cos, *sin;
};

/* The kernels' attention over rows of the step: q [count, q_stride], row i reading the
 * keys of the step's row rt[i], rl[i] of them. */
static void attend(const struct zs_layer *l, const struct zs_shape *s, const struct zs_rows *r,
                   const bf16 *q, int64_t q_stride, const int32_t *rt, const int32_t *rl,
                   int64_t count, bf16 *out) {
    zs_paged_attention(q, q_stride, l->k_cache, l->v_cache, r->tables, r->table_stride, rt, rl,
                       count, s->hq, s->hkv, s->d, s->block_size, l->window, s->scale, s->softcap,
                       out, s->hq * s->d, r->max_len);
}

static inline void *align64(void *p) { return (void *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

/* h [rows, hidden]: the residual stream after the embedding, updated in place. Answers
 * the residual before the last layer's MLP, and leaves in `down` [rows, hidden] that
 * MLP's output (their sum, normed, is the last hidden state; the caller adds only the
 * rows it samples). With keep (m rows of the step, fewer than its rows), the last layer
 * writes every row's K and V but computes its attention, o and MLP for those rows only
 * (no later layer reads the others: a prompt chunk's rows but its last); the answer and
 * `down` then hold their rows 0..m-1. scratch: as zs_decoder_scratch counts it. */
static const bf16 *zs_decoder(const struct zs_layer *layers, const struct zs_shape *s,
                       const struct zs_rows *r, const int64_t *keep, int64_t m, bf16 *h,
                       bf16 *down, bf16 *scratch) {
    const int64_t n = r->rows, hid = s->hidden, qd = s->hq * s->d;
    const int64_t width = qd + 2 * s->hkv * s->d;
    bf16 *qkv = scratch, *attn = qkv + n * width, *x = attn + n * qd, *gated = x + n * hid;
    zs_rms_norm(h, hid, NULL, 0, layers[0].input_norm, x, hid, n, hid, s->eps);
    for (int64_t i = 0; i < s->layers; i++) {
        const struct zs_layer *l = &layers[i];
        zs_linear(x, hid, l->qkv, l->qkv_bias, n, width, hid, 0, qkv, width, 0);
        zs_rope_store(qkv, width, r->positions, r->cos, r->sin, n, s->hq, s->hkv, s->d, l->q_norm,
                      l->k_norm, s->eps, l->k_cache, l->v_cache, r->slots, s->block_size);
        int64_t rows = n;
        bf16 *res = h;
        if (keep && i + 1 == s->layers) {
            /* The kept rows' queries and residuals, gathered; they go on alone. */
            bf16 *q = align64(gated + n * s->inter);
            res = align64(q + m * qd);
            int32_t *rt = align64(res + m * hid), *rl = rt + m;
            for (int64_t j = 0; j < m; j++) {
                memcpy(q + j * qd, qkv + keep[j] * width, qd * sizeof(bf16));
                memcpy(res + j * hid, h + keep[j] * hid, hid * sizeof(bf16));
                rt[j] = r->row_table[keep[j]], rl[j] = r->row_len[keep[j]];
            }
            attend(l, s, r, q, qd, rt, rl, rows = m, attn);
        } else {
            attend(l, s, r, qkv, width, r->row_table, r->row_len, n, attn);
        }
        zs_linear(attn, qd, l->o, NULL, rows, hid, qd, 0, down, hid, 0); /* o, into down's room */
        zs_rms_norm(down, hid, res, hid, l->post_norm, x, hid, rows, hid, s->eps);
        zs_linear(x, hid, l->gate_up, NULL, rows, s->inter, hid, 1, gated, s->inter, 0);
        zs_linear(gated, s->inter, l->down, NULL, rows, hid, s->inter, 0, down, hid, 0);
        if (i + 1 < s->layers)
            zs_rms_norm(down, hid, h, hid, layers[i + 1].input_norm, x, hid, n, hid, s->eps);
        else
            return res;
    }
    return h;
}

/* The bf16 elements zs_decoder_logits's scratch holds for a step of n rows, m of them
 * sampled: the layers' n rows (qkv, attention, x, gated); where m < n, the last layer's
 * m queries and residuals and two int32 rows of metadata, each 64-byte aligned; the
 * head's 3 m rows (afterwards, from the start). */
int64_t zs_decoder_scratch(const struct zs_shape *s, int64_t n, int64_t m) {
    const int64_t qd = s->hq * s->d, width = qd + 2 * s->hkv * s->d, head = 3 * m * s->hidden;
    int64_t len = n * (width + qd + s->hidden + s->inter);
    if (m < n) len += m * (qd + s->hidden) + 2 * m * (int64_t)(sizeof(int32_t) / sizeof(bf16)) + 3 * 32;
    return len > head ? len : head;
}

/* Mirrors cpu_decoder.StepHead: the step's token ids and where its logits go. */
struct zs_head {
    const int64_t *ids;     /* [rows] */
    const bf16 *embed;      /* [embed_rows, hidden] */
    int64_t embed_rows;
    const int64_t *sample;  /* [m] rows that take logits */
    int64_t m, vocab;
    const bf16 *norm;       /* the final norm's weight */
    const bf16 *lm_head;    /* packed [vocab, hidden], no bias */
    float *logits;          /* [m, vocab] */
};

/* The whole forward of a step: h [rows, hidden] = embed[ids], the decoder layers, then
 * logits = lm_head(norm(h + down)) of the sampled rows, fp32 (the bf16 values). h and
 * down [rows, hidden]; scratch: zs_decoder_scratch(s, rows, m) bf16.
 * Answers 0; or, computing nothing, 1 + the first row whose id is not an embedding row,
 * or -(1 + j) for a sampled row j that is not a row of the step. */
int64_t zs_decoder_logits(const struct zs_layer *layers, const struct zs_shape *s,
                          const struct zs_rows *r, const struct zs_head *head, bf16 *h,
                          bf16 *down, bf16 *scratch) {
    const int64_t n = r->rows, hid = s->hidden;
    for (int64_t i = 0; i < n; i++)
        if (head->ids[i] < 0 || head->ids[i] >= head->embed_rows) return i + 1;
    for (int64_t j = 0; j < head->m; j++)
        if (head->sample[j] < 0 || head->sample[j] >= n) return -(j + 1);
    for (int64_t i = 0; i < n; i++)
        memcpy(h + i * hid, head->embed + head->ids[i] * hid, hid * sizeof(bf16));
    const int64_t m = head->m, kept = m < n;
    const bf16 *last = zs_decoder(layers, s, r, kept ? head->sample : NULL, m, h, down, scratch);
    bf16 *res = scratch, *mlp = res + m * hid, *x = mlp + m * hid;
    for (int64_t j = 0; j < m; j++) {
        const int64_t row = kept ? j : head->sample[j];
        memcpy(res + j * hid, last + row * hid, hid * sizeof(bf16));
        memcpy(mlp + j * hid, down + row * hid, hid * sizeof(bf16));
    }
    zs_rms_norm(mlp, hid, res, hid, head->norm, x, hid, m, hid, s->eps);
    zs_linear(x, hid, head->lm_head, NULL, m, head->vocab, hid, 0, head->logits, head->vocab, 1);
    return 0;
}
#endif
