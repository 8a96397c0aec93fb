/* A bfloat16 linear layer for x86-64 CPUs with AVX2 and FMA but no bfloat16 instructions.
 *
 *     y[m, n] = bf16(sum_k x[m, k] w[n, k] + b[n])
 *
 * x, w (and b) are bfloat16, the sum runs in float32 and is rounded once to bfloat16 (to
 * nearest, ties to even, as torch rounds): what a bfloat16 matmul computes, up to summation
 * order.
 *
 * A bfloat16 value widened to float32 is its 16 bits shifted left by 16. Read as 32-bit lanes,
 * 16 weights w[k], w[k + 1] pair up in each lane: the lane shifted left by 16 is w[k] in
 * float32, the lane with its low half cleared is w[k + 1]. So the weights stream from memory at
 * 2 bytes each and widen with one shift and one mask per 16 weights, against the input widened
 * and split once per call into its even and odd elements. Each weight row is read from memory
 * once for all input rows (GROUP rows per pass, the next passes find it in L1 or L2), so a
 * verify step's few rows cost little more than one. The pool's threads (thread_pool.c) take the
 * output features in blocks of N_BLOCK as they come free (on a shared CPU a thread the OS
 * preempts takes fewer, instead of the whole step waiting for its fixed half). Which thread
 * sums an output never changes how it is summed.
 *
 * Batch invariance (docs/design.md §12): y[m, n] is summed in the same order whatever the number of
 * rows M and wherever row m falls in a group: four float32 chains over 32 weights at a time
 * (even and odd elements of two halves), folded, then chains over 16 weights, then the scalar
 * tails. A row's result depends on its own input and the weight only, so a token gives the same
 * bits decoded alone, in a batch, in a verify step or in a prefill (tested). Built
 * by verispec/ops/cpu_build.py.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#define GROUP 2 /* input rows per pass over a weight row (4 chains each: 8 of 16 registers) */
/* Output features per block: a thread takes a block, and for each group of input rows computes
 * every feature of it, so that the group's inputs stay in L1 while the block's weight rows
 * (in L2) are reused by every group; input rows are read from L2 once per block instead of
 * once per feature. This is what makes a prefill's many rows cheap; one row is unchanged
 * (docs/benchmarks.md). */
#define N_BLOCK 32

/* out[g] = sum_k x_g[k] w[k] for the `rows` (1..GROUP, a constant after inlining) input rows
 * whose even / odd elements start at xe / xo (row stride `half`); x holds the whole rows (for
 * an odd k_size's last element). */
static inline __attribute__((always_inline)) void dots(
    const uint16_t *w, const float *xe, const float *xo, const uint16_t *x, int64_t half,
    int64_t k_size, int rows, float *out) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    __m256 even[GROUP], odd[GROUP];
    for (int g = 0; g < rows; g++) even[g] = odd[g] = _mm256_setzero_ps();
    int64_t t = 0;
    { /* two more chains per row, so that FMA latency does not bound it */
        __m256 even2[GROUP], odd2[GROUP];
        for (int g = 0; g < rows; g++) even2[g] = odd2[g] = _mm256_setzero_ps();
        for (; t + 16 <= half; t += 16) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w + 2 * t));
            __m256i v2 = _mm256_loadu_si256((const __m256i *)(w + 2 * t + 16));
            __m256 w_even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            __m256 w_odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            __m256 w_even2 = _mm256_castsi256_ps(_mm256_slli_epi32(v2, 16));
            __m256 w_odd2 = _mm256_castsi256_ps(_mm256_and_si256(v2, high));
            for (int g = 0; g < rows; g++) {
                const float *e = xe + g * half + t, *o = xo + g * half + t;
                even[g] = _mm256_fmadd_ps(w_even, _mm256_loadu_ps(e), even[g]);
                odd[g] = _mm256_fmadd_ps(w_odd, _mm256_loadu_ps(o), odd[g]);
                even2[g] = _mm256_fmadd_ps(w_even2, _mm256_loadu_ps(e + 8), even2[g]);
                odd2[g] = _mm256_fmadd_ps(w_odd2, _mm256_loadu_ps(o + 8), odd2[g]);
            }
        }
        for (int g = 0; g < rows; g++) {
            even[g] = _mm256_add_ps(even[g], even2[g]);
            odd[g] = _mm256_add_ps(odd[g], odd2[g]);
        }
    }
    for (; t + 8 <= half; t += 8) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + 2 * t));
        __m256 w_even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        __m256 w_odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        for (int g = 0; g < rows; g++) {
            even[g] = _mm256_fmadd_ps(w_even, _mm256_loadu_ps(xe + g * half + t), even[g]);
            odd[g] = _mm256_fmadd_ps(w_odd, _mm256_loadu_ps(xo + g * half + t), odd[g]);
        }
    }
    for (int g = 0; g < rows; g++) {
        float s = hsum(_mm256_add_ps(even[g], odd[g]));
        for (int64_t u = t; u < half; u++)
            s += widen1(w[2 * u]) * xe[g * half + u] + widen1(w[2 * u + 1]) * xo[g * half + u];
        if (k_size & 1) s += widen1(w[k_size - 1]) * widen1(x[g * k_size + k_size - 1]);
        out[g] = s;
    }
}

static void group_rows(const uint16_t *w, const float *xe, const float *xo, const uint16_t *x,
                       int64_t half, int64_t k_size, int rows, float *out) {
    /* constant row counts, so that the loops over them unroll; every row is summed alike */
    if (rows == 1)
        dots(w, xe, xo, x, half, k_size, 1, out);
    else
        dots(w, xe, xo, x, half, k_size, GROUP, out);
}

struct bf16_job {
    const uint16_t *x, *w, *bias;
    uint16_t *y;
    const float *xe, *xo;
    int64_t m_size, n_size, k_size, half;
};

/* Output features [i N_BLOCK, (i + 1) N_BLOCK) of every row: one item of the thread pool. */
static void bf16_block(void *p, int64_t i) {
    const struct bf16_job *j = p;
    int64_t n0 = i * N_BLOCK, n1 = n0 + N_BLOCK < j->n_size ? n0 + N_BLOCK : j->n_size;
    for (int64_t m = 0; m < j->m_size; m += GROUP) {
        int rows = j->m_size - m < GROUP ? (int)(j->m_size - m) : GROUP;
        for (int64_t n = n0; n < n1; n++) {
            float b = j->bias ? widen1(j->bias[n]) : 0.0f;
            float out[GROUP];
            group_rows(j->w + n * j->k_size, j->xe + m * j->half, j->xo + m * j->half,
                       j->x + m * j->k_size, j->half, j->k_size, rows, out);
            for (int g = 0; g < rows; g++)
                j->y[(m + g) * j->n_size + n] = round_bf16(out[g] + b);
        }
    }
}

/* Returns 0, or -1 when the scratch for the split input cannot be allocated. */
int bf16_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                int64_t m_size, int64_t n_size, int64_t k_size, int num_threads) {
    int64_t half = k_size / 2;
    float *xe = malloc(sizeof(float) * (size_t)(2 * m_size * half + 1));
    if (xe == NULL) return -1;
    float *xo = xe + m_size * half;
    for (int64_t m = 0; m < m_size; m++)
        for (int64_t u = 0; u < half; u++) {
            xe[m * half + u] = widen1(x[m * k_size + 2 * u]);
            xo[m * half + u] = widen1(x[m * k_size + 2 * u + 1]);
        }
    struct bf16_job job = {x, w, bias, y, xe, xo, m_size, n_size, k_size, half};
    pool_for(bf16_block, &job, (n_size + N_BLOCK - 1) / N_BLOCK, num_threads);
    free(xe);
    return 0;
}

/* The same for float32 weights and input: y[m, n] = sum_k x[m, k] w[n, k] + b[n], every row
 * summed alike (two chains over 16 floats at a time, then the scalar tail) in groups of up to
 * F32_GROUP rows. */
#define F32_GROUP 4
static inline __attribute__((always_inline)) void f32_dots(
    const float *w, const float *x, int64_t k_size, int rows, float *out) {
    __m256 acc[F32_GROUP], acc2[F32_GROUP];
    for (int g = 0; g < rows; g++) acc[g] = acc2[g] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= k_size; k += 16) {
        __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
        for (int g = 0; g < rows; g++) {
            acc[g] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + g * k_size + k), acc[g]);
            acc2[g] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + g * k_size + k + 8), acc2[g]);
        }
    }
    for (int g = 0; g < rows; g++) {
        float s = hsum(_mm256_add_ps(acc[g], acc2[g]));
        for (int64_t t = k; t < k_size; t++) s += w[t] * x[g * k_size + t];
        out[g] = s;
    }
}

static void f32_group_rows(const float *w, const float *x, int64_t k_size, int rows,
                           float *out) {
    switch (rows) {
        case 1: f32_dots(w, x, k_size, 1, out); break;
        case 2: f32_dots(w, x, k_size, 2, out); break;
        case 3: f32_dots(w, x, k_size, 3, out); break;
        default: f32_dots(w, x, k_size, F32_GROUP, out); break;
    }
}

struct f32_job {
    const float *x, *w, *bias;
    float *y;
    int64_t m_size, n_size, k_size;
    int group;
};

static void f32_block(void *p, int64_t i) {
    const struct f32_job *j = p;
    int64_t n0 = i * N_BLOCK, n1 = n0 + N_BLOCK < j->n_size ? n0 + N_BLOCK : j->n_size;
    for (int64_t m = 0; m < j->m_size; m += j->group) {
        int rows = j->m_size - m < j->group ? (int)(j->m_size - m) : j->group;
        for (int64_t n = n0; n < n1; n++) {
            float out[F32_GROUP];
            f32_group_rows(j->w + n * j->k_size, j->x + m * j->k_size, j->k_size, rows, out);
            for (int g = 0; g < rows; g++)
                j->y[(m + g) * j->n_size + n] = out[g] + (j->bias ? j->bias[n] : 0.0f);
        }
    }
}

void f32_linear(const float *x, const float *w, const float *bias, float *y, int64_t m_size,
                int64_t n_size, int64_t k_size, int num_threads) {
    /* Rows of more than 1024 floats two at a time: four of them do not fit L1 beside the
     * weight stream. */
    struct f32_job job = {x, w, bias, y, m_size, n_size, k_size, k_size > 1024 ? 2 : F32_GROUP};
    pool_for(f32_block, &job, (n_size + N_BLOCK - 1) / N_BLOCK, num_threads);
}
