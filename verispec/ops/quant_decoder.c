/* Decoder layers of a GGUF-quantised Llama-family model on the CPU in one call
 * (verispec/ops/cpu_decoder.py), for the padded CPU forward of models/llama.py.
 *
 * A layer, for the T = batch * seq tokens of a step (x [T, H] float32, the residual stream,
 * updated in place):
 *
 *     h = rms_norm(x);  qkv = h @ Wqkv.T;  rotate q and k (RoPE);  write k, v to the cache;
 *     a = attention(q, cache);  x += a @ Wo.T;
 *     h = rms_norm(x);  [g | u] = h @ Wgu.T;  x += (silu(g) * u) @ Wdown.T
 *
 * with the same kernels the per-op path calls (rms_norm.c, quant_linear.c, attention.c), so
 * every matmul, norm and attention row is computed in the order those kernels fix (batch
 * invariance, docs/design.md §12). RoPE is fma(swapped(x), signed_sin, x * cos), as torch's
 * addcmul in ops.model_ops.apply_rope computes it; silu * up is elementwise.c's, which the
 * per-op path calls too: the two paths give the same bits.
 *
 * Why: a decode step of the bundled 30-layer model is ~700 small torch ops and ~200 kernel
 * calls from Python, ~10 ms of host work beside ~12 ms of kernels on a 2-core Xeon; here it is
 * one call (docs/benchmarks.md, "GGUF quantised weights on the CPU"). No library offers a
 * fused CPU decoder layer over these block layouts, hence this file. Elementwise work runs on
 * the calling thread for a few rows and over thread_pool.c's threads for many (a prefill):
 * what a row computes never depends on the thread that takes it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

void rms_norm(const void *x, const void *w, void *y, int bf16, int64_t m_size, int64_t n,
              float eps, int num_threads);
void quant_linear(const float *x, const void *qs, const void *so, const float *bias, float *y,
                  int64_t M, int64_t N, int64_t K, int bits, int64_t group, int num_threads,
                  int half);
void silu_mul(const float *gu, int64_t ld, float *out, int64_t rows, int64_t n,
              int num_threads);
int cache_attention(const void *q, int64_t q_token_stride, void *out, int io_bf16,
                    const float *k_cache, const float *v_cache, const int32_t *block_tables,
                    int64_t bt_stride, int64_t block_size, int64_t batch, int64_t seq,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t kv_len,
                    const uint8_t *mask, int causal, float scale, int num_threads);

/* A quantised weight in quant_linear.c's layout: y [M, n_padded] = x [M, k] @ w.T (+ bias). */
struct qweight {
    const void *qs, *scales;
    const float *bias; /* [n_padded] or NULL */
    int64_t n_padded, k, group, bits, half;
};

struct layer {
    struct qweight qkv, o, gate_up, down;
    const float *input_norm, *post_norm; /* [H] */
};

/* What every layer of one forward shares (models/layout.py AttentionMetadata). */
struct step {
    int64_t batch, seq, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    const float *cos, *sin;         /* [T, head_dim]; sin signed ([-sin, sin]) */
    const int64_t *slot_mapping;    /* [num_valid] cache row of each valid token */
    const int64_t *valid_index;     /* [num_valid] into [0, T), or NULL: every token */
    int64_t num_valid;
    const int32_t *block_tables;    /* [batch, bt_stride] */
    int64_t bt_stride, block_size, kv_len;
    const uint8_t *mask;            /* [batch, 1, seq, kv_len] or NULL */
    int64_t causal, num_threads;
    float scale, eps;
};

/* Rows [0, rows) of an elementwise job, ROWS_PER_ITEM at a time over the pool's threads. */
#define ROWS_PER_ITEM 16
#define SERIAL_ELEMENTS 32768 /* below this, the calling thread alone */

struct rows_job {
    void (*row)(const struct rows_job *job, int64_t r);
    int64_t rows;
    /* the job's operands */
    float *a;
    const float *b, *cos, *sin;
    int64_t lda, ldb, n, heads, head_dim;
};

static void rows_item(void *arg, int64_t item) {
    const struct rows_job *job = arg;
    const int64_t start = item * ROWS_PER_ITEM;
    const int64_t end = start + ROWS_PER_ITEM < job->rows ? start + ROWS_PER_ITEM : job->rows;
    for (int64_t r = start; r < end; r++) job->row(job, r);
}

static void run_rows(struct rows_job *job, int64_t elements, int num_threads) {
    pool_for(rows_item, job, (job->rows + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM,
             elements < SERIAL_ELEMENTS ? 1 : num_threads);
}

/* RoPE of row r's q and k heads (a[r, 0 : heads * head_dim]) in place. */
static void rope_row(const struct rows_job *j, int64_t r) {
    const int64_t d = j->head_dim, half = d / 2;
    const float *c = j->cos + r * d, *s = j->sin + r * d;
    float tmp[512];
    for (int64_t h = 0; h < j->heads; h++) {
        float *v = j->a + r * j->lda + h * d;
        memcpy(tmp, v, sizeof(float) * (size_t)d);
        for (int64_t i = 0; i < d; i++)  /* torch.addcmul(x * cos, swapped, sin): one FMA */
            v[i] = fmaf(i < half ? tmp[i + half] : tmp[i - half], s[i], tmp[i] * c[i]);
    }
}

/* a[r, :n] += b[r, :n] */
static void add_row(const struct rows_job *j, int64_t r) {
    float *a = j->a + r * j->lda;
    const float *b = j->b + r * j->ldb;
    for (int64_t i = 0; i < j->n; i++) a[i] += b[i];
}

static void linear(const struct qweight *w, const float *x, float *y, int64_t rows,
                   int num_threads) {
    quant_linear(x, w->qs, w->scales, w->bias, y, rows, w->n_padded, w->k, (int)w->bits,
                 w->group, num_threads, (int)w->half);
}

/* The widths of decoder_layers' three scratch buffers: the widest matmul output (qkv, gate |
 * up), the widest matmul input (normed x, attention output, silu(g) * u), the widest
 * projection output (o, down). */
static void scratch_widths(const struct layer *layers, int64_t num_layers, int64_t hidden,
                           int64_t q_size, int64_t intermediate, int64_t widths[3]) {
    widths[0] = 0;
    widths[1] = q_size > hidden ? q_size : hidden;
    if (widths[1] < intermediate) widths[1] = intermediate;
    widths[2] = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const struct layer *L = &layers[l];
        if (L->qkv.n_padded > widths[0]) widths[0] = L->qkv.n_padded;
        if (L->gate_up.n_padded > widths[0]) widths[0] = L->gate_up.n_padded;
        if (L->o.n_padded > widths[2]) widths[2] = L->o.n_padded;
        if (L->down.n_padded > widths[2]) widths[2] = L->down.n_padded;
    }
}

/* The floats of decoder_layers' scratch for `tokens` tokens. */
int64_t decoder_scratch_floats(const struct layer *layers, int64_t num_layers, int64_t tokens,
                               int64_t hidden, int64_t q_size, int64_t intermediate) {
    int64_t w[3];
    scratch_widths(layers, num_layers, hidden, q_size, intermediate, w);
    return tokens * (w[0] + w[1] + w[2]);
}

/* Layers [0, num_layers) over x [T, H] in place. k_caches / v_caches: each layer's float32
 * pool [rows, kv heads, head_dim]. scratch: decoder_scratch_floats(...) floats. captures: NULL,
 * or per layer NULL or [T, H] floats that receive the stream entering the layer (an EAGLE-3
 * head's inputs), so a forward that keeps some is still one call. Returns 0, or -1 when
 * attention's scratch memory cannot be allocated. */
int decoder_layers(const struct layer *layers, int64_t num_layers, float *const *k_caches,
                   float *const *v_caches, const struct step *s, float *x, float *scratch,
                   float *const *captures) {
    const int64_t T = s->batch * s->seq, H = s->hidden, d = s->head_dim;
    const int64_t q_size = s->num_heads * d, kv_size = s->num_kv_heads * d;
    const int nt = (int)s->num_threads;
    int64_t w[3];
    scratch_widths(layers, num_layers, H, q_size, s->intermediate, w);
    float *A = scratch, *B = A + T * w[0], *C = B + T * w[1];
    for (int64_t l = 0; l < num_layers; l++) {
        const struct layer *L = &layers[l];
        float *k_cache = k_caches[l], *v_cache = v_caches[l];
        const int64_t lq = L->qkv.n_padded;
        if (captures && captures[l]) memcpy(captures[l], x, sizeof(float) * (size_t)(T * H));
        /* attention block */
        rms_norm(x, L->input_norm, B, 0, T, H, s->eps, nt);
        linear(&L->qkv, B, A, T, nt);
        struct rows_job rope = {.row = rope_row, .rows = T, .a = A, .cos = s->cos,
                                .sin = s->sin, .lda = lq,
                                .heads = s->num_heads + s->num_kv_heads, .head_dim = d};
        run_rows(&rope, T * (q_size + kv_size), nt);
        for (int64_t i = 0; i < s->num_valid; i++) {
            int64_t t = s->valid_index ? s->valid_index[i] : i;
            int64_t row = s->slot_mapping[i] * kv_size;
            memcpy(k_cache + row, A + t * lq + q_size, sizeof(float) * (size_t)kv_size);
            memcpy(v_cache + row, A + t * lq + q_size + kv_size,
                   sizeof(float) * (size_t)kv_size);
        }
        if (cache_attention(A, lq, B, 0, k_cache, v_cache, s->block_tables, s->bt_stride,
                            s->block_size, s->batch, s->seq, s->num_heads, s->num_kv_heads, d,
                            s->kv_len, s->mask, (int)s->causal, s->scale, nt) != 0)
            return -1;
        linear(&L->o, B, C, T, nt);
        struct rows_job add = {.row = add_row, .rows = T, .a = x, .b = C, .lda = H,
                               .ldb = L->o.n_padded, .n = H};
        run_rows(&add, T * H, nt);
        /* MLP block */
        rms_norm(x, L->post_norm, B, 0, T, H, s->eps, nt);
        linear(&L->gate_up, B, A, T, nt);
        silu_mul(A, L->gate_up.n_padded, B, T, s->intermediate, nt);
        linear(&L->down, B, C, T, nt);
        add.ldb = L->down.n_padded;
        run_rows(&add, T * H, nt);
    }
    return 0;
}
