/* nmt's fused CPU kernels: the elementwise work of one RNN time step (GRU and LSTM, forward
 * and backward, all directions at once) in one pass over its tensors, where torch runs 9 to 15
 * small ops. nmt.native compiles this file with the machine's C compiler on first use and
 * calls it through ctypes; nmt.rnn runs torch ops instead where no compiler is found.
 *
 * Layout: every (D, B, F) argument is D blocks of B contiguous rows of F floats, block d
 * starting at ptr + d * <name>_ds elements (the loop's buffers hold all steps, so one step's
 * slice is strided over the directions). "mm" arguments are in the matmul dtype: bfloat16
 * (uint16_t bits) in the _bf16 variants, float in the _f32 ones. keep (D, B) is 1 where the
 * step is a real token of the sentence and 0 past its end, or NULL when every sentence goes on.
 *
 * Equations (torch's conventions and gate order; s = logistic sigmoid):
 *   GRU:  r = s(a_r)  z = s(a_z)  n = tanh(n_in + r * a_n)  h' = (1 - z) n + z h
 *         (a = W_h h + b_h + W_i x + b_i for r and z, a_n = W_hn h + b_hn)
 *   LSTM: i, f, o = s(a_i, a_f, a_o)  g = tanh(a_g)  c' = f c + i g  h' = o tanh(c')
 * tanh x is evaluated as 2 s(2x) - 1; s x = 1 / (1 + exp(-x)), with exp from the polynomial
 * below (within 2 float32 rounding steps of the exact value).
 */

#include <stdint.h>
#include <math.h>
#include <omp.h>
#include <string.h>

typedef uint16_t bf16;

static inline float from_bf16(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch rounds float32 to bfloat16 (NaN -> 0x7fc0). */
static inline bf16 to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

static inline float as_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t as_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* exp(x): x = k ln 2 + r with |r| <= ln(2) / 2 (ln 2 split in two for an exact k ln 2), a
 * degree-6 polynomial for exp(r) (Cephes' expf coefficients) and 2^k from the exponent bits.
 * x is clamped to [-87.3, 88], so 2^k stays a normal float; NaN stays NaN. */
static inline float exp_approx(float x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    x = x > 88.0f ? 88.0f : x;
    x = x < -87.3f ? -87.3f : x;
    float shifted = x * 1.44269504088896341f + magic;
    float k = shifted - magic;
    float r = x - k * 0.693359375f;
    r = r + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t exponent = (as_bits(shifted) - as_bits(magic) + 127u) << 23;
    return p * as_float(exponent);
}

static inline float sigmoid(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

static inline float tanh_approx(float x) { return 2.0f * sigmoid(2.0f * x) - 1.0f; }

/* A step's rows are split between threads when it has at least this many elements. */
#define MIN_PARALLEL 16384

#define LOAD_bf16(p, i) from_bf16((p)[i])
#define LOAD_f32(p, i) ((p)[i])
#define STORE_bf16(p, i, v) ((p)[i] = to_bf16(v))
#define STORE_f32(p, i, v) ((p)[i] = (v))

/* Each kernel is a loop over the (direction, sentence) rows of a step, in parallel on the
 * caller's number of threads, calling a row function that GCC vectorises over the H units
 * (it does not vectorise the same loop inlined into the OpenMP region). */
#define ROWS(D, B, H, CALL)                                                                    \
    int64_t work = (D) * (B) * (H);                                                            \
    _Pragma("omp parallel for collapse(2) num_threads(threads) if (work >= MIN_PARALLEL)")     \
    for (int64_t d = 0; d < (D); d++) {                                                        \
        for (int64_t b = 0; b < (B); b++) {                                                    \
            CALL;                                                                              \
        }                                                                                      \
    }

#define NOINLINE __attribute__((noinline))

/* h' (H) in the matmul dtype, for the next step's matmul. */
#define STORE_ROW(SUFFIX, MM)                                                                  \
    static inline void store_row_##SUFFIX(MM *restrict out, const float *restrict h,           \
                                          int64_t H) {                                         \
        for (int64_t j = 0; j < H; j++) STORE_##SUFFIX(out, j, h[j]);                          \
    }

STORE_ROW(bf16, bf16)
STORE_ROW(f32, float)

/* ------------------------------------------------------------------------------------ GRU */

#define GRU(SUFFIX, MM)                                                                        \
    static NOINLINE void gru_forward_row_##SUFFIX(                                             \
        const MM *restrict a, const float *restrict x, const float *restrict hp,               \
        int going, float *restrict n, float *restrict ho, MM *restrict po, int64_t H) {        \
        for (int64_t j = 0; j < H; j++) {                                                      \
            float r = sigmoid(LOAD_##SUFFIX(a, j));                                            \
            float z = sigmoid(LOAD_##SUFFIX(a, H + j));                                        \
            float nj = tanh_approx(x[j] + r * LOAD_##SUFFIX(a, 2 * H + j));                    \
            n[j] = nj;                                                                         \
            ho[j] = going ? nj + z * (hp[j] - nj) : hp[j];                                     \
        }                                                                                      \
        if (po != NULL) store_row_##SUFFIX(po, ho, H);                                         \
    }                                                                                          \
                                                                                               \
    /* pre (D, B, 3H) mm, contiguous: a_r, a_z, a_n; n_in, h (D, B, H) -> n_out, h_out and,    \
     * unless NULL, prev_out: h' in the matmul dtype for the next step's matmul. */            \
    void nmt_gru_forward_##SUFFIX(const MM *pre, const float *n_in, int64_t n_in_ds,           \
                                  const float *h, int64_t h_ds, const float *keep,             \
                                  int64_t keep_ds, float *n_out, int64_t n_out_ds,             \
                                  float *h_out, int64_t h_out_ds, MM *prev_out,                \
                                  int64_t prev_ds, int64_t D, int64_t B, int64_t H,            \
                                  int32_t threads) {                                           \
        ROWS(D, B, H,                                                                          \
             gru_forward_row_##SUFFIX(                                                         \
                 pre + (d * B + b) * 3 * H, n_in + d * n_in_ds + b * H, h + d * h_ds + b * H,  \
                 keep == NULL || keep[d * keep_ds + b] != 0.0f, n_out + d * n_out_ds + b * H,  \
                 h_out + d * h_out_ds + b * H,                                                 \
                 prev_out == NULL ? NULL : prev_out + d * prev_ds + b * H, H))                 \
    }                                                                                          \
                                                                                               \
    static NOINLINE void gru_backward_row_##SUFFIX(                                            \
        float *restrict cr, const MM *restrict rc, const float *restrict go, float going,      \
        const MM *restrict a, const float *restrict nn, const float *restrict hp,              \
        MM *restrict gg, MM *restrict gn, int64_t H) {                                         \
        for (int64_t j = 0; j < H; j++) {                                                      \
            float dh = cr[j] + LOAD_##SUFFIX(rc, j);                                           \
            dh += go[j];                                                                       \
            float dstep = dh * going;                                                          \
            float r = sigmoid(LOAD_##SUFFIX(a, j));                                            \
            float z = sigmoid(LOAD_##SUFFIX(a, H + j));                                        \
            float nj = nn[j];                                                                  \
            float dn = (dstep - dstep * z) * (1.0f - nj * nj);                                 \
            STORE_##SUFFIX(gg, j, dn * LOAD_##SUFFIX(a, 2 * H + j) * (r - r * r));             \
            STORE_##SUFFIX(gg, H + j, dstep * (hp[j] - nj) * (z - z * z));                     \
            STORE_##SUFFIX(gg, 2 * H + j, dn * r);                                             \
            STORE_##SUFFIX(gn, j, dn);                                                         \
            cr[j] = going != 0.0f ? dstep * z : dh;                                            \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    /* carry (D, B, H) float, contiguous: the part of dL/dh' that does not pass through W_h,   \
     * updated in place; rec (D, B, H) mm, contiguous: the part that does (W_h^T times the     \
     * next step's gate gradients; zeros at the last step); grad_out: dL/dh' from the outputs; \
     * pre, n, h_prev as the forward step had them -> grad_gates (D, B, 3H) mm: the gradients  \
     * at a_r, a_z (pre-activations) and at a_n; grad_n_in (D, B, H) mm: at n_in. */            \
    void nmt_gru_backward_##SUFFIX(float *carry, const MM *rec, const float *grad_out,         \
                                   int64_t grad_out_ds, const float *keep, int64_t keep_ds,    \
                                   const MM *pre, const float *n, int64_t n_ds,                \
                                   const float *h_prev, int64_t h_prev_ds, MM *grad_gates,     \
                                   int64_t grad_gates_ds, MM *grad_n_in, int64_t grad_n_in_ds, \
                                   int64_t D, int64_t B, int64_t H, int32_t threads) {         \
        ROWS(D, B, H,                                                                          \
             gru_backward_row_##SUFFIX(                                                        \
                 carry + (d * B + b) * H, rec + (d * B + b) * H,                               \
                 grad_out + d * grad_out_ds + b * H,                                           \
                 (keep == NULL || keep[d * keep_ds + b] != 0.0f) ? 1.0f : 0.0f,                \
                 pre + (d * B + b) * 3 * H, n + d * n_ds + b * H,                              \
                 h_prev + d * h_prev_ds + b * H, grad_gates + d * grad_gates_ds + b * 3 * H,   \
                 grad_n_in + d * grad_n_in_ds + b * H, H))                                     \
    }

GRU(bf16, bf16)
GRU(f32, float)

/* ----------------------------------------------------------------------------------- LSTM */

#define LSTM(SUFFIX, MM)                                                                       \
    static NOINLINE void lstm_forward_row_##SUFFIX(                                            \
        const MM *restrict a, const float *restrict cp, const float *restrict hp, int going,   \
        float *restrict act, float *restrict tc, float *restrict co, float *restrict ho,       \
        MM *restrict po, int64_t H) {                                                          \
        for (int64_t j = 0; j < H; j++) {                                                      \
            float gi = sigmoid(LOAD_##SUFFIX(a, j));                                           \
            float gf = sigmoid(LOAD_##SUFFIX(a, H + j));                                       \
            float gg = tanh_approx(LOAD_##SUFFIX(a, 2 * H + j));                               \
            float go = sigmoid(LOAD_##SUFFIX(a, 3 * H + j));                                   \
            float cn = gf * cp[j] + gi * gg;                                                   \
            float t = tanh_approx(cn);                                                         \
            act[j] = gi;                                                                       \
            act[H + j] = gf;                                                                   \
            act[2 * H + j] = gg;                                                               \
            act[3 * H + j] = go;                                                               \
            tc[j] = t;                                                                         \
            co[j] = going ? cn : cp[j];                                                        \
            ho[j] = going ? go * t : hp[j];                                                    \
        }                                                                                      \
        if (po != NULL) store_row_##SUFFIX(po, ho, H);                                         \
    }                                                                                          \
                                                                                               \
    /* pre (D, B, 4H) mm, contiguous: a_i, a_f, a_g, a_o; c, h (D, B, H) -> act_out (D, B,     \
     * 4H): i, f, g, o; tanh_c_out: tanh(c'); c_out, h_out; prev_out as for the GRU. */        \
    void nmt_lstm_forward_##SUFFIX(const MM *pre, const float *c, int64_t c_ds,                \
                                   const float *h, int64_t h_ds, const float *keep,            \
                                   int64_t keep_ds, float *act_out, int64_t act_ds,            \
                                   float *tanh_c_out, int64_t tanh_c_ds, float *c_out,         \
                                   int64_t c_out_ds, float *h_out, int64_t h_out_ds,           \
                                   MM *prev_out, int64_t prev_ds, int64_t D, int64_t B,        \
                                   int64_t H, int32_t threads) {                               \
        ROWS(D, B, H,                                                                          \
             lstm_forward_row_##SUFFIX(                                                        \
                 pre + (d * B + b) * 4 * H, c + d * c_ds + b * H, h + d * h_ds + b * H,        \
                 keep == NULL || keep[d * keep_ds + b] != 0.0f,                                \
                 act_out + d * act_ds + b * 4 * H, tanh_c_out + d * tanh_c_ds + b * H,         \
                 c_out + d * c_out_ds + b * H, h_out + d * h_out_ds + b * H,                   \
                 prev_out == NULL ? NULL : prev_out + d * prev_ds + b * H, H))                 \
    }                                                                                          \
                                                                                               \
    static NOINLINE void lstm_backward_row_##SUFFIX(                                           \
        float *restrict cr, const MM *restrict rc, const float *restrict go, float going,      \
        float *restrict dcr, const float *restrict ac, const float *restrict tc,               \
        const float *restrict cp, MM *restrict gg, int64_t H) {                                \
        for (int64_t j = 0; j < H; j++) {                                                      \
            float dh = cr[j] + LOAD_##SUFFIX(rc, j);                                           \
            dh += go[j];                                                                       \
            float dstep = dh * going;                                                          \
            float gi = ac[j], gf = ac[H + j], gc = ac[2 * H + j], gout = ac[3 * H + j];        \
            float t = tc[j];                                                                   \
            float dcn = dcr[j] * going + dstep * ((1.0f - t * t) * gout);                      \
            STORE_##SUFFIX(gg, j, dcn * gc * (gi - gi * gi));                                  \
            STORE_##SUFFIX(gg, H + j, dcn * cp[j] * (gf - gf * gf));                           \
            STORE_##SUFFIX(gg, 2 * H + j, dcn * gi * (1.0f - gc * gc));                        \
            STORE_##SUFFIX(gg, 3 * H + j, dstep * t * (gout - gout * gout));                   \
            dcr[j] = going != 0.0f ? dcn * gf : dcr[j];                                        \
            cr[j] = going != 0.0f ? 0.0f : dh;                                                 \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    /* carry, rec, grad_out as for the GRU; dc (D, B, H) float, contiguous: dL/dc', updated in \
     * place to dL/dc; act, tanh_c, c_prev as the forward step had them -> grad_gates (D, B,   \
     * 4H) mm: the gradients at a_i, a_f, a_g, a_o. */                                         \
    void nmt_lstm_backward_##SUFFIX(float *carry, const MM *rec, const float *grad_out,        \
                                    int64_t grad_out_ds, const float *keep, int64_t keep_ds,   \
                                    float *dc, const float *act, int64_t act_ds,               \
                                    const float *tanh_c, int64_t tanh_c_ds,                    \
                                    const float *c_prev, int64_t c_prev_ds, MM *grad_gates,    \
                                    int64_t grad_gates_ds, int64_t D, int64_t B, int64_t H,    \
                                    int32_t threads) {                                         \
        ROWS(D, B, H,                                                                          \
             lstm_backward_row_##SUFFIX(                                                       \
                 carry + (d * B + b) * H, rec + (d * B + b) * H,                               \
                 grad_out + d * grad_out_ds + b * H,                                           \
                 (keep == NULL || keep[d * keep_ds + b] != 0.0f) ? 1.0f : 0.0f,                \
                 dc + (d * B + b) * H, act + d * act_ds + b * 4 * H,                           \
                 tanh_c + d * tanh_c_ds + b * H, c_prev + d * c_prev_ds + b * H,               \
                 grad_gates + d * grad_gates_ds + b * 4 * H, H))                               \
    }

LSTM(bf16, bf16)
LSTM(f32, float)

/* ------------------------------------------------------------------------ the output layer */


/* One row of logits z (V) and its target y -> nll = log sum_v exp(z_v) - z_y, smooth =
 * log sum_v exp(z_v) - mean_v z_v and p_y = softmax(z)_y; with write_grad, overwrites z with
 * the loss's gradient at the logits, softmax(z) - eps / V - (1 - eps) onehot(y), rounded to
 * the logits' dtype once. scratch holds a row of V floats for each of the threads. */
#define XENT(SUFFIX, MM)                                                                       \
    static NOINLINE float row_max_##SUFFIX(const MM *restrict z, int64_t V, float *sum) {      \
        float top = LOAD_##SUFFIX(z, 0), total = 0.0f;                                         \
        _Pragma("omp simd reduction(max : top) reduction(+ : total)")                          \
        for (int64_t v = 0; v < V; v++) {                                                      \
            float zv = LOAD_##SUFFIX(z, v);                                                    \
            top = zv > top ? zv : top;                                                         \
            total += zv;                                                                       \
        }                                                                                      \
        *sum = total;                                                                          \
        return top;                                                                            \
    }                                                                                          \
                                                                                               \
    static NOINLINE float row_exp_##SUFFIX(const MM *restrict z, int64_t V, float top,         \
                                           float *restrict e) {                                \
        float total = 0.0f;                                                                    \
        _Pragma("omp simd reduction(+ : total)")                                               \
        for (int64_t v = 0; v < V; v++) {                                                      \
            e[v] = exp_approx(LOAD_##SUFFIX(z, v) - top);                                      \
            total += e[v];                                                                     \
        }                                                                                      \
        return total;                                                                          \
    }                                                                                          \
                                                                                               \
    static NOINLINE void row_grad_##SUFFIX(MM *restrict z, int64_t V, const float *restrict e, \
                                           float scale, float shift) {                         \
        for (int64_t v = 0; v < V; v++) STORE_##SUFFIX(z, v, e[v] * scale - shift);            \
    }                                                                                          \
                                                                                               \
    void nmt_softmax_xent_##SUFFIX(MM *logits, int64_t rows, int64_t V, const int64_t *target, \
                                   float *nll, float *smooth, float *p_target, float eps,      \
                                   int32_t write_grad, float *scratch, int32_t threads) {      \
        _Pragma("omp parallel num_threads(threads)")                                           \
        {                                                                                      \
            float *e = scratch + (int64_t)omp_get_thread_num() * V;                            \
            _Pragma("omp for schedule(static)")                                                \
            for (int64_t n = 0; n < rows; n++) {                                               \
                MM *z = logits + n * V;                                                        \
                int64_t y = target[n];                                                         \
                float sum;                                                                     \
                float top = row_max_##SUFFIX(z, V, &sum);                                      \
                float zy = LOAD_##SUFFIX(z, y);                                                \
                float total = row_exp_##SUFFIX(z, V, top, e);                                  \
                float log_z = logf(total) + top;                                               \
                nll[n] = log_z - zy;                                                           \
                smooth[n] = log_z - sum / (float)V;                                            \
                float scale = 1.0f / total;                                                    \
                float p_y = e[y] * scale;                                                      \
                p_target[n] = p_y;                                                             \
                if (write_grad) {                                                              \
                    row_grad_##SUFFIX(z, V, e, scale, eps / (float)V);                         \
                    STORE_##SUFFIX(z, y, p_y - (1.0f - eps) - eps / (float)V);                 \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

XENT(bf16, bf16)
XENT(f32, float)
