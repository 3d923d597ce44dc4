/* nmt's fused CPU kernels: the elementwise work of one RNN time step (GRU and LSTM, forward
 * and backward, all directions at once; and a search step's, without gradients) in one pass
 * over its tensors, where torch runs a small op for each operation; and search's log-softmax,
 * top-k and dot-product attention.
 * nmt.fast.compiled compiles this file with the machine's C compiler on first use and calls
 * it through ctypes; nmt.fast.gru and nmt.fast.lstm run torch ops instead where no compiler
 * is found or their model's FastPaths says so.
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

static inline float from_bf16(bf16 v) { return as_float((uint32_t)v << 16); }

/* Round to nearest even, as torch rounds float32 to bfloat16 (NaN -> 0x7fc0). */
static inline bf16 to_bf16(float f) {
    uint32_t u = as_bits(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
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
/* The search rows' bfloat16 variants, which nothing calls yet. */
#define MAYBE_UNUSED __attribute__((unused))

/* h' (H) in the matmul dtype, for the next step's matmul. */
#define STORE_ROW(SUFFIX, MM)                                                                  \
    static inline void store_row_##SUFFIX(MM *restrict out, const float *restrict h,           \
                                          int64_t H) {                                         \
        for (int64_t j = 0; j < H; j++) STORE_##SUFFIX(out, j, h[j]);                          \
    }

STORE_ROW(bf16, bf16)
STORE_ROW(f32, float)

/* The arguments of the step kernels: a (D, B, F) argument strided over the directions is its
 * pointer and the stride between its direction blocks (STRIDED); in a kernel's row loop,
 * AT(name, F) is row b of direction d of it, ROW(name, F) that of a contiguous one, and GOING
 * whether sentence b of direction d takes the step. The kernels end with the sizes and the
 * thread count (SIZES). */
#define STRIDED(TYPE, name) TYPE name, int64_t name##_ds
#define AT(name, F) ((name) + d * name##_ds + b * (F))
#define AT_OR_NULL(name, F) ((name) == NULL ? NULL : AT(name, F))
#define ROW(name, F) ((name) + (d * B + b) * (F))
#define GOING (keep == NULL || keep[d * keep_ds + b] != 0.0f)
#define SIZES int64_t D, int64_t B, int64_t H, int32_t threads
/* What both forward steps take and write around their own arguments: h (and keep) in; h' out,
 * in float and, unless NULL, in the matmul dtype for the next step's matmul (prev_out). */
#define STATE_IN STRIDED(const float *, h), STRIDED(const float *, keep)
#define STATE_OUT(MM) STRIDED(float *, h_out), STRIDED(MM *, prev_out), SIZES

/* ---------------------------------------------------------------------------------- cells */

/* One unit of each cell from its pre-activations, the one definition every row loop below uses
 * (training's forward rows and search's, in any matmul dtype: the loads are the caller's). Each
 * is a macro that fills a local unit: GCC 12 (-O3, an AVX2 EPYC) vectorised the same loops
 * through an inline function 1.4-1.7x slower.
 * GRU: a_r, a_z the sums W_i x + b_i + W_h h + b_h (as the matmul or the caller added them),
 * x_n = W_in x + b_in, h_n = W_hn h + b_hn, and h before the step. */
typedef struct {
    float n, h; /* n, and h' = n + z (h - n), that is (1 - z) n + z h */
} gru_unit;

#define GRU_CELL(U, A_R, A_Z, X_N, H_N, H_PREV)                                                \
    do {                                                                                       \
        float r_ = sigmoid(A_R);                                                               \
        float z_ = sigmoid(A_Z);                                                               \
        (U).n = tanh_approx((X_N) + r_ * (H_N));                                               \
        (U).h = (U).n + z_ * ((H_PREV) - (U).n);                                               \
    } while (0)

/* LSTM: a_i, a_f, a_g, a_o the sums W_i x + b_i + W_h h + b_h, and c before the step. */
typedef struct {
    float i, f, g, o, c, tanh_c, h; /* the gates, c' = f c + i g, tanh(c'), h' = o tanh(c') */
} lstm_unit;

#define LSTM_CELL(U, A_I, A_F, A_G, A_O, C_PREV)                                               \
    do {                                                                                       \
        (U).i = sigmoid(A_I);                                                                  \
        (U).f = sigmoid(A_F);                                                                  \
        (U).g = tanh_approx(A_G);                                                              \
        (U).o = sigmoid(A_O);                                                                  \
        (U).c = (U).f * (C_PREV) + (U).i * (U).g;                                              \
        (U).tanh_c = tanh_approx((U).c);                                                       \
        (U).h = (U).o * (U).tanh_c;                                                            \
    } while (0)

/* ------------------------------------------------------------------------------------ GRU */

#define GRU(SUFFIX, MM)                                                                        \
    /* A search step's row, without gradients: gx (3H) W_i x + b_i, gh (3H) W_h h + b_h in the \
     * matmul dtype, hp (H) h -> ho (H) h'. */                                                 \
    static NOINLINE MAYBE_UNUSED void gru_cell_row_##SUFFIX(                                   \
        const float *restrict gx, const MM *restrict gh, const float *restrict hp,             \
        float *restrict ho, int64_t H) {                                                       \
        for (int64_t j = 0; j < H; j++) {                                                      \
            gru_unit u;                                                                        \
            GRU_CELL(u, gx[j] + LOAD_##SUFFIX(gh, j), gx[H + j] + LOAD_##SUFFIX(gh, H + j),     \
                     gx[2 * H + j], LOAD_##SUFFIX(gh, 2 * H + j), hp[j]);                      \
            ho[j] = u.h;                                                                       \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    static NOINLINE void gru_forward_row_##SUFFIX(                                             \
        const MM *restrict a, const float *restrict x, const float *restrict hp,               \
        int going, float *restrict n, float *restrict ho, MM *restrict po, int64_t H) {        \
        for (int64_t j = 0; j < H; j++) {                                                      \
            gru_unit u;                                                                        \
            GRU_CELL(u, LOAD_##SUFFIX(a, j), LOAD_##SUFFIX(a, H + j), x[j],                     \
                     LOAD_##SUFFIX(a, 2 * H + j), hp[j]);                                      \
            n[j] = u.n;                                                                        \
            ho[j] = going ? u.h : hp[j];                                                       \
        }                                                                                      \
        if (po != NULL) store_row_##SUFFIX(po, ho, H);                                         \
    }                                                                                          \
                                                                                               \
    /* pre (D, B, 3H) mm, contiguous: a_r, a_z, a_n; n_in, h (D, B, H) -> n_out, h_out and,    \
     * unless NULL, prev_out. */                                                               \
    void nmt_gru_forward_##SUFFIX(const MM *pre, STRIDED(const float *, n_in), STATE_IN,       \
                                  STRIDED(float *, n_out), STATE_OUT(MM)) {                    \
        ROWS(D, B, H,                                                                          \
             gru_forward_row_##SUFFIX(ROW(pre, 3 * H), AT(n_in, H), AT(h, H), GOING,           \
                                      AT(n_out, H), AT(h_out, H), AT_OR_NULL(prev_out, H), H)) \
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
     * at a_r, a_z (pre-activations) and at a_n; grad_n_in (D, B, H) mm: at n_in. */           \
    void nmt_gru_backward_##SUFFIX(float *carry, const MM *rec, STRIDED(const float *, grad_out), \
                                   STRIDED(const float *, keep), const MM *pre,                \
                                   STRIDED(const float *, n), STRIDED(const float *, h_prev),  \
                                   STRIDED(MM *, grad_gates), STRIDED(MM *, grad_n_in),        \
                                   SIZES) {                                                    \
        ROWS(D, B, H,                                                                          \
             gru_backward_row_##SUFFIX(ROW(carry, H), ROW(rec, H), AT(grad_out, H),            \
                                       GOING ? 1.0f : 0.0f, ROW(pre, 3 * H), AT(n, H),         \
                                       AT(h_prev, H), AT(grad_gates, 3 * H),                   \
                                       AT(grad_n_in, H), H))                                   \
    }

GRU(bf16, bf16)
GRU(f32, float)

/* ----------------------------------------------------------------------------------- LSTM */

#define LSTM(SUFFIX, MM)                                                                       \
    /* A search step's row, as the GRU's: gx, gh (4H), cp (H) c -> ho (H) h', co (H) c'. */    \
    static NOINLINE MAYBE_UNUSED void lstm_cell_row_##SUFFIX(                                  \
        const float *restrict gx, const MM *restrict gh, const float *restrict cp,             \
        float *restrict ho, float *restrict co, int64_t H) {                                   \
        for (int64_t j = 0; j < H; j++) {                                                      \
            lstm_unit u;                                                                       \
            LSTM_CELL(u, gx[j] + LOAD_##SUFFIX(gh, j), gx[H + j] + LOAD_##SUFFIX(gh, H + j),    \
                      gx[2 * H + j] + LOAD_##SUFFIX(gh, 2 * H + j),                            \
                      gx[3 * H + j] + LOAD_##SUFFIX(gh, 3 * H + j), cp[j]);                    \
            co[j] = u.c;                                                                       \
            ho[j] = u.h;                                                                       \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    static NOINLINE void lstm_forward_row_##SUFFIX(                                            \
        const MM *restrict a, const float *restrict cp, const float *restrict hp, int going,   \
        float *restrict act, float *restrict tc, float *restrict co, float *restrict ho,       \
        MM *restrict po, int64_t H) {                                                          \
        for (int64_t j = 0; j < H; j++) {                                                      \
            lstm_unit u;                                                                       \
            LSTM_CELL(u, LOAD_##SUFFIX(a, j), LOAD_##SUFFIX(a, H + j),                          \
                      LOAD_##SUFFIX(a, 2 * H + j), LOAD_##SUFFIX(a, 3 * H + j), cp[j]);        \
            act[j] = u.i;                                                                      \
            act[H + j] = u.f;                                                                  \
            act[2 * H + j] = u.g;                                                              \
            act[3 * H + j] = u.o;                                                              \
            tc[j] = u.tanh_c;                                                                  \
            co[j] = going ? u.c : cp[j];                                                       \
            ho[j] = going ? u.h : hp[j];                                                       \
        }                                                                                      \
        if (po != NULL) store_row_##SUFFIX(po, ho, H);                                         \
    }                                                                                          \
                                                                                               \
    /* pre (D, B, 4H) mm, contiguous: a_i, a_f, a_g, a_o; c, h (D, B, H) -> act_out (D, B,     \
     * 4H): i, f, g, o; tanh_c_out: tanh(c'); c_out, h_out; prev_out as for the GRU. */        \
    void nmt_lstm_forward_##SUFFIX(const MM *pre, STRIDED(const float *, c), STATE_IN,         \
                                   STRIDED(float *, act_out), STRIDED(float *, tanh_c_out),    \
                                   STRIDED(float *, c_out), STATE_OUT(MM)) {                   \
        ROWS(D, B, H,                                                                          \
             lstm_forward_row_##SUFFIX(ROW(pre, 4 * H), AT(c, H), AT(h, H), GOING,             \
                                       AT(act_out, 4 * H), AT(tanh_c_out, H), AT(c_out, H),    \
                                       AT(h_out, H), AT_OR_NULL(prev_out, H), H))              \
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
    void nmt_lstm_backward_##SUFFIX(float *carry, const MM *rec,                               \
                                    STRIDED(const float *, grad_out),                          \
                                    STRIDED(const float *, keep), float *dc,                   \
                                    STRIDED(const float *, act), STRIDED(const float *, tanh_c), \
                                    STRIDED(const float *, c_prev), STRIDED(MM *, grad_gates), \
                                    SIZES) {                                                   \
        ROWS(D, B, H,                                                                          \
             lstm_backward_row_##SUFFIX(ROW(carry, H), ROW(rec, H), AT(grad_out, H),           \
                                        GOING ? 1.0f : 0.0f, ROW(dc, H), AT(act, 4 * H),       \
                                        AT(tanh_c, H), AT(c_prev, H), AT(grad_gates, 4 * H),   \
                                        H))                                                    \
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

/* ------------------------------------------------------------------------------- decoding */

/* x where ok, else otherwise: chosen by the values' bits, a form GCC vectorises. */
static inline float allowed_or(uint8_t ok, float x, float otherwise) {
    uint32_t keep = 0u - (uint32_t)(ok != 0);
    return as_float((as_bits(x) & keep) | (as_bits(otherwise) & ~keep));
}

/* A search step's log-softmax, in place: each row of z (rows, V) float32 becomes
 * z_v - log sum_{u allowed} exp(z_u) at its allowed columns and -inf at the others; allowed
 * (rows, V) is 1 where row n may go and 0 elsewhere (a shortlist's columns), or NULL for
 * every column. The row stays in the core's cache for its three passes (max, sum, write),
 * where torch's ops each go through the whole (rows, V) tensor. */
static NOINLINE float masked_max(const float *restrict z, const uint8_t *restrict ok, int64_t V) {
    float top = -INFINITY;
    if (ok == NULL) {
        _Pragma("omp simd reduction(max : top)")
        for (int64_t v = 0; v < V; v++) top = z[v] > top ? z[v] : top;
    } else { /* GCC vectorises this form, where (ok[v] && z[v] > top) stayed about 3x slower
              * (74-87 against 28-29 us for 50 rows of 3,000 on an AVX2 EPYC) */
        _Pragma("omp simd reduction(max : top)")
        for (int64_t v = 0; v < V; v++) {
            float x = allowed_or(ok[v], z[v], -INFINITY);
            top = x > top ? x : top;
        }
    }
    return top;
}

/* The exponentials' sum: a chunk of SUM_CHUNK columns at a time, its exponentials first
 * (zero where not allowed), then column v added into lane v mod SUM_LANES; the lanes are added
 * pairwise at the end. The masked and unmasked rows (every column allowed) so sum in the same
 * order, whatever vector width the compiler picks for each loop. */
#define SUM_LANES 8

/* The SUM_LANES partial sums added pairwise: (0+1)+(2+3), (4+5)+(6+7), then the two. */
static inline float lanes_total(const float *lane) {
    float low = (lane[0] + lane[1]) + (lane[2] + lane[3]);
    float high = (lane[4] + lane[5]) + (lane[6] + lane[7]);
    return low + high;
}
#define SUM_CHUNK 256

/* The one kernel compiled with fused multiply-adds (GCC's ISO C mode keeps a * b + c as two
 * roundings elsewhere, which the training kernels' results are held to): the exponentials'
 * polynomial is the row's largest cost, and a sum of them needs no bit-for-bit history. */
#define CONTRACTED __attribute__((optimize("fp-contract=fast")))

static NOINLINE CONTRACTED float masked_exp_sum(const float *restrict z,
                                                const uint8_t *restrict ok, int64_t V,
                                                float top) {
    float lane[SUM_LANES] = {0.0f};
    float e[SUM_CHUNK];
    for (int64_t start = 0; start < V; start += SUM_CHUNK) {
        int64_t n = V - start < SUM_CHUNK ? V - start : SUM_CHUNK, v = 0;
        const float *restrict zc = z + start;
        if (ok == NULL) {
            for (v = 0; v < n; v++) e[v] = exp_approx(zc[v] - top);
        } else {
            const uint8_t *restrict oc = ok + start;
            for (v = 0; v < n; v++) e[v] = allowed_or(oc[v], exp_approx(zc[v] - top), 0.0f);
        }
        int64_t whole = n - n % SUM_LANES;
        for (v = 0; v < whole; v += SUM_LANES)
            for (int l = 0; l < SUM_LANES; l++) lane[l] += e[v + l];
        for (; v < n; v++) lane[v - whole] += e[v];
    }
    return lanes_total(lane);
}

static NOINLINE void masked_shift(float *restrict z, const uint8_t *restrict ok, int64_t V,
                                  float shift) {
    if (ok == NULL) {
        _Pragma("omp simd")
        for (int64_t v = 0; v < V; v++) z[v] -= shift;
    } else {
        _Pragma("omp simd")
        for (int64_t v = 0; v < V; v++) z[v] = ok[v] ? z[v] - shift : -INFINITY;
    }
}

void nmt_log_softmax_f32(float *z, int64_t rows, int64_t V, const uint8_t *allowed,
                         int32_t threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (rows * V >= MIN_PARALLEL)")
    for (int64_t n = 0; n < rows; n++) {
        float *row = z + n * V;
        const uint8_t *ok = allowed == NULL ? NULL : allowed + n * V;
        float top = masked_max(row, ok, V);
        float total = masked_exp_sum(row, ok, V, top);
        masked_shift(row, ok, V, top + logf(total));
    }
}

/* The k largest values of each row of x (rows, V) float32, largest first, into values and
 * indices (rows, k); among equal values the first (lowest index) first, as Tensor.max(dim)
 * and a stable sort give them; NaN is never taken past the first k. The row is read once, in
 * blocks of TOPK_BLOCK compared with the k-th value so far all at once: only a block with a
 * value above it is looked at element by element. 1 <= k <= V. */
#define TOPK_BLOCK 64

static inline void topk_insert(float *best, int64_t *at, int64_t k, float value, int64_t index) {
    int64_t j = k - 1; /* value > best[k-1]: it enters, after every value >= it */
    while (j > 0 && best[j - 1] < value) {
        best[j] = best[j - 1];
        at[j] = at[j - 1];
        j--;
    }
    best[j] = value;
    at[j] = index;
}

static inline int block_beats(const float *restrict x, float bar) {
    int above = 0;
    _Pragma("omp simd reduction(| : above)")
    for (int64_t v = 0; v < TOPK_BLOCK; v++) above |= x[v] > bar;
    return above;
}

static void row_top_k(const float *restrict x, int64_t V, int64_t k, float *best, int64_t *at) {
    int64_t v = 0;
    for (; v < k; v++) { /* the first k, sorted as they come */
        int64_t j = v;
        while (j > 0 && !(best[j - 1] >= x[v])) {
            best[j] = best[j - 1];
            at[j] = at[j - 1];
            j--;
        }
        best[j] = x[v];
        at[j] = v;
    }
    for (; v < V && v % TOPK_BLOCK; v++)
        if (x[v] > best[k - 1]) topk_insert(best, at, k, x[v], v);
    for (; v + TOPK_BLOCK <= V; v += TOPK_BLOCK) {
        if (!block_beats(x + v, best[k - 1])) continue;
        for (int64_t u = v; u < v + TOPK_BLOCK; u++)
            if (x[u] > best[k - 1]) topk_insert(best, at, k, x[u], u);
    }
    for (; v < V; v++)
        if (x[v] > best[k - 1]) topk_insert(best, at, k, x[v], v);
}

void nmt_top_k_f32(const float *x, int64_t rows, int64_t V, int64_t k, float *values,
                   int64_t *indices, int32_t threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (rows * V >= MIN_PARALLEL)")
    for (int64_t n = 0; n < rows; n++) row_top_k(x + n * V, V, k, values + n * k, indices + n * k);
}

/* A search step's attention by a dot-product score (Luong's dot and general, the scaled dot):
 *   e_s = g q^T k_s at the real positions s, a = softmax_s(e), context = sum_s a_s v_s
 * for R query rows per sentence (a greedy search's one, a beam search's K, which share their
 * sentence's memory): q (B*R, A); keys (B, S, A); values (B, S, F); mask (B, S), 1 at the
 * real positions (at least one a row); g the score's scale -> alphas (B*R, S), exactly 0 at
 * padding, and context (B*R, F). One pass over a sentence's memory per row, where torch's
 * batched products, mask and softmax each go through it or through the energies; each row
 * sums in one fixed order (the dot products in SUM_LANES lanes, the context over s in turn),
 * whatever the rows or threads. */
static inline float dot_lanes(const float *restrict x, const float *restrict y, int64_t n) {
    float lane[SUM_LANES] = {0.0f};
    int64_t whole = n - n % SUM_LANES, i = 0;
    for (i = 0; i < whole; i += SUM_LANES)
        for (int l = 0; l < SUM_LANES; l++) lane[l] += x[i + l] * y[i + l];
    for (; i < n; i++) lane[i - whole] += x[i] * y[i];
    return lanes_total(lane);
}

static NOINLINE void attend_row(const float *restrict q, const float *restrict keys,
                                const float *restrict values, const uint8_t *restrict mask,
                                int64_t S, int64_t A, int64_t F, float scale,
                                float *restrict alpha, float *restrict context) {
    float top = -INFINITY;
    for (int64_t s = 0; s < S; s++) {
        float e = mask[s] ? dot_lanes(q, keys + s * A, A) * scale : 0.0f;
        alpha[s] = e;
        top = (mask[s] && e > top) ? e : top;
    }
    float total = 0.0f;
    for (int64_t s = 0; s < S; s++) {
        float e = mask[s] ? expf(alpha[s] - top) : 0.0f;
        alpha[s] = e;
        total += e;
    }
    for (int64_t f = 0; f < F; f++) context[f] = 0.0f;
    for (int64_t s = 0; s < S; s++) {
        if (!mask[s]) continue;
        float a = alpha[s] / total;
        alpha[s] = a;
        const float *restrict v = values + s * F;
        for (int64_t f = 0; f < F; f++) context[f] += a * v[f];
    }
}

void nmt_attend_f32(const float *q, const float *keys, const float *values, const uint8_t *mask,
                    int64_t B, int64_t R, int64_t S, int64_t A, int64_t F, float scale,
                    float *alphas, float *context, int32_t threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (B * R * S * (A + F) >= MIN_PARALLEL)")
    for (int64_t n = 0; n < B * R; n++) {
        int64_t b = n / R;
        attend_row(q + n * A, keys + b * S * A, values + b * S * F, mask + b * S, S, A, F, scale,
                   alphas + n * S, context + n * F);
    }
}

/* ------------------------------------------------------------------------------ inference */

/* One step of an RNN layer in a pass without gradients (a search's decoder step), float32
 * throughout, one direction:
 *   gx (B, G*H), W_i x + b_i; gh (B, G*H), W_h h + b_h; h (B, H) (and the LSTM's c), the
 *   state before the step, all contiguous
 * -> h_out (B, H) (and c_out), contiguous, apart from h and c: the state after the step, by
 * the cells above (gru_cell, lstm_cell) of x + h for each gate but the GRU's n (x_n, h_n). */

void nmt_gru_cell_f32(const float *gx, const float *gh, const float *h, float *h_out, int64_t B,
                      int64_t H, int32_t threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (B * H >= MIN_PARALLEL)")
    for (int64_t b = 0; b < B; b++)
        gru_cell_row_f32(gx + b * 3 * H, gh + b * 3 * H, h + b * H, h_out + b * H, H);
}

void nmt_lstm_cell_f32(const float *gx, const float *gh, const float *c, float *h_out,
                       float *c_out, int64_t B, int64_t H, int32_t threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (B * H >= MIN_PARALLEL)")
    for (int64_t b = 0; b < B; b++)
        lstm_cell_row_f32(gx + b * 4 * H, gh + b * 4 * H, c + b * H, h_out + b * H, c_out + b * H,
                          H);
}
