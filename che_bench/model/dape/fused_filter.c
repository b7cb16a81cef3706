/* DAPE's f on a CPU, fused per query row (loaded by native.py):
 *
 *     hidden = LeakyReLU(Conv1(content) + addend),    scores += residual + Conv2(hidden)
 *
 * Conv1 (heads -> width channels) and Conv2 (width -> heads) are 1 x k convolutions along
 * the key axis with zero "same" padding. One row's channels are copied into zero-padded
 * buffers, so the shifted windows are plain unaligned loads (no im2col matrix); the hidden
 * row stays in cache between the two convolutions and the activation is applied in
 * registers. The products are register blocks of OUT channels x BLOCK vectors of keys; each
 * output sums channel by channel, tap by tap within a channel, started from the addend
 * (Conv1) or the residual (Conv2). At evaluation the row's logits can become its attention
 * probabilities (softmax over the keys, those after the query hidden when causal) while
 * they are in cache.
 *
 * The backward through the hidden map is the same computation with the adjoint weights
 * (dape_filter_rows), after the row's hidden map is recomputed; it writes that map, its
 * gradient and their inputs out as zero-padded rows, and the gradients of both convolutions'
 * weights are long dot products over those rows (dape_filter_weight_grads). */
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* The blocking follows the registers: a convolution's block of OUT outputs x BLOCK vectors of
 * keys keeps its OUT * BLOCK accumulators, BLOCK input vectors and a weight in registers, as
 * does a weights' gradient block its TILE accumulators. AVX-512 and AArch64 have 32 vector
 * registers (16 and 4 floats): 8 x 3 blocks. AVX2 has 16 (8 floats), and every weight is a
 * separate broadcast load (AVX-512 broadcasts it inside the multiply-add): 8 x 1 blocks, 8
 * accumulators, one input vector and a weight, with registers to spare. Its 4 x 3 blocks
 * took all 16 registers and spilled to the stack inside the block: 23-24 GFLOP/s against 34
 * on an AMD EPYC Zen 3, the same sums. Other targets (x86-64's default, SSE2) block 4 x 3 on
 * 4-float vectors. */
#if defined(__AVX512F__)
#define LANES 16 /* floats per vector register */
#define OUT 8    /* output channels per register block: 24 accumulators of 32 registers */
#define BLOCK 3  /* vectors of keys per register block */
#define TILE 24  /* accumulators of a block of weight gradients */
#elif defined(__aarch64__)
#define LANES 4
#define OUT 8
#define BLOCK 3
#define TILE 24
#elif defined(__AVX__)
#define LANES 8
#define OUT 8
#define BLOCK 1
#define TILE 12
#else
#define LANES 4
#define OUT 4
#define BLOCK 3
#define TILE 12
#endif
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

/* v, loaded into a register once: the compiler would otherwise read it from memory again in
 * every multiply-add that uses it, and loads, not multiply-adds, would bound the weight
 * gradients' blocks. */
static inline vec in_register(vec v)
{
#if defined(__x86_64__)
    __asm__("" : "+v"(v));
#elif defined(__aarch64__)
    __asm__("" : "+w"(v));
#endif
    return v;
}

/* LeakyReLU as torch computes it: x where x > 0, else x * slope. */
static inline vec leaky_relu(vec x)
{
    return choose(x > 0, x, x * NEGATIVE_SLOPE);
}

/* acc[o][v] += sum_{s < taps} w[s * outputs + o] * x[s + LANES v], tap by tap. */
static inline __attribute__((always_inline)) void convolve_taps(
    vec acc[OUT][BLOCK], int outs, int nv, const float *x, const float *w, long outputs,
    long taps)
{
    for (long s = 0; s < taps; s++, w += outputs) {
        vec in[BLOCK];
        for (int v = 0; v < nv; v++) in[v] = load(x + s + LANES * v);
        for (int o = 0; o < outs; o++)
            for (int v = 0; v < nv; v++) acc[o][v] += w[o] * in[v];
    }
}

/* acc[o][v] += sum_{c, s} w[(c * kernel + s) * outputs + o] * x[c * stride + j + LANES v + s]
 * for outs <= OUT output channels of `outputs` and nv <= BLOCK vectors of keys, channel by
 * channel, tap by tap within a channel (weights laid out input, tap, output: one tap's weights
 * of the block side by side). */
static inline __attribute__((always_inline)) void convolve_block(
    vec acc[OUT][BLOCK], int outs, int nv, const float *x, long stride, const float *w,
    long outputs, long channels, long kernel, long j)
{
    for (long c = 0; c < channels; c++, x += stride, w += kernel * outputs) {
        if (kernel == 3) /* DAPE V2's: its taps unrolled */
            convolve_taps(acc, outs, nv, x + j, w, outputs, 3);
        else
            convolve_taps(acc, outs, nv, x + j, w, outputs, kernel);
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

/* What one row of the first convolution starts from, how it is activated and where it goes,
 * for keys j < length: the batch-free addend (none when its `at` is NULL), then LeakyReLU, or
 * (gate's `at` not NULL) LeakyReLU's derivative at the activated map `gate`, which keeps the
 * sign of its argument: the backward's gradient of the hidden map; channel d's row is at
 * hidden + d * hidden_stride. */
struct hidden_terms {
    struct key_rows addend, gate;
    long length;
    float *hidden;
    long hidden_stride;
};

/* One register block of the first convolution: hidden[o][j ..] = the activation of the
 * addend plus the block's sums (0 from `length` on), for outputs d0 + o, rows of content
 * `stride` apart. */
static inline __attribute__((always_inline)) void hidden_block(
    const struct hidden_terms *terms, long d0, const float *content, long stride, const float *w,
    long width, long heads, long kernel, int outs, int nv, long j)
{
    vec acc[OUT][BLOCK];
    long length = terms->length;
    for (int o = 0; o < outs; o++)
        for (int v = 0; v < nv; v++)
            if (terms->addend.at)
                acc[o][v] = key_vector(&terms->addend, d0 + o, j + LANES * v, length);
            else
                acc[o][v] = (vec){0};
    convolve_block(acc, outs, nv, content, stride, w, width, heads, kernel, j);
    float *hidden = terms->hidden + d0 * terms->hidden_stride;
    for (int v = 0; v < nv; v++) {
        long at = j + LANES * v;
        mask keep = at + LANES > length ? inside(at, length) : ~(mask){0};
        for (int o = 0; o < outs; o++) {
            vec x = acc[o][v];
            if (terms->gate.at)
                x = choose(key_vector(&terms->gate, d0 + o, at, length) > 0, x,
                           x * NEGATIVE_SLOPE);
            else
                x = leaky_relu(x);
            store(hidden + o * terms->hidden_stride + at, choose(keep, x, (vec){0}));
        }
    }
}

/* What a row of the second convolution's sums is added to (`base`): the row of out itself,
 * nothing (out is written over), or the row's input. */
enum base { OUT_BASE, NO_BASE, INPUT_BASE };

/* Where one row of scores goes: out[h * out_stride + j] = base + (residual[h * residual_stride
 * + j * residual_step] (when there is one) + the second convolution), for keys j < length;
 * the input base is input[h * input_stride + j]. */
struct output {
    float *out;
    long out_stride, length;
    const float *residual;
    long residual_stride, residual_step; /* step 1 (a value per key) or 0 (one per row) */
    enum base base;
    const float *input;
    long input_stride;
};

/* One register block of the second convolution, added to its base (`to`):
 * outputs h0 .. h0 + outs at keys j, w (w2 + h0) over the hidden row at key -kernel / 2,
 * zero-padded; the sums start from the residual. */
static inline __attribute__((always_inline)) void output_block(
    const struct output *to, long h0, const float *hidden, long stride, const float *w,
    long heads, long width, long kernel, int outs, int nv, long j)
{
    vec acc[OUT][BLOCK];
    for (int o = 0; o < outs; o++) {
        const float *residual = to->residual + (h0 + o) * to->residual_stride;
        for (int v = 0; v < nv; v++)
            if (!to->residual)
                acc[o][v] = (vec){0};
            else if (to->residual_step)
                acc[o][v] = row_vector(residual, j + LANES * v, to->length, 0);
            else
                acc[o][v] = (vec){0} + residual[0];
    }
    convolve_block(acc, outs, nv, hidden, stride, w, heads, width, kernel, j);
    for (int o = 0; o < outs; o++)
        for (int v = 0; v < nv; v++) {
            long at = j + LANES * v, left = to->length - at;
            if (left <= 0) break;
            float *out = to->out + (h0 + o) * to->out_stride + at;
            vec x = acc[o][v];
            if (to->base == INPUT_BASE)
                x = load(to->input + (h0 + o) * to->input_stride + at) + x;
            else if (to->base == OUT_BASE)
                x = (left >= LANES ? load(out) : load_first(out, left)) + x;
            if (left >= LANES)
                store(out, x);
            else
                store_first(out, x, left);
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

/* hidden[d][j ..] = the activation of addend[d][j ..] (`from`) + sum_{h, s} w1[h, s, d]
 * content[h][j + s ..] for the outs channels d = d0 .. d0 + outs and nv vectors of keys at j.
 * Full blocks get code of constant shape. */
static inline __attribute__((always_inline)) void hidden_columns(
    const struct hidden_terms *from, const float *content, long stride, const float *w1,
    long heads, long width, long kernel, long d0, int outs, int nv, long j)
{
    const float *w = w1 + d0;
    if (outs == OUT && nv == BLOCK)
        hidden_block(from, d0, content, stride, w, width, heads, kernel, OUT, BLOCK, j);
    else if (BLOCK > 2 && outs == OUT && nv == 2) /* BLOCK 3's remainders */
        hidden_block(from, d0, content, stride, w, width, heads, kernel, OUT, 2, j);
    else if (outs == OUT)
        hidden_block(from, d0, content, stride, w, width, heads, kernel, OUT, 1, j);
    else
        hidden_block(from, d0, content, stride, w, width, heads, kernel, outs, nv, j);
}

/* The second convolution over a whole hidden row (at key -kernel / 2, zero-padded), added to
 * the row of scores `to`. */
static void output_row(const struct output *to, const float *hidden, long stride,
                       const float *w2, long heads, long width, long kernel, long padded)
{
    for (long h0 = 0; h0 < heads; h0 += OUT) {
        int outs = heads - h0 < OUT ? (int)(heads - h0) : OUT;
        const float *w = w2 + h0;
        for (long j = 0; j < padded;) {
            int nv = vectors_at(j, padded);
            if (outs == OUT && nv == BLOCK)
                output_block(to, h0, hidden, stride, w, heads, width, kernel, OUT, BLOCK, j);
            else if (BLOCK > 2 && outs == OUT && nv == 2) /* BLOCK 3's remainders */
                output_block(to, h0, hidden, stride, w, heads, width, kernel, OUT, 2, j);
            else if (outs == OUT)
                output_block(to, h0, hidden, stride, w, heads, width, kernel, OUT, 1, j);
            else
                output_block(to, h0, hidden, stride, w, heads, width, kernel, outs, nv, j);
            j += nv * LANES;
        }
    }
}

/* One call of the filter over the rows of `batch` sequences x `rows` queries x `length` keys:
 *
 *     out[b, h, i, j] = base + (residual[h, i, j] + Conv2(hidden)[b, h, i, j]),
 *     hidden = the activation of (Conv1(in) + addend),
 *
 * with element (b, h, i, j) of out at b * ob + h * oh + i * oi + j and of in at b * ib +
 * h * ih + i * ii + j; base (`enum base`) out itself, nothing or in; residual (h, i, j) at
 * h * rh + i * ri + j * rj (none when NULL); the addend (d, i, j) at d * ad + i * ai + j * aj
 * (none when NULL; rj and aj are 1 or 0); the gate (d, b, i, j) at d * gd + b * gb + i * gi +
 * j. Unless NULL, hidden_out (d, b, i, j) at d * hd + b * hb + i * hi + j and in_copy (b, h,
 * i, j) at b * cb + h * ch + i * ci + j receive the hidden map and the input for keys j <
 * span (span >= length + kernel / 2; 0 from `length` on). w1 is [heads, kernel, width], w2
 * [width, kernel, heads] (input channel, tap, output channel), both contiguous. Out may be
 * in: each row is read before it is written. With `normalise`, each row's logits then become
 * probabilities over its keys, the keys j > first_row + i hidden when first_row >= 0 (causal
 * attention; row i is query first_row + i).
 *
 * The backward is the same call with the adjoint weights, the gradient of the logits as `in`,
 * the forward's hidden map as the gate and no base (f's gradient of its content) or the input
 * (that plus the logits' gradient: the scores' whole gradient when they are f's content).
 * With `source` (b, h, i, j at b * sb + h * sh + i * si + j: the forward's content), that
 * hidden map is recomputed first, from the source, the addend and w0 (as w1), and written to
 * the gate (zero-padded to span: `gate` is then an output too), and the source to
 * source_copy (likewise, at b * xb + h * xh + i * xi + j) unless NULL. Unless NULL, in_sum
 * (h, i, j at h * qh + i * qi + j) and hidden_sum (d, i, j at d * ed + i * ei + j) receive,
 * added, in and the hidden map over the sequences, in their order (the gradients of the
 * batch-free residual and addend, when a call's parts split the rows, not the sequences). */
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
    float *in_copy;
    long cb, ch, ci;
    const float *source;
    long sb, sh, si;
    float *source_copy;
    long xb, xh, xi;
    float *in_sum;
    long qh, qi;
    float *hidden_sum;
    long ed, ei;
    const float *w0, *w1, *w2;
    long batch, heads, rows, length, width, kernel, span;
    int base, normalise;
    long first_row;
};

/* The buffers of one row: the input, zero-padded by kernel / 2 on each side (its keys
 * aligned from in + kernel / 2), and the hidden row (0 from `length` on). */
struct row_buffers {
    float *in, *hidden;
    long stride, padded;
};

/* out[c * channel_stride + j] = rows[c * stride + j] for `channels` rows and j < span (a
 * multiple of LANES): whole vectors, not a library call per row. */
static void copy_rows(float *out, long channel_stride, const float *rows, long stride,
                      long channels, long span)
{
    for (long c = 0; c < channels; c++)
        for (long j = 0; j < span; j += LANES)
            store(out + c * channel_stride + j, load(rows + c * stride + j));
}

/* out[c * channel_stride + j] += rows[c * stride + j] for `channels` rows and j < length. */
static void add_rows(float *out, long channel_stride, const float *rows, long stride,
                     long channels, long length)
{
    for (long c = 0; c < channels; c++) {
        float *to = out + c * channel_stride;
        const float *from = rows + c * stride;
        long j = 0;
        for (; j + LANES <= length; j += LANES) store(to + j, load(to + j) + load(from + j));
        if (j < length) store_first(to + j, load_first(to + j, length - j) + load(from + j), length - j);
    }
}

/* A row's channels (`heads` rows `channel_stride` apart, keys j < length) into the row buffer
 * `to` (rows `stride` apart, keys aligned), whole vectors, 0 past the keys. */
static void load_row(float *to, long stride, const float *from, long channel_stride, long heads,
                     long length, long padded)
{
    for (long h = 0; h < heads; h++)
        for (long j = 0; j < padded; j += LANES)
            store(to + h * stride + j, row_vector(from + h * channel_stride, j, length, 0));
}

/* One row of the first convolution (w: input, tap, output) over the row buffer `in` (key 0 at
 * in + kernel / 2), into `terms`' hidden rows; 0 from `padded` to `span` too when span >
 * padded. */
static void hidden_row(const struct hidden_terms *terms, const float *in, long stride,
                       const float *w, long heads, long width, long kernel, long padded,
                       long span)
{
    /* Channels outer: a block's addend, gate and hidden rows are a few streams along the
     * keys, which the hardware prefetches (keys outer, every channel's rows at once). */
    for (long d0 = 0; d0 < width; d0 += OUT) {
        int outs = width - d0 < OUT ? (int)(width - d0) : OUT;
        for (long j = 0; j < padded; j += vectors_at(j, padded) * LANES)
            hidden_columns(terms, in, stride, w, heads, width, kernel, d0, outs,
                           vectors_at(j, padded), j);
    }
    for (long d = 0; span > padded && d < width; d++)
        memset(terms->hidden + d * terms->hidden_stride + padded, 0,
               sizeof(float) * (span - padded));
}

/* The backward's gate of row (b, i): the forward's hidden map, recomputed from the source into
 * the gate's row (returned), the source copied out. */
static const float *recomputed_gate(const struct filter_rows *call, long b, long i,
                                    const struct row_buffers *buffer)
{
    long heads = call->heads, kernel = call->kernel, stride = buffer->stride;
    load_row(buffer->in + kernel / 2, stride, call->source + b * call->sb + i * call->si,
             call->sh, heads, call->length, buffer->padded);
    float *gate = (float *)call->gate + b * call->gb + i * call->gi;
    struct hidden_terms forward = {
        {call->addend ? call->addend + i * call->ai : NULL, call->ad, call->aj},
        {NULL, 0, 0},
        call->length,
        gate,
        call->gd};
    hidden_row(&forward, buffer->in, stride, call->w0, heads, call->width, kernel,
               buffer->padded, call->span);
    if (call->source_copy)
        copy_rows(call->source_copy + b * call->xb + i * call->xi, call->xh,
                  buffer->in + kernel / 2, stride, heads, call->span);
    return gate;
}

/* One row (b, i) of `call`. */
static void filter_row(const struct filter_rows *call, long b, long i,
                       const struct row_buffers *buffer)
{
    long heads = call->heads, width = call->width, kernel = call->kernel;
    long length = call->length, stride = buffer->stride, padded = buffer->padded;
    const float *gate = call->source ? recomputed_gate(call, b, i, buffer)
                        : call->gate ? call->gate + b * call->gb + i * call->gi
                                     : NULL;
    load_row(buffer->in + kernel / 2, stride, call->in + b * call->ib + i * call->ii,
             call->ih, heads, length, padded);
    struct hidden_terms terms = {
        {call->addend && !call->source ? call->addend + i * call->ai : NULL, call->ad, call->aj},
        {gate, call->gd, 1},
        length,
        buffer->hidden,
        stride};
    hidden_row(&terms, buffer->in, stride, call->w1, heads, width, kernel, padded, 0);
    if (call->hidden_out)
        copy_rows(call->hidden_out + b * call->hb + i * call->hi, call->hd, buffer->hidden,
                  stride, width, call->span);
    if (call->in_copy)
        copy_rows(call->in_copy + b * call->cb + i * call->ci, call->ch,
                  buffer->in + kernel / 2, stride, heads, call->span);
    if (call->in_sum)
        add_rows(call->in_sum + i * call->qi, call->qh, buffer->in + kernel / 2, stride, heads,
                 length);
    if (call->hidden_sum)
        add_rows(call->hidden_sum + i * call->ei, call->ed, buffer->hidden, stride, width, length);
    float *out = call->out + b * call->ob + i * call->oi;
    struct output to = {out,
                        call->oh,
                        length,
                        call->residual ? call->residual + i * call->ri : NULL,
                        call->rh,
                        call->rj,
                        (enum base)call->base,
                        buffer->in + kernel / 2,
                        stride};
    output_row(&to, buffer->hidden - kernel / 2, stride, call->w2, heads, width, kernel, padded);
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
     * last block's shifted loads and for a span past the keys); rows of whole vectors apart,
     * so every row is aligned. */
    long margin = (kernel / 2 + LANES - 1) / LANES * LANES;
    long stride = padded + 2 * margin + LANES;
    long floats = (heads + width) * stride;
    float *work = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
    if (!work) return -1;
    memset(work, 0, sizeof(float) * floats); /* the padding, which no row writes */
    struct row_buffers buffer = {work + margin - kernel / 2, work + heads * stride + margin,
                                 stride, padded};
    for (long b = 0; b < call->batch; b++)
        for (long i = 0; i < call->rows; i++) filter_row(call, b, i, &buffer);
    free(work);
    return 0;
}

/* The gradients of a convolution's weights from rows written out by dape_filter_rows,
 * accumulated:
 *
 *     out[n * on + m * om + s] += sum_r sum_{p < span} small[n][r][p] big[m][r][p + e (s - k / 2)]
 *
 * with small (n, r, p) at n * small_channel + r * small_row + p, big likewise, k = kernel,
 * e = direction (1 or -1), over smalls x bigs x k outputs and `rows` rows. Every row of both
 * must be 0 from its keys' end to `span` (a multiple of LANES), and big must read 0 for k / 2
 * floats before its first row and after its last: then each row's shifted reads see the zero
 * padding of the convolution. For Conv2's weights ([heads, width, k]), small is the logits'
 * gradient and big the hidden map, e = 1; for Conv1's, transposed, small is the content and
 * big the hidden map's gradient, e = -1. */
struct weight_grads {
    const float *small;
    long small_channel, small_row;
    const float *big;
    long big_channel, big_row;
    float *out;
    long on, om;
    long smalls, bigs, rows, span, kernel, direction;
};

static inline float horizontal_sum(vec v)
{
    float total = 0;
    for (int t = 0; t < LANES; t++) total += v[t];
    return total;
}

/* The small rows r0 .. r0 + nr, packed vector by vector: packed[((r - r0) * vectors + v) *
 * smalls + n] is small channel n's vector v of row r, so the blocks below read them at
 * constant offsets, in order. */
static void pack_small(vec *packed, const struct weight_grads *g, long r0, long nr)
{
    long vectors = g->span / LANES;
    for (long r = 0; r < nr; r++)
        for (long v = 0; v < vectors; v++)
            for (long n = 0; n < g->smalls; n++)
                *packed++ = load(g->small + n * g->small_channel + (r0 + r) * g->small_row +
                                 LANES * v);
}

/* acc[n * taps + s] += the lanes of big channel m's sums with small channels n0 .. n0 + ns
 * over nr packed rows (`small` at channel n0), every tap: ns * taps <= TILE accumulators, in
 * registers meanwhile. `big` is the channel's first row of the block. */
static inline __attribute__((always_inline)) void weight_block(
    vec *acc, const vec *small, long smalls, const float *big, long big_row, long nr,
    long vectors, long direction, int ns, int taps)
{
    vec sums[TILE];
#pragma GCC unroll 24
    for (int a = 0; a < ns * taps; a++) sums[a] = acc[a];
    for (long r = 0; r < nr; r++, big += big_row) {
        for (long v = 0; v < vectors; v++, small += smalls) {
            vec shifted[TILE];
#pragma GCC unroll 24
            for (int s = 0; s < taps; s++)
                shifted[s] = load(big + LANES * v + direction * (s - taps / 2));
#pragma GCC unroll 24
            for (int n = 0; n < ns; n++) {
                vec x = in_register(small[n]);
#pragma GCC unroll 24
                for (int s = 0; s < taps; s++) sums[n * taps + s] += x * shifted[s];
            }
        }
    }
#pragma GCC unroll 24
    for (int a = 0; a < ns * taps; a++) acc[a] = sums[a];
}

/* Every output's lanes (acc[(m * smalls + n) * taps + s]) over nr rows from r0, packed. */
static void weight_rows(vec *acc, const vec *packed, const struct weight_grads *g, long r0,
                        long nr)
{
    int taps = (int)g->kernel, per_block = TILE / taps;
    long vectors = g->span / LANES, smalls = g->smalls;
    for (long m = 0; m < g->bigs; m++) {
        const float *big = g->big + m * g->big_channel + r0 * g->big_row;
        for (long n0 = 0; n0 < smalls; n0 += per_block) {
            int ns = smalls - n0 < per_block ? (int)(smalls - n0) : per_block;
            vec *at = acc + (m * smalls + n0) * taps;
            const vec *small = packed + n0;
#define WEIGHT_BLOCK(NS, TAPS) \
    weight_block(at, small, smalls, big, g->big_row, nr, vectors, g->direction, NS, TAPS)
            if (ns == per_block && taps == 3)
                WEIGHT_BLOCK(TILE / 3, 3);
            else if (ns == per_block && taps == 5)
                WEIGHT_BLOCK(TILE / 5, 5);
            else if (ns == per_block && taps == 7)
                WEIGHT_BLOCK(TILE / 7, 7);
            else
                WEIGHT_BLOCK(ns, taps);
#undef WEIGHT_BLOCK
        }
    }
}

/* Returns 0, -1 out of memory, or -2 for a kernel wider than TILE taps. Each output sums lane
 * by lane over the rows in order, then across the lanes; the rows go in blocks whose small
 * rows, packed, stay in the L1 cache while every big channel passes over them. */
int dape_filter_weight_grads(const struct weight_grads *g)
{
    if (g->kernel > TILE) return -2;
    long outputs = g->bigs * g->smalls * g->kernel, row_vectors = g->smalls * g->span / LANES;
    long block = (24 << 10) / ((long)sizeof(vec) * row_vectors);
    block = block < 1 ? 1 : block;
    /* aligned_alloc takes a multiple of the alignment (C11; macOS holds to it) */
    vec *acc = aligned_alloc(64, (sizeof(vec) * (outputs + block * row_vectors) + 63) / 64 * 64);
    if (!acc) return -1;
    memset(acc, 0, sizeof(vec) * outputs);
    for (long r0 = 0; r0 < g->rows; r0 += block) {
        long nr = g->rows - r0 < block ? g->rows - r0 : block;
        pack_small(acc + outputs, g, r0, nr);
        weight_rows(acc, acc + outputs, g, r0, nr);
    }
    for (long m = 0; m < g->bigs; m++)
        for (long n = 0; n < g->smalls; n++)
            for (long s = 0; s < g->kernel; s++)
                g->out[n * g->on + m * g->om + s] +=
                    horizontal_sum(acc[(m * g->smalls + n) * g->kernel + s]);
    free(acc);
    return 0;
}

/* Floats per vector register in this build (16 with AVX-512, 8 with AVX2, else 4). */
int dape_fused_filter_lanes(void) { return LANES; }

/* The vector instructions this build was compiled for. */
const char *dape_fused_filter_isa(void)
{
#if defined(__AVX512F__)
    return "AVX-512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "AVX2";
#elif defined(__AVX__)
    return "AVX";
#elif defined(__aarch64__)
    return "AArch64 NEON";
#elif defined(__x86_64__)
    return "SSE2";
#else
    return "generic";
#endif
}
