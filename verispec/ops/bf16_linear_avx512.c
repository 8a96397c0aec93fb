/* The bfloat16 linear layer of bf16_linear.c for CPUs with bfloat16 instructions:
 *
 *     y[m, n] = bf16(sum_k x[m, k] w[n, k] + b[n])
 *
 * - bf16_linear_avx512: AVX-512 BF16 (VDPBF16PS: 32 bfloat16 products summed pairwise into 16
 *   float32 lanes per instruction, no widening), up to four input rows per pass over a weight
 *   row; any sizes (masked loads take the tails).
 * - bf16_linear_amx: AMX (TDPBF16PS: a 16 x 16 float32 tile += 16 weight rows x 32 inputs x 16
 *   input rows per instruction). The weight rows load as they lie in memory (the A tile); the
 *   input rows are packed once per call into the B tile's layout (pairs of inputs per column).
 *   Up to 16 rows cost about one: a verify step's few rows are as cheap as a decode row.
 *   Needs in_features % 32 == 0 and out_features % 16 == 0 (cpu_kernels.py falls back).
 *
 * Both sum in float32 and round once to bfloat16, as the AVX2 kernel. Each product of two
 * bfloat16 values is exact in float32; the instructions add them in a fixed order per output
 * element with round-to-nearest and flush denormal inputs and results to zero (a bfloat16
 * subnormal is below 1.2e-38). Batch invariance (docs/design.md §12): row m's outputs are summed
 * by the same instruction sequence over its own input alone, whatever the number of rows and
 * wherever the row falls in a group or tile, and which kernel runs depends on the CPU and the
 * weight's shape only. Dispatch: cpu_kernels.bf16_linear.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_kernels.h"

#define X512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))
#define ROWS 4     /* input rows per pass over a weight row (AVX-512 BF16) */
#define N_BLOCK 32 /* output features per work item, as in bf16_linear.c */

/* 2: AMX usable (the CPU has it and the kernel granted this process its tile state),
 * 1: AVX-512 BF16, 0: neither. */
int bf16_isa(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bf16")) return 0;
    if (__builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-tile")
        && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0)
        return 2;
    return 1;
}

/* out[g] = sum_k x_g[k] w[k] for `rows` (1..ROWS, a constant after inlining) input rows. */
static inline X512 __attribute__((always_inline)) void dots(
    const uint16_t *w, const uint16_t *x, int64_t k_size, int rows, float *out) {
    __m512 acc[ROWS], acc2[ROWS]; /* two chains per row, so that latency does not bound it */
    for (int g = 0; g < rows; g++) acc[g] = acc2[g] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= k_size; k += 64) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
        for (int g = 0; g < rows; g++) {
            const uint16_t *xg = x + g * k_size + k;
            acc[g] = _mm512_dpbf16_ps(acc[g], w0, (__m512bh)_mm512_loadu_si512(xg));
            acc2[g] = _mm512_dpbf16_ps(acc2[g], w1, (__m512bh)_mm512_loadu_si512(xg + 32));
        }
    }
    for (; k < k_size; k += 32) { /* zeros past the end add nothing */
        __mmask32 m = k + 32 <= k_size ? 0xffffffffu : (__mmask32)((1ull << (k_size - k)) - 1);
        __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m, w + k);
        for (int g = 0; g < rows; g++)
            acc[g] = _mm512_dpbf16_ps(acc[g], w0,
                                      (__m512bh)_mm512_maskz_loadu_epi16(m, x + g * k_size + k));
    }
    for (int g = 0; g < rows; g++) out[g] = _mm512_reduce_add_ps(_mm512_add_ps(acc[g], acc2[g]));
}

static X512 void group_rows(const uint16_t *w, const uint16_t *x, int64_t k_size, int rows,
                            float *out) {
    switch (rows) { /* constant row counts, so that the loops over them unroll */
        case 1: dots(w, x, k_size, 1, out); break;
        case 2: dots(w, x, k_size, 2, out); break;
        case 3: dots(w, x, k_size, 3, out); break;
        default: dots(w, x, k_size, ROWS, out); break;
    }
}

struct linear_job {
    const uint16_t *x, *w, *bias, *packed;
    uint16_t *y;
    int64_t m_size, n_size, k_size, m_tiles, pairs;
};

/* Output features [i N_BLOCK, (i + 1) N_BLOCK) of every row: one item of the thread pool. */
static X512 void avx512_block(void *p, int64_t i) {
    const struct linear_job *j = p;
    int64_t n0 = i * N_BLOCK, n1 = n0 + N_BLOCK < j->n_size ? n0 + N_BLOCK : j->n_size;
    for (int64_t m = 0; m < j->m_size; m += ROWS) {
        int rows = j->m_size - m < ROWS ? (int)(j->m_size - m) : ROWS;
        for (int64_t n = n0; n < n1; n++) {
            float b = j->bias ? widen1(j->bias[n]) : 0.0f, out[ROWS];
            group_rows(j->w + n * j->k_size, j->x + m * j->k_size, j->k_size, rows, out);
            for (int g = 0; g < rows; g++)
                j->y[(m + g) * j->n_size + n] = round_bf16(out[g] + b);
        }
    }
}

X512 int bf16_linear_avx512(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                            uint16_t *y, int64_t m_size, int64_t n_size, int64_t k_size,
                            int num_threads) {
    struct linear_job job = {.x = x, .w = w, .bias = bias, .y = y, .m_size = m_size,
                             .n_size = n_size, .k_size = k_size};
    pool_for(avx512_block, &job, (n_size + N_BLOCK - 1) / N_BLOCK, num_threads);
    return 0;
}

typedef struct { /* LDTILECFG's 64-byte layout, palette 1 */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Output features [i N_BLOCK, (i + 1) N_BLOCK) of every row: one item of the thread pool, which
 * loads the tile configuration itself (an item may land on any thread) and releases the tiles. */
static AMX void amx_block(void *p, int64_t i) {
    const struct linear_job *j = p;
    const int64_t k_size = j->k_size, n_size = j->n_size, m_size = j->m_size;
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 3; t++) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config); /* tile 0: 16 weight rows, 1: packed inputs, 2: sums */
    float sums[16 * 16] __attribute__((aligned(64)));
    int64_t n0 = i * N_BLOCK, n1 = n0 + N_BLOCK < n_size ? n0 + N_BLOCK : n_size;
    for (int64_t n = n0; n < n1; n += 16)
        for (int64_t t = 0; t < j->m_tiles; t++) {
            _tile_zero(2);
            const uint16_t *b = j->packed + t * j->pairs * 32;
            for (int64_t k = 0; k < k_size; k += 32) {
                _tile_loadd(0, j->w + n * k_size + k, k_size * 2);
                _tile_loadd(1, b + k * 16, 64);
                _tile_dpbf16ps(2, 0, 1);
            }
            _tile_stored(2, sums, 64); /* sums[o * 16 + r]: output n + o, row 16 t + r */
            int64_t rows = m_size - 16 * t < 16 ? m_size - 16 * t : 16;
            for (int o = 0; o < 16; o++) {
                float bo = j->bias ? widen1(j->bias[n + o]) : 0.0f;
                for (int64_t r = 0; r < rows; r++)
                    j->y[(16 * t + r) * n_size + n + o] = round_bf16(sums[o * 16 + r] + bo);
            }
        }
    _tile_release();
}

/* Returns 0, or -1 when the packed input cannot be allocated. */
AMX int bf16_linear_amx(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                        uint16_t *y, int64_t m_size, int64_t n_size, int64_t k_size,
                        int num_threads) {
    int64_t m_tiles = (m_size + 15) / 16, pairs = k_size / 2;
    /* B tiles: per 16 input rows, row i holds (x[m, 2i], x[m, 2i + 1]) for its 16 rows m
     * (zeros past the last row): [m_tiles][pairs][16][2] bfloat16 */
    size_t bytes = (size_t)(m_tiles * pairs * 64);
    uint16_t *packed = aligned_alloc(64, bytes);
    if (packed == NULL) return -1;
    memset(packed, 0, bytes);
    for (int64_t m = 0; m < m_size; m++) {
        uint16_t *b = packed + (m / 16) * pairs * 32 + (m % 16) * 2;
        const uint16_t *row = x + m * k_size;
        for (int64_t i = 0; i < pairs; i++) memcpy(b + i * 32, row + 2 * i, 4);
    }
    struct linear_job job = {.w = w, .bias = bias, .packed = packed, .y = y, .m_size = m_size,
                             .n_size = n_size, .k_size = k_size, .m_tiles = m_tiles,
                             .pairs = pairs};
    pool_for(amx_block, &job, (n_size + N_BLOCK - 1) / N_BLOCK, num_threads);
    free(packed);
    return 0;
}
