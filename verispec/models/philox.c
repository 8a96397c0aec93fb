/* Philox4x32-10 uniforms for the CPU: the words of verispec/ops/philox.py's rounds (and of
 * Triton's tl.randint4x; counter (c0, c1, 0, 0), key (seed_lo, seed_hi)) made uniform as
 * philox.py makes them.
 *
 * Why: a race over one block of 4096 tokens needs 1024 Philox evaluations; numpy runs the ten
 * rounds as ~80 array operations (~0.1 ms at any size up to a few thousand counters, most of it
 * per-call overhead, and torch ~10 more to make uniforms), this loop takes a few microseconds on
 * the calling thread. The rounds are integer arithmetic, so the words are those of the numpy and
 * torch rounds bit for bit; uniform_of makes them uniform with torch's roundings. Built and
 * loaded by verispec/models/cpu_kernels.py.
 */
#include <stddef.h>
#include <stdint.h>

#define KEY_A 0x9E3779B9u
#define KEY_B 0xBB67AE85u
#define ROUND_A 0xD2511F53u
#define ROUND_B 0xCD9E8D57u
#define UNIFORM_SCALE 4.6566127342e-10f
#define MIN_UNIFORM 2.3283064e-10f

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
