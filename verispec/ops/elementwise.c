/* SwiGLU's activation on CPU: out[r, i] = silu(g[r, i]) * u[r, i], silu(g) = g / (1 + exp(-g)),
 * with the C library's expf, for the float32 per-op path (models/layers.py MLP) and the compiled
 * decoder (quant_decoder.c) alike, so the two give the same bits (torch's vectorised exp may
 * differ from expf in the last bit). Rows split over threads from PARALLEL_ELEMENTS on; a row's
 * result never depends on the thread. Built and loaded by verispec/ops/cpu_kernels.py.
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_ELEMENTS 262144

/* gu [rows, ld]: row r's gate in [0, n), its up in [n, 2 n); out [rows, n]. */
void silu_mul(const float *gu, int64_t ld, float *out, int64_t rows, int64_t n,
              int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * ld, *u = g + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
