/* The linear layer of GGUF-quantised weights, kept quantised (verispec/ops/quant.py):
 *
 *     w[n, k] = fma(scale[n, k / G], q[n, k], offset[n, k / G])     (float32, exact: see below)
 *     y[m, n] = sum_k x[m, k] w[n, k]  (+ b[n])                    (float32)
 *
 * Every GGUF type verispec reads (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) is an integer q per weight
 * and a (scale, offset) pair per group of G = 32 (16 for Q6_K) inputs; ops/quant.py converts the
 * blocks once at load into one of two layouts, 16 output features interleaved so that one vector
 * holds the same input of 16 features:
 *
 * - 4-bit (Q4_0, Q4_1, Q4_K): byte [g][b][j][r] holds q[16 g + r, 32 b + j] in its low nibble and
 *   q[16 g + r, 32 b + 16 + j] in its high one;
 * - 8-bit (Q8_0, Q5_K, Q6_K): int8 [g][k][r];
 * - scales: [g][k / G][2][16], the 16 features' scales then their offsets: float32, or float16
 *   where all of a weight's are float16 values (the fp16 fields of Q4_0, Q4_1, Q8_0).
 *
 * fma(scale, q, offset) equals the gguf package's dequantisation bit for bit: there scale * q is
 * exact in float32 (an fp16 scale times a few-bit integer) and one rounding follows.
 *
 * Order: y[m, n] is one chain of fused multiply-adds over the inputs (acc = fma(x, w, acc), acc
 * starting at 0), then + b[n]: in order k = 0, 1, ..., K - 1 for the 8-bit layout; for the 4-bit
 * one block by block, inside a block of 32 the two nibbles of a byte together (inputs 0, 16, 1,
 * 17, ..., 15, 31: one load serves both). It depends on K and the layout alone: whatever the
 * number of rows, the row's place in a tile or the thread that runs it (batch invariance,
 * docs/design.md §12), so a prefill, a verify step and a decode step give a token the same bits.
 *
 * Work: up to 8 input rows (decode and verify steps) take the weights dequantised in registers,
 * 64 output features at a time for 1..4 rows, 32 at a time for 5..8 (the accumulators stay in
 * registers): a verify step of 6 rows costs ~1.5 decode steps instead of ~1.9 through the panel.
 * More rows: 64 output features x 64 inputs of weights are dequantised into a float32 panel
 * (16 KiB, L1), then multiplied by up to 128 input rows, four at a time (16 accumulator
 * vectors); a panel is dequantised once per 128 rows, so a long prefill runs at the float32 FMA
 * rate and a decode step at the rate the quantised weights stream in. Output features are split over the
 * threads of thread_pool.c (not OpenMP's: why is said there) in tiles of 64.
 *
 * Why not torch's own CPU weight-only kernels: ``_weight_int4pack_mm_for_cpu`` takes 4-bit
 * weights only, with bfloat16 scales (an fp16 scale is not exact in bfloat16); with float32
 * activations it runs a reference loop (~40x slower than its bfloat16 path), and with bfloat16
 * ones it is level with this kernel for one row but slower from four rows on (verify steps,
 * prefill); ``_weight_int8pack_mm`` has one scale per output feature, not per group. Measured
 * in docs/benchmarks.md ("GGUF quantised weights on the CPU").
 */
#include <immintrin.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

#define X512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define NR 16 /* output features a vector holds */
#define NG 4  /* vectors a tile holds: 64 output features */
#define NT (NR * NG)
#define KC 64  /* inputs per panel */
#define MR 4   /* input rows per pass over a panel */
#define FR 8   /* at most this many input rows: weights dequantised in registers, no panel */
#define MB 128 /* input rows per block: a panel is dequantised once per block */

/* 1 where this CPU runs quant_linear (AVX-512 F and BW). */
int quant_isa(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

/* The 16 scales (or offsets) from element `at` of the layout's scales: float32, or float16
 * widened (exact) where every scale and offset of the weight is a float16 value (ops/quant.py:
 * Q4_0, Q4_1 and Q8_0 always are; 4 instead of 8 bytes a group of 32 weights). */
static inline X512 __attribute__((always_inline)) __m512 load16(const void *so, int64_t at,
                                                                int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)so + at)))
                : _mm512_loadu_ps((const float *)so + at);
}

/* panel[p][NT] = w of the tile's NT features for inputs [k0, k0 + kc), 4-bit layout, in the
 * kernel's order (panel row 32 b + 2 j + h holds input 32 b + 16 h + j). */
static X512 void dequant_q4(const uint8_t *qs, const void *so, int half, int64_t K,
                            int64_t tile, int64_t k0, int64_t kc, float *panel) {
    const __m512i low = _mm512_set1_epi32(15);
    for (int gi = 0; gi < NG; gi++) {
        int64_t g = tile * NG + gi;
        const uint8_t *q = qs + (g * (K / 32) + k0 / 32) * 256;
        int64_t s = (g * (K / 32) + k0 / 32) * 32;
        for (int64_t b = 0; b < kc / 32; b++, q += 256, s += 32) {
            __m512 scale = load16(so, s, half), offset = load16(so, s + 16, half);
            float *p = panel + 32 * b * NT + NR * gi;
            for (int j = 0; j < 16; j++) {
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * j)));
                __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
                __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
                _mm512_store_ps(p + 2 * j * NT, _mm512_fmadd_ps(scale, lo, offset));
                _mm512_store_ps(p + (2 * j + 1) * NT, _mm512_fmadd_ps(scale, hi, offset));
            }
        }
    }
}

/* The same for the 8-bit layout with groups of `group` (16 or 32) inputs; k0 % group == 0. */
static X512 void dequant_q8(const int8_t *qs, const void *so, int half, int64_t K,
                            int64_t group, int64_t tile, int64_t k0, int64_t kc, float *panel) {
    for (int gi = 0; gi < NG; gi++) {
        int64_t g = tile * NG + gi;
        const int8_t *q = qs + (g * K + k0) * 16;
        int64_t s = (g * (K / group) + k0 / group) * 32;
        for (int64_t c = 0; c < kc; c += group, s += 32) {
            __m512 scale = load16(so, s, half), offset = load16(so, s + 16, half);
            for (int64_t k = c; k < c + group; k++, q += 16) {
                __m512 v = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
                _mm512_store_ps(panel + k * NT + NR * gi, _mm512_fmadd_ps(scale, v, offset));
            }
        }
    }
}

/* A few rows (1..FR, a constant after inlining) times vectors [g0, g0 + ng) of a tile (ng 4, or
 * 2 for 5..8 rows: the accumulators stay in registers), the weights dequantised in registers (no
 * panel): the same fma chain per output as panel_rows, so the same bits. */
static inline X512 __attribute__((always_inline)) void fused_rows(
    const void *qs, const void *so, int half, int bits, int64_t group, int64_t K, int64_t tile,
    const float *x, int rows, float *y, int64_t ldy, int g0, int ng) {
    __m512 acc[FR][NG];
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < ng; g++) acc[r][g] = _mm512_setzero_ps();
    if (bits == 4) {
        const __m512i low = _mm512_set1_epi32(15);
        for (int64_t b = 0; b < K / 32; b++) {
            __m512 scale[NG], offset[NG];
            const uint8_t *q[NG];
            for (int g = 0; g < ng; g++) {
                int64_t gg = tile * NG + g0 + g;
                int64_t s = (gg * (K / 32) + b) * 32;
                scale[g] = load16(so, s, half), offset[g] = load16(so, s + 16, half);
                q[g] = (const uint8_t *)qs + (gg * (K / 32) + b) * 256;
            }
            for (int j = 0; j < 16; j++) { /* inputs 32 b + j, then 32 b + 16 + j */
                const float *xj = x + 32 * b + j;
                for (int g = 0; g < ng; g++) {
                    __m512i v = _mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(q[g] + 16 * j)));
                    __m512 lo = _mm512_fmadd_ps(
                        scale[g], _mm512_cvtepi32_ps(_mm512_and_si512(v, low)), offset[g]);
                    __m512 hi = _mm512_fmadd_ps(
                        scale[g], _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), offset[g]);
                    for (int r = 0; r < rows; r++) {
                        acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(xj[r * K]), lo, acc[r][g]);
                        acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(xj[r * K + 16]), hi,
                                                    acc[r][g]);
                    }
                }
            }
        }
    } else {
        for (int64_t c = 0; c < K; c += group) {
            __m512 scale[NG], offset[NG];
            for (int g = 0; g < ng; g++) {
                int64_t s = ((tile * NG + g0 + g) * (K / group) + c / group) * 32;
                scale[g] = load16(so, s, half), offset[g] = load16(so, s + 16, half);
            }
            for (int64_t k = c; k < c + group; k++)
                for (int g = 0; g < ng; g++) {
                    const int8_t *q = (const int8_t *)qs + ((tile * NG + g0 + g) * K + k) * 16;
                    __m512 w = _mm512_fmadd_ps(
                        scale[g],
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                            _mm_loadu_si128((const __m128i *)q))),
                        offset[g]);
                    for (int r = 0; r < rows; r++)
                        acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w, acc[r][g]);
                }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < ng; g++) _mm512_storeu_ps(y + r * ldy + NR * (g0 + g), acc[r][g]);
}

static X512 void fused_block(const void *qs, const void *so, int half, int bits, int64_t group,
                             int64_t K, int64_t tile, const float *x, int64_t rows, float *y,
                             int64_t ldy) {
#define FUSED(n) fused_rows(qs, so, half, bits, group, K, tile, x, n, y, ldy, 0, NG)
#define FUSED_HALVES(n)                                                          \
    fused_rows(qs, so, half, bits, group, K, tile, x, n, y, ldy, 0, NG / 2); \
    fused_rows(qs, so, half, bits, group, K, tile, x, n, y, ldy, NG / 2, NG / 2)
    switch (rows) {
    case 1: FUSED(1); break;
    case 2: FUSED(2); break;
    case 3: FUSED(3); break;
    case 4: FUSED(4); break;
    case 5: FUSED_HALVES(5); break;
    case 6: FUSED_HALVES(6); break;
    case 7: FUSED_HALVES(7); break;
    default: FUSED_HALVES(8); break;
    }
#undef FUSED
#undef FUSED_HALVES
}

/* y[r][0, NT) (+)= x[r] . panel for `rows` (1..MR, a constant after inlining) input rows: one
 * fma chain per output over the panel's inputs, continuing from y unless `first`. */
static inline X512 __attribute__((always_inline)) void panel_rows(
    const float *panel, int64_t kc, const float *x, int64_t ldx, int rows, float *y,
    int64_t ldy, int first, int paired) {
    __m512 acc[MR][NG];
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < NG; g++)
            acc[r][g] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * ldy + NR * g);
    for (int64_t k = 0; k < kc; k++) {
        __m512 w[NG];
        for (int g = 0; g < NG; g++) w[g] = _mm512_load_ps(panel + k * NT + NR * g);
        /* panel row k holds input k, or with `paired` (4 bits) input (k / 2) % 16 + 16 (k % 2)
         * of its block of 32 */
        int64_t xk = paired ? (k & ~31) + ((k & 31) >> 1) + 16 * (k & 1) : k;
        for (int r = 0; r < rows; r++) {
            __m512 xv = _mm512_set1_ps(x[r * ldx + xk]);
            for (int g = 0; g < NG; g++) acc[r][g] = _mm512_fmadd_ps(xv, w[g], acc[r][g]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < NG; g++) _mm512_storeu_ps(y + r * ldy + NR * g, acc[r][g]);
}

static X512 void panel_block(const float *panel, int64_t kc, const float *x, int64_t ldx,
                             int64_t rows, float *y, int64_t ldy, int first, int paired) {
    int64_t m = 0;
    for (; m + MR <= rows; m += MR)
        panel_rows(panel, kc, x + m * ldx, ldx, MR, y + m * ldy, ldy, first, paired);
    switch (rows - m) {
    case 1: panel_rows(panel, kc, x + m * ldx, ldx, 1, y + m * ldy, ldy, first, paired); break;
    case 2: panel_rows(panel, kc, x + m * ldx, ldx, 2, y + m * ldy, ldy, first, paired); break;
    case 3: panel_rows(panel, kc, x + m * ldx, ldx, 3, y + m * ldy, ldy, first, paired); break;
    default: break;
    }
}

struct quant_args {
    const float *x;
    const void *qs;
    const void *so;
    int half;
    const float *bias;
    float *y;
    int64_t M, N, K, group;
    int bits;
    _Atomic int64_t next; /* the next (row block, tile) item to take */
};

/* A thread's share of quant_linear: (row block, 64-feature tile) items taken one at a time as
 * the thread comes free (a loaded core takes fewer); an item's outputs are computed the same
 * way whichever thread takes it. */
static X512 void quant_linear_part(void *p, int thread, int num_threads) {
    struct quant_args *a = p;
    (void)thread, (void)num_threads;
    const int64_t N = a->N, K = a->K, num_tiles = N / NT;
    const int64_t items = (a->M + MB - 1) / MB * num_tiles;
    float panel[KC * NT] __attribute__((aligned(64)));
    for (int64_t item; (item = atomic_fetch_add_explicit(&a->next, 1, memory_order_relaxed))
                       < items;) {
        int64_t m0 = item / num_tiles * MB, tile = item % num_tiles;
        int64_t rows = a->M - m0 < MB ? a->M - m0 : MB;
        const float *x = a->x + m0 * K;
        float *yt = a->y + m0 * N + tile * NT;
        if (rows <= FR) { /* decode and verify steps: no panel */
            fused_block(a->qs, a->so, a->half, a->bits, a->group, K, tile, x, rows, yt, N);
        } else {
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                int64_t kc = K - k0 < KC ? K - k0 : KC;
                if (a->bits == 4)
                    dequant_q4((const uint8_t *)a->qs, a->so, a->half, K, tile, k0, kc,
                               panel);
                else
                    dequant_q8((const int8_t *)a->qs, a->so, a->half, K, a->group, tile, k0,
                               kc, panel);
                panel_block(panel, kc, x + k0, K, rows, yt, N, k0 == 0, a->bits == 4);
            }
        }
        if (a->bias)
            for (int64_t m = 0; m < rows; m++)
                for (int64_t n = 0; n < NT; n++) yt[m * N + n] += a->bias[tile * NT + n];
    }
}

/* y [M, N] = x [M, K] @ w.T (+ bias [N] or NULL), w quantised as above (bits 4 or 8; group 32,
 * or 16 for 8 bits). N % 64 == 0 (ops/quant.py pads), K % 32 == 0. Threads: thread_pool.c. */
void quant_linear(const float *x, const void *qs, const void *so, const float *bias, float *y,
                  int64_t M, int64_t N, int64_t K, int bits, int64_t group, int num_threads,
                  int half) {
    struct quant_args a = {x, qs, so, half, bias, y, M, N, K, group, bits, 0};
    pool_run(quant_linear_part, &a, num_threads);
}
