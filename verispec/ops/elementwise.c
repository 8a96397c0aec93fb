/* Elementwise CPU kernels: SwiGLU's activation and a grammar's token masks.
 *
 * SwiGLU's activation: out[r, i] = silu(g[r, i]) * u[r, i], silu(g) = g / (1 + exp(-g)),
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

/* A grammar's token masks on CPU, in place: logits[rows[g], v] = -inf unless bit t % 32 of
 * bitmask[g, t / 32] is set, t = v (token_ids NULL) or token_ids[v] (an EAGLE-3 head's columns
 * mapped onto the target's ids); the torch twin is verispec/ops/options.py: apply_token_bitmask.
 * A word of 32 allowed tokens is skipped whole. Logits are float32 rows ld apart, n columns. */
void token_bitmask(float *logits, int64_t ld, const int64_t *rows, const int32_t *bitmask,
                   int64_t num_words, int64_t num_rows, int64_t n, const int64_t *token_ids) {
    for (int64_t g = 0; g < num_rows; g++) {
        float *row = logits + rows[g] * ld;
        const uint32_t *words = (const uint32_t *)(bitmask + g * num_words);
        if (token_ids) {
            for (int64_t v = 0; v < n; v++) {
                int64_t t = token_ids[v];
                if (!((words[t >> 5] >> (t & 31)) & 1u)) row[v] = -INFINITY;
            }
            continue;
        }
        for (int64_t i = 0; i * 32 < n; i++) {
            uint32_t word = words[i];
            if (word == 0xffffffffu) continue;
            float *at = row + i * 32;
            if (n - i * 32 < 32) {  /* the vocabulary ends inside this word */
                for (int64_t j = 0; j < n - i * 32; j++)
                    if (!((word >> j) & 1u)) at[j] = -INFINITY;
                continue;
            }
            for (int j = 0; j < 32; j++)  /* branch-free: vectorised */
                at[j] = (word >> j) & 1u ? at[j] : -INFINITY;
        }
    }
}
