/* DAPE's f at evaluation on a CPU, fused per query row (loaded by native.py):
 *
 *     hidden = LeakyReLU(addend + Conv1(content)),    scores += residual + Conv2(hidden)
 *
 * Conv1 (heads -> width channels) and Conv2 (width -> heads) are 1 x k convolutions along
 * the key axis with zero "same" padding. One row's channels are copied into zero-padded
 * buffers, so the shifted windows are plain unaligned loads (no im2col matrix); the hidden
 * row stays in cache between the two convolutions and the activation is applied in
 * registers. The products are register blocks of OUT channels x BLOCK vectors of keys.
 * Optionally the row's logits then become its attention probabilities (softmax over the
 * keys, those after the query hidden when causal) while they are in cache. */
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512F__
#define LANES 16 /* floats per vector register */
#define OUT 8    /* output channels per register block: 24 accumulators of 32 registers */
#else
#define LANES 8
#define OUT 4 /* 12 accumulators of 16 registers */
#endif
#define BLOCK 3 /* vectors of keys per register block */
#define NEGATIVE_SLOPE 0.01f

typedef float vec __attribute__((vector_size(4 * LANES), aligned(4), may_alias));
typedef int mask __attribute__((vector_size(4 * LANES)));

static inline vec load(const float *p) { return *(const vec *)p; }
static inline void store(float *p, vec v) { *(vec *)p = v; }

static inline vec choose(mask where, vec yes, vec no)
{
    return (vec)(((mask)yes & where) | ((mask)no & ~where));
}

/* The keys j .. j + LANES of a row whose key k is at[k * step] (step 1, or 0 for one value
 * per row), `fill` from `length` on: it never reads beyond. */
static inline vec row_vector(const float *at, long step, long j, long length, float fill)
{
    if (!step) return (vec){0} + at[0];
    if (j + LANES <= length) return load(at + j);
    float tail[LANES];
    for (long t = 0; t < LANES; t++) tail[t] = j + t < length ? at[j + t] : fill;
    return load(tail);
}

/* LeakyReLU as torch computes it: x where x > 0, else x * slope. */
static inline vec leaky_relu(vec x)
{
    return choose(x > 0, x, x * NEGATIVE_SLOPE);
}

/* acc[o][v] += sum_{c, s} w[(o * channels + c) * kernel + s] * x[c * stride + j + LANES v + s]
 * for outs <= OUT output channels and nv <= BLOCK vectors of keys. */
static inline __attribute__((always_inline)) void convolve_block(
    vec acc[OUT][BLOCK], int outs, int nv, const float *x, long stride, const float *w,
    long channels, long kernel, long j)
{
    for (long c = 0; c < channels; c++) {
        const float *row = x + c * stride + j;
        for (long s = 0; s < kernel; s++) {
            vec in[BLOCK];
            for (int v = 0; v < nv; v++) in[v] = load(row + LANES * v + s);
            for (int o = 0; o < outs; o++) {
                float weight = w[(o * channels + c) * kernel + s];
                for (int v = 0; v < nv; v++) acc[o][v] += weight * in[v];
            }
        }
    }
}

/* One row of the first convolution's batch-free addend: channel d, key j at
 * at[d * channel_stride + j * step], for keys j < length. */
struct addend {
    const float *at;
    long channel_stride, step, length;
};

/* One register block of the first convolution: hidden[o][j ..] = LeakyReLU(addend + the
 * block's sums) for outputs d0 + o, rows of hidden and content `stride` apart. */
static inline __attribute__((always_inline)) void hidden_block(
    float *hidden, const struct addend *from, long d0, const float *content, long stride,
    const float *w, long heads, long kernel, int outs, int nv, long j)
{
    vec acc[OUT][BLOCK];
    for (int o = 0; o < outs; o++) {
        const float *at = from->at + (d0 + o) * from->channel_stride;
        for (int v = 0; v < nv; v++)
            acc[o][v] = row_vector(at, from->step, j + LANES * v, from->length, 0);
    }
    convolve_block(acc, outs, nv, content, stride, w, heads, kernel, j);
    for (int o = 0; o < outs; o++)
        for (int v = 0; v < nv; v++)
            store(hidden + (d0 + o) * stride + j + LANES * v, leaky_relu(acc[o][v]));
}

/* Where one row of the second convolution's output goes: out[h * out_stride + j] +=
 * residual[h * residual_stride + j * residual_step] + the convolution, for keys j < length. */
struct output {
    float *out;
    long out_stride, length;
    const float *residual;
    long residual_stride, residual_step; /* step 1 (a value per key) or 0 (one per row) */
};

/* One register block of the second convolution, outputs h0 .. h0 + outs at keys j. */
static inline __attribute__((always_inline)) void output_block(
    const struct output *to, long h0, const float *hidden, long stride, const float *w,
    long width, long kernel, int outs, int nv, long j)
{
    vec acc[OUT][BLOCK];
    float spill[BLOCK * LANES];
    for (int o = 0; o < outs; o++)
        for (int v = 0; v < nv; v++) {
            const float *at = to->residual + (h0 + o) * to->residual_stride;
            acc[o][v] = row_vector(at, to->residual_step, j + LANES * v, to->length, 0);
        }
    convolve_block(acc, outs, nv, hidden, stride, w, width, kernel, j);
    long count = to->length - j < nv * LANES ? to->length - j : nv * LANES;
    for (int o = 0; o < outs; o++) {
        float *dst = to->out + (h0 + o) * to->out_stride + j;
        if (count == nv * LANES) {
            for (int v = 0; v < nv; v++) store(dst + LANES * v, load(dst + LANES * v) + acc[o][v]);
            continue;
        }
        for (int v = 0; v < nv; v++) store(spill + LANES * v, acc[o][v]);
        for (long t = 0; t < count; t++) dst[t] += spill[t];
    }
}

/* exp(x) for x <= 0 to about 2 ulp: x = n ln 2 + r with |r| <= ln 2 / 2, a degree-6 Taylor
 * polynomial in r (truncation below 1.3e-7), then n added to the exponent; 0 below -86.5,
 * where 2^n would leave the normal floats (and for x = -inf). */
static inline vec exp_vector(vec x)
{
    mask underflow = x < -86.5f;
    x = choose(underflow, (vec){0}, x);
    vec scaled = x * 1.44269504f;
    mask n = __builtin_convertvector(scaled + choose(scaled < 0, (vec){0} - 0.5f,
                                                     (vec){0} + 0.5f), mask);
    vec whole = __builtin_convertvector(n, vec);
    vec r = x - whole * 0.693145752f - whole * 1.42860677e-6f;
    vec p = (vec){0} + 1.0f / 720;
    const float taylor[] = {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    for (int t = 0; t < 6; t++) p = p * r + taylor[t];
    return choose(underflow, (vec){0}, (vec)((mask)p + (n << 23)));
}

/* row[j] = softmax over the keys j < visible of row[j]; 0 from `visible` to `length`. */
static void softmax_row(float *row, long length, long visible)
{
    float ninf = -__builtin_inff();
    long full = visible / LANES * LANES;
    vec top = row_vector(row, 1, full, visible, ninf);
    for (long j = 0; j < full; j += LANES) top = choose(load(row + j) > top, load(row + j), top);
    float largest = ninf;
    for (int t = 0; t < LANES; t++) largest = top[t] > largest ? top[t] : largest;
    vec tail = exp_vector(row_vector(row, 1, full, visible, ninf) - largest);
    vec sum = tail;
    for (long j = 0; j < full; j += LANES) {
        vec e = exp_vector(load(row + j) - largest);
        sum += e;
        store(row + j, e);
    }
    float total = 0;
    for (int t = 0; t < LANES; t++) total += sum[t];
    float scale = 1.0f / total;
    for (long j = 0; j < full; j += LANES) store(row + j, load(row + j) * scale);
    for (long j = full; j < visible; j++) row[j] = tail[j - full] * scale;
    for (long j = visible; j < length; j++) row[j] = 0.0f;
}

static inline int vectors_at(long j, long padded)
{
    return padded - j >= BLOCK * LANES ? BLOCK : 1;
}

/* hidden[d][j] = LeakyReLU(addend[d][j] + sum_{h, s} w1[d, h, s] content[h][j + s]) for keys
 * j < padded. Full blocks get code of constant shape. */
static void hidden_row(float *hidden, const struct addend *from, const float *content,
                       long stride, const float *w1, long heads, long width, long kernel,
                       long padded)
{
    for (long d0 = 0; d0 < width; d0 += OUT) {
        int outs = width - d0 < OUT ? (int)(width - d0) : OUT;
        const float *w = w1 + d0 * heads * kernel;
        for (long j = 0; j < padded;) {
            int nv = vectors_at(j, padded);
            if (outs == OUT && nv == BLOCK)
                hidden_block(hidden, from, d0, content, stride, w, heads, kernel, OUT, BLOCK, j);
            else if (outs == OUT)
                hidden_block(hidden, from, d0, content, stride, w, heads, kernel, OUT, 1, j);
            else
                hidden_block(hidden, from, d0, content, stride, w, heads, kernel, outs, nv, j);
            j += nv * LANES;
        }
    }
}

/* The output row `to` of the second convolution, w2 [heads, width, kernel] over hidden. */
static void output_row(const struct output *to, const float *hidden, long stride,
                       const float *w2, long heads, long width, long kernel, long padded)
{
    for (long h0 = 0; h0 < heads; h0 += OUT) {
        int outs = heads - h0 < OUT ? (int)(heads - h0) : OUT;
        const float *w = w2 + h0 * width * kernel;
        for (long j = 0; j < padded;) {
            int nv = vectors_at(j, padded);
            if (outs == OUT && nv == BLOCK)
                output_block(to, h0, hidden, stride, w, width, kernel, OUT, BLOCK, j);
            else if (outs == OUT)
                output_block(to, h0, hidden, stride, w, width, kernel, OUT, 1, j);
            else
                output_block(to, h0, hidden, stride, w, width, kernel, outs, nv, j);
            j += nv * LANES;
        }
    }
}

/* scores[b, h, i, j] += residual[h, i, j] + f(content)[b, h, i, j] for b < batch, i < rows,
 * j < length. Element (b, h, i, j) of scores and content is at b * sb + h * sh + i * si + j,
 * residual (h, i, j) at h * rh + i * ri + j * rj, and the first convolution's batch-free
 * addend (its bias and bias channels) at d * ad + i * ai + j * aj, where rj and aj are 1 or
 * 0. w1 is [width, heads, kernel], w2 [heads, width, kernel], both contiguous. Scores may be
 * content: each row is read before it is written. With `normalise`, each row's logits then
 * become probabilities over its keys, the keys j > first_row + i hidden when first_row >= 0
 * (causal attention; row i of the tile is query first_row + i). Returns 0, or -1 out of
 * memory. */
int dape_fused_filter(float *scores, const float *content, long sb, long sh, long si,
                      const float *residual, long rh, long ri, long rj, const float *addend,
                      long ad, long ai, long aj, const float *w1, const float *w2, long batch,
                      long heads, long rows, long length, long width, long kernel,
                      int normalise, long first_row)
{
    long pad = kernel / 2;
    long padded = (length + LANES - 1) / LANES * LANES;
    long stride = padded + kernel - 1 + LANES; /* room for the last block's shifted loads */
    size_t bytes = sizeof(float) * (size_t)((heads + width) * stride);
    float *work = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!work) return -1;
    memset(work, 0, bytes); /* the padding, which no row writes */
    float *padded_content = work, *hidden = work + heads * stride;
    for (long b = 0; b < batch; b++)
        for (long i = 0; i < rows; i++) {
            long at = b * sb + i * si;
            for (long h = 0; h < heads; h++)
                memcpy(padded_content + h * stride + pad, content + at + h * sh,
                       sizeof(float) * length);
            struct addend from = {addend + i * ai, ad, aj, length};
            hidden_row(hidden + pad, &from, padded_content, stride, w1, heads, width, kernel,
                       padded);
            for (long d = 0; d < width; d++) /* Conv2's zero padding past the row's end */
                memset(hidden + d * stride + pad + length, 0,
                       sizeof(float) * (stride - pad - length));
            struct output to = {scores + at, sh, length, residual + i * ri, rh, rj};
            output_row(&to, hidden, stride, w2, heads, width, kernel, padded);
            if (!normalise) continue;
            long visible = first_row < 0 || first_row + i + 1 > length ? length
                                                                        : first_row + i + 1;
            for (long h = 0; h < heads; h++) softmax_row(scores + at + h * sh, length, visible);
        }
    free(work);
    return 0;
}

/* Floats per vector register in this build (16 with AVX-512, else 8). */
int dape_fused_filter_lanes(void) { return LANES; }
