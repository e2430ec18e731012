/* How fast a Q6_K product with 8-bit activations (llama.cpp's Q8_K scheme: per 256 values a float
 * scale and int8 codes; maddubs integer dot products, one float multiply-add per super-block)
 * runs on this machine, against the float kernels' figures: a probe, not musegl code. One
 * thread, thread CPU time, the head shape (202048 x 1024) of random Q6_K blocks, one row.
 * Checks its result against a float64 reference of the same dequantized weights (and reports
 * the relative error the 8-bit activations cost).
 *   cc -O3 -march=native q6k_int8_probe.c -o probe -lm && ./probe            (AVX-512 machine's build)
 *   cc -O3 -march=native -mno-avx512f q6k_int8_probe.c -o probe2 -lm && ./probe2 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double cpu(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

typedef struct { uint8_t ql[128], qh[64]; int8_t sc[16]; uint16_t d; } q6k;
typedef struct { float d; int8_t q[256]; } q8k;

static float h2f(uint16_t h) { return _cvtsh_ss(h); }

static float dot(const q6k *x, const q8k *y, int nb) {
    __m256 acc = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
    for (int i = 0; i < nb; ++i) {
        const float d = y[i].d * h2f(x[i].d);
        const uint8_t *q4 = x[i].ql, *qh = x[i].qh;
        const int8_t *q8 = y[i].q;
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < 2; ++j) {
            const __m256i b1 = _mm256_loadu_si256((const __m256i *)(q4 + 64 * j));
            const __m256i b2 = _mm256_loadu_si256((const __m256i *)(q4 + 64 * j + 32));
            const __m256i bh = _mm256_loadu_si256((const __m256i *)(qh + 32 * j));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(b1, m4), _mm256_slli_epi16(_mm256_and_si256(bh, m2), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(b2, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 2), m2), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 4), m2), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 6), m2), 4));
            for (int t = 0; t < 4; ++t) {
                const __m256i y8 = _mm256_loadu_si256((const __m256i *)(q8 + 128 * j + 32 * t));
                __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(q[t], y8), _mm256_maddubs_epi16(k32, y8));
                const int s = 8 * j + 2 * t;
                const __m256i sc = _mm256_setr_m128i(_mm_set1_epi16(x[i].sc[s]), _mm_set1_epi16(x[i].sc[s + 1]));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(sc, p));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

int main(void) {
    const long n = 202048, k = 1024, nb = k / 256;
    q6k *w = aligned_alloc(64, sizeof(q6k) * n * nb);
    uint8_t *raw = (uint8_t *)w;
    srand(1);
    for (size_t i = 0; i < sizeof(q6k) * n * nb; ++i) raw[i] = rand() & 255;
    for (long i = 0; i < n * nb; ++i) w[i].d = _cvtss_sh(0.001f + 0.009f * (rand() / (float)RAND_MAX), 0);
    float x[1024];
    for (int i = 0; i < k; ++i) x[i] = (float)(rand() / (double)RAND_MAX * 2 - 1);
    q8k y[4];
    for (int b = 0; b < nb; ++b) {  /* Q8_K: round(x / d), d = max|x| / 127 */
        float amax = 0;
        for (int i = 0; i < 256; ++i) amax = fmaxf(amax, fabsf(x[b * 256 + i]));
        y[b].d = amax / 127;
        for (int i = 0; i < 256; ++i) y[b].q[i] = (int8_t)lrintf(x[b * 256 + i] / y[b].d);
    }
    float *out = malloc(sizeof(float) * n);
    double best = 1e9, times[11];
    for (int rep = 0; rep < 11; ++rep) {
        double t = cpu();
        for (long r = 0; r < n; ++r) out[r] = dot(w + r * nb, y, (int)nb);
        times[rep] = cpu() - t;
        if (times[rep] < best) best = times[rep];
    }
    for (int a = 0; a < 11; ++a) for (int b = a + 1; b < 11; ++b) if (times[b] < times[a]) { double s = times[a]; times[a] = times[b]; times[b] = s; }
    double err = 0, scale = 0;
    for (long r = 0; r < 2000; ++r) {  /* float64 reference of the dequantized row */
        double ref = 0, mag = 0;
        for (int b = 0; b < nb; ++b) {
            const q6k *blk = w + r * nb + b;
            const double d = h2f(blk->d);
            for (int s = 0; s < 8; ++s) {
                const int h = s / 4, t = s % 4;
                for (int l = 0; l < 32; ++l) {
                    const uint8_t lo = blk->ql[64 * h + 32 * (t & 1) + l];
                    const int q = ((t < 2 ? lo & 15 : lo >> 4) | (((blk->qh[32 * h + l] >> (2 * t)) & 3) << 4)) - 32;
                    const double v = d * blk->sc[2 * s + l / 16] * q, xv = x[b * 256 + 32 * s + l];
                    ref += v * xv;
                    mag += v * v * xv * xv;
                }
            }
        }
        err += fabs(out[r] - ref) / sqrt(mag);
        scale += 1;
    }
    printf("q6_k x q8_k head %ldx%ld one row, one thread: median %.2f ms, min %.2f ms (%s); mean |error| / natural size %.2e\n",
           n, k, times[5] * 1e3, best * 1e3,
#ifdef __AVX512F__
           "built with AVX-512 allowed, 256-bit code"
#else
           "AVX2 build"
#endif
           , err / scale);
    return 0;
}
