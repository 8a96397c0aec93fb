/* Sampling on the CPU. Philox4x32-10 uniforms: the words of verispec/ops/philox.py's rounds
 * (and of Triton's tl.randint4x; counter (c0, c1, 0, 0), key (seed_lo, seed_hi)) made uniform
 * as philox.py makes them. The exponential race of verispec/ops/sampling.py (race_rows), and
 * the rejection sampler of verispec/ops/rejection.py after p (rejection_rows).
 *
 * Why: a race over one block of 4096 tokens needs 1024 Philox evaluations; numpy runs the ten
 * rounds as ~80 array operations (mostly per-call overhead at any size up to a few thousand
 * counters, and torch ~10 more to make uniforms); this loop runs them on the calling thread
 * without that overhead. The rounds are integer arithmetic, so the words are those of the numpy and
 * torch rounds bit for bit; uniform_of makes them uniform with torch's roundings. Built by
 * verispec/ops/cpu_build.py.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "cpu_kernels.h"

#define KEY_A 0x9E3779B9u
#define KEY_B 0xBB67AE85u
#define ROUND_A 0xD2511F53u
#define ROUND_B 0xCD9E8D57u
#define UNIFORM_SCALE 4.6566127342e-10f
#define MIN_UNIFORM 2.3283064e-10f
#define NUM_STREAMS 4
/* A race over this many weights or more opens a parallel region over its rows. */
#define PARALLEL_ELEMENTS 1048576

static inline void rounds(int64_t seed, int64_t c0, int64_t c1, uint32_t x[4]) {
    uint32_t k0 = (uint32_t)(uint64_t)seed, k1 = (uint32_t)((uint64_t)seed >> 32);
    uint32_t x0 = (uint32_t)c0, x1 = (uint32_t)c1, x2 = 0, x3 = 0;
    for (int r = 0; r < 10; r++) {
        uint64_t prod_b = (uint64_t)ROUND_B * x2, prod_a = (uint64_t)ROUND_A * x0;
        x0 = (uint32_t)(prod_b >> 32) ^ x1 ^ k0;
        x2 = (uint32_t)(prod_a >> 32) ^ x3 ^ k1;
        x1 = (uint32_t)prod_b;
        x3 = (uint32_t)prod_a;
        k0 += KEY_A;
        k1 += KEY_B;
    }
    x[0] = x0;
    x[1] = x1;
    x[2] = x2;
    x[3] = x3;
}

/* philox.py's uniform of a word: Triton's uint_to_uniform_float (a word >= 2**31 taken as ~w,
 * the float32 of that times the float32 scale), an exact 0 raised to MIN_UNIFORM. Integer
 * work, one rounding int -> float32 and one float32 product: the bits torch computes. */
static inline float uniform_of(uint32_t w) {
    uint32_t x = w >= 0x80000000u ? ~w : w;
    float u = (float)(int64_t)x * UNIFORM_SCALE;
    return u < MIN_UNIFORM ? MIN_UNIFORM : u;
}

/* seed, c0, c1: n int64 each (c0, c1 hold uint32 values; the seed's 64 bits are the key).
 * The uniforms of counters i < n: with word == NULL all four, out[4 * i + w] (the vocabulary
 * layout: index 4 i + w); else the one word[i] (0..3), out[i]. */
void philox_uniform(const int64_t *seed, const int64_t *c0, const int64_t *c1,
                    const int64_t *word, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t x[4];
        rounds(seed[i], c0[i], c1[i], x);
        if (word == NULL)
            for (int w = 0; w < 4; w++) out[4 * i + w] = uniform_of(x[w]);
        else
            out[i] = uniform_of(x[word[i] & 3]);
    }
}

/* ---------------------------------------------------------------- the exponential race */

/* Philox counter (c0, c1) of draw (position, stream, index >> 2), as philox.make_offset. */
static inline void draw_words(int64_t seed, int64_t position, int64_t stream, int64_t counter,
                              uint32_t x[4]) {
    uint64_t offset = (((uint64_t)position * NUM_STREAMS + (uint64_t)stream) << 32) |
                      (uint64_t)counter;  /* wrapping as torch's int64 does */
    rounds(seed, (int64_t)(offset & 0xFFFFFFFFu), (int64_t)(offset >> 32), x);
}

/* Exp(1) noise E = -log u of draw (seed, position, stream, index). */
static inline float noise_at(int64_t seed, int64_t position, int64_t stream, int64_t index) {
    uint32_t x[4];
    draw_words(seed, position, stream, index >> 2, x);
    return -logf(uniform_of(x[index & 3]));
}

/* s beats best in torch.max's order: larger, or the first NaN (which nothing beats after). */
static inline int beats(float s, float best) { return s > best || (s != s && best == best); }

/* argmax over tokens start .. start + n - 1 (start a multiple of 4) of w[v] / E_v, the first
 * index of the maximum; w points at token start. Returns the index relative to start. */
static int64_t race_span(const float *w, int64_t start, int64_t n, int64_t seed,
                         int64_t position, int64_t stream) {
    float best = 0.0f;
    int64_t arg = 0;
    for (int64_t i = 0; i < n; i += 4) {
        uint32_t x[4];
        draw_words(seed, position, stream, (start + i) >> 2, x);
        for (int j = 0; j < 4 && i + j < n; j++) {
            float score = w[i + j] / -logf(uniform_of(x[j]));
            if (i + j == 0 || beats(score, best)) {
                best = score;
                arg = i + j;
            }
        }
    }
    return arg;
}

static float sum_floats(const float *x, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(x + i));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(x + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_loadu_ps(x + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_loadu_ps(x + i + 24));
    }
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; i++) s += x[i];
    return s;
}

/* The race over one row of `vocab` weights (sampling.race): over more than `block` tokens in
 * two levels, block c chosen by its total weight over the noise of draw block_noise_index + c,
 * then the token within it. */
static int64_t race_row(const float *row, int64_t vocab, int64_t seed, int64_t position,
                        int64_t stream, int64_t block, int64_t block_noise_index) {
    if (vocab <= block) return race_span(row, 0, vocab, seed, position, stream);
    int64_t num_blocks = (vocab + block - 1) / block, chosen = 0;
    float best = 0.0f;
    for (int64_t c = 0; c < num_blocks; c++) {
        int64_t n = vocab - c * block < block ? vocab - c * block : block;
        float score = sum_floats(row + c * block, n) /
                      noise_at(seed, position, stream, block_noise_index + c);
        if (c == 0 || beats(score, best)) {
            best = score;
            chosen = c;
        }
    }
    int64_t start = chosen * block;
    int64_t n = vocab - start < block ? vocab - start : block;
    return start + race_span(row + start, start, n, seed, position, stream);
}

/* sampling.race for each of `rows` rows of `vocab` non-negative float32 weights (row r at
 * w + r * row_stride): the token argmax_v w_v / E_v. The same draws as the torch race; the
 * logarithm (libm's) and the blocks' sums (eight lanes) may round differently from torch's in
 * the last bit. Rows are independent (a row's token does not depend on the number of
 * threads). */
void race_rows(const float *w, int64_t rows, int64_t vocab, int64_t row_stride,
               const int64_t *seed, const int64_t *position, const int64_t *stream,
               int64_t block, int64_t block_noise_index, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * vocab >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++)
        out[r] = race_row(w + r * row_stride, vocab, seed[r], position[r], stream[r], block,
                          block_noise_index);
}

/* verispec/ops/rejection.py's rejection_sample from its processed probabilities on: request r
 * owns drafts cu[r] .. cu[r + 1] - 1 and target rows cu[r] + r .. cu[r + 1] + r (its verify
 * rows, then its bonus row). probs [N + B, V] (row stride probs_stride; NULL when every request
 * is greedy), q [N, V] (the full rule; NULL: the one-hot rule), argmax [N + B] (each row's
 * first argmax; NULL when no request is greedy). A request is greedy where all_greedy or its
 * temperature is 0. streams: the acceptance, residual and sample streams' numbers
 * (verispec/ops/philox.py's). scratch: B x V floats for the residuals. Writes out [B, width]
 * int32: the accepted drafts, the recovered or bonus token, -1 padding. The twin's comparisons
 * and residual in float32, exactly; its races as race_rows. Returns 0, or -1 (nothing written)
 * where a draft id lies outside [-1, V). */
int rejection_rows(const float *probs, int64_t probs_stride, const float *q, int64_t q_stride,
                   const int64_t *argmax, const int64_t *draft_ids, const int64_t *cu,
                   int64_t batch, int64_t vocab, const float *temperature, int all_greedy,
                   const int64_t *seed, const int64_t *position, const int64_t streams[3],
                   int64_t width, int64_t block, int64_t block_noise_index, float *scratch,
                   int32_t *out, int num_threads) {
    int64_t accept_stream = streams[0], residual_stream = streams[1], sample_stream = streams[2];
    for (int64_t i = 0; i < cu[batch]; i++)
        if (draft_ids[i] < -1 || draft_ids[i] >= vocab) return -1;
#pragma omp parallel for num_threads(num_threads) if (batch * vocab >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < batch; r++) {
        int64_t start = cu[r], n = cu[r + 1] - cu[r], base = start + r;
        int greedy = all_greedy || temperature[r] == 0.0f;
        int64_t present = 0;  /* the drafts before the first -1 */
        while (present < n && draft_ids[start + present] >= 0) present++;
        int64_t accepted = 0;
        for (; accepted < present; accepted++) {
            int64_t d = draft_ids[start + accepted], row = base + accepted;
            int ok;
            if (greedy) {
                ok = d == argmax[row];
            } else {
                float p_d = probs[row * probs_stride + d];
                uint32_t x[4];
                draw_words(seed[r], position[r] + accepted, accept_stream, 0, x);
                float u = uniform_of(x[0]);
                if (q != NULL) {
                    float q_d = q[(start + accepted) * q_stride + d];
                    ok = u * q_d < p_d && q_d > 0.0f;
                } else {
                    ok = u < p_d;
                }
            }
            if (!ok) break;
        }
        int64_t final_row = base + accepted, token;
        if (greedy) {
            token = argmax[final_row];
        } else {
            const float *p = probs + final_row * probs_stride, *w = p;
            int rejected = accepted < present;
            if (rejected) {  /* the residual of the first rejected draft, unless it is all 0 */
                float *residual = scratch + r * vocab;
                if (q != NULL) {
                    const float *q_row = q + (start + accepted) * q_stride;
                    for (int64_t v = 0; v < vocab; v++) {
                        float x = p[v] - q_row[v];
                        residual[v] = x < 0.0f ? 0.0f : x;  /* NaN stays, as clamp_min */
                    }
                } else {
                    for (int64_t v = 0; v < vocab; v++) residual[v] = p[v];
                    residual[draft_ids[start + accepted]] = 0.0f;
                }
                if (sum_floats(residual, vocab) > 0.0f) w = residual;
            }
            token = race_row(w, vocab, seed[r], position[r] + accepted,
                             rejected ? residual_stream : sample_stream, block,
                             block_noise_index);
        }
        for (int64_t j = 0; j < width; j++)
            out[r * width + j] = (int32_t)(j < accepted ? draft_ids[start + j]
                                           : j == accepted ? token : -1);
    }
    return 0;
}
