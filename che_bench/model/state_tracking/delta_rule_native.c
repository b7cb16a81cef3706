/* The gated delta product on a CPU as its plain recurrence, forward and backward, in C
 * (loaded by delta_rule_native.py). Per sequence (one head of one sequence of one member),
 * per token t (spec state_tracking.md 1.b-1.d; module docstring of delta_rule.py):
 *
 *     S <- exp(g_t) S;   n times:  u = v_r - S^T k_r,  S <- S + beta_r k_r u^T;   o_t = S^T q_t
 *
 * S is d_k x d_v (d x d here), a row of S is nv vectors of LANES floats (zero beyond d), and
 * fits in L1 at the formal-language sizes (d = 32: 4 KiB). The forward keeps the state before
 * every block of `block` tokens (the checkpoints); the backward replays a block from its
 * checkpoint, keeping the state before each row and the row's u, then runs the block in
 * reverse, carrying dS:
 *
 *     dq_t = S_t dO_t,  dS += q_t dO_t^T;   per row, last first, with S the state before it:
 *     x = dS^T k, du = beta x = dv, y = dS u, dbeta = k . y, dk = beta y - S du, dS -= k du^T;
 *     dg_t = <dS, S after the gate>,  dS <- exp(g_t) dS.
 *
 * Sums run in their own order (SPLIT partial sums along a row loop, a tree within a vector),
 * so the results equal the chunkwise form's within float32 rounding, not bit for bit. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#define MAXV 8 /* vectors per state row: d <= MAXV * LANES */
#elif defined(__AVX__)
#define LANES 8
#define MAXV 8
#else
#define LANES 4 /* SSE2, AArch64: vectors of their 16-byte registers (wider ones split over */
#define MAXV 16 /* several registers, and the compiler takes minutes over them) */
#endif
#define SPLIT 4  /* independent accumulators along a reduction over rows */

typedef float vec __attribute__((vector_size(4 * LANES), aligned(4), may_alias));

#define INLINE static inline __attribute__((always_inline))

/* The sum of a vector's lanes, as a tree of pairwise sums. */
INLINE float hsum(vec x)
{
    float lane[LANES];
    memcpy(lane, &x, sizeof(lane));
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lane[l] += lane[l + width];
    return lane[0];
}

/* A row of d floats as nv vectors, zero beyond d. */
INLINE void load_row(vec *out, const float *x, long d, int nv)
{
    if (d == nv * LANES) {
        for (int m = 0; m < nv; m++) out[m] = *(const vec *)(x + m * LANES);
        return;
    }
    float *o = (float *)out;
    memcpy(o, x, sizeof(float) * d);
    memset(o + d, 0, sizeof(float) * (nv * LANES - d));
}

INLINE void store_row(float *x, const vec *in, long d)
{
    memcpy(x, in, sizeof(float) * d);
}

/* out[m] = sum_i S[i][m] * w[i]  (SPLIT partial sums, added in order) */
INLINE void weighted_rows(vec *out, const vec *S, const float *w, long d, int nv)
{
    vec acc[SPLIT][MAXV];
    for (int a = 0; a < SPLIT; a++)
        for (int m = 0; m < nv; m++) acc[a][m] = (vec){0};
    long i = 0;
    for (; i + SPLIT <= d; i += SPLIT)
        for (int a = 0; a < SPLIT; a++)
            for (int m = 0; m < nv; m++) acc[a][m] += S[(i + a) * nv + m] * w[i + a];
    for (; i < d; i++)
        for (int m = 0; m < nv; m++) acc[0][m] += S[i * nv + m] * w[i];
    for (int m = 0; m < nv; m++) out[m] = (acc[0][m] + acc[1][m]) + (acc[2][m] + acc[3][m]);
}

/* next = decay prev + (b k) u^T, u = v - decay prev^T k: a row's update after the token's
 * gate (decay = exp(g) for a token's first row, else 1) */
INLINE void row_update(vec *next, const vec *prev, const float *k, const vec *v, float b,
                       float decay, long d, int nv, vec *u)
{
    vec w[MAXV];
    weighted_rows(w, prev, k, d, nv);
    for (int m = 0; m < nv; m++) u[m] = v[m] - decay * w[m];
    for (long i = 0; i < d; i++) {
        const float bk = b * k[i];
        for (int m = 0; m < nv; m++) next[i * nv + m] = decay * prev[i * nv + m] + bk * u[m];
    }
}

int delta_product_lanes(void) { return LANES; }

/* The longest state row this build takes, in floats. */
int delta_product_widest(void) { return MAXV * LANES; }

INLINE void forward_sequence(
    const float *q, const float *k, const float *v, const float *beta, const float *g, float *o,
    float *checkpoints, long s, long T, long n, long d, long block, const int nv, vec *S)
{
    const long size = d * nv, blocks = (T + block - 1) / block;
    vec row[MAXV], u[MAXV];
    memset(S, 0, sizeof(vec) * size);
    for (long t = 0; t < T; t++) {
        const long token = s * T + t;
        if (t % block == 0)
            memcpy(checkpoints + (s * blocks + t / block) * size * LANES, S, sizeof(vec) * size);
        const float decay = g ? expf(g[token]) : 1.0f;
        for (long j = 0; j < n; j++) {
            const long r = token * n + j;
            load_row(row, v + r * d, d, nv);
            row_update(S, S, k + r * d, row, beta[r], j ? 1.0f : decay, d, nv, u);
        }
        weighted_rows(row, S, q + token * d, d, nv);
        store_row(o + token * d, row, d);
    }
}

#define FOR_NV(call)                                                                      \
    switch (nv) {                                                                         \
    case 1: call(1); break; case 2: call(2); break; case 3: call(3); break;               \
    case 4: call(4); break; case 5: call(5); break; case 6: call(6); break;               \
    case 7: call(7); break; default: call(8); break;                                      \
    }

int delta_product_forward(const float *q, const float *k, const float *v, const float *beta,
                          const float *g, float *o, float *checkpoints, long sequences, long T,
                          long n, long d, long block)
{
    const int nv = (int)((d + LANES - 1) / LANES);
    if (nv > MAXV) return 2;
    vec *S = aligned_alloc(sizeof(vec), sizeof(vec) * d * nv);
    if (!S) return 1;
#define FORWARD(NV) for (long s = 0; s < sequences; s++) \
        forward_sequence(q, k, v, beta, g, o, checkpoints, s, T, n, d, block, NV, S)
    FOR_NV(FORWARD)
    free(S);
    return 0;
}

/* S^T of a row-layout state (zero beyond d in both directions). */
INLINE void transpose(vec *out, const vec *in, long d, int nv)
{
    const float *from = (const float *)in;
    float *to = (float *)out;
    memset(to, 0, sizeof(vec) * d * nv);
    for (long i = 0; i < d; i++)
        for (long c = 0; c < d; c++) to[c * nv * LANES + i] = from[i * nv * LANES + c];
}

/* rows[i][:] = keep * rows[i][:] + factor * a[i] * b, for row-layout rows (or, given a
 * transposed matrix, its columns); out may be rows. */
INLINE void add_outer(vec *out, const vec *rows, float keep, const float *a, const vec *b,
                      float factor, long d, int nv)
{
    for (long i = 0; i < d; i++) {
        const float coefficient = factor * a[i];
        for (int m = 0; m < nv; m++) out[i * nv + m] = keep * rows[i * nv + m] + coefficient * b[m];
    }
}

/* Where replay keeps S^T before row j of token t of a block (before its gate: the row's
 * state is this times the gate for j = 0): the state after the token before, for j = 0 (the
 * checkpoint's, `first`, at the block's first token), else mid. */
INLINE vec *state_before(vec *first, vec *after, vec *mid, long t, long t0, long j, long n,
                         long size)
{
    if (j) return mid + ((t - t0) * (n - 1) + j - 1) * size;
    return t == t0 ? first : after + (t - t0 - 1) * size;
}

/* Replays block [t0, t1) of sequence s from its checkpoint, keeping S^T before each row
 * (state_before) and after each token (after[t - t0]) and each row's u (us); S itself is
 * carried in `S` (row layout). */
INLINE void replay(vec *first, vec *after, vec *mid, vec *us, vec *S, const vec *start,
                   const float *k, const float *v, const float *beta, const float *g, long s,
                   long t0, long t1, long T, long n, long d, int nv)
{
    const long size = d * nv;
    vec row[MAXV], key[MAXV];
    memcpy(S, start, sizeof(vec) * size);
    transpose(first, start, d, nv);
    for (long t = t0; t < t1; t++) {
        const long token = s * T + t;
        const float decay = g ? expf(g[token]) : 1.0f;
        for (long j = 0; j < n; j++) {
            const long r = token * n + j;
            const vec *in = state_before(first, after, mid, t, t0, j, n, size);
            vec *out = j + 1 < n ? state_before(first, after, mid, t, t0, j + 1, n, size)
                                 : after + (t - t0) * size;
            vec *u = us + ((t - t0) * n + j) * nv;
            load_row(row, v + r * d, d, nv);
            load_row(key, k + r * d, d, nv);
            row_update(S, S, k + r * d, row, beta[r], j ? 1.0f : decay, d, nv, u);
            add_outer(out, in, j ? 1.0f : decay, (const float *)u, key, beta[r], d, nv);
        }
    }
}

/* rows[i][:] = keep * rows[i][:] + a[i] * b - c[i] * e: add_outer with a second term */
INLINE void add_two_outer(vec *rows, float keep, const float *a, const vec *b, const float *c,
                          const vec *e, long d, int nv)
{
    for (long i = 0; i < d; i++) {
        const float first = a[i], second = c[i];
        for (int m = 0; m < nv; m++)
            rows[i * nv + m] = keep * rows[i * nv + m] + first * b[m] - second * e[m];
    }
}

/* The query's term of a token's backward, dS += q dO^T (and dS^T += dO q^T), after the
 * gate of the token after it (keep), left for the token's last row to fold in. */
struct query_term {
    float keep;
    const float *q, *dO;   /* as floats */
    const vec *query, *dOv; /* as vectors */
};

/* The gradients of one row's update (row_update), dS (and its transpose dST) carried back
 * through it; the state before the row is decay * prev (prev: S^T). With `late`, dS and dS^T
 * first take the query's term (in the same passes). */
INLINE void row_backward(vec *dS, vec *dST, const struct query_term *late, const vec *prev,
                         float decay, const vec *u, const float *k, float b, long d, int nv,
                         float *dk, float *dv, float *dbeta)
{
    vec x[MAXV], y[MAXV], z[MAXV], du[MAXV], key[MAXV];
    load_row(key, k, d, nv);
    weighted_rows(x, dS, k, d, nv);
    weighted_rows(y, dST, (const float *)u, d, nv);
    if (late) { /* x, y of dS after the query's term, without forming it first */
        vec qk = (vec){0}, ou = (vec){0};
        for (int m = 0; m < nv; m++) {
            qk += late->query[m] * key[m];
            ou += late->dOv[m] * u[m];
        }
        const float q_dot_k = hsum(qk), dO_dot_u = hsum(ou);
        for (int m = 0; m < nv; m++) {
            x[m] = late->keep * x[m] + q_dot_k * late->dOv[m];
            y[m] = late->keep * y[m] + dO_dot_u * late->query[m];
        }
    }
    for (int m = 0; m < nv; m++) du[m] = b * x[m];
    store_row(dv, du, d);
    weighted_rows(z, prev, (const float *)du, d, nv);
    vec db = (vec){0};
    for (int m = 0; m < nv; m++) {
        db += key[m] * y[m];
        z[m] = b * y[m] - decay * z[m];
    }
    store_row(dk, z, d);
    *dbeta = hsum(db);
    if (late) {
        add_two_outer(dS, late->keep, late->q, late->dOv, k, du, d, nv);
        add_two_outer(dST, late->keep, late->dO, late->query, (const float *)du, key, d, nv);
    } else {
        add_outer(dS, dS, 1.0f, k, du, -1.0f, d, nv);
        add_outer(dST, dST, 1.0f, (const float *)du, key, -1.0f, d, nv);
    }
}

/* <a, b> over `size` vectors, in SPLIT partial sums */
INLINE float inner(const vec *a, const vec *b, long size)
{
    vec acc[SPLIT] = {{0}};
    long x = 0;
    for (; x + SPLIT <= size; x += SPLIT)
        for (int p = 0; p < SPLIT; p++) acc[p] += a[x + p] * b[x + p];
    for (; x < size; x++) acc[0] += a[x] * b[x];
    return hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
}

INLINE void backward_sequence(
    const float *q, const float *k, const float *v, const float *beta, const float *g,
    const float *checkpoints, const float *dO, float *dq, float *dk, float *dv, float *dbeta,
    float *dg, long s, long T, long n, long d, long block, const int nv, vec *buffer)
{
    const long size = d * nv, blocks = (T + block - 1) / block;
    vec *first = buffer, *after = first + size, *mid = after + block * size;
    vec *us = mid + block * (n - 1) * size, *dS = us + block * n * nv, *dST = dS + size;
    vec *S = dST + size;
    vec row[MAXV], query[MAXV], out[MAXV];
    float pending = 1.0f; /* the gate the carried dS has yet to take (the token after's) */
    memset(dS, 0, sizeof(vec) * 2 * size);
    for (long b = blocks - 1; b >= 0; b--) {
        const long t0 = b * block, t1 = t0 + block < T ? t0 + block : T;
        const vec *start = (const vec *)(checkpoints + (s * blocks + b) * size * LANES);
        replay(first, after, mid, us, S, start, k, v, beta, g, s, t0, t1, T, n, d, nv);
        for (long t = t1 - 1; t >= t0; t--) {
            const long token = s * T + t;
            load_row(row, dO + token * d, d, nv);
            load_row(query, q + token * d, d, nv);
            weighted_rows(out, after + (t - t0) * size, dO + token * d, d, nv);
            store_row(dq + token * d, out, d);
            const struct query_term late = {pending, q + token * d, dO + token * d, query, row};
            const float decay = g ? expf(g[token]) : 1.0f;
            for (long j = n - 1; j >= 0; j--) {
                const long r = token * n + j;
                const vec *prev = state_before(first, after, mid, t, t0, j, n, size);
                row_backward(dS, dST, j == n - 1 ? &late : NULL, prev, j ? 1.0f : decay,
                             us + ((t - t0) * n + j) * nv, k + r * d, beta[r], d, nv,
                             dk + r * d, dv + r * d, dbeta + r);
            }
            if (g) {
                const vec *prev = state_before(first, after, mid, t, t0, 0, n, size);
                dg[token] = decay * inner(dST, prev, size);
            }
            pending = decay;
        }
    }
}

int delta_product_backward(const float *q, const float *k, const float *v, const float *beta,
                           const float *g, const float *checkpoints, const float *dO, float *dq,
                           float *dk, float *dv, float *dbeta, float *dg, long sequences, long T,
                           long n, long d, long block)
{
    const int nv = (int)((d + LANES - 1) / LANES);
    if (nv > MAXV) return 2;
    const long size = d * nv;
    /* S^T of the checkpoint, after each token and before each later row; each row's u; dS,
     * dS^T; S */
    const long vectors = (1 + block * n) * size + block * n * nv + 3 * size;
    vec *buffer = aligned_alloc(sizeof(vec), sizeof(vec) * vectors);
    if (!buffer) return 1;
#define BACKWARD(NV) for (long s = 0; s < sequences; s++) \
        backward_sequence(q, k, v, beta, g, checkpoints, dO, dq, dk, dv, dbeta, dg, s, T, n, d, \
                          block, NV, buffer)
    FOR_NV(BACKWARD)
    free(buffer);
    return 0;
}
