/* The int8 decode step of an STT model on a CPU, the whole step in one call (see chatapp/stt/cpu_step.py, which
 * builds this file with the system's C compiler and calls `chatapp_decode` through ctypes).
 *
 * At batch 1 a decode step of the default model in int8 is 120 matrix-vector products over 106 MB of weights plus
 * the small work around them (norms, rotary, cache writes, attention, activations, routers). torch's weight-only
 * kernel (`_weight_int8pack_mm`) is written for AVX-512 and streamed weights at 7.5-14 GB/s on a 2-core AVX2 EPYC,
 * and each of the ~40 small torch ops of a block costs a few microseconds of dispatch. Here a product reads each
 * weight row once for all rows of the batch (int8 widened to float32, four independent vector sums so the adds
 * do not wait on each other, widened once for two rows: `DOT_ROWS`), and everything else is plain loops.
 *
 * The arithmetic is the eager torch step's with the int8 weights dequantized exactly (`q * scale`, one scale per
 * output channel, applied after the sum) and float32 throughout where the eager step rounds activations to
 * bfloat16: tests/stt/test_gemv.py compares the two on the same weights, step by step.
 *
 * Parallel loops (OpenMP) run output channels (a product) or (row, K/V head) pairs (attention).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define MAX_ROWS 8
#ifndef ROW_BLOCK
#define ROW_BLOCK 2 /* rows a weight row is widened for at once (int8_matmul) */
#endif

/* Every array is C-contiguous float32 unless named otherwise; per-layer arrays are stacked on a first axis of
 * layers (L), the routers' on one of STT layers (L_stt). Mirrored field for field by `cpu_step.DecodeArgs`. */
typedef struct {
    int64_t batch, hidden, layers, heads, kv_heads, head_dim, qkv_rows, up_rows, vocab, slots, stt_count,
        router_width, has_bias, student, store_skipped, threads;
    float *x;                                 /* (B, D) the token embeddings; the final hidden state after */
    const float *norm1, *eps1;                /* (L, D), (L) */
    const int8_t *qkv_w;                      /* (L, QKV, D) */
    const float *qkv_s, *qkv_b;               /* (L, QKV) each; qkv_b only when has_bias */
    const int8_t *o_w;                        /* (L, D, H * Dh) */
    const float *o_s;                         /* (L, D) */
    const float *norm2, *eps2;                /* (L, D), (L) */
    const int8_t *up_w;                       /* (L, 2I, D): gate rows, then up rows */
    const float *up_s;                        /* (L, 2I) */
    const int8_t *down_w;                     /* (L, D, I) */
    const float *down_s;                      /* (L, D) */
    const float *r_norm_c, *r_eps_c, *r_norm_p, *r_eps_p; /* (L_stt, D), (L_stt) each */
    const float *r_up_w, *r_up_b, *r_out_w, *r_out_b;     /* (L_stt, R, 2D), (L_stt, R), (L_stt, R), (L_stt) */
    const int64_t *stt_slot;                  /* (L): the layer's STT index, -1 for a dense layer */
    float *keys, *values;                     /* (L, B, S + 1, H_kv, Dh): slot S is the trash slot */
    int64_t *lengths;                         /* (L, B) */
    int32_t *positions;                       /* (L, B, S + 1), as the cache keeps them */
    int64_t *seen;                            /* (B) */
    const float *previous;                    /* (L_stt, B, D): each STT layer's input one token before */
    float *inputs;                            /* (L_stt, B, D): this token's, for the next step */
    const float *cos, *sin;                   /* (B, Dh) at each row's position; sin signed as decode.rope_tables */
    const float *cutoff;                      /* (B) */
    const float *final_norm;                  /* (D) */
    float final_eps;
    const int8_t *head_w;                     /* (V, D) */
    const float *head_s;                      /* (V) */
    float *logits;                            /* (B, V) */
    float *probs;                             /* (L_stt, B) */
    uint8_t *selected;                        /* (L_stt, B) */
} DecodeArgs;

/* The dot products of one int8 weight row with ROWS float32 rows. With AVX2, 32 weights an iteration, widened to
 * float32 once and used for every row, each row summed into four independent vectors: with one, every add waits
 * on the one before it and the product is latency-bound (measured on the 2-core EPYC: 21 GB/s of weights on two
 * threads at one row, against 15 for what gcc makes of the plain loop), and widening the weights again for every
 * row made a batch of 8 cost nearly 8 rows' time. Every row is summed in the same order whatever ROWS is, so a
 * row's result does not depend on the rows beside it (tests/stt/test_gemv.py). Elsewhere, the plain loop for the
 * compiler to vectorize. */
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 widen(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

static inline float finish(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    half = _mm_hadd_ps(half, half);
    return _mm_cvtss_f32(_mm_hadd_ps(half, half));
}

#define DOT_ROWS(ROWS)                                                                                               \
    static inline void dot_i8_##ROWS(const int8_t *restrict w, const float *restrict x, int64_t k,                 \
                                     float *restrict out) {                                                        \
        __m256 acc[ROWS][4];                                                                                       \
        for (int m = 0; m < ROWS; m++) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = _mm256_setzero_ps();       \
        int64_t j = 0;                                                                                             \
        for (; j + 32 <= k; j += 32) {                                                                             \
            const __m128i low = _mm_loadu_si128((const __m128i *)(w + j));                                        \
            const __m128i high = _mm_loadu_si128((const __m128i *)(w + j + 16));                                  \
            const __m256 w0 = widen(low), w1 = widen(_mm_srli_si128(low, 8));                                      \
            const __m256 w2 = widen(high), w3 = widen(_mm_srli_si128(high, 8));                                    \
            for (int m = 0; m < ROWS; m++) {                                                                       \
                const float *xm = x + m * k + j;                                                                   \
                acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), acc[m][0]);                                   \
                acc[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), acc[m][1]);                               \
                acc[m][2] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xm + 16), acc[m][2]);                              \
                acc[m][3] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xm + 24), acc[m][3]);                              \
            }                                                                                                      \
        }                                                                                                          \
        for (int m = 0; m < ROWS; m++) {                                                                           \
            float total = finish(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);                                      \
            for (int64_t i = j; i < k; i++) total += (float)w[i] * x[m * k + i];                                   \
            out[m] = total;                                                                                        \
        }                                                                                                          \
    }
DOT_ROWS(1)
DOT_ROWS(ROW_BLOCK)
#else
static inline void dot_i8_rows(const int8_t *restrict w, const float *restrict x, int64_t k, int64_t rows,
                               float *restrict out) {
    for (int64_t m = 0; m < rows; m++) {
        float total = 0.0f;
        for (int64_t j = 0; j < k; j++) total += (float)w[j] * x[m * k + j];
        out[m] = total;
    }
}
#define dot_i8_1(w, x, k, out) dot_i8_rows(w, x, k, 1, out)
#define dot_i8_ROW_BLOCK(w, x, k, out) dot_i8_rows(w, x, k, ROW_BLOCK, out)
#endif

/* out[m, r - first] = (x[m] . w[r]) * s[r] (+ bias[r]) for output channels r in [first, n); x (rows, k), rows
 * taken ROW_BLOCK at a time. */
static void int8_matmul(const float *x, int64_t rows, int64_t k, const int8_t *w, const float *s,
                        const float *bias, int64_t first, int64_t n, float *out) {
    const int64_t width = n - first;
#pragma omp parallel for schedule(static)
    for (int64_t r = first; r < n; r++) {
        const int8_t *row = w + r * k;
        float dots[ROW_BLOCK];
        for (int64_t m = 0; m < rows;) {
            const int64_t count = rows - m >= ROW_BLOCK ? ROW_BLOCK : 1;
            if (count == ROW_BLOCK)
                dot_i8_ROW_BLOCK(row, x + m * k, k, dots);
            else
                dot_i8_1(row, x + m * k, k, dots);
            for (int64_t i = 0; i < count; i++) {
                float value = dots[i] * s[r];
                if (bias) value += bias[r];
                out[(m + i) * width + (r - first)] = value;
            }
            m += count;
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

/* Scratch for one block on up to MAX_ROWS rows, allocated once per step. */
typedef struct {
    float *xs, *h, *qkv, *attended, *projected, *gate_up, *act;
} Scratch;

/* One decoder block on `n` rows (indices `rows` into the batch and the cache), whose tokens are stored at slots
 * `slots`. `kv_only`: store K/V and stop (an STT layer's skipped token in "kv" mode). */
static void block(const DecodeArgs *a, int64_t layer, const int64_t *rows, const int64_t *slots, int64_t n,
                  int kv_only, Scratch *t) {
    const int64_t d = a->hidden, dh = a->head_dim, hkv = a->kv_heads, q_width = a->heads * dh;
    const int64_t kv_width = hkv * dh, inter = a->up_rows / 2, s1 = a->slots;
    const int64_t first = kv_only ? q_width : 0, qkv_width = a->qkv_rows - first;
    float *keys = a->keys + layer * a->batch * s1 * kv_width, *values = a->values + layer * a->batch * s1 * kv_width;

    for (int64_t i = 0; i < n; i++) {
        memcpy(t->xs + i * d, a->x + rows[i] * d, d * sizeof(float));
        rms_norm(t->xs + i * d, d, a->norm1 + layer * d, a->eps1[layer], t->h + i * d);
    }
    int8_matmul(t->h, n, d, a->qkv_w + layer * a->qkv_rows * d, a->qkv_s + layer * a->qkv_rows,
                a->has_bias ? a->qkv_b + layer * a->qkv_rows : NULL, first, a->qkv_rows, t->qkv);
    const int64_t k_at = q_width - first, v_at = k_at + kv_width;
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = rows[i];
        for (int64_t g = 0; g < hkv; g++) {
            const int64_t at = ((b * s1 + slots[i]) * hkv + g) * dh;
            rotate(t->qkv + i * qkv_width + k_at + g * dh, keys + at, a->cos + b * dh, a->sin + b * dh, dh);
            memcpy(values + at, t->qkv + i * qkv_width + v_at + g * dh, dh * sizeof(float));
        }
    }
    if (kv_only) return;

    /* Attention over the row's entries 0..slot, softmax in float32: one task per (row, K/V head), whose query
     * heads read each key and value once between them. */
    const int64_t group = a->heads / hkv;
    const float scale = 1.0f / sqrtf((float)dh);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < n * hkv; task++) {
        const int64_t i = task / hkv, g = task % hkv, b = rows[i], count = slots[i] + 1;
        float q[group * dh], out[group * dh];
        float *scores = malloc(sizeof(float) * group * count);
        for (int64_t h = 0; h < group; h++)
            rotate(t->qkv + i * qkv_width + (g * group + h) * dh, q + h * dh, a->cos + b * dh, a->sin + b * dh, dh);
        for (int64_t s = 0; s < count; s++) {
            const float *key = keys + ((b * s1 + s) * hkv + g) * dh;
            for (int64_t h = 0; h < group; h++) {
                float dot = 0.0f;
                for (int64_t e = 0; e < dh; e++) dot += q[h * dh + e] * key[e];
                scores[h * count + s] = dot * scale;
            }
        }
        for (int64_t h = 0; h < group; h++) {
            float *row = scores + h * count, peak = row[0], total = 0.0f;
            for (int64_t s = 1; s < count; s++) peak = row[s] > peak ? row[s] : peak;
            for (int64_t s = 0; s < count; s++) total += (row[s] = expf(row[s] - peak));
            for (int64_t s = 0; s < count; s++) row[s] /= total;
        }
        memset(out, 0, sizeof(out));
        for (int64_t s = 0; s < count; s++) {
            const float *value = values + ((b * s1 + s) * hkv + g) * dh;
            for (int64_t h = 0; h < group; h++) {
                const float weight = scores[h * count + s];
                for (int64_t e = 0; e < dh; e++) out[h * dh + e] += weight * value[e];
            }
        }
        memcpy(t->attended + i * q_width + g * group * dh, out, sizeof(out));
        free(scores);
    }
    int8_matmul(t->attended, n, q_width, a->o_w + layer * d * q_width, a->o_s + layer * d, NULL, 0, d, t->projected);
    for (int64_t j = 0; j < n * d; j++) t->xs[j] += t->projected[j];

    /* SwiGLU MLP: gate and up are one product, gate first. */
    for (int64_t i = 0; i < n; i++) rms_norm(t->xs + i * d, d, a->norm2 + layer * d, a->eps2[layer], t->h + i * d);
    int8_matmul(t->h, n, d, a->up_w + layer * a->up_rows * d, a->up_s + layer * a->up_rows, NULL, 0, a->up_rows,
                t->gate_up);
    for (int64_t i = 0; i < n; i++)
        for (int64_t e = 0; e < inter; e++)
            t->act[i * inter + e] = silu(t->gate_up[i * a->up_rows + e]) * t->gate_up[i * a->up_rows + inter + e];
    int8_matmul(t->act, n, inter, a->down_w + layer * d * inter, a->down_s + layer * d, NULL, 0, d, t->projected);
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < d; j++) a->x[rows[i] * d + j] = t->xs[i * d + j] + t->projected[i * d + j];
}

/* The causal router's probability of "process x_t" for each row (`layers.CausalRouter`, then a sigmoid): a small
 * float32 MLP on the RMS-normed current and previous layer inputs, side by side. */
static void router(const DecodeArgs *a, int64_t slot) {
    const int64_t d = a->hidden, width = a->router_width;
    float features[2 * d];
    for (int64_t b = 0; b < a->batch; b++) {
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

/* One decode step of every row (the rules of `decode.decode_step`, which tests/stt/test_gemv.py checks):
 * - at an STT layer its router reads the layer input beside `previous` into `probs`, and the input is kept in
 *   `inputs` for the next token;
 * - with `student` a row runs an STT layer only when its probability is at or above its cutoff; a skipped row
 *   stores its K/V only (`store_skipped`, "kv" mode) or nothing ("strict": its trash slot takes the position);
 * - a row's length at a layer grows by one wherever it stored its token; `positions` records the token's position
 *   `seen[b]` at its slot, and `seen` grows by one.
 * Returns 0, or -1 for a call it does not take (more than MAX_ROWS rows, or out of memory). */
int chatapp_decode(const DecodeArgs *a) {
    const int64_t batch = a->batch, d = a->hidden, s1 = a->slots, trash = s1 - 1;
    if (batch < 1 || batch > MAX_ROWS) return -1;
    if (a->threads > 0) omp_set_num_threads((int)a->threads);
    const int64_t q_width = a->heads * a->head_dim, inter = a->up_rows / 2;
    Scratch t;
    const int64_t widest = a->qkv_rows > a->up_rows ? a->qkv_rows : a->up_rows;
    float *memory = malloc(sizeof(float) * batch * (3 * d + widest + q_width + a->up_rows + inter));
    if (!memory) return -1;
    t.xs = memory;
    t.h = t.xs + batch * d;
    t.projected = t.h + batch * d;
    t.qkv = t.projected + batch * d;
    t.attended = t.qkv + batch * widest;
    t.gate_up = t.attended + batch * q_width;
    t.act = t.gate_up + batch * a->up_rows;

    for (int64_t layer = 0; layer < a->layers; layer++) {
        const int64_t slot = a->stt_slot[layer];
        int64_t *lengths = a->lengths + layer * batch;
        int32_t *positions = a->positions + layer * batch * s1;
        uint8_t run[MAX_ROWS];
        for (int64_t b = 0; b < batch; b++) run[b] = 1;
        if (slot >= 0) {
            memcpy(a->inputs + slot * batch * d, a->x, sizeof(float) * batch * d);
            router(a, slot);
            for (int64_t b = 0; b < batch; b++) {
                if (a->student) run[b] = a->probs[slot * batch + b] >= a->cutoff[b];
                a->selected[slot * batch + b] = run[b];
            }
        }
        int64_t taken[MAX_ROWS], taken_slots[MAX_ROWS], skipped[MAX_ROWS], skipped_slots[MAX_ROWS], nt = 0, ns = 0;
        for (int64_t b = 0; b < batch; b++) {
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
    }
    for (int64_t b = 0; b < batch; b++) {
        a->seen[b]++;
        rms_norm(a->x + b * d, d, a->final_norm, a->final_eps, t.h + b * d);
    }
    int8_matmul(t.h, batch, d, a->head_w, a->head_s, NULL, 0, a->vocab, a->logits);
    free(memory);
    return 0;
}
