/* SwiGLU's activation on CPU: out[r, i] = silu(g[r, i]) * u[r, i], silu(g) = g / (1 + exp(-g)),
 * with the C library's expf, for the float32 per-op path (models/layers.py MLP) and the compiled
 * decoder (quant_decoder.c) alike, so the two give the same bits (torch's vectorised exp may
 * differ from expf in the last bit). Rows split over the pool's threads from PARALLEL_ELEMENTS on; a row's
 * result never depends on the thread. Built by verispec/ops/cpu_build.py.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_kernels.h"

#define PARALLEL_ELEMENTS 262144

struct silu_job {
    const float *gu;
    float *out;
    int64_t ld, n;
};

static void silu_row(void *p, int64_t r) {
    const struct silu_job *j = p;
    const float *g = j->gu + r * j->ld, *u = g + j->n;
    float *o = j->out + r * j->n;
    for (int64_t i = 0; i < j->n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* gu [rows, ld]: row r's gate in [0, n), its up in [n, 2 n); out [rows, n]. */
void silu_mul(const float *gu, int64_t ld, float *out, int64_t rows, int64_t n,
              int num_threads) {
    struct silu_job job = {gu, out, ld, n};
    pool_for(silu_row, &job, rows, rows * n >= PARALLEL_ELEMENTS ? num_threads : 1);
}
