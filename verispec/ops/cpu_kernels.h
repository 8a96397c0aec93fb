/* Helpers shared by the CPU kernels (bf16_linear.c, attention.c, quant_linear.c, ...): bfloat16
 * <-> float32, a horizontal sum, and the thread pool (thread_pool.c), the kernels' only threads:
 * no OpenMP region runs in a decode step, so torch's OpenMP workers stay asleep (under OpenMP's
 * default wait policy, which applies when torch is imported before verispec, a woken worker
 * spins for milliseconds on the core the pool's worker needs). */
#ifndef VERISPEC_CPU_KERNELS_H
#define VERISPEC_CPU_KERNELS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* A bfloat16 value in float32: its 16 bits shifted left by 16 (exact). */
static inline float widen1(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 to bfloat16, to nearest, ties to even (as torch rounds); NaN stays NaN. */
static inline uint16_t round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Calls task(arg, i, n) on this thread (i = 0) and the pool's workers that come; returns when
 * those calls are done (thread_pool.c). */
void pool_run(void (*task)(void *arg, int thread, int num_threads), void *arg, int num_threads);

/* item(arg, i) for i in [0, num_items), each item taken from a shared counter by whichever of
 * up to num_threads threads comes free (so what an item computes never depends on the thread);
 * the caller's thread alone when num_threads or num_items is at most 1 (thread_pool.c). */
void pool_for(void (*item)(void *arg, int64_t i), void *arg, int64_t num_items,
              int num_threads);

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
