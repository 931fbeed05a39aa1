/* The int8 decode step of an STT model on a CPU, the whole step in one call (see chatapp/stt/cpu_step.py, which
 * builds this file with the system's C compiler and calls `chatapp_decode` through ctypes).
 *
 * At batch 1 a decode step of the default model in int8 is 120 matrix-vector products over 106 MB of weights plus
 * the small work around them (norms, rotary, cache writes, attention, activations, routers). torch's weight-only
 * kernel (`_weight_int8pack_mm`) is written for AVX-512 and streamed weights at 7.5-14 GB/s on a 2-core AVX2 EPYC,
 * and each of the ~40 small torch ops of a block costs a few microseconds of dispatch. Here a product quantizes its
 * input rows as llama.cpp does (blocks of 32 int8 levels with a scale each) and sums each block in int32 with the
 * int8 weight rows, a batch's rows in tiles that read each weight once for several rows (`DOT_ROWS`, `DOT_TILE`);
 * everything else (norms, rotary, attention, softmax, routers) is float32 in plain loops. It serves every batch
 * size: it is the only decode path of an int8 model on a CPU.
 *
 * The arithmetic is the eager torch step's with the int8 weights dequantized exactly (`q * scale`, one scale per
 * output channel, applied after the sum), the products' inputs quantized as above, and float32 elsewhere where the
 * eager step rounds activations to bfloat16: tests/stt/test_gemv.py compares the two on the same weights, step by
 * step, against an oracle that quantizes the products' inputs the same way.
 *
 * Parallel loops (OpenMP) run output channels (a product) or (row, K/V head) pairs (attention).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if (defined(__AVX2__) && defined(__FMA__)) || defined(__F16C__)
#include <immintrin.h>
#endif

#ifndef ROW_BLOCK
#define ROW_BLOCK 2 /* rows a weight row is loaded for at once (int8_matmul) */
#endif

/* `DecodeArgs`, the call's one argument, is defined once, in `cpu_step.DECODE_ARGS` (each field's type, name and
 * meaning): the build generates decode_args.h from that table (the struct, and `DECODE_ARGS_FIELDS`, the list of its
 * names), and the ctypes mirror is made from the same table. */
#include "decode_args.h"

/* The struct's layout as this compiler laid it out, field by field in order, for the loader to check against its
 * ctypes mirror before the first call: a build against another table refuses to load, where it would otherwise
 * read the wrong memory. */
#define FIELD(name) {#name, offsetof(DecodeArgs, name), sizeof(((DecodeArgs *)0)->name)},
static const struct {
    const char *name;
    int64_t offset, size;
} LAYOUT[] = {DECODE_ARGS_FIELDS(FIELD)};
#undef FIELD

/* The number of fields; with `at` in range, that field's name, offset and size. The struct's whole size is field
 * -1's (name "sizeof"), so a field left out of LAYOUT at the end shows too. */
int64_t chatapp_decode_layout(int64_t at, const char **name, int64_t *offset, int64_t *size) {
    const int64_t count = (int64_t)(sizeof(LAYOUT) / sizeof(LAYOUT[0]));
    if (at == -1) {
        *name = "sizeof", *offset = 0, *size = (int64_t)sizeof(DecodeArgs);
    } else if (at >= 0 && at < count) {
        *name = LAYOUT[at].name, *offset = LAYOUT[at].offset, *size = LAYOUT[at].size;
    }
    return count;
}

/* The products. Activations are quantized as llama.cpp quantizes them for its own quantized products (Q8_0):
 * each row in blocks of QBLOCK values, a block's values rounded to int8 levels of one float32 scale, its largest
 * magnitude / 127 (`quantize_rows`). A block's dot product with the int8 weights is then exact in int32, 32
 * multiply-adds in a few integer instructions (`_mm256_maddubs_epi16`, on |w| and x with w's sign), and each block
 * adds its sum times its scale. Against int8 weights widened to float32 (four conversions and four FMAs for 32
 * weights) this made the default model's products 1.4-1.6x as fast at one row and 2.1-2.4x at eight on the 2-core
 * AVX2 EPYC (18 -> 26 GB/s of weights for the 3072 x 576 gate/up product): the float path was bound by its own
 * instructions, not by memory. The rounding adds ~0.5% of a row's largest value to a product's result, as it does
 * in llama.cpp; docs/benchmarks.md (cpu_decode.py, the quality guard) measures what it does to the replies. A
 * weight row is read once for ROW_BLOCK rows, and each row is summed in the same order whatever ROW_BLOCK is, so a
 * row's result does not depend on the rows beside it (tests/stt/test_gemv.py). With AVX-512 VNNI the products
 * below take over (`DOT_TILE`).
 *
 * Without AVX2, or for a row length that is not a multiple of QBLOCK, the products take float32 activations, in
 * plain loops for the compiler to vectorize. */
#define QBLOCK 32

#if defined(__AVX2__) && defined(__FMA__)
#define INTEGER_PRODUCTS 1

static inline float hsum(__m256 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_hadd_ps(half, half);
    return _mm_cvtss_f32(_mm_hadd_ps(half, half));
}

/* Eight int32 sums of four products each of int8 vectors w and x (|w| times x with w's sign: maddubs multiplies
 * unsigned by signed bytes; no pair exceeds 2 * 127 * 127, so nothing saturates). */
static inline __m256i dot_blocks(__m256i magnitude, __m256i w, __m256i x) {
    const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

#define DOT_ROWS(ROWS)                                                                                               \
    static inline void dot_q8_##ROWS(const int8_t *restrict w, const int8_t *restrict q, const float *restrict d,  \
                                     int64_t k, float *restrict out) {                                             \
        const int64_t blocks = k / QBLOCK;                                                                         \
        __m256 acc[ROWS][2];                                                                                       \
        for (int m = 0; m < ROWS; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();                                \
        int64_t b = 0;                                                                                             \
        for (; b + 2 <= blocks; b += 2) {                                                                          \
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + b * QBLOCK));                             \
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + (b + 1) * QBLOCK));                       \
            const __m256i m0 = _mm256_sign_epi8(w0, w0), m1 = _mm256_sign_epi8(w1, w1);                            \
            for (int m = 0; m < ROWS; m++) {                                                                       \
                const int8_t *qm = q + m * k + b * QBLOCK;                                                         \
                const float *dm = d + m * blocks + b;                                                              \
                const __m256i s0 = dot_blocks(m0, w0, _mm256_loadu_si256((const __m256i *)qm));                   \
                const __m256i s1 = dot_blocks(m1, w1, _mm256_loadu_si256((const __m256i *)(qm + QBLOCK)));        \
                acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_set1_ps(dm[0]), acc[m][0]);            \
                acc[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_set1_ps(dm[1]), acc[m][1]);            \
            }                                                                                                      \
        }                                                                                                          \
        if (b < blocks) {                                                                                          \
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + b * QBLOCK));                             \
            const __m256i m0 = _mm256_sign_epi8(w0, w0);                                                           \
            for (int m = 0; m < ROWS; m++) {                                                                       \
                const __m256i s0 = dot_blocks(m0, w0, _mm256_loadu_si256((const __m256i *)(q + m * k + b * QBLOCK)));\
                acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_set1_ps(d[m * blocks + b]), acc[m][0]); \
            }                                                                                                      \
        }                                                                                                          \
        for (int m = 0; m < ROWS; m++) out[m] = hsum(_mm256_add_ps(acc[m][0], acc[m][1]));                         \
    }
DOT_ROWS(1)
DOT_ROWS(ROW_BLOCK)
#else
#define INTEGER_PRODUCTS 0
#endif

/* With AVX-512 VNNI a product takes its input as unsigned levels (level + 128) against the signed weights:
 * `vpdpbusd` sums four u8 x s8 products into each int32 lane and adds the lane's start value, set to -128 times
 * the lane's four weights, so the sum is the signed one, exact, in one instruction a pair of 64-byte vectors
 * (against five for maddubs with the sign trick above). The block scales are laid out eight to a block
 * (`SCALE_SPREAD`), so a 64-byte vector of levels, two blocks, takes its sixteen scales in one load.
 *
 * Many rows (a batch) are a small matrix product: tiles of TILE_W output channels by TILE_X rows, their
 * TILE_W * TILE_X sums in registers, so each 64-byte load of weights serves TILE_X rows and each load of levels
 * and scales TILE_W channels. One channel at a time, a batch of 32 re-read every row's levels from L2 for every
 * weight row (36-100 KB each time). A sum's order does not depend on the tile it is in (chunk by chunk, lane by
 * lane, then across lanes), so a row's numbers do not depend on the rows beside it. */
#if INTEGER_PRODUCTS && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VNNI_PRODUCTS 1
#define SCALE_SPREAD 8
#ifndef TILE_W
#define TILE_W 4
#endif
#define TILE_X 4
#ifndef MIN_ROWS
#define MIN_ROWS TILE_X
#endif
#ifndef W_AHEAD
#define W_AHEAD 4
#endif

/* sums[i * X + j] = w[i] . q[j] (k levels each, rows `k` apart) with the scales of q[j]'s blocks. */
#define DOT_TILE(W, X)                                                                                               \
    static inline void dot_tile_##W##x##X(const int8_t *restrict w, const uint8_t *restrict q,                    \
                                          const float *restrict d, int64_t k, float *restrict sums) {             \
        const int64_t chunks = k / 64, spread = k / QBLOCK * SCALE_SPREAD;                                        \
        const __m512i offset = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();                      \
        __m512 acc[W][X];                                                                                          \
        for (int i = 0; i < W; i++)                                                                                \
            for (int j = 0; j < X; j++) acc[i][j] = _mm512_setzero_ps();                                           \
        for (int64_t c = 0; c < chunks; c++) {                                                                     \
            __m512i weights[W], start[W];                                                                          \
            for (int i = 0; i < W; i++) {                                                                          \
                if (W > 1) _mm_prefetch((const char *)(w + i * k + (c + W_AHEAD) * 64), _MM_HINT_T0);             \
                weights[i] = _mm512_loadu_si512((const void *)(w + i * k + c * 64));                              \
                start[i] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, offset, weights[i]));                 \
            }                                                                                                      \
            for (int j = 0; j < X; j++) {                                                                          \
                const __m512i levels = _mm512_loadu_si512((const void *)(q + j * k + c * 64));                    \
                const __m512 scales = _mm512_loadu_ps(d + j * spread + c * 16);                                    \
                for (int i = 0; i < W; i++)                                                                        \
                    acc[i][j] = _mm512_fmadd_ps(                                                                   \
                        _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start[i], levels, weights[i])), scales, acc[i][j]); \
            }                                                                                                      \
        }                                                                                                          \
        for (int i = 0; i < W; i++)                                                                                \
            for (int j = 0; j < X; j++) sums[i * X + j] = _mm512_reduce_add_ps(acc[i][j]);                         \
        if (k % 64) { /* one block of 32 left, added last */                                                       \
            const __m256i offset8 = _mm256_set1_epi8((char)0x80), zero8 = _mm256_setzero_si256();                 \
            for (int i = 0; i < W; i++) {                                                                          \
                const __m256i weights = _mm256_loadu_si256((const __m256i *)(w + i * k + chunks * 64));           \
                const __m256i start = _mm256_sub_epi32(zero8, _mm256_dpbusd_epi32(zero8, offset8, weights));      \
                for (int j = 0; j < X; j++) {                                                                      \
                    const __m256i levels = _mm256_loadu_si256((const __m256i *)(q + j * k + chunks * 64));        \
                    const __m256 scales = _mm256_loadu_ps(d + j * spread + chunks * 16);                           \
                    sums[i * X + j] +=                                                                             \
                        hsum(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_dpbusd_epi32(start, levels, weights)), scales)); \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
    }
DOT_TILE(1, 1)
DOT_TILE(1, 4) /* TILE_X */
DOT_TILE(4, 1) /* TILE_W */
DOT_TILE(4, 4)
#else
#define VNNI_PRODUCTS 0
#define SCALE_SPREAD 1
#define TILE_W 1
#define TILE_X ROW_BLOCK
#define MIN_ROWS 1
#endif

/* q, d = the rows of x (rows, k) in blocks of QBLOCK: int8 levels and one scale a block (see above), the scale
 * written SCALE_SPREAD times and, for the VNNI products, each level stored plus 128 as an unsigned byte. Rounded to
 * nearest, ties to even (`nearbyintf` in the default rounding mode), as `torch.round` does. */
static void quantize_rows(const float *x, int64_t rows, int64_t k, int8_t *q, float *d) {
    for (int64_t block = 0; block < rows * (k / QBLOCK); block++) {
        const float *xb = x + block * QBLOCK;
        float largest = 0.0f;
        for (int i = 0; i < QBLOCK; i++) largest = fabsf(xb[i]) > largest ? fabsf(xb[i]) : largest; /* no NaN rule */
        const float scale = largest / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (int i = 0; i < SCALE_SPREAD; i++) d[block * SCALE_SPREAD + i] = scale;
        for (int i = 0; i < QBLOCK; i++) {
            const float level = nearbyintf(xb[i] * inverse);
            const int8_t clamped = (int8_t)(level > 127.0f ? 127.0f : level < -127.0f ? -127.0f : level);
            q[block * QBLOCK + i] = VNNI_PRODUCTS ? (int8_t)(uint8_t)(clamped + 128) : clamped;
        }
    }
}

static inline float dot_f32(const int8_t *restrict w, const float *restrict x, int64_t k) {
    float total = 0.0f;
    for (int64_t j = 0; j < k; j++) total += (float)w[j] * x[j];
    return total;
}

/* out[m, r - first] = (x[m] . w[r]) * s[r] (+ bias[r]) for output channels r in [first, n); x (rows, k).
 * Channels go TILE_W at a time (threads split them), rows TILE_X at a time, what is left over of either one at a
 * time; `q` and `d` hold room for x quantized (rows * k levels, rows * k / QBLOCK * SCALE_SPREAD scales). */
static void int8_matmul(const float *x, int64_t rows, int64_t k, const int8_t *w, const float *s,
                        const float *bias, int64_t first, int64_t n, float *out, int8_t *q, float *d) {
    const int64_t width = n - first, spread = k / QBLOCK * SCALE_SPREAD, groups = (width + TILE_W - 1) / TILE_W;
    const int integer = INTEGER_PRODUCTS && k % QBLOCK == 0;
    if (integer) quantize_rows(x, rows, k, q, d);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        /* Fewer rows than a tile: the product is bound by reading the weights, which stream fastest one row
         * after another (four rows side by side measured 2.4x slower at batch 1). */
        const int64_t r0 = first + g * TILE_W, channels = integer && n - r0 >= TILE_W && rows >= MIN_ROWS ? TILE_W : 1;
        for (int64_t r = r0; r < r0 + TILE_W && r < n; r += channels) {
            const int8_t *row = w + r * k;
            for (int64_t m = 0; m < rows;) {
                const int64_t count = integer && rows - m >= TILE_X ? TILE_X : 1;
                float sums[TILE_W * TILE_X];
#if VNNI_PRODUCTS
                const uint8_t *levels = (const uint8_t *)q + m * k;
                if (!integer)
                    sums[0] = dot_f32(row, x + m * k, k);
                else if (channels == TILE_W && count == TILE_X)
                    dot_tile_4x4(row, levels, d + m * spread, k, sums);
                else if (channels == TILE_W)
                    dot_tile_4x1(row, levels, d + m * spread, k, sums);
                else if (count == TILE_X)
                    dot_tile_1x4(row, levels, d + m * spread, k, sums);
                else
                    dot_tile_1x1(row, levels, d + m * spread, k, sums);
#elif INTEGER_PRODUCTS
                if (integer && count == TILE_X)
                    dot_q8_ROW_BLOCK(row, q + m * k, d + m * spread, k, sums);
                else if (integer)
                    dot_q8_1(row, q + m * k, d + m * spread, k, sums);
                else
                    sums[0] = dot_f32(row, x + m * k, k);
#else
                sums[0] = dot_f32(row, x + m * k, k);
#endif
                for (int64_t i = 0; i < channels; i++)
                    for (int64_t j = 0; j < count; j++) {
                        float value = sums[i * count + j] * s[r + i];
                        if (bias) value += bias[r + i];
                        out[(m + j) * width + (r + i - first)] = value;
                    }
                m += count;
            }
        }
    }
}

static void rms_norm(const float *x, int64_t d, const float *weight, float eps, float *out) {
    float total = 0.0f;
    for (int64_t j = 0; j < d; j++) total += x[j] * x[j];
    const float factor = 1.0f / sqrtf(total / (float)d + eps);
    for (int64_t j = 0; j < d; j++) out[j] = x[j] * factor * weight[j];
}

/* dst = src * cos + roll(src, half) * sin over one head. */
static void rotate(const float *src, float *dst, const float *cos, const float *sin, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < head_dim; i++) dst[i] = src[i] * cos[i] + src[(i + half) % head_dim] * sin[i];
}

static float silu(float v) { return v / (1.0f + expf(-v)); }

/* The cache keeps keys and values in IEEE half precision (float16), as llama.cpp does by default: a decode step
 * reads every cached entry of every layer, and past ~2,000 tokens of context that is more bytes than the weights
 * (float32 K/V of the default model: 46 KB a position). Stored rounded to nearest (ties to even, what torch's
 * `.half()` does, so a cache written by the torch prefill and one written here hold the same bits), read back
 * exactly into float32; every sum stays float32. With F16C, one instruction converts eight values each way. */
#if defined(__F16C__)
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t float_to_half(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    union { uint32_t u; float f; } out;
    if (exponent == 0x1f) out.u = sign | 0x7f800000u | (mantissa << 13); /* inf, NaN */
    else if (exponent) out.u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else { /* zero or subnormal: mantissa * 2^-24 */
        out.f = (float)mantissa * 5.9604644775390625e-8f;
        out.u |= sign;
    }
    return out.f;
}
static inline uint16_t float_to_half(float f) {
    union { float f; uint32_t u; } in = {f};
    const uint32_t sign = (in.u >> 16) & 0x8000, magnitude = in.u & 0x7fffffffu;
    if (magnitude >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (magnitude > 0x7f800000u ? 0x200 : 0));
    if (magnitude >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds past 65504: inf */
    if (magnitude < 0x38800000u) { /* below 2^-14: a subnormal half, rounded to nearest even by the float add */
        union { uint32_t u; float f; } scaled = {magnitude};
        scaled.f += 0.5f; /* 2^-1: its last mantissa bit is 2^-24, the smallest subnormal half */
        return (uint16_t)(sign | (scaled.u - 0x3f000000u));
    }
    const uint32_t odd = (magnitude >> 13) & 1; /* round to nearest, ties to even */
    return (uint16_t)(sign | ((magnitude + 0xc8000fffu + odd) >> 13));
}
#endif

static void halves_to_floats(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = half_to_float(src[i]);
}

static void floats_to_halves(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) dst[i] = float_to_half(src[i]);
}

/* The conversions the cache's entries go through, for the tests to hold against torch's `.half()`. */
void chatapp_to_halves(const float *src, uint16_t *dst, int64_t n) { floats_to_halves(src, dst, n); }
void chatapp_from_halves(const uint16_t *src, float *dst, int64_t n) { halves_to_floats(src, dst, n); }

/* Attention reads a (row, K/V head)'s cached keys, then its values, one entry per position: dh values out of every
 * kv_heads * dh, so each task walks the cache with a stride the hardware prefetchers did not follow. Measured with
 * perf, the attention loops waited on those loads, and attention took over the step as a chat grew. Asking for the
 * entry AHEAD positions on while working on this one took a step at 2,048 cached tokens from 30-38 ms to 22-24 and
 * at 512 from 14-16 to 13-14 (2-core AVX2 EPYC, float32 entries, interleaved; 4, 8 and 16 ahead measured alike). */
#ifndef AHEAD
#define AHEAD 8
#endif
#define PV_CHUNK 32 /* positions of values summed head by head (`attend_span`) */
static inline void prefetch_entry(const uint16_t *entry, int64_t dh) {
    for (int64_t at = 0; at < dh; at += 32) __builtin_prefetch(entry + at); /* one 64-byte line each */
}

/* Attention splits each (row, K/V head)'s positions into spans of SPAN, one task each, so that a batch of one row
 * with three K/V heads (the default model) keeps every thread busy: as one task per head, two threads did two heads
 * and one. Each span's softmax is local (its own peak and total); `attend` merges them in span order. The spans
 * depend on the row's length only, so a row's numbers depend neither on the rows beside it nor on the threads. */
#ifndef SPAN
#define SPAN 256
#endif

/* Scratch for one block on every row of the batch, allocated once per step. */
typedef struct {
    float *xs, *h, *qkv, *attended, *projected, *gate_up, *act;
    int8_t *q; /* a product's input quantized (`int8_matmul`): its levels, then its block scales in `d` */
    float *d;
    float *parts; /* attention's spans (`attend_span`): room for every row's, K/V head's and span's */
} Scratch;

/* A skipped token's predicted update in "predict" skip mode (`layers.SkipPredictor`): x += up . (down . h) + bias
 * for the n rows, h their normed inputs (n, D). A rank-P map: 2 * P * D multiply-adds a row, ~2% of a block. */
static void predict(const DecodeArgs *a, int64_t slot, const int64_t *rows, int64_t n, const float *h) {
    const int64_t d = a->hidden, rank = a->predictor_rank;
    const float *down = a->p_down + slot * rank * d, *up = a->p_up + slot * d * rank, *bias = a->p_bias + slot * d;
    float u[rank];
    for (int64_t i = 0; i < n; i++) {
        for (int64_t r = 0; r < rank; r++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < d; j++) acc += down[r * d + j] * h[i * d + j];
            u[r] = acc;
        }
        float *x = a->x + rows[i] * d;
        for (int64_t j = 0; j < d; j++) {
            float acc = bias[j];
            for (int64_t r = 0; r < rank; r++) acc += up[j * rank + r] * u[r];
            x[j] += acc;
        }
    }
}

/* One span [lo, hi) of one (row, K/V head)'s cached entries against its `group` query heads (the row's projected
 * q at `q_at` of `qkv`, rotated here): each head's softmax over the span, unnormalized, into `out` (group * dh),
 * with the span's peak score and total of exp(score - peak) per head. `entry0` is the element offset of the row's
 * first entry for this K/V head, `stride` the elements from one position to the next. */
static void attend_span(const float *qkv, const uint16_t *keys, const uint16_t *values, int64_t entry0,
                        int64_t stride, int64_t lo, int64_t hi, int64_t group, int64_t q_at, int64_t dh,
                        const float *cos, const float *sin, float scale, float *out, float *peaks, float *totals) {
    const int64_t width = hi - lo;
    float q[group * dh], entry[dh], scores[group * width];
    for (int64_t h = 0; h < group; h++) rotate(qkv + q_at + h * dh, q + h * dh, cos, sin, dh);
    for (int64_t s = lo; s < hi; s++) {
        const uint16_t *key = keys + entry0 + s * stride;
        if (s + AHEAD < hi) prefetch_entry(key + AHEAD * stride, dh);
        halves_to_floats(key, entry, dh);
        for (int64_t h = 0; h < group; h++) {
            float dot = 0.0f;
            for (int64_t e = 0; e < dh; e++) dot += q[h * dh + e] * entry[e];
            scores[h * width + s - lo] = dot * scale;
        }
    }
    for (int64_t h = 0; h < group; h++) {
        float *row = scores + h * width, peak = row[0], total = 0.0f;
        for (int64_t s = 1; s < width; s++) peak = row[s] > peak ? row[s] : peak;
        for (int64_t s = 0; s < width; s++) total += (row[s] = expf(row[s] - peak));
        peaks[h] = peak, totals[h] = total;
    }
    memset(out, 0, sizeof(float) * group * dh);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    /* Heads of 64 (most small models'): each head's sum stays in eight registers over PV_CHUNK positions, whose
     * values stay in L1 for the group's other heads, where the plain loop below loads and stores the sum at every
     * position and head. A step at 2,048 cached float32 tokens: 22-28 -> 20-24 ms (5 interleaved pairs). */
    if (dh == 64) {
        for (int64_t c = lo; c < hi; c += PV_CHUNK) {
            const int64_t end = c + PV_CHUNK < hi ? c + PV_CHUNK : hi;
            for (int64_t s = c; s < end && s + AHEAD < hi; s++) prefetch_entry(values + entry0 + (s + AHEAD) * stride, dh);
            for (int64_t h = 0; h < group; h++) {
                __m256 acc[8];
                for (int e = 0; e < 8; e++) acc[e] = _mm256_loadu_ps(out + h * dh + 8 * e);
                for (int64_t s = c; s < end; s++) {
                    const uint16_t *value = values + entry0 + s * stride;
                    const __m256 weight = _mm256_set1_ps(scores[h * width + s - lo]);
                    for (int e = 0; e < 8; e++)
                        acc[e] = _mm256_fmadd_ps(
                            weight, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(value + 8 * e))), acc[e]);
                }
                for (int e = 0; e < 8; e++) _mm256_storeu_ps(out + h * dh + 8 * e, acc[e]);
            }
        }
        return;
    }
#endif
    for (int64_t s = lo; s < hi; s++) {
        const uint16_t *value = values + entry0 + s * stride;
        if (s + AHEAD < hi) prefetch_entry(value + AHEAD * stride, dh);
        halves_to_floats(value, entry, dh);
        for (int64_t h = 0; h < group; h++) {
            const float weight = scores[h * width + s - lo];
            for (int64_t e = 0; e < dh; e++) out[h * dh + e] += weight * entry[e];
        }
    }
}

/* The spans of one (row, K/V head) as one softmax: each span's sums rescaled from its own peak to the overall one,
 * added in span order, divided by the rescaled totals; `parts` holds `spans` tasks' results `part` floats apart
 * (`attend_span`'s out, peaks, totals). */
static void merge_spans(const float *parts, int64_t spans, int64_t part, int64_t group, int64_t dh, float *attended) {
    for (int64_t h = 0; h < group; h++) {
        float peak = -INFINITY, total = 0.0f;
        for (int64_t s = 0; s < spans; s++) {
            const float p = parts[s * part + group * dh + h];
            peak = p > peak ? p : peak;
        }
        float *o = attended + h * dh;
        memset(o, 0, sizeof(float) * dh);
        for (int64_t s = 0; s < spans; s++) {
            const float *span = parts + s * part;
            if (span[group * dh + group + h] == 0.0f) continue; /* an empty span */
            const float weight = expf(span[group * dh + h] - peak);
            total += weight * span[group * dh + group + h];
            for (int64_t e = 0; e < dh; e++) o[e] += weight * span[h * dh + e];
        }
        const float inverse = 1.0f / total;
        for (int64_t e = 0; e < dh; e++) o[e] *= inverse;
    }
}

/* One decoder block on `n` rows (indices `rows` into the batch and the cache), whose tokens are stored at slots
 * `slots`. `kv_only`: store K/V and stop (an STT layer's skipped token in "kv" mode), after adding the predicted
 * update in "predict" mode. */
static void block(const DecodeArgs *a, int64_t layer, const int64_t *rows, const int64_t *slots, int64_t n,
                  int kv_only, Scratch *t) {
    const int64_t d = a->hidden, dh = a->head_dim, hkv = a->kv_heads, q_width = a->heads * dh;
    const int64_t kv_width = hkv * dh, inter = a->up_rows / 2, s1 = a->slots;
    const int64_t first = kv_only ? q_width : 0, qkv_width = a->qkv_rows - first;
    uint16_t *keys = a->keys + layer * a->batch * s1 * kv_width, *values = a->values + layer * a->batch * s1 * kv_width;

    for (int64_t i = 0; i < n; i++) {
        memcpy(t->xs + i * d, a->x + rows[i] * d, d * sizeof(float));
        rms_norm(t->xs + i * d, d, a->norm1 + layer * d, a->eps1[layer], t->h + i * d);
    }
    int8_matmul(t->h, n, d, a->qkv_w + layer * a->qkv_rows * d, a->qkv_s + layer * a->qkv_rows,
                a->has_bias ? a->qkv_b + layer * a->qkv_rows : NULL, first, a->qkv_rows, t->qkv, t->q, t->d);
    const int64_t k_at = q_width - first, v_at = k_at + kv_width;
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = rows[i];
        for (int64_t g = 0; g < hkv; g++) {
            const int64_t at = ((b * s1 + slots[i]) * hkv + g) * dh;
            float key[dh];
            rotate(t->qkv + i * qkv_width + k_at + g * dh, key, a->cos + b * dh, a->sin + b * dh, dh);
            floats_to_halves(key, keys + at, dh);
            floats_to_halves(t->qkv + i * qkv_width + v_at + g * dh, values + at, dh);
        }
    }
    if (kv_only) {
        if (a->predictor_rank > 0) predict(a, a->stt_slot[layer], rows, n, t->h);
        return;
    }

    /* Attention over the row's entries 0..slot, softmax in float32: one task per (row, K/V head, span of SPAN
     * positions), whose query heads read each key and value once between them; then each (row, K/V head)'s spans
     * merged in order. */
    const int64_t group = a->heads / hkv;
    int64_t most = 0;
    for (int64_t i = 0; i < n; i++) most = slots[i] + 1 > most ? slots[i] + 1 : most;
    const int64_t spans = (most + SPAN - 1) / SPAN, tasks = n * hkv * spans;
    /* Per task: its heads' unnormalized outputs (group * dh), then their peaks and totals (group each). */
    const int64_t part = group * dh + 2 * group;
    float *parts = t->parts;
    const float scale = 1.0f / sqrtf((float)dh);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t i = task / (hkv * spans), g = task / spans % hkv, span = task % spans;
        const int64_t b = rows[i], count = slots[i] + 1, lo = span * SPAN, hi = lo + SPAN < count ? lo + SPAN : count;
        float *out = parts + task * part, *peaks = out + group * dh, *totals = peaks + group;
        if (lo >= hi) { /* past this row's length: an empty span */
            for (int64_t h = 0; h < group; h++) peaks[h] = -INFINITY, totals[h] = 0.0f;
            continue;
        }
        attend_span(t->qkv + i * qkv_width, keys, values, ((b * s1) * hkv + g) * dh, hkv * dh, lo, hi, group,
                    (g * group) * dh, dh, a->cos + b * dh, a->sin + b * dh, scale, out, peaks, totals);
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t g = 0; g < hkv; g++)
            merge_spans(parts + (i * hkv + g) * spans * part, spans, part, group, dh,
                        t->attended + i * q_width + g * group * dh);
    int8_matmul(t->attended, n, q_width, a->o_w + layer * d * q_width, a->o_s + layer * d, NULL, 0, d, t->projected, t->q,
                t->d);
    for (int64_t j = 0; j < n * d; j++) t->xs[j] += t->projected[j];

    /* SwiGLU MLP: gate and up are one product, gate first. */
    for (int64_t i = 0; i < n; i++) rms_norm(t->xs + i * d, d, a->norm2 + layer * d, a->eps2[layer], t->h + i * d);
    int8_matmul(t->h, n, d, a->up_w + layer * a->up_rows * d, a->up_s + layer * a->up_rows, NULL, 0, a->up_rows,
                t->gate_up, t->q, t->d);
    for (int64_t i = 0; i < n; i++)
        for (int64_t e = 0; e < inter; e++)
            t->act[i * inter + e] = silu(t->gate_up[i * a->up_rows + e]) * t->gate_up[i * a->up_rows + inter + e];
    int8_matmul(t->act, n, inter, a->down_w + layer * d * inter, a->down_s + layer * d, NULL, 0, d, t->projected, t->q,
                t->d);
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < d; j++) a->x[rows[i] * d + j] = t->xs[i * d + j] + t->projected[i * d + j];
}

/* The causal router's probability of "process x_t" for each of the `n` rows `rows` (`layers.CausalRouter`, then a
 * sigmoid): a small float32 MLP on the RMS-normed current and previous layer inputs, side by side. */
static void router(const DecodeArgs *a, int64_t slot, const int64_t *rows, int64_t n) {
    const int64_t d = a->hidden, width = a->router_width;
    float features[2 * d];
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = rows[i];
        rms_norm(a->x + b * d, d, a->r_norm_c + slot * d, a->r_eps_c[slot], features);
        rms_norm(a->previous + (slot * a->batch + b) * d, d, a->r_norm_p + slot * d, a->r_eps_p[slot], features + d);
        float logit = a->r_out_b[slot];
        for (int64_t r = 0; r < width; r++) {
            const float *w = a->r_up_w + (slot * width + r) * 2 * d;
            float acc = a->r_up_b[slot * width + r];
            for (int64_t j = 0; j < 2 * d; j++) acc += w[j] * features[j];
            logit += a->r_out_w[slot * width + r] * silu(acc);
        }
        a->probs[slot * a->batch + b] = 1.0f / (1.0f + expf(-logit));
    }
}

/* One decode step of every active row (the rules of `decode.decode_step`, which tests/stt/test_gemv.py checks):
 * - a row whose `active` flag is 0 is left as it was: no router, no block, no cache write, no logits (its
 *   `inputs` keep its `previous`), so a batch can feed some rows and not others (finished rows, a row that feeds
 *   a longer run of known tokens than the rest) without leaving this call; `active` NULL: every row;
 * - at an STT layer its router reads the layer input beside `previous` into `probs`, and the input is kept in
 *   `inputs` for the next token;
 * - with `student` a row runs an STT layer only when its probability is at or above its cutoff; a skipped row
 *   stores its K/V only (`store_skipped`, "kv" mode; plus its predicted update with `predictor_rank`, "predict")
 *   or nothing ("strict": its trash slot takes the position);
 * - a row's length at a layer grows by one wherever it stored its token; `positions` records the token's position
 *   `seen[b]` at its slot, and `seen` grows by one;
 * - with `states`, every layer's output of every active row is written there (the lens reads them).
 * Every row's numbers are computed in the same order whatever the other rows are (see `int8_matmul`), so a row
 * decodes the same in any batch. Returns 0, or -1 for a call it does not take (no rows, or out of memory). */
static int decode(const DecodeArgs *a) {
    const int64_t batch = a->batch, d = a->hidden, s1 = a->slots, trash = s1 - 1;
    if (batch < 1) return -1;
    const int64_t q_width = a->heads * a->head_dim, inter = a->up_rows / 2;
    Scratch t;
    const int64_t widest = a->qkv_rows > a->up_rows ? a->qkv_rows : a->up_rows;
    /* The widest product input is the hidden state, the attention output or the MLP's activation. */
    const int64_t longest = d > q_width ? (d > inter ? d : inter) : (q_width > inter ? q_width : inter);
    /* The active rows first: an idle row takes no part in the step. */
    int64_t nl = 0;
    for (int64_t b = 0; b < batch; b++) nl += !a->active || a->active[b];
    /* Scratch for the blocks; with idle rows, also the active rows' logits before each is copied to its row. */
    const int64_t head_scratch = nl < batch ? nl * a->vocab : 0;
    /* Attention's spans: at most every row's, K/V head's and span of the cache's slots (`block`). */
    const int64_t group = a->heads / a->kv_heads, span_parts = batch * a->kv_heads * ((s1 + SPAN - 1) / SPAN) *
                                                                (group * a->head_dim + 2 * group);
    float *memory = malloc(sizeof(float) * (batch * (3 * d + widest + q_width + a->up_rows + inter
                                                     + longest / QBLOCK * SCALE_SPREAD) + head_scratch + span_parts)
                           + batch * longest);
    /* The active rows; per layer, which of them run the block and which store K/V only, with their slots. */
    int64_t *row_lists = malloc(sizeof(int64_t) * 5 * batch);
    uint8_t *run = malloc(batch);
    if (!memory || !row_lists || !run) {
        free(memory);
        free(row_lists);
        free(run);
        return -1;
    }
    int64_t *live = row_lists, *taken = live + batch, *taken_slots = taken + batch, *skipped = taken_slots + batch,
            *skipped_slots = skipped + batch;
    for (int64_t b = 0, i = 0; b < batch; b++)
        if (!a->active || a->active[b]) live[i++] = b;
    t.xs = memory;
    t.h = t.xs + batch * d;
    t.projected = t.h + batch * d;
    t.qkv = t.projected + batch * d;
    t.attended = t.qkv + batch * widest;
    t.gate_up = t.attended + batch * q_width;
    t.act = t.gate_up + batch * a->up_rows;
    t.d = t.act + batch * inter;
    float *head = t.d + batch * (longest / QBLOCK * SCALE_SPREAD);
    t.parts = head + head_scratch;
    t.q = (int8_t *)(t.parts + span_parts);

    for (int64_t layer = 0; layer < a->layers; layer++) {
        const int64_t slot = a->stt_slot[layer];
        int64_t *lengths = a->lengths + layer * batch;
        int32_t *positions = a->positions + layer * batch * s1;
        for (int64_t i = 0; i < nl; i++) run[live[i]] = 1;
        if (slot >= 0) {
            float *inputs = a->inputs + slot * batch * d;
            if (nl < batch) /* an idle row's next token reads the input it kept */
                memcpy(inputs, a->previous + slot * batch * d, sizeof(float) * batch * d);
            for (int64_t i = 0; i < nl; i++) memcpy(inputs + live[i] * d, a->x + live[i] * d, sizeof(float) * d);
            router(a, slot, live, nl);
            for (int64_t i = 0; i < nl; i++) {
                const int64_t b = live[i];
                if (a->student) run[b] = a->probs[slot * batch + b] >= a->cutoff[b];
                a->selected[slot * batch + b] = run[b];
            }
        }
        int64_t nt = 0, ns = 0;
        for (int64_t i = 0; i < nl; i++) {
            const int64_t b = live[i];
            if (run[b]) {
                taken[nt] = b;
                taken_slots[nt++] = lengths[b];
                positions[b * s1 + lengths[b]] = (int32_t)a->seen[b];
            } else {
                skipped[ns] = b;
                skipped_slots[ns++] = lengths[b];
            }
        }
        if (nt) block(a, layer, taken, taken_slots, nt, 0, &t);
        if (ns && a->store_skipped) {
            block(a, layer, skipped, skipped_slots, ns, 1, &t);
            for (int64_t i = 0; i < ns; i++) {
                positions[skipped[i] * s1 + lengths[skipped[i]]] = (int32_t)a->seen[skipped[i]];
                lengths[skipped[i]]++;
            }
        } else {
            for (int64_t i = 0; i < ns; i++) positions[skipped[i] * s1 + trash] = (int32_t)a->seen[skipped[i]];
        }
        for (int64_t i = 0; i < nt; i++) lengths[taken[i]]++;
        if (a->states)
            for (int64_t i = 0; i < nl; i++)
                memcpy(a->states + (layer * batch + live[i]) * d, a->x + live[i] * d, sizeof(float) * d);
    }
    for (int64_t i = 0; i < nl; i++) {
        a->seen[live[i]]++;
        rms_norm(a->x + live[i] * d, d, a->final_norm, a->final_eps, t.h + i * d);
    }
    if (nl == batch) {
        int8_matmul(t.h, batch, d, a->head_w, a->head_s, NULL, 0, a->vocab, a->logits, t.q, t.d);
    } else if (nl > 0) { /* the active rows' logits, then each copied to its row */
        int8_matmul(t.h, nl, d, a->head_w, a->head_s, NULL, 0, a->vocab, head, t.q, t.d);
        for (int64_t i = 0; i < nl; i++)
            memcpy(a->logits + live[i] * a->vocab, head + i * a->vocab, sizeof(float) * a->vocab);
    }
    free(memory);
    free(row_lists);
    free(run);
    return 0;
}

/* The step at `threads` threads, the caller's own OpenMP thread count left as it was: torch's CPU ops read the same
 * setting (its intra-op pool is this libgomp's), so a step that set it would leave torch, and the thread governor
 * that reads torch's count as its ceiling, at the step's count. */
int chatapp_decode(const DecodeArgs *a) {
    const int before = omp_get_max_threads();
    if (a->threads > 0) omp_set_num_threads((int)a->threads);
    const int result = decode(a);
    omp_set_num_threads(before);
    return result;
}
