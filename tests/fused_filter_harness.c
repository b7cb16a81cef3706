/* DAPE's native filter in one call (2 sequences x 4 rows x 53 keys, k = 3) against f in double
 * precision, for tests/test_native_targets.py to run on another target (AArch64 under qemu):
 * prints the build, the largest error and a hash of the logits' bits. */
#include "fused_filter.c"
#include <math.h>
#include <stdint.h>
#include <stdio.h>

enum { H = 8, D = 32, K = 3, R = 4, T = 53, B = 2 };
static float scores[B][H][R][T], out[B][H][R][T], residual[H][R][T], addend[D][R][T];
static float w1[H][K][D], w2[D][K][H];
static uint32_t state = 1;
static float draw(void)
{
    state = state * 1664525u + 1013904223u;
    return (float)(state >> 8) / 16777216.0f - 0.5f;
}
static void fill(float *x, long n) { for (long i = 0; i < n; i++) x[i] = draw(); }

int main(void)
{
    fill(&scores[0][0][0][0], sizeof scores / 4);
    fill(&residual[0][0][0], sizeof residual / 4);
    fill(&addend[0][0][0], sizeof addend / 4);
    fill(&w1[0][0][0], sizeof w1 / 4);
    fill(&w2[0][0][0], sizeof w2 / 4);
    memcpy(out, scores, sizeof out);
    struct filter_rows call = {0};
    call.out = &out[0][0][0][0], call.ob = H * R * T, call.oh = R * T, call.oi = T;
    call.in = &scores[0][0][0][0], call.ib = H * R * T, call.ih = R * T, call.ii = T;
    call.residual = &residual[0][0][0], call.rh = R * T, call.ri = T, call.rj = 1;
    call.addend = &addend[0][0][0], call.ad = R * T, call.ai = T, call.aj = 1;
    call.w0 = call.w1 = &w1[0][0][0], call.w2 = &w2[0][0][0];
    call.batch = B, call.heads = H, call.rows = R, call.length = T, call.width = D;
    call.kernel = K, call.span = T, call.base = OUT_BASE, call.first_row = -1;
    if (dape_filter_rows(&call)) return 1;
    double worst = 0;
    for (int b = 0; b < B; b++)
        for (int i = 0; i < R; i++) {
            double hidden[D][T];
            for (int d = 0; d < D; d++)
                for (int j = 0; j < T; j++) {
                    double x = addend[d][i][j];
                    for (int h = 0; h < H; h++)
                        for (int s = 0; s < K; s++) {
                            int at = j + s - K / 2;
                            if (at >= 0 && at < T) x += (double)w1[h][s][d] * scores[b][h][i][at];
                        }
                    hidden[d][j] = x > 0 ? x : x * 0.01;
                }
            for (int h = 0; h < H; h++)
                for (int j = 0; j < T; j++) {
                    double x = residual[h][i][j];
                    for (int d = 0; d < D; d++)
                        for (int s = 0; s < K; s++) {
                            int at = j + s - K / 2;
                            if (at >= 0 && at < T) x += (double)w2[d][s][h] * hidden[d][at];
                        }
                    double error = fabs(out[b][h][i][j] - (scores[b][h][i][j] + x));
                    worst = error > worst ? error : worst;
                }
        }
    uint64_t hash = 1469598103934665603u;
    const unsigned char *bytes = (const unsigned char *)out;
    for (size_t n = 0; n < sizeof out; n++) hash = (hash ^ bytes[n]) * 1099511628211u;
    printf("%s, %d lanes: largest error %.3g, logits' hash %016llx\n", dape_fused_filter_isa(),
           dape_fused_filter_lanes(), worst, (unsigned long long)hash);
    return 0;
}
