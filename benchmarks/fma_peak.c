/* One core's fp32 fused multiply-add throughput (loaded by cpu_peak.py): `chains`
 * independent chains of 64-byte vector FMAs, enough to hide the FMA latency on both of a
 * core's FMA units. Returns the FLOPs done; the caller times the call. */
typedef float vec __attribute__((vector_size(64)));

#define CHAINS 16

double fma_peak_flops(long iterations)
{
    vec acc[CHAINS], scale = (vec){0} + 0.9999999f, shift = (vec){0} + 1e-7f;
    for (int k = 0; k < CHAINS; k++) acc[k] = (vec){0} + (float)k;
    for (long i = 0; i < iterations; i++)
        for (int k = 0; k < CHAINS; k++) acc[k] = acc[k] * scale + shift;
    volatile float sink = 0;
    for (int k = 0; k < CHAINS; k++) sink += acc[k][0]; /* keeps the loop */
    (void)sink;
    return 2.0 * 16 * CHAINS * iterations;
}
