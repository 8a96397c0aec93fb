/* Attention of a few new tokens per request over the KV cache, for CPU decode and verify steps.
 *
 * For token t = b * seq + s of request b and query head h (key/value head h / (heads / kv
 * heads)):   out[t, h] = sum_j p_j v[b, j],  p = softmax_j(scale * q[t, h] . k[b, j])
 * over the cache rows j < kv_len that the token may see: all of them, or those where
 * mask[b, s, j] is set, or with `causal` those up to its own position kv_len - seq + s. A token
 * that sees no row gets zeros. The cache is paged: position j of request b is row
 * block_tables[b, j / block_size] * block_size + j % block_size of the layer's pool
 * [num_blocks * block_size, kv heads, head_dim]. The cache is float32; q and out are bfloat16 (io_bf16) or
 * float32; scores, softmax and the weighted sum run in float32. It reads each key and value
 * row where it lies in the cache (no gathered copy) and needs no layout change of q: what
 * torch's SDPA costs at one query per request is mostly fixed overhead, plus the casts around
 * it (docs/benchmarks.md). One (token, head) per work item, taken as threads (thread_pool.c)
 * come free; each sums its rows in order, so its result depends on nothing else in the batch
 * (batch invariance). Built and loaded by verispec/ops/cpu_kernels.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    float r = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

/* acc += w * v over n floats */
static inline void axpy(float *acc, float w, const float *v, int64_t n) {
    __m256 wv = _mm256_set1_ps(w);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + i),
                                                  _mm256_loadu_ps(acc + i)));
    for (; i < n; i++) acc[i] += w * v[i];
}

/* The pool row of position j of a request whose block table is `table`. */
#define ROW(table, j, block_size) \
    ((int64_t)(table)[(j) / (block_size)] * (block_size) + (j) % (block_size))

struct attention_args {
    const void *q;
    int64_t q_token_stride;
    void *out;
    int io_bf16;
    const float *k_cache, *v_cache;
    const int32_t *block_tables;
    int64_t bt_stride, block_size, batch, seq, num_heads, num_kv_heads, head_dim, kv_len;
    const uint8_t *mask;
    int causal;
    float scale;
    float *scratch;
    size_t per_thread;
    _Atomic int64_t next; /* the next (token, head) item to take */
};

/* A thread's share: (token, head) items taken one at a time as the thread comes free. */
static void attention_part(void *arg, int thread, int num_threads) {
    struct attention_args *a = arg;
    (void)num_threads;
    const void *q = a->q;
    void *out = a->out;
    const int io_bf16 = a->io_bf16, causal = a->causal;
    const int64_t q_token_stride = a->q_token_stride, bt_stride = a->bt_stride;
    const int64_t block_size = a->block_size, seq = a->seq, num_heads = a->num_heads;
    const int64_t head_dim = a->head_dim, kv_len = a->kv_len;
    const int64_t items = a->batch * seq * num_heads, group = num_heads / a->num_kv_heads;
    const int64_t row_stride = a->num_kv_heads * head_dim; /* between cache rows */
    const float *k_cache = a->k_cache, *v_cache = a->v_cache, scale = a->scale;
    const int32_t *block_tables = a->block_tables;
    const uint8_t *mask = a->mask;
    float *p = a->scratch + a->per_thread * (size_t)thread;
    for (int64_t item;
         (item = atomic_fetch_add_explicit(&a->next, 1, memory_order_relaxed)) < items;) {
        float *qf = p + kv_len, *acc = qf + head_dim;
        int64_t t = item / num_heads, h = item % num_heads;
        int64_t b = t / seq, s = t % seq;
        int64_t g = h / group;
        const float *keys = k_cache + g * head_dim;
        const float *values = v_cache + g * head_dim;
        const int32_t *table = block_tables + b * bt_stride;
        const uint8_t *visible = mask ? mask + (b * seq + s) * kv_len : NULL;
        int64_t last = causal ? kv_len - seq + s : kv_len - 1; /* the last row it may see */
        int64_t q_at = t * q_token_stride + h * head_dim;
        for (int64_t i = 0; i < head_dim; i++)
            qf[i] = io_bf16 ? widen1(((const uint16_t *)q)[q_at + i])
                            : ((const float *)q)[q_at + i];
        float m = -INFINITY;
        for (int64_t j = 0; j <= last; j++) {
            p[j] = (visible && !visible[j])
                       ? -INFINITY
                       : scale * dot(qf, keys + ROW(table, j, block_size) * row_stride, head_dim);
            if (p[j] > m) m = p[j];
        }
        memset(acc, 0, sizeof(float) * (size_t)head_dim);
        if (m != -INFINITY) {
            float sum = 0.0f;
            for (int64_t j = 0; j <= last; j++) {
                p[j] = expf(p[j] - m);
                sum += p[j];
            }
            for (int64_t j = 0; j <= last; j++)
                if (p[j] != 0.0f)
                    axpy(acc, p[j], values + ROW(table, j, block_size) * row_stride, head_dim);
            float inv = 1.0f / sum;
            for (int64_t i = 0; i < head_dim; i++) acc[i] *= inv;
        }
        int64_t out_at = t * num_heads * head_dim + h * head_dim;
        for (int64_t i = 0; i < head_dim; i++) {
            if (io_bf16)
                ((uint16_t *)out)[out_at + i] = round_bf16(acc[i]);
            else
                ((float *)out)[out_at + i] = acc[i];
        }
    }
}

/* Returns 0, or -1 when scratch memory cannot be allocated. num_threads >= 1. Threads:
 * thread_pool.c, as quant_linear.c's (a decode step runs no OpenMP region). */
int cache_attention(const void *q, int64_t q_token_stride, void *out, int io_bf16,
                    const float *k_cache, const float *v_cache, const int32_t *block_tables,
                    int64_t bt_stride, int64_t block_size, int64_t batch, int64_t seq,
                    int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t kv_len,
                    const uint8_t *mask, int causal, float scale, int num_threads) {
    size_t per_thread = (size_t)(kv_len + 2 * head_dim + 16);
    float *scratch = malloc(sizeof(float) * per_thread * (size_t)num_threads);
    if (scratch == NULL) return -1;
    struct attention_args a = {q, q_token_stride, out, io_bf16, k_cache, v_cache, block_tables,
                               bt_stride, block_size, batch, seq, num_heads, num_kv_heads,
                               head_dim, kv_len, mask, causal, scale, scratch, per_thread, 0};
    pool_run(attention_part, &a, num_threads);
    free(scratch);
    return 0;
}
