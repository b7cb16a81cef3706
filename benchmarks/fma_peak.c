/* One core's fp32 fused multiply-add throughput (loaded by cpu_peak.py): CHAINS independent
 * chains of vector FMAs as wide as the registers of the instruction set it is built for,
 * enough to hide the FMA latency on both of a core's FMA units while every chain stays in a
 * register. A vector wider than the registers (64 bytes on AVX2) is split over several, and
 * 16 such chains no longer fit in AVX2's 16 registers: the loop then waits on memory and reads
 * a fifth of the core's rate. Returns the FLOPs done; the caller times the call. */
#if defined(__AVX512F__)
#define LANES 16 /* 32 registers of 16 floats */
#define CHAINS 16
#elif defined(__AVX__)
#define LANES 8 /* 16 registers of 8 floats: 12 chains, the constants and room */
#define CHAINS 12
#elif defined(__aarch64__)
#define LANES 4 /* 32 NEON registers of 4 floats */
#define CHAINS 16
#else
#define LANES 4 /* SSE: 16 registers of 4 floats */
#define CHAINS 12
#endif

typedef float vec __attribute__((vector_size(4 * LANES)));

double fma_peak_flops(long iterations)
{
    vec acc[CHAINS], scale = (vec){0} + 0.9999999f, shift = (vec){0} + 1e-7f;
    for (int k = 0; k < CHAINS; k++) acc[k] = (vec){0} + (float)k;
    for (long i = 0; i < iterations; i++)
        for (int k = 0; k < CHAINS; k++) acc[k] = acc[k] * scale + shift;
    volatile float sink = 0;
    for (int k = 0; k < CHAINS; k++) sink += acc[k][0]; /* keeps the loop */
    (void)sink;
    return 2.0 * LANES * CHAINS * iterations;
}

/* Floats per vector in this build. */
int fma_peak_lanes(void) { return LANES; }
