/* DAPE's f on a CPU, fused per query row (loaded by native.py):
 *
 *     hidden = LeakyReLU(Conv1(content) + addend),    scores += residual + Conv2(hidden)
 *
 * Conv1 (heads -> width channels) and Conv2 (width -> heads) are 1 x k convolutions along
 * the key axis with zero "same" padding. One row's channels are copied into zero-padded
 * buffers, so the shifted windows are plain unaligned loads (no im2col matrix); the hidden
 * row stays in cache between the two convolutions and the activation is applied in
 * registers. The products are register blocks of OUT channels x BLOCK vectors of keys.
 *
 * Conv1 sums tap by tap, channel by channel within a tap, from 0, then adds the addend: the
 * order of the chunks filter's im2col product (kernel.py), as torch's matrix products sum
 * it on the CPUs checked. Conv2 sums in one of two orders. The fast one (evaluation) sums
 * every tap and channel of an output into one register, started from the residual. The
 * `exact` one (training) is the chunks filter's: each tap's channels from 0 (its taps
 * product), then a row of scores takes the residual, the centre tap and the other taps in
 * order, each shifted along the keys; with fused multiply-adds its results are that filter's
 * bits. The backward through the hidden map is the same computation with the adjoint
 * weights (below).
 *
 * Optionally the row's hidden map is written out (training keeps it for the backward) and
 * the row's logits then become its attention probabilities (softmax over the keys, those
 * after the query hidden when causal) while they are in cache. */
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

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

/* The first `count` (<= LANES) floats at p, 0 after them; nothing beyond them is read. */
static inline vec load_first(const float *p, long count)
{
#ifdef __AVX512F__
    return (vec)_mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1), p);
#else
    float first[LANES] = {0};
    memcpy(first, p, sizeof(float) * count);
    return load(first);
#endif
}

/* Stores the first `count` (<= LANES) floats of v at p; nothing beyond them is written. */
static inline void store_first(float *p, vec v, long count)
{
#ifdef __AVX512F__
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << count) - 1), (__m512)v);
#else
    float first[LANES];
    store(first, v);
    memcpy(p, first, sizeof(float) * count);
#endif
}

/* Whether lane t of a vector at key j holds a key < length. */
static inline mask inside(long j, long length)
{
    mask lane;
    for (int t = 0; t < LANES; t++) lane[t] = t;
    return lane < (int)(length - j < LANES ? length - j : LANES);
}

/* The keys j .. j + LANES of a row, `fill` from `length` on: it never reads beyond. */
static inline vec row_vector(const float *at, long j, long length, float fill)
{
    if (j + LANES <= length) return load(at + j);
    return choose(inside(j, length), load_first(at + j, length - j), (vec){0} + fill);
}

/* LeakyReLU as torch computes it: x where x > 0, else x * slope. */
static inline vec leaky_relu(vec x)
{
    return choose(x > 0, x, x * NEGATIVE_SLOPE);
}

/* acc[o][v] += sum_{s, c} w[(o * channels + c) * kernel + s] * x[c * stride + j + LANES v + s]
 * over taps s < taps, for outs <= OUT output channels and nv <= BLOCK vectors of keys: tap by
 * tap (`taps_outer`, the chunks filter's order) or channel by channel. */
static inline __attribute__((always_inline)) void convolve_block(
    vec acc[OUT][BLOCK], int outs, int nv, const float *x, long stride, const float *w,
    long channels, long kernel, long taps, long j, int taps_outer)
{
    long outer = taps_outer ? taps : channels, inner = taps_outer ? channels : taps;
    for (long a = 0; a < outer; a++) {
        for (long b = 0; b < inner; b++) {
            long s = taps_outer ? a : b, c = taps_outer ? b : a;
            const float *row = x + c * stride + j + s;
            vec in[BLOCK];
            for (int v = 0; v < nv; v++) in[v] = load(row + LANES * v);
            for (int o = 0; o < outs; o++) {
                float weight = w[(o * channels + c) * kernel + s];
                for (int v = 0; v < nv; v++) acc[o][v] += weight * in[v];
            }
        }
    }
}

/* One row of values per channel and key: channel c, key j at at[c * channel_stride + j * step]
 * (step 1, or 0 for one value per channel), for keys j < length. */
struct key_rows {
    const float *at;
    long channel_stride, step;
};

/* The row's keys j .. j + LANES of `channel` (0 from `length` on; 0 + the value when step is
 * 0). */
static inline vec key_vector(const struct key_rows *rows, long channel, long j, long length)
{
    const float *row = rows->at + channel * rows->channel_stride;
    if (!rows->step) return (vec){0} + row[0];
    return j + LANES <= length ? load(row + j) : load_first(row + j, length - j);
}

/* x + the row's keys j .. j + LANES of `channel` (0 from `length` on). */
static inline vec add_keys(vec x, const struct key_rows *rows, long channel, long j,
                           long length)
{
    if (!rows->step) /* an exact splat, unlike key_vector's 0 + the value */
        return x + rows->at[channel * rows->channel_stride];
    return x + key_vector(rows, channel, j, length);
}

/* What one row of the first convolution adds, how it is activated and where it goes, for keys
 * j < length: the batch-free addend (none when its `at` is NULL), then LeakyReLU, or (gate's
 * `at` not NULL) LeakyReLU's derivative at the activated map `gate`, which keeps the sign of
 * its argument: the backward's gradient of the hidden map. The result is written to out[d *
 * out_stride + j] too when `out` is not NULL. */
struct hidden_terms {
    struct key_rows addend, gate;
    float *out;
    long out_stride, length;
};

/* One register block of the first convolution: hidden[o][j ..] = the activation of the
 * block's sums and the addend (0 from `length` on), for outputs d0 + o, rows of hidden and
 * content `stride` apart. `exact`: the sums from 0, tap by tap, then the addend (the chunks
 * filter's order); else from the addend, channel by channel. */
static inline __attribute__((always_inline)) void hidden_block(
    float *hidden, const struct hidden_terms *terms, long d0, const float *content, long stride,
    const float *w, long heads, long kernel, int outs, int nv, long j, int exact)
{
    vec acc[OUT][BLOCK] = {{{0}}};
    long length = terms->length;
    for (int o = 0; o < outs && !exact && terms->addend.at; o++)
        for (int v = 0; v < nv; v++)
            acc[o][v] = key_vector(&terms->addend, d0 + o, j + LANES * v, length);
    convolve_block(acc, outs, nv, content, stride, w, heads, kernel, kernel, j, exact);
    for (int o = 0; o < outs; o++) {
        long d = d0 + o;
        for (int v = 0; v < nv; v++) {
            long at = j + LANES * v;
            vec x = acc[o][v];
            if (exact && terms->addend.at) x = add_keys(x, &terms->addend, d, at, length);
            if (terms->gate.at)
                x = choose(key_vector(&terms->gate, d, at, length) > 0, x, x * NEGATIVE_SLOPE);
            else
                x = leaky_relu(x);
            if (at + LANES > length) x = choose(inside(at, length), x, (vec){0});
            store(hidden + d * stride + at, x);
            if (!terms->out) continue;
            float *out = terms->out + d * terms->out_stride + at;
            if (at + LANES <= length)
                store(out, x);
            else
                store_first(out, x, length - at);
        }
    }
}

/* One register block of one tap s of the second convolution (w is w2 + s): taps[o][j ..] =
 * sum_d w[((h0 + o) * width + d) * kernel] hidden[d][j ..] for outputs h0 .. h0 + outs. */
static inline __attribute__((always_inline)) void taps_block(
    float *taps, long taps_stride, long h0, const float *hidden, long stride, const float *w,
    long width, long kernel, int outs, int nv, long j)
{
    vec acc[OUT][BLOCK] = {{{0}}};
    convolve_block(acc, outs, nv, hidden, stride, w + h0 * width * kernel, width, kernel, 1, j,
                   1);
    for (int o = 0; o < outs; o++)
        for (int v = 0; v < nv; v++)
            store(taps + (h0 + o) * taps_stride + j + LANES * v, acc[o][v]);
}

/* Where one row of scores goes: out[h * out_stride + j] += residual[h * residual_stride +
 * j * residual_step] (when there is one) + the second convolution, for keys j < length;
 * with `overwrite`, out = the second convolution (the backward's gradient of the content). */
struct output {
    float *out;
    long out_stride, length;
    const float *residual;
    long residual_stride, residual_step; /* step 1 (a value per key) or 0 (one per row) */
    int overwrite;
};

/* For keys first <= j < last (first a multiple of LANES, last one too or the row's length):
 * out[h][j] (+)= the residual and the per-tap rows taps[(s * heads + h) * taps_stride + j]
 * of the second convolution, each shifted by s - kernel / 2, summed in that order: the
 * chunks filter's passes (residual, centre tap, the others) fused into one. The taps must
 * read +0 at the keys before 0 and from `length` on: adding +0 then changes nothing, as the
 * centre tap, a sum started from +0, is never -0, nor is any sum that includes it. */
static void add_to_scores(const struct output *to, const float *taps, long taps_stride,
                          long heads, long kernel, long first, long last)
{
    long centre = kernel / 2, length = to->length, spacing = heads * taps_stride;
    for (long h = 0; h < heads; h++) {
        float *out = to->out + h * to->out_stride;
        const float *tap = taps + h * taps_stride;
        const float *residual = to->residual ? to->residual + h * to->residual_stride : NULL;
        for (long j = first; j < last; j += LANES) {
            int whole = j + LANES <= length;
            vec x = load(tap + centre * spacing + j);
            if (!to->overwrite) {
                vec value = whole ? load(out + j) : row_vector(out, j, length, 0);
                if (residual && to->residual_step)
                    value += whole ? load(residual + j) : row_vector(residual, j, length, 0);
                if (residual && !to->residual_step) value += residual[0]; /* an exact splat */
                x = value + x;
            }
            for (long s = 0; s < kernel; s++)
                if (s != centre) x += load(tap + s * spacing + j + s - centre);
            if (whole) {
                store(out + j, x);
                continue;
            }
            store_first(out + j, x, length - j);
        }
    }
}

/* One register block of the second convolution in the fast order (all taps and channels in
 * one sum, started from the residual), added to the scores: outputs h0 .. h0 + outs at keys
 * j, w (w2 + h0 rows) over the hidden row at key -kernel / 2, zero-padded. */
static inline __attribute__((always_inline)) void output_block(
    const struct output *to, long h0, const float *hidden, long stride, const float *w,
    long width, long kernel, int outs, int nv, long j)
{
    vec acc[OUT][BLOCK] = {{{0}}};
    for (int o = 0; o < outs && to->residual; o++) {
        const float *residual = to->residual + (h0 + o) * to->residual_stride;
        for (int v = 0; v < nv; v++)
            if (to->residual_step)
                acc[o][v] = row_vector(residual, j + LANES * v, to->length, 0);
            else
                acc[o][v] += residual[0];
    }
    convolve_block(acc, outs, nv, hidden, stride, w, width, kernel, kernel, j, 0);
    for (int o = 0; o < outs; o++)
        for (int v = 0; v < nv; v++) {
            long at = j + LANES * v;
            if (at >= to->length) break;
            float *out = to->out + (h0 + o) * to->out_stride + at;
            if (at + LANES <= to->length)
                store(out, load(out) + acc[o][v]);
            else
                store_first(out, load_first(out, to->length - at) + acc[o][v], to->length - at);
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
    vec top = row_vector(row, full, visible, ninf);
    for (long j = 0; j < full; j += LANES) top = choose(load(row + j) > top, load(row + j), top);
    float largest = ninf;
    for (int t = 0; t < LANES; t++) largest = top[t] > largest ? top[t] : largest;
    vec tail = exp_vector(row_vector(row, full, visible, ninf) - largest);
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

/* Vectors of keys in the register block at key j: BLOCK, or the (fewer) that are left. */
static inline int vectors_at(long j, long padded)
{
    long left = (padded - j) / LANES;
    return left >= BLOCK ? BLOCK : (int)left;
}

/* hidden[d][j ..] = the activation of sum_{s, h} w1[d, h, s] content[h][j + s ..] +
 * addend[d][j ..] (`from`) for nv vectors of keys at j, every d, in the `exact` order or
 * not. Full blocks get code of constant shape. */
static inline __attribute__((always_inline)) void hidden_columns(
    float *hidden, const struct hidden_terms *from, const float *content, long stride,
    const float *w1, long heads, long width, long kernel, int nv, long j, int exact)
{
    for (long d0 = 0; d0 < width; d0 += OUT) {
        int outs = width - d0 < OUT ? (int)(width - d0) : OUT;
        const float *w = w1 + d0 * heads * kernel;
        if (outs == OUT && nv == BLOCK)
            hidden_block(hidden, from, d0, content, stride, w, heads, kernel, OUT, BLOCK, j,
                         exact);
        else if (outs == OUT && nv == 2)
            hidden_block(hidden, from, d0, content, stride, w, heads, kernel, OUT, 2, j, exact);
        else if (outs == OUT)
            hidden_block(hidden, from, d0, content, stride, w, heads, kernel, OUT, 1, j, exact);
        else
            hidden_block(hidden, from, d0, content, stride, w, heads, kernel, outs, nv, j,
                         exact);
    }
}

/* taps[(s * heads + h) * taps_stride + j ..] = sum_d w2[h, d, s] hidden[d][j ..] for nv
 * vectors of keys at j, every tap s of the second convolution (w2 [heads, width, kernel]). */
static void taps_columns(float *taps, long taps_stride, const float *hidden, long stride,
                         const float *w2, long heads, long width, long kernel, int nv, long j)
{
    for (long s = 0; s < kernel; s++)
        for (long h0 = 0; h0 < heads; h0 += OUT) {
            int outs = heads - h0 < OUT ? (int)(heads - h0) : OUT;
            float *tap = taps + s * heads * taps_stride;
            if (outs == OUT && nv == BLOCK)
                taps_block(tap, taps_stride, h0, hidden, stride, w2 + s, width, kernel, OUT,
                           BLOCK, j);
            else if (outs == OUT && nv == 2)
                taps_block(tap, taps_stride, h0, hidden, stride, w2 + s, width, kernel, OUT, 2,
                           j);
            else if (outs == OUT)
                taps_block(tap, taps_stride, h0, hidden, stride, w2 + s, width, kernel, OUT, 1,
                           j);
            else
                taps_block(tap, taps_stride, h0, hidden, stride, w2 + s, width, kernel, outs,
                           nv, j);
        }
}

/* The second convolution in the fast order over a whole hidden row (at key -kernel / 2,
 * zero-padded), added to the row of scores `to`. */
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
            else if (outs == OUT && nv == 2)
                output_block(to, h0, hidden, stride, w, width, kernel, OUT, 2, j);
            else if (outs == OUT)
                output_block(to, h0, hidden, stride, w, width, kernel, OUT, 1, j);
            else
                output_block(to, h0, hidden, stride, w, width, kernel, outs, nv, j);
            j += nv * LANES;
        }
    }
}

/* One call of the filter over the rows of `batch` sequences x `rows` queries x `length` keys:
 *
 *     out[b, h, i, j] += residual[h, i, j] + Conv2(hidden)[b, h, i, j],
 *     hidden = the activation of (Conv1(in) + addend), written to hidden_out unless NULL,
 *
 * with element (b, h, i, j) of out at b * ob + h * oh + i * oi + j and of in at b * ib +
 * h * ih + i * ii + j; residual (h, i, j) at h * rh + i * ri + j * rj (none when NULL); the
 * addend (d, i, j) at d * ad + i * ai + j * aj (none when NULL; rj and aj are 1 or 0); the
 * gate (d, b, i, j) at d * gd + b * gb + i * gi + j, and hidden_out likewise with hd, hb, hi.
 * w1 is [width, heads, kernel], w2 [heads, width, kernel], both contiguous. Out may be in:
 * each row is read before it is written. With `overwrite`, out = Conv2(hidden) (and no
 * residual). With `normalise`, each row's logits then become probabilities over its keys,
 * the keys j > first_row + i hidden when first_row >= 0 (causal attention; row i is query
 * first_row + i). The backward is the same call with the adjoint weights, the gradient of
 * the logits as `in`, the forward's hidden map as the gate and `overwrite`. */
struct filter_rows {
    float *out;
    long ob, oh, oi;
    const float *in;
    long ib, ih, ii;
    const float *residual;
    long rh, ri, rj;
    const float *addend;
    long ad, ai, aj;
    const float *gate;
    long gd, gb, gi;
    float *hidden_out;
    long hd, hb, hi;
    const float *w1, *w2;
    long batch, heads, rows, length, width, kernel;
    int overwrite, normalise, exact;
    long first_row;
};

/* The buffers of one row: the input and the per-tap rows of the second convolution, both
 * zero-padded by kernel / 2 on each side, and the hidden row (0 from `length` on). */
struct row_buffers {
    float *in, *hidden, *taps;
    long stride, padded;
};

/* The hidden map, the taps and the scores of one row in the chunks filter's order, block by
 * block of keys while they are in cache (the scores of a block once all their taps are
 * known: those of the block before). */
static void exact_output(const struct filter_rows *call, const struct hidden_terms *terms,
                         const struct row_buffers *buffer, const struct output *to)
{
    long heads = call->heads, width = call->width, kernel = call->kernel;
    long stride = buffer->stride, padded = buffer->padded, finished = 0;
    for (long j = 0; j < padded;) {
        int nv = vectors_at(j, padded);
        hidden_columns(buffer->hidden, terms, buffer->in, stride, call->w1, heads, width, kernel,
                       nv, j, 1);
        taps_columns(buffer->taps, stride, buffer->hidden, stride, call->w2, heads, width,
                     kernel, nv, j);
        j += nv * LANES;
        long known = j >= padded ? call->length : (j - kernel / 2) / LANES * LANES;
        add_to_scores(to, buffer->taps, stride, heads, kernel, finished, known);
        finished = known > finished ? known : finished;
    }
}

/* One row (b, i) of `call`. */
static void filter_row(const struct filter_rows *call, long b, long i,
                       const struct row_buffers *buffer)
{
    long heads = call->heads, width = call->width, kernel = call->kernel;
    long length = call->length, stride = buffer->stride;
    const float *in = call->in + b * call->ib + i * call->ii;
    for (long h = 0; h < heads; h++)
        memcpy(buffer->in + kernel / 2 + h * stride, in + h * call->ih, sizeof(float) * length);
    struct hidden_terms terms = {
        {call->addend ? call->addend + i * call->ai : NULL, call->ad, call->aj},
        {call->gate ? call->gate + b * call->gb + i * call->gi : NULL, call->gd, 1},
        call->hidden_out ? call->hidden_out + b * call->hb + i * call->hi : NULL, call->hd,
        length};
    float *out = call->out + b * call->ob + i * call->oi;
    struct output to = {out, call->oh, length,
                        call->residual ? call->residual + i * call->ri : NULL, call->rh,
                        call->rj, call->overwrite};
    if (call->exact) {
        exact_output(call, &terms, buffer, &to);
    } else {
        for (long j = 0; j < buffer->padded; j += vectors_at(j, buffer->padded) * LANES)
            hidden_columns(buffer->hidden, &terms, buffer->in, stride, call->w1, heads, width,
                           kernel, vectors_at(j, buffer->padded), j, 0);
        output_row(&to, buffer->hidden - kernel / 2, stride, call->w2, heads, width, kernel,
                   buffer->padded);
    }
    if (!call->normalise) return;
    long visible = call->first_row < 0 || call->first_row + i + 1 > length
                       ? length
                       : call->first_row + i + 1;
    for (long h = 0; h < heads; h++) softmax_row(out + h * call->oh, length, visible);
}

/* Returns 0, or -1 out of memory. */
int dape_filter_rows(const struct filter_rows *call)
{
    long heads = call->heads, width = call->width, kernel = call->kernel;
    long padded = (call->length + LANES - 1) / LANES * LANES;
    /* Each buffer row: a margin, the keys (key 0 aligned), a margin and a vector (room for the
     * last block's shifted loads); rows of whole vectors apart, so every row is aligned. */
    long margin = (kernel / 2 + LANES - 1) / LANES * LANES;
    long stride = padded + 2 * margin + LANES;
    long floats = (heads + width + kernel * heads) * stride;
    float *work = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
    if (!work) return -1;
    memset(work, 0, sizeof(float) * floats); /* the padding, which no row writes */
    struct row_buffers buffer = {work + margin - kernel / 2, work + heads * stride + margin,
                                 work + (heads + width) * stride + margin, stride, padded};
    for (long b = 0; b < call->batch; b++)
        for (long i = 0; i < call->rows; i++) filter_row(call, b, i, &buffer);
    free(work);
    return 0;
}

/* Floats per vector register in this build (16 with AVX-512, else 8). */
int dape_fused_filter_lanes(void) { return LANES; }
