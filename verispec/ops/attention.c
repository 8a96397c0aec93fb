/* Attention of new tokens over the KV cache on CPU: decode and verify steps, and (in batch
 * invariant mode, where every step must sum a token's rows alike) prefills.
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
 * it (docs/benchmarks.md). One (tile of up to TOKEN_TILE consecutive tokens of a request, kv
 * head) per work item, taken as threads (thread_pool.c) come free; each (token, query head)
 * sums its rows in order, so its result depends on nothing else in the batch or the tile (batch
 * invariance). The tokens and heads of an item share each key and value row's loads (a 1 750-token
 * prefill layer of the bundled model: 45 -> 37.5 ms with tiles of 8, the rows no longer
 * streamed from memory once per token), four dot products run interleaved and the weighted sum
 * keeps its accumulators in registers across a block's rows: the same operations per
 * (token, head) as one dot and one axpy per row. The softmax numerators run eight rows at a time (exp8, a value's result
 * independent of its lane); their sum runs in row order. Built by
 * verispec/ops/cpu_build.py.
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

/* The unreduced sums of dot() over the first n / 16 * 16 features, four rows: sums[r] holds
 * the eight lanes whose hsum starts dot(a, b[r]). Four independent chains interleaved, where
 * one dot alone waits on its own additions. */
static inline void dot4_lanes(const float *a, const float *const b[4], int64_t n,
                              __m256 sums[4]) {
    __m256 x[4], y[4];
    for (int r = 0; r < 4; r++) x[r] = y[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        __m256 a0 = _mm256_loadu_ps(a + i), a1 = _mm256_loadu_ps(a + i + 8);
        for (int r = 0; r < 4; r++) {
            x[r] = _mm256_fmadd_ps(a0, _mm256_loadu_ps(b[r] + i), x[r]);
            y[r] = _mm256_fmadd_ps(a1, _mm256_loadu_ps(b[r] + i + 8), y[r]);
        }
    }
    for (int r = 0; r < 4; r++) sums[r] = _mm256_add_ps(x[r], y[r]);
}

/* out[r] = dot(a, b[r]) for four rows, each summed exactly as dot() sums it. */
static inline void dot4(const float *a, const float *const b[4], int64_t n, float out[4]) {
    __m256 sums[4];
    dot4_lanes(a, b, n, sums);
    for (int r = 0; r < 4; r++) {
        float s = hsum(sums[r]);
        for (int64_t k = n / 16 * 16; k < n; k++) s += a[k] * b[r][k];
        out[r] = s;
    }
}

/* hsum() of eight vectors at once, lane r of the result hsum(v[r]): the same additions in the
 * same order (lanes i + (i + 4), then (0 + 2) and (1 + 3), then the two), done for pairs of
 * vectors side by side instead of one vector's lanes in turn. */
static inline __m256 hsum8(const __m256 v[8]) {
    __m256 u[4];
    for (int k = 0; k < 4; k++)  /* [v[2k].lo + v[2k].hi, v[2k+1].lo + v[2k+1].hi] */
        u[k] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x31));
    /* per 128-bit half: [s0 + s2, s1 + s3] of two vectors */
    __m256 w0 = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 w1 = _mm256_add_ps(_mm256_shuffle_ps(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
    /* low half: vectors 0, 2, 4, 6; high half: 1, 3, 5, 7 */
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* acc += w[r] * v[r * stride] for rows r = 0 .. rows - 1 in order, skipping w[r] == 0: what
 * `rows` calls of acc += w * v would give (an FMA per element where a vector covers it, a
 * product then a sum in the tail), with the accumulators held in registers across the rows. */
static inline void axpy_rows(float *acc, const float *w, const float *v, int64_t stride,
                             int64_t rows, int64_t n) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m256 s[8];
        for (int u = 0; u < 8; u++) s[u] = _mm256_loadu_ps(acc + i + 8 * u);
        for (int64_t r = 0; r < rows; r++) {
            if (w[r] == 0.0f) continue;
            __m256 wv = _mm256_set1_ps(w[r]);
            const float *row = v + r * stride + i;
            for (int u = 0; u < 8; u++)
                s[u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(row + 8 * u), s[u]);
        }
        for (int u = 0; u < 8; u++) _mm256_storeu_ps(acc + i + 8 * u, s[u]);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 s = _mm256_loadu_ps(acc + i);
        for (int64_t r = 0; r < rows; r++)
            if (w[r] != 0.0f)
                s = _mm256_fmadd_ps(_mm256_set1_ps(w[r]), _mm256_loadu_ps(v + r * stride + i), s);
        _mm256_storeu_ps(acc + i, s);
    }
    for (; i < n; i++)
        for (int64_t r = 0; r < rows; r++)
            if (w[r] != 0.0f) acc[i] += w[r] * v[r * stride + i];
}

/* exp(x) for eight x <= 0 (softmax numerators), -inf and anything below expf's normal range
 * giving 0: 2^n * e^r with n = round(x / ln 2), r = x - n ln 2 in two parts, e^r by a degree-7
 * polynomial (within ~2 ulp of expf). One FMA sequence per lane, so a score's numerator does
 * not depend on the lane or the row count it comes with; ~10x faster than libm's expf a value,
 * which took over a quarter of a 1 750-token prefill. */
static inline __m256 exp8(__m256 x) {
    const __m256 underflow = _mm256_set1_ps(-87.33654f);
    __m256 zero = _mm256_cmp_ps(x, underflow, _CMP_LT_OQ);
    x = _mm256_max_ps(x, underflow);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                  23);
    return _mm256_andnot_ps(zero, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

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
    _Atomic int64_t next; /* the next (tile of tokens, kv head) item to take */
};

/* Consecutive tokens of a request that one item computes: they share each key and value row's
 * loads (a prefill's rows are read from memory once per tile rather than once per token). */
#define TOKEN_TILE 8

/* A thread's share: (tile of tokens, kv head) items taken one at a time as the thread comes
 * free. An item computes the `group` query heads that share the kv head, for each token of the
 * tile, each (token, head) exactly as it would alone (its own dot products, max, exponentials,
 * sum and weighted sum, over its rows j in order): they only share the loads of each key and
 * value row, and the walk over the block table (a block at a time, no division per row). */
static void attention_part(void *arg, int thread, int num_threads) {
    struct attention_args *a = arg;
    (void)num_threads;
    const void *q = a->q;
    void *out = a->out;
    const int io_bf16 = a->io_bf16, causal = a->causal;
    const int64_t q_token_stride = a->q_token_stride, bt_stride = a->bt_stride;
    const int64_t block_size = a->block_size, seq = a->seq, num_heads = a->num_heads;
    const int64_t num_kv_heads = a->num_kv_heads, head_dim = a->head_dim, kv_len = a->kv_len;
    const int64_t tile = seq < TOKEN_TILE ? seq : TOKEN_TILE, tiles = (seq + tile - 1) / tile;
    const int64_t items = a->batch * tiles * num_kv_heads, group = num_heads / num_kv_heads;
    const int64_t row_stride = num_kv_heads * head_dim; /* between cache rows */
    const float scale = a->scale;
    const int32_t *block_tables = a->block_tables;
    const uint8_t *mask = a->mask;
    /* per (token, head) of the item: kv_len scores (room for a multiple of 8), q, the
     * accumulator (head_dim each), 1 / sum */
    const int64_t room = (kv_len + 7) / 8 * 8, per_head = room + 2 * head_dim + 1;
    float *scratch = a->scratch + a->per_thread * (size_t)thread;
    for (int64_t item;
         (item = atomic_fetch_add_explicit(&a->next, 1, memory_order_relaxed)) < items;) {
        int64_t bt = item / num_kv_heads, g = item % num_kv_heads;
        int64_t b = bt / tiles, s0 = bt % tiles * tile;
        int64_t count = seq - s0 < tile ? seq - s0 : tile; /* tokens s0 .. s0 + count - 1 */
        const float *keys = a->k_cache + g * head_dim;
        const float *values = a->v_cache + g * head_dim;
        const int32_t *table = block_tables + b * bt_stride;
        int64_t rows_of[TOKEN_TILE], most = 0; /* rows each token may see */
        for (int64_t u = 0; u < count; u++) {
            int64_t t = b * seq + s0 + u;
            rows_of[u] = (causal ? kv_len - seq + s0 + u : kv_len - 1) + 1;
            if (rows_of[u] > most) most = rows_of[u];
            for (int64_t hh = 0; hh < group; hh++) {
                float *qf = scratch + (u * group + hh) * per_head + room;
                int64_t q_at = t * q_token_stride + (g * group + hh) * head_dim;
                for (int64_t i = 0; i < head_dim; i++)
                    qf[i] = io_bf16 ? widen1(((const uint16_t *)q)[q_at + i])
                                    : ((const float *)q)[q_at + i];
            }
        }
        /* scores, a block of the table at a time, four rows at once */
        for (int64_t j0 = 0; j0 < most; j0 += block_size) {
            const float *k_block = keys + (int64_t)table[j0 / block_size] * block_size
                                              * row_stride;
            for (int64_t u = 0; u < count; u++) {
                int64_t n = rows_of[u] - j0 < block_size ? rows_of[u] - j0 : block_size;
                if (n <= 0) continue;
                const uint8_t *visible = mask ? mask + (b * seq + s0 + u) * kv_len : NULL;
                for (int64_t hh = 0; hh < group; hh++) {
                    float *p = scratch + (u * group + hh) * per_head + j0;
                    const float *qf = scratch + (u * group + hh) * per_head + room;
                    int64_t r = 0;
                    if (head_dim % 16 == 0) /* eight rows: their sums reduced side by side */
                        for (; r + 8 <= n; r += 8) {
                            __m256 sums[8];
                            for (int h = 0; h < 2; h++) {
                                const float *kr[4];
                                for (int w = 0; w < 4; w++)
                                    kr[w] = k_block + (r + 4 * h + w) * row_stride;
                                dot4_lanes(qf, kr, head_dim, sums + 4 * h);
                            }
                            _mm256_storeu_ps(p + r, _mm256_mul_ps(_mm256_set1_ps(scale),
                                                                  hsum8(sums)));
                        }
                    for (; r + 4 <= n; r += 4) {
                        const float *kr[4] = {k_block + r * row_stride,
                                              k_block + (r + 1) * row_stride,
                                              k_block + (r + 2) * row_stride,
                                              k_block + (r + 3) * row_stride};
                        float d[4];
                        dot4(qf, kr, head_dim, d);
                        for (int w = 0; w < 4; w++) p[r + w] = scale * d[w];
                    }
                    for (; r < n; r++) p[r] = scale * dot(qf, k_block + r * row_stride, head_dim);
                    if (visible)
                        for (r = 0; r < n; r++)
                            if (!visible[j0 + r]) p[r] = -INFINITY;
                }
            }
        }
        /* softmax numerators; 1 / sum, or 0 for a head that sees no row (zeros out) */
        for (int64_t u = 0; u < count; u++) {
            const int64_t rows = rows_of[u];
            for (int64_t hh = 0; hh < group; hh++) {
                float *p = scratch + (u * group + hh) * per_head, *acc = p + room + head_dim;
                int64_t rows8 = (rows + 7) / 8 * 8;
                for (int64_t j = rows; j < rows8; j++) p[j] = -INFINITY; /* exp8 gives 0 */
                __m256 mv = _mm256_set1_ps(-INFINITY);
                for (int64_t j = 0; j < rows8; j += 8)
                    mv = _mm256_max_ps(mv, _mm256_loadu_ps(p + j));
                __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
                m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
                float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
                memset(acc, 0, sizeof(float) * (size_t)head_dim);
                if (m == -INFINITY) {
                    for (int64_t j = 0; j < rows; j++) p[j] = 0.0f;
                    acc[head_dim] = 0.0f;
                    continue;
                }
                mv = _mm256_set1_ps(m);
                for (int64_t j = 0; j < rows8; j += 8)
                    _mm256_storeu_ps(p + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv)));
                acc[head_dim] = 1.0f; /* a head that sees rows: 1 / sum below */
            }
            /* each head's sum in row order (a masked row adds an exact 0, so a tree token sums
             * what the chain holding its path sums, in the same order), four heads' independent
             * sums interleaved */
            for (int64_t h0 = 0; h0 < group; h0 += 4) {
                const int64_t nh = group - h0 < 4 ? group - h0 : 4;
                const float *ph[4];
                float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (int64_t w = 0; w < 4; w++)
                    ph[w] = scratch + (u * group + h0 + (w < nh ? w : 0)) * per_head;
                for (int64_t j = 0; j < rows; j++)
                    for (int w = 0; w < 4; w++) sum[w] += ph[w][j];
                for (int64_t w = 0; w < nh; w++) {
                    float *inv = scratch + (u * group + h0 + w) * per_head + room + 2 * head_dim;
                    if (*inv != 0.0f) *inv = 1.0f / sum[w];
                }
            }
        }
        /* weighted sums of the value rows, in order */
        for (int64_t j0 = 0; j0 < most; j0 += block_size) {
            const float *v_block = values + (int64_t)table[j0 / block_size] * block_size
                                                * row_stride;
            for (int64_t u = 0; u < count; u++) {
                int64_t n = rows_of[u] - j0 < block_size ? rows_of[u] - j0 : block_size;
                if (n <= 0) continue;
                for (int64_t hh = 0; hh < group; hh++) {
                    float *p = scratch + (u * group + hh) * per_head;
                    axpy_rows(p + room + head_dim, p + j0, v_block, row_stride, n, head_dim);
                }
            }
        }
        for (int64_t u = 0; u < count; u++) {
            int64_t t = b * seq + s0 + u;
            for (int64_t hh = 0; hh < group; hh++) {
                const float *acc = scratch + (u * group + hh) * per_head + room + head_dim;
                float inv = acc[head_dim];
                int64_t out_at = t * num_heads * head_dim + (g * group + hh) * head_dim;
                for (int64_t i = 0; i < head_dim; i++) {
                    float o = acc[i] * inv;
                    if (io_bf16)
                        ((uint16_t *)out)[out_at + i] = round_bf16(o);
                    else
                        ((float *)out)[out_at + i] = o;
                }
            }
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
    int64_t tile = seq < TOKEN_TILE ? seq : TOKEN_TILE;
    size_t per_thread = (size_t)(((kv_len + 7) / 8 * 8 + 2 * head_dim + 1)
                                 * (num_heads / num_kv_heads) * tile + 16);
    float *scratch = malloc(sizeof(float) * per_thread * (size_t)num_threads);
    if (scratch == NULL) return -1;
    struct attention_args a = {q, q_token_stride, out, io_bf16, k_cache, v_cache, block_tables,
                               bt_stride, block_size, batch, seq, num_heads, num_kv_heads,
                               head_dim, kv_len, mask, causal, scale, scratch, per_thread, 0};
    pool_run(attention_part, &a, num_threads);
    free(scratch);
    return 0;
}
