/* RMS norm of a few rows on CPU: y = w * (x / sqrt(mean(x^2) + eps)), as HF Llama computes it
 * (statistics in float32; for bfloat16 x the normalised row is rounded to bfloat16, then the
 * product with w is rounded again).
 *
 * Why: torch's fused CPU layer norm opens an OpenMP parallel region for every call of more than
 * one row, and with passive OpenMP workers (cpu_threads.py) each region waits for a worker to
 * wake, which costs far more than the norm of a few rows (docs/benchmarks.md). Rows of a
 * decode or verify step are normalised here serially (on the pool's threads, thread_pool.c,
 * only from PARALLEL_ELEMENTS on), each summed in one fixed order whatever the number of
 * rows (batch invariance, docs/design.md §12). Built by verispec/ops/cpu_build.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "cpu_kernels.h"

#define PARALLEL_ELEMENTS 262144

static inline float load1(const void *x, int bf16, int64_t i) {
    return bf16 ? widen1(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

struct norm_job {
    const void *x, *w;
    void *y;
    int bf16;
    int64_t n;
    float eps;
};

static void norm_row(void *p, int64_t m) {
    const struct norm_job *job = p;
    const void *x = job->x, *w = job->w;
    void *y = job->y;
    const int bf16 = job->bf16;
    const int64_t n = job->n;
    const float eps = job->eps;
    int64_t base = m * n;
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v;
        if (bf16) {
            __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + base + i));
            v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        } else {
            v = _mm256_loadu_ps((const float *)x + base + i);
        }
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (; i < n; i++) {
        float v = load1(x, bf16, base + i);
        ss += v * v;
    }
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t j = 0; j < n; j++) {
        float v = load1(x, bf16, base + j) * inv;
        if (bf16)
            ((uint16_t *)y)[base + j] = round_bf16(widen1(round_bf16(v)) * load1(w, 1, j));
        else
            ((float *)y)[base + j] = v * ((const float *)w)[j];
    }
}

void rms_norm(const void *x, const void *w, void *y, int bf16, int64_t m_size, int64_t n,
              float eps, int num_threads) {
    struct norm_job job = {x, w, y, bf16, n, eps};
    pool_for(norm_row, &job, m_size, m_size * n >= PARALLEL_ELEMENTS ? num_threads : 1);
}
