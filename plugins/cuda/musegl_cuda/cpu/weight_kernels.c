/* Matrix products that read weights in their stored form, on the CPU.
 *
 * y[m, n] = sum_k x[m, k] * W[n, k] for activation rows x (float32) and a weight W
 * kept as float32, float16, bfloat16 or GGUF blocks (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K). Each weight
 * row is decoded in registers, 32 values at a time, and multiplied into the activation
 * rows, so a decode step reads the weight once, at its stored size: decode is bound by
 * weight bytes, which is what halving or quartering them buys. Wide products (prefill
 * chunks) decode a few weight rows at a time into a float32 scratch that stays in cache
 * and multiply them into blocks of activation rows (see "Wide products").
 *
 * One source, three builds (musegl_cuda/cpu/native.py picks one at run time by what
 * the CPU has; MUSEGL_CPU_KERNELS forces one):
 *   avx512fp16  AVX-512 F/BW + F16C + FMA, and AVX512-FP16 for mw_gemm_f16 (prompt
 *               rows of float16 weights in float16 arithmetic, at the end of the file);
 *   avx512      the same without AVX512-FP16 (mw_gemm_f16 reports it is missing);
 *   avx2        AVX2 + FMA + F16C, 8-lane vectors (built with -mno-avx512f).
 * The build's instruction set is fixed by the compiler flags; mw_path() says which.
 *
 * Rows never depend on their batch. Every product computes each output
 * y[m][n] = sum over k of x[m][k] * W[n][k] in one fixed order, whatever the number
 * of activation rows, the tile that computes it or the thread that runs it: one vector
 * accumulator (VL lanes) per output, for each 32-value block of k in order and each VL
 * values of that block in order acc = fma(w, x, acc), then the lanes added up by
 * v_sum (one fixed tree). Every kernel below (small tiles, register tiles, the wide
 * products' float32 scratch, whose values are the very floats the decoders give) keeps
 * that order, so row r of an N-row product is bit for bit the 1-row product of row r,
 * and a prompt row gives the same K/V however its chunk was cut. The order differs
 * between builds (16 or 8 lanes): results are reproducible per build, not across them.
 * Q4_K, Q5_K and Q6_K take their own order ("Integer products of k-quant weights": exact
 * integer sums per super-block, then one order of float operations), as fixed per row.
 *
 * mw_dequant_rows decodes whole rows to float32 (embedding lookups).
 *
 * Block layouts (ggml):
 *   Q8_0: 32 values, 34 bytes: f16 d, int8 q[32]; v = d*q.
 *   Q4_0: 32 values, 18 bytes: f16 d, uint8 q[16]; v[j] = d*((q[j]&15)-8), v[j+16] = d*((q[j]>>4)-8).
 *   Q4_K: 256 values, 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) for
 *         8 sub-blocks of 32, uint8 q[128]; each 64 values use 32 bytes of q: low
 *         nibbles the first 32 (sub-block 2i), high nibbles the next 32 (2i+1);
 *         v = d*scale*nibble - dmin*min.
 *   Q5_K: 256 values, 176 bytes: f16 d, f16 dmin, 12 bytes of (scale, min) as in Q4_K,
 *         uint8 qh[32], uint8 q[128] (nibbles as in Q4_K); bit s of qh[l] is the fifth
 *         bit of value l of sub-block s; v = d*scale*(nibble + 16*bit) - dmin*min.
 *   Q6_K: 256 values, 210 bytes: uint8 ql[128], uint8 qh[64], int8 scales[16], f16 d.
 *         Sub-block s (32 values) of half h = s / 4, quarter t = s % 4: low 4 bits from
 *         ql[64h + 32(t&1) + l] (low nibble for t < 2, high for t >= 2), high 2 bits
 *         (qh[32h + l] >> 2t) & 3; values 0-15 scaled by scales[2s], 16-31 by
 *         scales[2s+1]; v = d*scale*(q - 32).
 *   A4 (MLX's affine 4-bit codes in groups of 64, as mlx-lm's converter writes them, laid out
 *         again at load): 64 values per block, a scale and a bias (float32 for MW_A4_F32,
 *         float16 for MW_A4_F16, bfloat16 for MW_A4_BF16: the file's dtype), then 32 bytes of
 *         nibbles in Q4_0's order per 32 values; v = scale*q + bias (the product rounded,
 *         then the sum: numpy's order).
 * Every decoded value is exact in float32 before the final subtraction (Q4_K/Q5_K: one
 * rounding, as in gguf-py's dequantizer), so every kernel sees gguf-py's floats.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

enum { MW_F32 = 0, MW_F16 = 1, MW_BF16 = 2, MW_Q8_0 = 8, MW_Q4_0 = 4, MW_Q4_K = 12, MW_Q5_K = 13, MW_Q6_K = 14,
       MW_A4_F32 = 20, MW_A4_F16 = 21, MW_A4_BF16 = 22 };
enum { PATH_AVX2 = 1, PATH_AVX512 = 2, PATH_AVX512FP16 = 3 };

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* ---- Vectors of the build's width ------------------------------------------------ */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__) && defined(__FMA__)
#define VL 16
#define NV (32 / VL) /* vectors per 32-value block */
typedef __m512 vf;
typedef __m512i vi;
#ifdef __AVX512FP16__
#define MW_PATH PATH_AVX512FP16
#else
#define MW_PATH PATH_AVX512
#endif
#define v_zero() _mm512_setzero_ps()
#define v_load(p) _mm512_loadu_ps(p)
#define v_store(p, v) _mm512_storeu_ps((p), (v))
#define v_fma(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define v_fmsub(a, b, c) _mm512_fmsub_ps((a), (b), (c))
#define v_mul(a, b) _mm512_mul_ps((a), (b))
#define v_set1(s) _mm512_set1_ps(s)
#define v_cvt(i) _mm512_cvtepi32_ps(i)
#define i_set1(s) _mm512_set1_epi32(s)
#define i_and(a, b) _mm512_and_si512((a), (b))
#define i_sub(a, b) _mm512_sub_epi32((a), (b))
#define i_srli(a, n) _mm512_srli_epi32((a), (n))
#define i_slli(a, n) _mm512_slli_epi32((a), (n))
#define i_srlv(a, n) _mm512_srl_epi32((a), _mm_cvtsi32_si128(n)) /* a shift count known at run time */
#define i_or(a, b) _mm512_or_si512((a), (b))
#define v_max(a, b) _mm512_max_ps((a), (b))
#define v_add(a, b) _mm512_add_ps((a), (b))
#define v_sub(a, b) _mm512_sub_ps((a), (b))
#define v_div(a, b) _mm512_div_ps((a), (b))
#define v_round(a) _mm512_roundscale_ps((a), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define v_pow2i(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), i_set1(127)), 23))
ALWAYS_INLINE vf v_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
ALWAYS_INLINE vf v_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
ALWAYS_INLINE vi i_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
ALWAYS_INLINE vi i_i8(const int8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
/* 32 signed bytes of a register as NV vectors of int32 (bytes c*VL .. c*VL+VL-1 in q[c]). */
ALWAYS_INLINE void i_i8x32(__m256i b, vi q[NV]) {
    q[0] = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(b));
    q[1] = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1));
}
/* The 16 lanes folded to 4: lane i + lane i+8, then + (lane i+4 + lane i+12). */
ALWAYS_INLINE __m128 v_fold4(vf v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
}
/* Register tiles: NR weight rows x up to TILE_MR activation rows (16 of 32 registers). */
#define TILE_MR 4
/* Integer k-quant products (see "Integer products of k-quant weights"): iv holds 32 int16. */
typedef __m512i iv;
#define NI 1 /* int16 vectors per 32 values */
#define v_fnmadd(a, b, c) _mm512_fnmadd_ps((a), (b), (c))
#define v_cvtr(a) _mm512_cvtps_epi32(a) /* round to nearest even (MXCSR's default) */
#define i_zero() _mm512_setzero_si512()
#define i_store(p, v) _mm512_storeu_si512((void *)(p), (v))
#define iv_load(p) _mm512_loadu_si512((const void *)(p))
#define iv_mullo(a, b) _mm512_mullo_epi16((a), (b))
#define iv_set1(s) _mm512_set1_epi16((short)(s))
#ifdef __AVX512VNNI__
#define i_dot(acc, a, b) _mm512_dpwssd_epi32((acc), (a), (b)) /* acc + a0*b0 + a1*b1 per int32 lane, wrapping */
#else
#define i_dot(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#endif
/* Q4_K/Q5_K: the 8 floats of a super-block's mins term in the low lanes, zeros above. */
#define v_from8(p) _mm512_zextps256_ps512(_mm256_loadu_ps(p))
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define VL 8
#define NV (32 / VL)
typedef __m256 vf;
typedef __m256i vi;
#define MW_PATH PATH_AVX2
#define v_zero() _mm256_setzero_ps()
#define v_load(p) _mm256_loadu_ps(p)
#define v_store(p, v) _mm256_storeu_ps((p), (v))
#define v_fma(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define v_fmsub(a, b, c) _mm256_fmsub_ps((a), (b), (c))
#define v_mul(a, b) _mm256_mul_ps((a), (b))
#define v_set1(s) _mm256_set1_ps(s)
#define v_cvt(i) _mm256_cvtepi32_ps(i)
#define i_set1(s) _mm256_set1_epi32(s)
#define i_and(a, b) _mm256_and_si256((a), (b))
#define i_sub(a, b) _mm256_sub_epi32((a), (b))
#define i_srli(a, n) _mm256_srli_epi32((a), (n))
#define i_slli(a, n) _mm256_slli_epi32((a), (n))
#define i_srlv(a, n) _mm256_srl_epi32((a), _mm_cvtsi32_si128(n))
#define i_or(a, b) _mm256_or_si256((a), (b))
#define v_max(a, b) _mm256_max_ps((a), (b))
#define v_add(a, b) _mm256_add_ps((a), (b))
#define v_sub(a, b) _mm256_sub_ps((a), (b))
#define v_div(a, b) _mm256_div_ps((a), (b))
#define v_round(a) _mm256_round_ps((a), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define v_pow2i(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), i_set1(127)), 23))
ALWAYS_INLINE vf v_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
ALWAYS_INLINE vf v_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
ALWAYS_INLINE vi i_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
ALWAYS_INLINE vi i_i8(const int8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
ALWAYS_INLINE void i_i8x32(__m256i b, vi q[NV]) {
    const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    q[0] = _mm256_cvtepi8_epi32(lo);
    q[1] = _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo));
    q[2] = _mm256_cvtepi8_epi32(hi);
    q[3] = _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi));
}
/* The 8 lanes folded to 4: lane i + lane i+4. */
ALWAYS_INLINE __m128 v_fold4(vf v) { return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); }
/* 16 registers: 4 x 3 accumulators and the 4 vectors of one decoded 32-value block. */
#define TILE_MR 3
typedef __m256i iv; /* 16 int16 */
#define NI 2
#define v_fnmadd(a, b, c) _mm256_fnmadd_ps((a), (b), (c))
#define v_cvtr(a) _mm256_cvtps_epi32(a)
#define i_zero() _mm256_setzero_si256()
#define i_store(p, v) _mm256_storeu_si256((__m256i *)(p), (v))
#define iv_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define iv_mullo(a, b) _mm256_mullo_epi16((a), (b))
#define iv_set1(s) _mm256_set1_epi16((short)(s))
#define i_dot(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#define v_from8(p) _mm256_loadu_ps(p)
#else
#error "weight_kernels.c needs AVX2 + FMA + F16C, or AVX-512 F/BW + F16C + FMA"
#endif

/* The sum of a vector's lanes, in one fixed tree (v_fold4, then (l0 + l2) + (l1 + l3)). */
ALWAYS_INLINE float v_sum(vf v) {
    const __m128 b = v_fold4(v);
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

/* v_sum of four vectors at once, the same additions (so the same bits) in a transposed layout. */
ALWAYS_INLINE __m128 v_sum4(vf a, vf b, vf c, vf d) {
    const __m128 fa = v_fold4(a), fb = v_fold4(b), fc = v_fold4(c), fd = v_fold4(d);
    const __m128 ab = _mm_add_ps(_mm_movelh_ps(fa, fb), _mm_movehl_ps(fb, fa));  /* a0+a2 a1+a3 b0+b2 b1+b3 */
    const __m128 cd = _mm_add_ps(_mm_movelh_ps(fc, fd), _mm_movehl_ps(fd, fc));
    return _mm_add_ps(_mm_shuffle_ps(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)), _mm_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
}

#ifndef NR
#define NR 4         /* weight rows of a register tile */
#endif
#ifndef NR_WIDE
#if VL == 16
#define NR_WIDE 8
#define MR_WIDE 3
#else
#define NR_WIDE 4
#define MR_WIDE 3
#endif
#endif
#define SMALL_M 8    /* activation rows up to which one weight row at a time is multiplied */
/* Software prefetch of the weight stream in the decode tiles, whose weights come from DRAM
 * (the bench model's 600 MB of f16 weights a step outsize any cache). One weight row at a
 * time is one stream the hardware prefetchers follow: 1 KiB ahead into L1. A tile of NRT > 1
 * rows reads NRT streams a row apart, each only a row long, which they follow poorly:
 * measured on an AMD EPYC (Zen 4; thread CPU time, one thread, f16 head 202048 x 1024, one
 * activation row), the AVX2 build's 4-row tiles took 37 ms with the 1 KiB prefetch and 36 ms
 * with none. Such a tile prefetches, for each row at its current position, the same position
 * NRT rows on (the next tile's rows, in the order it reads them) into L2: 18 ms (into L1:
 * 34 ms). With it, 4-row tiles beat one row at a time at one and two activation rows on
 * both builds (AVX-512: f16 17.8 vs 22.9 ms, Q6_K 21.1 vs 26.1, Q4_K 25.6 vs 32.0). A
 * prefetch past the matrix's end is harmless (prefetches never fault). */
ALWAYS_INLINE void prefetch_weights(const int NRT, const uint8_t *p, long rb) {
    if (NRT == 1) _mm_prefetch((const char *)p + 1024, _MM_HINT_T0);
    else _mm_prefetch((const char *)p + NRT * rb, _MM_HINT_T1);
}

int mw_path(void) { return MW_PATH; }
int mw_vector_lanes(void) { return VL; }

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

/* Bytes of one row of K values. */
long mw_row_bytes(int type, long k) {
    switch (type) {
    case MW_F32: return 4 * k;
    case MW_F16: case MW_BF16: return 2 * k;
    case MW_Q8_0: return k / 32 * 34;
    case MW_Q4_0: return k / 32 * 18;
    case MW_Q4_K: return k / 256 * 144;
    case MW_Q5_K: return k / 256 * 176;
    case MW_Q6_K: return k / 256 * 210;
    case MW_A4_F32: return k / 64 * 40;
    case MW_A4_F16: case MW_A4_BF16: return k / 64 * 36;
    }
    return -1;
}

static inline void q4k_scale_min(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* The 32 values of 32-value block b of a row, as NV vectors (values c*VL .. c*VL+VL-1
 * in w[c]). Every kernel decodes through this function, so they all see the same
 * floats (for the GGUF types the products are exact: an f16 scale times a few-bit
 * integer fits float32's mantissa). */
ALWAYS_INLINE void decode32(const int type, const uint8_t *wrow, long b, vf w[NV]) {
    if (type == MW_F32) {
        const float *p = (const float *)wrow + b * 32;
        for (int c = 0; c < NV; ++c) w[c] = v_load(p + c * VL);
    } else if (type == MW_F16) {
        const uint16_t *p = (const uint16_t *)wrow + b * 32;
        for (int c = 0; c < NV; ++c) w[c] = v_f16(p + c * VL);
    } else if (type == MW_BF16) {
        const uint16_t *p = (const uint16_t *)wrow + b * 32;
        for (int c = 0; c < NV; ++c) w[c] = v_bf16(p + c * VL);
    } else if (type == MW_Q8_0) {
        const uint8_t *blk = wrow + b * 34;
        uint16_t dh;
        memcpy(&dh, blk, 2);
        const vf d = v_set1(half_to_float(dh));
        const int8_t *q = (const int8_t *)(blk + 2);
        for (int c = 0; c < NV; ++c) w[c] = v_mul(d, v_cvt(i_i8(q + c * VL)));
    } else if (type == MW_Q4_0) {
        const uint8_t *blk = wrow + b * 18;
        uint16_t dh;
        memcpy(&dh, blk, 2);
        const vf d = v_set1(half_to_float(dh));
        const vi low = i_set1(15), eight = i_set1(8);
        for (int c = 0; c < NV / 2; ++c) {  /* bytes c*VL..: low nibbles values c*VL.., high ones 16 + c*VL.. */
            vi q = i_u8(blk + 2 + c * VL);
            w[c] = v_mul(d, v_cvt(i_sub(i_and(q, low), eight)));
            w[c + NV / 2] = v_mul(d, v_cvt(i_sub(i_srli(q, 4), eight)));
        }
    } else if (type == MW_A4_F32 || type == MW_A4_F16 || type == MW_A4_BF16) {  /* half b & 1 of group b / 2 */
        const int ss = type == MW_A4_F32 ? 4 : 2;
        const uint8_t *blk = wrow + (b >> 1) * (2 * ss + 32);
        float sf, bf;
        if (type == MW_A4_F32) {
            memcpy(&sf, blk, 4);
            memcpy(&bf, blk + 4, 4);
        } else {
            uint16_t sh, bh;
            memcpy(&sh, blk, 2);
            memcpy(&bh, blk + 2, 2);
            if (type == MW_A4_F16) {
                sf = half_to_float(sh);
                bf = half_to_float(bh);
            } else {
                uint32_t su = (uint32_t)sh << 16, bu = (uint32_t)bh << 16;
                memcpy(&sf, &su, 4);
                memcpy(&bf, &bu, 4);
            }
        }
        const vf d = v_set1(sf), m = v_set1(bf);
        const uint8_t *q = blk + 2 * ss + (b & 1) * 16;
        const vi low = i_set1(15);
        for (int c = 0; c < NV / 2; ++c) {
            vi n = i_u8(q + c * VL);
            w[c] = v_add(v_mul(d, v_cvt(i_and(n, low))), m);
            w[c + NV / 2] = v_add(v_mul(d, v_cvt(i_srli(n, 4))), m);
        }
    } else if (type == MW_Q6_K) {
        /* The 6-bit codes of the 32 values put together in one register of bytes (two
         * shifts and masks for all 32, against two per vector of values), then widened. */
        const uint8_t *blk = wrow + (b >> 3) * 210;
        const int s = (int)(b & 7), h = s >> 2, t = s & 3;
        uint16_t dh;
        memcpy(&dh, blk + 208, 2);
        const float d = half_to_float(dh);
        const int8_t *scales = (const int8_t *)(blk + 192) + 2 * s;
        __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (t & 1)));
        if (t >= 2) lo = _mm256_srli_epi16(lo, 4);
        lo = _mm256_and_si256(lo, _mm256_set1_epi8(15));
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)),
                                                             _mm_cvtsi32_si128(2 * t)),
                                            _mm256_set1_epi8(3));
        vi q[NV];
        i_i8x32(_mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32)), q);
        for (int c = 0; c < NV; ++c) {
            const vf ds = v_set1(d * (float)scales[c * VL / 16]);  /* exact: f16 x int8 */
            w[c] = v_mul(ds, v_cvt(q[c]));
        }
    } else {  /* MW_Q4_K, MW_Q5_K: 32-value sub-block s of super-block b / 8 */
        const int q5 = type == MW_Q5_K;
        const uint8_t *blk = wrow + (b >> 3) * (q5 ? 176 : 144);
        const int s = (int)(b & 7);
        uint16_t dh, mh;
        memcpy(&dh, blk, 2);
        memcpy(&mh, blk + 2, 2);
        int sc, mn;
        q4k_scale_min(s, blk + 4, &sc, &mn);
        const vf d = v_set1(half_to_float(dh) * sc), m = v_set1(half_to_float(mh) * mn);
        const uint8_t *qh = blk + 16, *q = blk + (q5 ? 48 : 16) + (s >> 1) * 32;
        const vi low = i_set1(15), one = i_set1(1);
        for (int c = 0; c < NV; ++c) {
            vi n = i_u8(q + c * VL);
            n = (s & 1) ? i_srli(n, 4) : i_and(n, low);
            if (q5) n = i_or(n, i_slli(i_and(i_srlv(i_u8(qh + c * VL), s), one), 4));
            w[c] = v_fmsub(d, v_cvt(n), m);
        }
    }
}

/* ---- Decoding several 32-value blocks of a k-quant at once ---------------------------
 * The same floats as decode32, for the blocks that share stored bytes: Q6_K's four
 * sub-blocks of a 128-value half (two 32-byte loads of low nibbles and one of high bits
 * serve all four: decode32 loads and shifts them once per sub-block), and Q4_K's two
 * sub-blocks of 64 values (one 32-byte run of nibbles, its low then its high halves).
 * On AVX-512 a Q4_K value is looked up, not computed: the 16 values d*scale*n - dmin*min
 * of a sub-block are computed once (v_fmsub on n = 0..15, the very operation decode32 does
 * per value, so the same bits) and vpermps picks them by the nibble (it reads the low 4
 * bits of each 32-bit index, so the low nibbles need no mask). */

/* Q6_K half h of super-block blk: the 6-bit codes minus 32 of sub-blocks 4h .. 4h+3, as
 * signed bytes in q[t] (value l of sub-block 4h+t in byte l). */
ALWAYS_INLINE void q6k_half_codes(const uint8_t *blk, int h, __m256i q[4]) {
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    const __m256i m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(48), k32 = _mm256_set1_epi8(32);
    q[0] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l0, m15), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m48)), k32);
    q[1] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l1, m15), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m48)), k32);
    q[2] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m15), _mm256_and_si256(hb, m48)), k32);
    q[3] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15),
                                           _mm256_and_si256(_mm256_srli_epi16(hb, 2), m48)), k32);
}

/* The 16 d * scale of a Q6_K super-block (an int8 converted to float times the f16 d: the
 * product decode32 computes). */
ALWAYS_INLINE void q6k_scales(const uint8_t *blk, float ds[16]) {
    uint16_t dh;
    memcpy(&dh, blk + 208, 2);
    const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
    const __m256 d = _mm256_set1_ps(half_to_float(dh));
    _mm256_storeu_ps(ds, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_storeu_ps(ds + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc)))));
}

/* Sub-block s of a Q6_K super-block from its codes (q6k_half_codes' q[s % 4]) and q6k_scales: w as
 * decode32 gives it. */
ALWAYS_INLINE void q6k_sub(const float ds[16], int s, __m256i codes, vf w[NV]) {
    vi q[NV];
    i_i8x32(codes, q);
    for (int c = 0; c < NV; ++c) w[c] = v_mul(v_set1(ds[2 * s + c * VL / 16]), v_cvt(q[c]));
}

/* The 8 (d * scale, dmin * min) of a Q4_K/Q5_K super-block, as q4k_scale_min and decode32
 * compute them (an int converted to float, times the f16 scale: the same product). */
/* A Q4_K/Q5_K super-block's 8 six-bit scales and 8 mins, as bytes in sc[0..1] and mn[0..1]. */
ALWAYS_INLINE void k4_unpack(const uint8_t *blk, uint32_t sc[2], uint32_t mn[2]) {
    uint32_t u[3];
    memcpy(u, blk + 4, 12);
    /* bytes 0-3 hold scales 0-3 (low 6 bits) and bits 4-5 of scales 4-7 (top 2); bytes 4-7 the
     * same for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high) */
    sc[0] = u[0] & 0x3F3F3F3Fu;
    mn[0] = u[1] & 0x3F3F3F3Fu;
    sc[1] = (u[2] & 0x0F0F0F0Fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    mn[1] = ((u[2] >> 4) & 0x0F0F0F0Fu) | (((u[1] >> 6) & 0x03030303u) << 4);
}

ALWAYS_INLINE void q4k_scales(const uint8_t *blk, float ds[8], float dm[8]) {
    uint16_t dh, mh;
    memcpy(&dh, blk, 2);
    memcpy(&mh, blk + 2, 2);
    uint32_t sc[2], mn[2];
    k4_unpack(blk, sc, mn);
    const __m256 d = _mm256_set1_ps(half_to_float(dh)), dmin = _mm256_set1_ps(half_to_float(mh));
    _mm256_storeu_ps(ds, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)))));
    _mm256_storeu_ps(dm, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)))));
}

/* Sub-blocks 2i and 2i+1 of a Q4_K super-block blk (scales from q4k_scales): w[0..NV) and
 * w[NV..2NV) as decode32 gives them. */
ALWAYS_INLINE void q4k_pair(const uint8_t *blk, int i, const float ds[8], const float dm[8], vf w[2 * NV]) {
    const vf d0 = v_set1(ds[2 * i]), m0 = v_set1(dm[2 * i]), d1 = v_set1(ds[2 * i + 1]), m1 = v_set1(dm[2 * i + 1]);
    const uint8_t *q = blk + 16 + i * 32;
#if VL == 16
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 t0 = v_fmsub(d0, iota, m0), t1 = v_fmsub(d1, iota, m1);
    for (int c = 0; c < NV; ++c) {
        const vi n = i_u8(q + c * VL);
        w[c] = _mm512_permutexvar_ps(n, t0);
        w[NV + c] = _mm512_permutexvar_ps(i_srli(n, 4), t1);
    }
#else
    const vi low = i_set1(15);
    for (int c = 0; c < NV; ++c) {
        const vi n = i_u8(q + c * VL);
        w[c] = v_fmsub(d0, v_cvt(i_and(n, low)), m0);
        w[NV + c] = v_fmsub(d1, v_cvt(i_srli(n, 4)), m1);
    }
#endif
}

/* y[m * ldy + j] = v_sum(acc[j][m]): four weight rows at a time through v_sum4. */
#define store_sums(NRT, MRT, acc, y, ldy)                                                                  \
    do {                                                                                                   \
        for (int m_ = 0; m_ < (MRT); ++m_) {                                                               \
            int j_ = 0;                                                                                    \
            for (; j_ + 4 <= (NRT); j_ += 4)                                                               \
                _mm_storeu_ps((y) + m_ * (ldy) + j_, v_sum4(acc[j_][m_], acc[j_ + 1][m_], acc[j_ + 2][m_], \
                                                            acc[j_ + 3][m_]));                             \
            for (; j_ < (NRT); ++j_) (y)[m_ * (ldy) + j_] = v_sum(acc[j_][m_]);                            \
        }                                                                                                  \
    } while (0)

/* ---- Tiles ----------------------------------------------------------------------
 * tile(): y[m][j] = dot(W row j, x row m) for j < NRT weight rows (rb bytes apart),
 * m < MRT activation rows; k % 32 == 0. NRT x MRT accumulators in registers; type,
 * NRT and MRT are compile-time constants in every instantiation (always_inline and
 * switches outside the loops). The accumulation order of each output is the one the
 * file's header states, whatever NRT and MRT. */
ALWAYS_INLINE void tile(const int type, const int NRT, const int MRT, const int prefetch, const uint8_t *w,
                          long rb, long k, const float *x, long ldx, float *y, long ldy) {
    vf acc[NR_WIDE][SMALL_M];  /* NRT x MRT of them used */
    for (int j = 0; j < NRT; ++j)
        for (int m = 0; m < MRT; ++m) acc[j][m] = v_zero();
    const long bytes = rb / (k / 32);  /* stored bytes per 32 values (Q4_K: an average) */
    if (VL == 8 ? (type == MW_F32 || type == MW_F16 || type == MW_BF16) : type == MW_F32) {
        /* 16 registers: per VL values, MRT x vectors and one weight vector at a time (the
         * same order per output as below: block by block, VL values by VL values) */
        for (long i = 0; i < k; i += VL) {
            vf xv[SMALL_M];
            for (int m = 0; m < MRT; ++m) xv[m] = v_load(x + m * ldx + i);
            for (int j = 0; j < NRT; ++j) {
                if (prefetch && (i & 31) == 0) prefetch_weights(NRT, w + j * rb + i / 32 * bytes, rb);
                const vf wv = type == MW_F32 ? v_load((const float *)(w + j * rb) + i)
                              : type == MW_F16 ? v_f16((const uint16_t *)(w + j * rb) + i)
                                               : v_bf16((const uint16_t *)(w + j * rb) + i);
                for (int m = 0; m < MRT; ++m) acc[j][m] = v_fma(wv, xv[m], acc[j][m]);
            }
        }
        store_sums(NRT, MRT, acc, y, ldy);
        return;
    }
    if (type == MW_Q6_K) {  /* a super-block's scales at once, then a 128-value half at a time */
        for (long sb = 0; sb < k / 256; ++sb) {
            for (int j = 0; j < NRT; ++j) {
                const uint8_t *blk = w + j * rb + sb * 210;
                float ds[16];
                q6k_scales(blk, ds);
                for (int h = 0; h < 2; ++h) {
                    if (prefetch)
                        for (int t = 0; t < 4; ++t) prefetch_weights(NRT, w + j * rb + (sb * 8 + 4 * h + t) * bytes, rb);
                    __m256i codes[4];
                    q6k_half_codes(blk, h, codes);
                    for (int t = 0; t < 4; ++t) {
                        vf wv[NV];
                        q6k_sub(ds, 4 * h + t, codes[t], wv);
                        for (int c = 0; c < NV; ++c)
                            for (int m = 0; m < MRT; ++m)
                                acc[j][m] = v_fma(wv[c], v_load(x + m * ldx + sb * 256 + h * 128 + t * 32 + c * VL),
                                                  acc[j][m]);
                    }
                }
            }
        }
        store_sums(NRT, MRT, acc, y, ldy);
        return;
    }
    if (type == MW_Q4_K) {  /* a super-block's scales at once, then two sub-blocks (64 values) at a time */
        for (long sb = 0; sb < k / 256; ++sb) {
            for (int j = 0; j < NRT; ++j) {
                const uint8_t *blk = w + j * rb + sb * 144;
                float ds[8], dm[8];
                q4k_scales(blk, ds, dm);
                for (int i = 0; i < 4; ++i) {
                    if (prefetch)
                        for (int t = 0; t < 2; ++t) prefetch_weights(NRT, w + j * rb + (sb * 8 + 2 * i + t) * bytes, rb);
                    vf wv[2 * NV];
                    q4k_pair(blk, i, ds, dm, wv);
                    for (int c = 0; c < 2 * NV; ++c)
                        for (int m = 0; m < MRT; ++m)
                            acc[j][m] = v_fma(wv[c], v_load(x + m * ldx + sb * 256 + i * 64 + c * VL), acc[j][m]);
                }
            }
        }
        store_sums(NRT, MRT, acc, y, ldy);
        return;
    }
    for (long b = 0; b < k / 32; ++b) {
#if VL == 16
        vf xv[SMALL_M][NV];  /* MRT x NV used: the x block stays in registers for every weight row */
        for (int m = 0; m < MRT; ++m)
            for (int c = 0; c < NV; ++c) xv[m][c] = v_load(x + m * ldx + b * 32 + c * VL);
#endif
        for (int j = 0; j < NRT; ++j) {
            if (prefetch) prefetch_weights(NRT, w + j * rb + b * bytes, rb);
            vf wv[NV];
            decode32(type, w + j * rb, b, wv);
            for (int c = 0; c < NV; ++c)
                for (int m = 0; m < MRT; ++m) {
#if VL == 16
                    acc[j][m] = v_fma(wv[c], xv[m][c], acc[j][m]);
#else
                    acc[j][m] = v_fma(wv[c], v_load(x + m * ldx + b * 32 + c * VL), acc[j][m]);
#endif
                }
        }
    }
    store_sums(NRT, MRT, acc, y, ldy);
}

/* One weight row against up to SMALL_M activation rows. */
ALWAYS_INLINE void tile_1_mr(const int type, const int pf, int mr, const uint8_t *w, long rb, long k, const float *x, long ldx,
                             float *y, long ldy) {
    switch (mr) {
    case 1: tile(type, 1, 1, pf, w, rb, k, x, ldx, y, ldy); break;
    case 2: tile(type, 1, 2, pf, w, rb, k, x, ldx, y, ldy); break;
    case 3: tile(type, 1, 3, pf, w, rb, k, x, ldx, y, ldy); break;
    case 4: tile(type, 1, 4, pf, w, rb, k, x, ldx, y, ldy); break;
    case 5: tile(type, 1, 5, pf, w, rb, k, x, ldx, y, ldy); break;
    case 6: tile(type, 1, 6, pf, w, rb, k, x, ldx, y, ldy); break;
    case 7: tile(type, 1, 7, pf, w, rb, k, x, ldx, y, ldy); break;
    default: tile(type, 1, 8, pf, w, rb, k, x, ldx, y, ldy); break;
    }
}

/* NR weight rows against up to TILE_MR activation rows. */
ALWAYS_INLINE void tile_nr_mr(const int type, const int pf, int mr, const uint8_t *w, long rb, long k, const float *x, long ldx,
                              float *y, long ldy) {
    switch (mr) {
    case 1: tile(type, NR, 1, pf, w, rb, k, x, ldx, y, ldy); break;
    case 2: tile(type, NR, 2, pf, w, rb, k, x, ldx, y, ldy); break;
#if TILE_MR >= 4
    case 3: tile(type, NR, 3, pf, w, rb, k, x, ldx, y, ldy); break;
#endif
    default: tile(type, NR, TILE_MR, pf, w, rb, k, x, ldx, y, ldy); break;
    }
}

/* NR_WIDE scratch rows against MRT activation rows over values [k0, k1) of k: the
 * accumulators start at zero (k0 == 0) or from acc_mem, where the previous slice left
 * them, and end in acc_mem or, on the last slice (k1 == k), as the outputs' lane sums.
 * Each output's vector accumulator sees the same FMAs in the same order as in tile()
 * (VL values by VL values along k): storing a vector and loading it back changes no bit. */
ALWAYS_INLINE void tile_wide(const int MRT, const float *w, long ldw, long k0, long k1, long k, const float *x,
                             long ldx, vf *acc_mem, float *y, long ldy) {
    vf acc[NR_WIDE][MR_WIDE];
    for (int j = 0; j < NR_WIDE; ++j)
        for (int m = 0; m < MRT; ++m) acc[j][m] = k0 == 0 ? v_zero() : acc_mem[j * MR_WIDE + m];
    for (long i = k0; i < k1; i += VL) {
        vf xv[MR_WIDE];
        for (int m = 0; m < MRT; ++m) xv[m] = v_load(x + m * ldx + i);
        for (int j = 0; j < NR_WIDE; ++j) {
            const vf wv = v_load(w + j * ldw + i);
            for (int m = 0; m < MRT; ++m) acc[j][m] = v_fma(wv, xv[m], acc[j][m]);
        }
    }
    if (k1 == k) {
        store_sums(NR_WIDE, MRT, acc, y, ldy);
    } else {
        for (int j = 0; j < NR_WIDE; ++j)
            for (int m = 0; m < MRT; ++m) acc_mem[j * MR_WIDE + m] = acc[j][m];
    }
}

ALWAYS_INLINE void tile_wide_mr(int mr, const float *w, long ldw, long k0, long k1, long k, const float *x, long ldx,
                                vf *acc_mem, float *y, long ldy) {
    switch (mr) {
    case 1: tile_wide(1, w, ldw, k0, k1, k, x, ldx, acc_mem, y, ldy); break;
    case 2: tile_wide(2, w, ldw, k0, k1, k, x, ldx, acc_mem, y, ldy); break;
#if MR_WIDE > 3
    case 3: tile_wide(3, w, ldw, k0, k1, k, x, ldx, acc_mem, y, ldy); break;
#endif
    default: tile_wide(MR_WIDE, w, ldw, k0, k1, k, x, ldx, acc_mem, y, ldy); break;
    }
}

/* Rows [begin, end) of W against the m activation rows x[0..m): NR-row register tiles
 * for whole groups of NR weight rows, one weight row at a time for the rest (and, with
 * some small activation-row counts, everywhere: see GROUP_FEW). */
static void direct_rows(int type, const uint8_t *w, long rb, long k, const float *x, long ldx, long m,
                        float *y, long ldy, long begin, long end, int grouped) {
    long r = begin;
    if (grouped) {
        for (; r + NR <= end; r += NR)
            for (long m0 = 0; m0 < m; m0 += TILE_MR) {
                int mr = (int)(m - m0 < TILE_MR ? m - m0 : TILE_MR);
                const uint8_t *wr = w + r * rb;
                const float *xm = x + m0 * ldx;
                float *ym = y + m0 * ldy + r;
                switch (type) {
                case MW_F32: tile_nr_mr(MW_F32, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
                case MW_F16: tile_nr_mr(MW_F16, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
                case MW_BF16: tile_nr_mr(MW_BF16, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
                case MW_Q8_0: tile_nr_mr(MW_Q8_0, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
                case MW_Q4_0: tile_nr_mr(MW_Q4_0, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
                case MW_Q5_K: tile_nr_mr(MW_Q5_K, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
                case MW_Q6_K: tile_nr_mr(MW_Q6_K, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
                case MW_A4_F32: tile_nr_mr(MW_A4_F32, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
                case MW_A4_F16: tile_nr_mr(MW_A4_F16, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
                case MW_A4_BF16: tile_nr_mr(MW_A4_BF16, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
                default: tile_nr_mr(MW_Q4_K, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
                }
            }
    }
    for (; r < end; ++r)
        for (long m0 = 0; m0 < m; m0 += SMALL_M) {
            int mr = (int)(m - m0 < SMALL_M ? m - m0 : SMALL_M);
            const uint8_t *wr = w + r * rb;
            const float *xm = x + m0 * ldx;
            float *ym = y + m0 * ldy + r;
            switch (type) {
            case MW_F32: tile_1_mr(MW_F32, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            case MW_F16: tile_1_mr(MW_F16, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            case MW_BF16: tile_1_mr(MW_BF16, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            case MW_Q8_0: tile_1_mr(MW_Q8_0, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            case MW_Q4_0: tile_1_mr(MW_Q4_0, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            case MW_Q5_K: tile_1_mr(MW_Q5_K, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            case MW_Q6_K: tile_1_mr(MW_Q6_K, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            case MW_A4_F32: tile_1_mr(MW_A4_F32, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            case MW_A4_F16: tile_1_mr(MW_A4_F16, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            case MW_A4_BF16: tile_1_mr(MW_A4_BF16, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            default: tile_1_mr(MW_Q4_K, 1, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            }
        }
}

/* ---- Integer products of k-quant weights ------------------------------------------
 * The default for Q4_K, Q5_K and Q6_K (the float path above is kept for comparison: built with
 * -DMW_KQUANT_FLOAT, MUSEGL_CPU_KQUANT=float, see native.py). Decoding codes to float32
 * weights (widen, convert, scale, then the FMA, per value) is what bounds the float kernels,
 * not the bytes; here the codes are multiplied as integers by the activations in fixed point.
 *
 * Activations (kq_quant_row, once per product and activation row): per 256-value block a
 * power-of-two scale s and integers X = round(x / s), |X| <= XQ_T = 2^29 - 2^15 (s the
 * smallest power of two that allows it), so x - s*X is at most s/2 <= 2^-29 of the block's
 * largest |x| (float32 rounds each product at 2^-24 of it). X is held as two int16 limbs,
 * X = 2^15 H + L, H = floor((X + 2^14) / 2^15) in [-(2^14 - 1), 2^14 - 1], L in [-2^14, 2^14 - 1].
 * For Q4_K/Q5_K's mins also s * (sum of X over each 32-value sub-block), 8 floats per block.
 *
 * Weights (decoded in registers): the integer code times its integer scale, int16:
 * Q6_K (q - 32) * scale in [-4064, 4096] (q - 32 in [-32, 31], scale an int8);
 * Q4_K nibble * scale <= 15 * 63 = 945; Q5_K (nibble + 16 bit) * scale <= 31 * 63 = 1953.
 *
 * Per super-block and (weight row, activation row): int32 lane sums of w*H and of w*L by
 * vpmaddwd (two adjacent products a lane; VNNI's vpdpwssd where the build has AVX512-VNNI:
 * the same wrapping sums, so the same integers), lane i of a vector of 2*VL int16 taking
 * values 2i, 2i+1 of every 2*VL in the super-block. Overflow: |w| <= 4096, |H| <= 2^14 - 1,
 * so |w*H| < 2^26, and w*L in [-2^26, 2^26) (w*L = -2^26 only for w = 4096, L = -2^14; the
 * largest positive product is max(4096 (2^14 - 1), 4064 * 2^14) < 2^26). A lane sums
 * 256 / VL products a super-block: AVX-512 16 (|sum| < 2^30), AVX2 32 (in [-2^31, 2^31),
 * exactly int32's range). Then, in one fixed order, for every row count, tile and thread:
 *   c = fma(float(sum H), 2^15, float(sum L));  acc = fma(c, d * s, acc);
 *   Q4_K/Q5_K: acc = fnmadd(dmin * min_j, s * sumX_j, acc) in lanes j < 8 (zeros above);
 * acc the output's vector accumulator over the super-blocks in order, its lanes added up
 * by v_sum at the end. The integer sums are exact, so the result does not depend on how
 * a tile walks them; every row count (decode tiles and prompt rows alike) takes this path,
 * so rows never depend on their batch. The wide (scratch) products are not used for these
 * types. Accuracy: see docs/executor.md (the error of each output relative to
 * sqrt(sum (w x)^2), against float64, is of float32's order, like the float path's). */
#ifdef MW_KQUANT_FLOAT
#define KQ_INT 0
#else
#define KQ_INT 1
#endif
ALWAYS_INLINE int kq_int(int type) { return KQ_INT && (type == MW_Q4_K || type == MW_Q5_K || type == MW_Q6_K); }
/* Prompt-sized products decode a few weight rows to a scratch of int16 weights first (see
 * wide_rows_kq): per super-block KQS_BYTES, the 256 weights (code times scale) as kq6_w16 /
 * kq4_w16 give them, then float d and dmin * min_j (j < 8; Q4_K/Q5_K). tile_kq reads them as
 * these two types (KQ_S6 without mins, KQ_S4 with) and combines them as it does the stored ones. */
enum { KQ_S6 = 100, KQ_S4 = 101 };
#define KQS_BYTES 576
int mw_kquant_int(void) { return KQ_INT; }

#define XQ_T ((1 << 29) - (1 << 15))
#define XQ_TINY 0x1p-90f /* blocks whose largest |x| is below this count as zero (s stays a normal float) */
#define XQ_LD(k) ((k) / 256 * 512 + 32) /* int16 per activation row: k values x 2 limbs, plus a cache line */
typedef struct {
    int16_t *q; /* row r, block b: q + r * ld + b * 512: H[256], then L[256] */
    float *s;   /* s[r * nsb + b]: the block's scale (0: all zero; NaN: a value not finite) */
    float *xs;  /* xs + (r * nsb + b) * 8: s * (sum of X over sub-block j), j < 8 */
    long nsb, ld;
} xq_t;

/* 2^e for a normal float's exponent e (-126 <= e <= 127). */
static inline float pow2f(int e) {
    const uint32_t bits = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void kq_quant_row(const float *x, long k, int16_t *q, float *s, float *xs) {
    for (long b = 0; b < k / 256; ++b) {
        const float *xb = x + b * 256;
        int16_t *qb = q + b * 512;
        float *xsb = xs + b * 8;
        vf top = v_zero(), bad = v_zero();
        for (int i = 0; i < 256; i += VL) {
            const vf v = v_load(xb + i);
            top = v_max(v_max(top, v), v_sub(v_zero(), v));
            bad = v_add(bad, v_mul(v, v_zero())); /* NaN where a value is an infinity or NaN */
        }
        float lanes[VL], amax = 0.0f;
        v_store(lanes, top);
        for (int i = 0; i < VL; ++i) amax = lanes[i] > amax ? lanes[i] : amax;
        const float nonfinite = v_sum(bad);
        if (nonfinite != 0.0f || amax < XQ_TINY) {
            const float fill = nonfinite != 0.0f ? __builtin_nanf("") : 0.0f; /* a NaN makes the row's outputs NaN */
            memset(qb, 0, 512 * sizeof(int16_t));
            s[b] = fill;
            for (int j = 0; j < 8; ++j) xsb[j] = fill;
            continue;
        }
        uint32_t bits;
        memcpy(&bits, &amax, 4);
        int e = (int)(bits >> 23) - 126 - 29; /* amax in [2^(e+28), 2^(e+29)): a normal float */
        if (amax * pow2f(-e) > (float)XQ_T) ++e; /* exact: a power of two; e in [-118, 100] */
        const vf inv = v_set1(pow2f(-e));
        s[b] = pow2f(e);
        int32_t X[256];
        for (int i = 0; i < 256; i += VL) i_store(X + i, v_cvtr(v_mul(v_load(xb + i), inv))); /* x * inv exact */
        for (int i = 0; i < 256; ++i) {
            const int32_t h = (X[i] + (1 << 14)) >> 15; /* arithmetic shift: floor */
            qb[i] = (int16_t)h;
            qb[256 + i] = (int16_t)(X[i] - h * 32768);
        }
        for (int j = 0; j < 8; ++j) {
            int64_t t = 0;
            for (int l = 0; l < 32; ++l) t += X[32 * j + l];
            xsb[j] = (float)((double)t * (double)s[b]); /* |t| < 2^34: exact in double, one rounding */
        }
    }
}

/* Q6_K's 16 scales of a super-block, as kq6_w16 takes them. */
#if VL == 16
typedef __m512i kq6_scales_t; /* dword j: scale j in both int16 halves */
ALWAYS_INLINE kq6_scales_t kq6_scales(const uint8_t *blk) {
    const __m512i s = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)));
    return _mm512_or_si512(_mm512_and_si512(s, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(s, 16));
}
/* Sub-block s's codes minus 32 (signed bytes, from q6k_half_codes) times their scales. */
ALWAYS_INLINE void kq6_w16(kq6_scales_t sc, int s, __m256i codes, iv w[NI]) {
    const __m512i idx = _mm512_add_epi32(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                         _mm512_set1_epi32(2 * s));
    w[0] = iv_mullo(_mm512_cvtepi8_epi16(codes), _mm512_permutexvar_epi32(idx, sc));
}
#else
typedef const int8_t *kq6_scales_t;
ALWAYS_INLINE kq6_scales_t kq6_scales(const uint8_t *blk) { return (const int8_t *)(blk + 192); }
ALWAYS_INLINE void kq6_w16(kq6_scales_t sc, int s, __m256i codes, iv w[NI]) {
    w[0] = iv_mullo(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(codes)), iv_set1(sc[2 * s]));
    w[1] = iv_mullo(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(codes, 1)), iv_set1(sc[2 * s + 1]));
}
#endif

/* A Q4_K/Q5_K super-block's 8 scales and 8 mins as bytes (q4k_scales' unpacking), dm[j] =
 * dmin * min_j (the product q4k_scales computes); returns d. */
ALWAYS_INLINE float kq4_scales(const uint8_t *blk, uint8_t sc[8], float dm[8]) {
    uint16_t dh, mh;
    memcpy(&dh, blk, 2);
    memcpy(&mh, blk + 2, 2);
    uint32_t scw[2], mn[2];
    k4_unpack(blk, scw, mn);
    memcpy(sc, scw, 8);
    _mm256_storeu_ps(dm, _mm256_mul_ps(_mm256_set1_ps(half_to_float(mh)),
                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)))));
    return half_to_float(dh);
}

/* Sub-blocks 2i (w[0..NI)) and 2i+1 (w[NI..2NI)) of a Q4_K/Q5_K super-block: the code
 * (nibble, plus 16 times Q5_K's fifth bit) times the sub-block's scale. */
ALWAYS_INLINE void kq4_w16(const int q5, const uint8_t *blk, int i, const uint8_t sc[8], iv w[2 * NI]) {
    const uint8_t *q = blk + (q5 ? 48 : 16) + 32 * i;
    const iv s0 = iv_set1(sc[2 * i]), s1 = iv_set1(sc[2 * i + 1]);
    const __m128i c0 = _mm_cvtsi32_si128(2 * i), c1 = _mm_cvtsi32_si128(2 * i + 1);
#if VL == 16
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)q));
    __m512i lo = _mm512_and_si512(b, _mm512_set1_epi16(15)), hi = _mm512_srli_epi16(b, 4);
    if (q5) {
        const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 16)));
        const __m512i one = _mm512_set1_epi16(1);
        lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(h, c0), one), 4));
        hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(h, c1), one), 4));
    }
    w[0] = iv_mullo(lo, s0);
    w[1] = iv_mullo(hi, s1);
#else
    for (int c = 0; c < 2; ++c) {
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + 16 * c)));
        __m256i lo = _mm256_and_si256(b, _mm256_set1_epi16(15)), hi = _mm256_srli_epi16(b, 4);
        if (q5) {
            const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 16 + 16 * c)));
            const __m256i one = _mm256_set1_epi16(1);
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, c0), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, c1), one), 4));
        }
        w[c] = iv_mullo(lo, s0);
        w[NI + c] = iv_mullo(hi, s1);
    }
#endif
}

/* ah[m] += w . H, al[m] += w . L over 32 values at offset off of the activation block. */
ALWAYS_INLINE void kq_acc(const int MRT, const iv w[NI], const int16_t *const *xp, int off, vi *ah, vi *al) {
    for (int c = 0; c < NI; ++c)
        for (int m = 0; m < MRT; ++m) {
            ah[m] = i_dot(ah[m], w[c], iv_load(xp[m] + off + c * 2 * VL));
            al[m] = i_dot(al[m], w[c], iv_load(xp[m] + 256 + off + c * 2 * VL));
        }
}

/* tile() for the k-quants in integers: y[m][j] for j < NRT weight rows, m < MRT activation
 * rows (rows m0.. of xq). */
#ifndef NR_KQ
#define NR_KQ 8 /* weight rows of a decode tile (see direct_rows_kq) */
#endif
ALWAYS_INLINE void tile_kq(const int type, const int NRT, const int MRT, const uint8_t *w, long rb, const xq_t *xq,
                           long m0, float *y, long ldy) {
    vf acc[NR_KQ > NR ? NR_KQ : NR][SMALL_M]; /* NRT x MRT of them used */
    for (int j = 0; j < NRT; ++j)
        for (int m = 0; m < MRT; ++m) acc[j][m] = v_zero();
    const int sbb = type == MW_Q6_K ? 210 : type == MW_Q5_K ? 176 : type == MW_Q4_K ? 144 : KQS_BYTES;
    const vf two15 = v_set1(32768.0f);
    for (long sb = 0; sb < xq->nsb; ++sb) {
        const int16_t *xp[SMALL_M];
        float xsc[SMALL_M];
        for (int m = 0; m < MRT; ++m) {
            xp[m] = xq->q + (m0 + m) * xq->ld + sb * 512;
            xsc[m] = xq->s[(m0 + m) * xq->nsb + sb];
        }
        for (int j = 0; j < NRT; ++j) {
            const uint8_t *blk = w + j * rb + sb * sbb;
            if (type != KQ_S6 && type != KQ_S4)
                for (int off = 0; off < sbb; off += 64) prefetch_weights(NRT, blk + off, rb);
            vi ah[SMALL_M], al[SMALL_M];
            for (int m = 0; m < MRT; ++m) ah[m] = al[m] = i_zero();
            float d, dm[8];
            if (type == KQ_S6 || type == KQ_S4) {
                memcpy(&d, blk + 512, 4);
                if (type == KQ_S4) memcpy(dm, blk + 516, 32);
                for (int t = 0; t < 8; ++t) {
                    iv wv[NI];
                    for (int c = 0; c < NI; ++c) wv[c] = iv_load((const int16_t *)blk + 32 * t + c * 2 * VL);
                    kq_acc(MRT, wv, xp, 32 * t, ah, al);
                }
            } else if (type == MW_Q6_K) {
                uint16_t dh;
                memcpy(&dh, blk + 208, 2);
                d = half_to_float(dh);
                const kq6_scales_t sc = kq6_scales(blk);
                for (int h = 0; h < 2; ++h) {
                    __m256i codes[4];
                    q6k_half_codes(blk, h, codes);
                    for (int t = 0; t < 4; ++t) {
                        iv wv[NI];
                        kq6_w16(sc, 4 * h + t, codes[t], wv);
                        kq_acc(MRT, wv, xp, (4 * h + t) * 32, ah, al);
                    }
                }
            } else {
                uint8_t sc[8];
                d = kq4_scales(blk, sc, dm);
                for (int i = 0; i < 4; ++i) {
                    iv wv[2 * NI];
                    kq4_w16(type == MW_Q5_K, blk, i, sc, wv);
                    kq_acc(MRT, wv, xp, 64 * i, ah, al);
                    kq_acc(MRT, wv + NI, xp, 64 * i + 32, ah, al);
                }
            }
            for (int m = 0; m < MRT; ++m)
                acc[j][m] = v_fma(v_fma(v_cvt(ah[m]), two15, v_cvt(al[m])), v_set1(d * xsc[m]), acc[j][m]);
            if (type != MW_Q6_K && type != KQ_S6) {
                const vf vdm = v_from8(dm);
                for (int m = 0; m < MRT; ++m)
                    acc[j][m] = v_fnmadd(vdm, v_from8(xq->xs + ((m0 + m) * xq->nsb + sb) * 8), acc[j][m]);
            }
        }
    }
    store_sums(NRT, MRT, acc, y, ldy);
}

ALWAYS_INLINE void tile_kq_1_mr(const int type, int mr, const uint8_t *w, long rb, const xq_t *xq, long m0, float *y,
                                long ldy) {
    switch (mr) {
    case 1: tile_kq(type, 1, 1, w, rb, xq, m0, y, ldy); break;
    case 2: tile_kq(type, 1, 2, w, rb, xq, m0, y, ldy); break;
    case 3: tile_kq(type, 1, 3, w, rb, xq, m0, y, ldy); break;
    case 4: tile_kq(type, 1, 4, w, rb, xq, m0, y, ldy); break;
    case 5: tile_kq(type, 1, 5, w, rb, xq, m0, y, ldy); break;
    case 6: tile_kq(type, 1, 6, w, rb, xq, m0, y, ldy); break;
    case 7: tile_kq(type, 1, 7, w, rb, xq, m0, y, ldy); break;
    default: tile_kq(type, 1, 8, w, rb, xq, m0, y, ldy); break;
    }
}

ALWAYS_INLINE void tile_kq_nr_mr(const int type, int mr, const uint8_t *w, long rb, const xq_t *xq, long m0, float *y,
                                 long ldy) {
    switch (mr) {
    case 1: tile_kq(type, NR, 1, w, rb, xq, m0, y, ldy); break;
    case 2: tile_kq(type, NR, 2, w, rb, xq, m0, y, ldy); break;
#if TILE_MR >= 4
    case 3: tile_kq(type, NR, 3, w, rb, xq, m0, y, ldy); break;
#endif
    default: tile_kq(type, NR, TILE_MR, w, rb, xq, m0, y, ldy); break;
    }
}

/* tile_kq over the scratch (types KQ_S6, KQ_S4) with every weight row's and activation row's
 * integer sums of a super-block in registers at once (NRT x MRT x 2 of them): each 32 values
 * of an activation row are loaded once for the NRT weight rows, where tile_kq loads them once
 * per weight row. The same integers and float operations per output. */
#ifndef MR_KQS
#define MR_KQS 2 /* AVX-512: 16 integer and 8 float accumulators (3 rows spill: 78 ms against 41) */
#endif
ALWAYS_INLINE void tile_kqs(const int type, const int NRT, const int MRT, const uint8_t *w, long rb, const xq_t *xq,
                            long m0, float *y, long ldy) {
    vf acc[NR][MR_KQS];
    for (int j = 0; j < NRT; ++j)
        for (int m = 0; m < MRT; ++m) acc[j][m] = v_zero();
    const vf two15 = v_set1(32768.0f);
    for (long sb = 0; sb < xq->nsb; ++sb) {
        const int16_t *xp[MR_KQS];
        for (int m = 0; m < MRT; ++m) xp[m] = xq->q + (m0 + m) * xq->ld + sb * 512;
        vi ah[NR][MR_KQS], al[NR][MR_KQS];
        for (int j = 0; j < NRT; ++j)
            for (int m = 0; m < MRT; ++m) ah[j][m] = al[j][m] = i_zero();
        for (int i = 0; i < 256; i += 2 * VL) {
            iv xh[MR_KQS], xl[MR_KQS];
            for (int m = 0; m < MRT; ++m) {
                xh[m] = iv_load(xp[m] + i);
                xl[m] = iv_load(xp[m] + 256 + i);
            }
            for (int j = 0; j < NRT; ++j) {
                const iv wv = iv_load((const int16_t *)(w + j * rb + sb * KQS_BYTES) + i);
                for (int m = 0; m < MRT; ++m) {
                    ah[j][m] = i_dot(ah[j][m], wv, xh[m]);
                    al[j][m] = i_dot(al[j][m], wv, xl[m]);
                }
            }
        }
        for (int j = 0; j < NRT; ++j) {
            const uint8_t *blk = w + j * rb + sb * KQS_BYTES;
            float d;
            memcpy(&d, blk + 512, 4);
            for (int m = 0; m < MRT; ++m)
                acc[j][m] = v_fma(v_fma(v_cvt(ah[j][m]), two15, v_cvt(al[j][m])),
                                  v_set1(d * xq->s[(m0 + m) * xq->nsb + sb]), acc[j][m]);
            if (type == KQ_S4) {
                const vf vdm = v_from8((const float *)(blk + 516));
                for (int m = 0; m < MRT; ++m)
                    acc[j][m] = v_fnmadd(vdm, v_from8(xq->xs + ((m0 + m) * xq->nsb + sb) * 8), acc[j][m]);
            }
        }
    }
    store_sums(NRT, MRT, acc, y, ldy);
}

ALWAYS_INLINE void tile_kqs_mr(const int type, int mr, const uint8_t *w, long rb, const xq_t *xq, long m0, float *y,
                               long ldy) {
#if MR_KQS > 1
    if (mr < MR_KQS) {
        tile_kqs(type, NR, 1, w, rb, xq, m0, y, ldy);
        return;
    }
#endif
    (void)mr;
    tile_kqs(type, NR, MR_KQS, w, rb, xq, m0, y, ldy);
}

/* A row of nsb super-blocks as the scratch tile_kq reads as KQ_S6 / KQ_S4. */
ALWAYS_INLINE void kq_scratch_row(const int type, const uint8_t *row, long nsb, uint8_t *out) {
    const int sbb = type == MW_Q6_K ? 210 : type == MW_Q5_K ? 176 : 144;
    for (long sb = 0; sb < nsb; ++sb) {
        const uint8_t *blk = row + sb * sbb;
        uint8_t *o = out + sb * KQS_BYTES;
        int16_t *ow = (int16_t *)o;
        float d;
        if (type == MW_Q6_K) {
            uint16_t dh;
            memcpy(&dh, blk + 208, 2);
            d = half_to_float(dh);
            const kq6_scales_t sc = kq6_scales(blk);
            for (int h = 0; h < 2; ++h) {
                __m256i codes[4];
                q6k_half_codes(blk, h, codes);
                for (int t = 0; t < 4; ++t) {
                    iv wv[NI];
                    kq6_w16(sc, 4 * h + t, codes[t], wv);
                    for (int c = 0; c < NI; ++c) i_store(ow + (4 * h + t) * 32 + c * 2 * VL, wv[c]);
                }
            }
        } else {
            uint8_t sc[8];
            float dm[8];
            d = kq4_scales(blk, sc, dm);
            memcpy(o + 516, dm, 32);
            for (int i = 0; i < 4; ++i) {
                iv wv[2 * NI];
                kq4_w16(type == MW_Q5_K, blk, i, sc, wv);
                for (int c = 0; c < 2 * NI; ++c) i_store(ow + 64 * i + c * 2 * VL, wv[c]);
            }
        }
        memcpy(o + 512, &d, 4);
    }
}

ALWAYS_INLINE void tile_kq_nrkq_mr(const int type, int mr, const uint8_t *w, long rb, const xq_t *xq, long m0, float *y,
                                   long ldy) {
    switch (mr) {
    case 1: tile_kq(type, NR_KQ, 1, w, rb, xq, m0, y, ldy); break;
    case 2: tile_kq(type, NR_KQ, 2, w, rb, xq, m0, y, ldy); break;
#if TILE_MR >= 4
    case 3: tile_kq(type, NR_KQ, 3, w, rb, xq, m0, y, ldy); break;
#endif
    default: tile_kq(type, NR_KQ, TILE_MR, w, rb, xq, m0, y, ldy); break;
    }
}

/* direct_rows for the k-quants in integers: the same tiling of weight and activation rows,
 * but NR_KQ weight rows a tile (more rows' streams and integer chains in flight: Q4_K head
 * 202048 x 1024, one row, one thread, AVX-512: 8 rows 9.9 ms, 4 rows 11.9; AVX2 13.8, 14.6). */
static void direct_rows_kq(int type, const uint8_t *w, long rb, const xq_t *xq, long m, float *y, long ldy, long begin,
                           long end, int grouped) {
    long r = begin;
    if (grouped)
        for (; r + NR_KQ <= end; r += NR_KQ)
            for (long m0 = 0; m0 < m; m0 += TILE_MR) {
                const int mr = (int)(m - m0 < TILE_MR ? m - m0 : TILE_MR);
                float *ym = y + m0 * ldy + r;
                switch (type) {
                case MW_Q6_K: tile_kq_nrkq_mr(MW_Q6_K, mr, w + r * rb, rb, xq, m0, ym, ldy); break;
                case MW_Q5_K: tile_kq_nrkq_mr(MW_Q5_K, mr, w + r * rb, rb, xq, m0, ym, ldy); break;
                default: tile_kq_nrkq_mr(MW_Q4_K, mr, w + r * rb, rb, xq, m0, ym, ldy); break;
                }
            }
    for (; r < end; ++r)
        for (long m0 = 0; m0 < m; m0 += SMALL_M) {
            const int mr = (int)(m - m0 < SMALL_M ? m - m0 : SMALL_M);
            float *ym = y + m0 * ldy + r;
            switch (type) {
            case MW_Q6_K: tile_kq_1_mr(MW_Q6_K, mr, w + r * rb, rb, xq, m0, ym, ldy); break;
            case MW_Q5_K: tile_kq_1_mr(MW_Q5_K, mr, w + r * rb, rb, xq, m0, ym, ldy); break;
            default: tile_kq_1_mr(MW_Q4_K, mr, w + r * rb, rb, xq, m0, ym, ldy); break;
            }
        }
}

/* Above DIRECT_M activation rows: NR weight rows at a time decoded once to the int16 scratch
 * (kq_scratch_row), then multiplied into every activation row by NR x TILE_MR tiles of
 * tile_kq (a decode tile would decode each weight row once per TILE_MR activation rows).
 * The same integers and float operations per output as the decode tiles. 0 when the scratch
 * could not be allocated (the caller then takes direct_rows_kq: the same bits). */
static int wide_rows_kq(int type, const uint8_t *w, long rb, const xq_t *xq, long m, float *y, long ldy, long begin,
                        long end) {
    const long srb = xq->nsb * KQS_BYTES;
    uint8_t *scratch = aligned_alloc(64, (size_t)(NR * srb));
    if (!scratch) return 0;
    const int s = type == MW_Q6_K ? KQ_S6 : KQ_S4;
    for (long r = begin; r < end; r += NR) {
        const int nr = (int)(end - r < NR ? end - r : NR);
        for (int j = 0; j < nr; ++j) switch (type) {
            case MW_Q6_K: kq_scratch_row(MW_Q6_K, w + (r + j) * rb, xq->nsb, scratch + j * srb); break;
            case MW_Q5_K: kq_scratch_row(MW_Q5_K, w + (r + j) * rb, xq->nsb, scratch + j * srb); break;
            default: kq_scratch_row(MW_Q4_K, w + (r + j) * rb, xq->nsb, scratch + j * srb); break;
            }
        if (nr == NR) {
#if VL == 16 /* 32 registers: tile_kqs's 4 x 2 tiles (Q4_K 5632 x 1024 x 256 rows, one thread: 41 ms, tile_kq 49) */
            for (long m0 = 0; m0 < m;) {
                const int mr = (int)(m - m0 < MR_KQS ? m - m0 : MR_KQS);
                if (s == KQ_S6) tile_kqs_mr(KQ_S6, mr, scratch, srb, xq, m0, y + m0 * ldy + r, ldy);
                else tile_kqs_mr(KQ_S4, mr, scratch, srb, xq, m0, y + m0 * ldy + r, ldy);
                m0 += mr < MR_KQS ? 1 : MR_KQS;
            }
#else /* 16 registers: tile_kq's 4 x 3 tiles (the same product: 46 ms, tile_kqs 4 x 1 57) */
            for (long m0 = 0; m0 < m; m0 += TILE_MR) {
                const int mr = (int)(m - m0 < TILE_MR ? m - m0 : TILE_MR);
                if (s == KQ_S6) tile_kq_nr_mr(KQ_S6, mr, scratch, srb, xq, m0, y + m0 * ldy + r, ldy);
                else tile_kq_nr_mr(KQ_S4, mr, scratch, srb, xq, m0, y + m0 * ldy + r, ldy);
            }
#endif
        } else {
            for (int j = 0; j < nr; ++j)
                for (long m0 = 0; m0 < m; m0 += SMALL_M) {
                    const int mr = (int)(m - m0 < SMALL_M ? m - m0 : SMALL_M);
                    if (s == KQ_S6) tile_kq_1_mr(KQ_S6, mr, scratch + j * srb, srb, xq, m0, y + m0 * ldy + r + j, ldy);
                    else tile_kq_1_mr(KQ_S4, mr, scratch + j * srb, srb, xq, m0, y + m0 * ldy + r + j, ldy);
                }
        }
    }
    free(scratch);
    return 1;
}

/* ---- Wide products ---------------------------------------------------------------
 * Above DIRECT_M activation rows the product is bound by arithmetic, and decoding a
 * weight row once per register tile costs as much as the FMAs for the GGUF types.
 * wide_rows decodes NR_WIDE weight rows at a time into a float32 scratch (through
 * decode32: the same floats) and multiplies them, as MW_F32 tiles, into blocks of
 * activation rows small enough to stay in L2 while the thread's weight rows pass.
 * Same accumulation order as everywhere else. The tiles are NR_WIDE x MR_WIDE
 * accumulators (8 x 3 on AVX-512: an activation vector loaded from L2 serves 8 FMAs,
 * against 4 in 4 x 4 tiles; 4 x 3 on AVX2's 16 registers), and k is cut into slices
 * whose NR_WIDE scratch rows fit in L1 (K_SLICE_BYTES; the whole row where it fits),
 * each tile's vector accumulators kept in memory between slices: every output still
 * sees the same FMAs in the same order, and the scratch is read from L1 for every
 * activation row of the block instead of from L2 (k = 2816). DIRECT_M = 8: measured on the bench
 * shapes (one thread), at 12-32 rows the scratch is faster on both builds (Q8_0 at 32
 * rows: AVX2 8.5 ms against 14.6 decoding in registers, AVX-512 6.3 against 8.7). */
#ifndef DIRECT_M
#define DIRECT_M 8
#endif
#ifndef BLOCK_X_BYTES
#if VL == 16 /* AVX-512 cores have 1-2 MiB of L2 (768 KiB: 512-row products 1.12 -> 1.02x MKL at k = 1024,
              * 1.30 -> 1.18x at k = 2816); AVX2 ones from 512 KiB (AMD Zen 2/3) */
#define BLOCK_X_BYTES (768 * 1024)
#else
#define BLOCK_X_BYTES (384 * 1024)
#endif
#endif
#ifndef K_SLICE_BYTES
#if VL == 16 /* of a 48 KiB L1 (Intel from Ice Lake; 32 KiB before: measured on the 48 KiB one) */
#define K_SLICE_BYTES (32 * 1024)
#else        /* of a 32 KiB L1 (AMD Zen 2/3, Intel Haswell-Skylake): 512 x 1024 x 2816, AVX2 vs MKL held to AVX2,
              * 1.13x with 32 KiB slices, 1.04x with 16 */
#define K_SLICE_BYTES (16 * 1024)
#endif
#endif

static void decode_rows(int type, const uint8_t *w, long rb, long k, int rows, float *out) {
    for (int j = 0; j < rows; ++j)
        for (long b = 0; b < k / 32; ++b) {
            vf wv[NV];
            switch (type) {  /* constant type per decode32 instantiation */
            case MW_F32: decode32(MW_F32, w + j * rb, b, wv); break;
            case MW_F16: decode32(MW_F16, w + j * rb, b, wv); break;
            case MW_BF16: decode32(MW_BF16, w + j * rb, b, wv); break;
            case MW_Q8_0: decode32(MW_Q8_0, w + j * rb, b, wv); break;
            case MW_Q4_0: decode32(MW_Q4_0, w + j * rb, b, wv); break;
            case MW_Q5_K: decode32(MW_Q5_K, w + j * rb, b, wv); break;
            case MW_Q6_K: decode32(MW_Q6_K, w + j * rb, b, wv); break;
            case MW_A4_F32: decode32(MW_A4_F32, w + j * rb, b, wv); break;
            case MW_A4_F16: decode32(MW_A4_F16, w + j * rb, b, wv); break;
            case MW_A4_BF16: decode32(MW_A4_BF16, w + j * rb, b, wv); break;
            default: decode32(MW_Q4_K, w + j * rb, b, wv); break;
            }
            for (int c = 0; c < NV; ++c) v_store(out + j * k + b * 32 + c * VL, wv[c]);
        }
}

/* Row strides of the wide products' buffers, in floats: k plus one cache line, so the
 * rows a tile reads at once do not all map to the same L1 sets (at k = 1024 a float32
 * row is 4 KiB, the L1's set stride). */
#define PADDED(k) ((k) + 64 / 4)

/* 0 when the scratch could not be allocated (the caller then takes the direct path). */
static int wide_rows(int type, const uint8_t *w, long rb, long k, const float *x, long ldx, long m,
                     float *y, long ldy, long begin, long end) {
    const long ldw = PADDED(k);
    /* k in slices whose NR_WIDE scratch rows fit in L1 (the whole row where it does) */
    const long kc = NR_WIDE * k * 4 <= K_SLICE_BYTES ? k : K_SLICE_BYTES / (NR_WIDE * 4) / 32 * 32;
    long mb = BLOCK_X_BYTES / (k * 4);
    mb = mb < MR_WIDE ? MR_WIDE : mb / MR_WIDE * MR_WIDE;
    if (mb > m) mb = m;
    float *scratch = aligned_alloc(64, (size_t)(NR_WIDE * ldw * 4 + 63) / 64 * 64);
    float *xb = aligned_alloc(64, (size_t)(mb * ldw * 4 + 63) / 64 * 64);
    vf *accs = aligned_alloc(64, (size_t)((mb + MR_WIDE - 1) / MR_WIDE * NR_WIDE * MR_WIDE) * sizeof(vf));
    if (!scratch || !xb || !accs) {
        free(scratch);
        free(xb);
        free(accs);
        return 0;
    }
    for (long m0 = 0; m0 < m; m0 += mb) {
        long mend = m0 + mb < m ? m0 + mb : m;
        for (long i = m0; i < mend; ++i) memcpy(xb + (i - m0) * ldw, x + i * ldx, k * 4);
        for (long r = begin; r < end; r += NR_WIDE) {
            int nr = (int)(end - r < NR_WIDE ? end - r : NR_WIDE);
            for (int j = 0; j < nr; ++j) decode_rows(type, w + (r + j) * rb, rb, k, 1, scratch + j * ldw);
            if (nr == NR_WIDE) {
                for (long k0 = 0; k0 < k; k0 += kc) {
                    const long k1 = k0 + kc < k ? k0 + kc : k;
                    for (long m1 = m0; m1 < mend; m1 += MR_WIDE) {
                        int mr = (int)(mend - m1 < MR_WIDE ? mend - m1 : MR_WIDE);
                        tile_wide_mr(mr, scratch, ldw, k0, k1, k, xb + (m1 - m0) * ldw, ldw,
                                     accs + (m1 - m0) / MR_WIDE * (NR_WIDE * MR_WIDE), y + m1 * ldy + r, ldy);
                    }
                }
            } else {
                for (int j = 0; j < nr; ++j)
                    for (long m1 = m0; m1 < mend; m1 += SMALL_M) {
                        int mr = (int)(mend - m1 < SMALL_M ? mend - m1 : SMALL_M);
                        tile_1_mr(MW_F32, 0, mr, (const uint8_t *)(scratch + j * ldw), ldw * 4, k,
                                  xb + (m1 - m0) * ldw, ldw, y + m1 * ldy + r + j, ldy);
                    }
            }
        }
    }
    free(scratch);
    free(xb);
    free(accs);
    return 1;
}

/* ---- Thread pool ------------------------------------------------------------------
 * A call is cut into chunks of rows; the calling thread and the helper threads
 * claim chunks with one atomic compare-and-swap on (job generation, next chunk),
 * and the caller waits only for chunks a helper has claimed and not finished.
 * Unlike an OpenMP region, which ends at a barrier every team thread must reach,
 * a call never waits for a helper the OS has not scheduled yet: on a loaded
 * machine the caller then simply does all the chunks. Idle helpers spin briefly
 * and then sleep on a condition variable. Which thread runs a chunk never changes
 * a result (see the header). */

typedef void (*chunk_fn)(long begin, long end, const void *arg);

#define CLOSED 0xFFFFFFFFu
static struct {
    chunk_fn fn;
    const void *arg;
    long rows, chunk_rows;
    uint32_t chunks;
} job;
static _Atomic uint64_t state;           /* generation << 32 | next chunk (CLOSED between jobs) */
static _Atomic uint32_t finished;        /* chunks done in the current generation */
static _Atomic uint32_t posted;          /* the latest generation (helpers wait for a change) */
static _Atomic int sleepers;
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static int pool_threads = 0;             /* helpers + the caller */
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;

static void run_chunks(uint32_t gen) {
    for (;;) {
        uint64_t s = atomic_load(&state);
        if ((uint32_t)(s >> 32) != gen) return;
        uint32_t idx = (uint32_t)s;
        if (idx == CLOSED || idx >= job.chunks) return;
        if (!atomic_compare_exchange_weak(&state, &s, s + 1)) continue;
        /* Claimed: the job cannot finish (nor its parameters change) before we count it. */
        long begin = (long)idx * job.chunk_rows;
        long end = begin + job.chunk_rows < job.rows ? begin + job.chunk_rows : job.rows;
        job.fn(begin, end, job.arg);
        atomic_fetch_add(&finished, 1);
    }
}

static void *helper_main(void *unused) {
    (void)unused;
    uint32_t seen = atomic_load(&posted);
    for (;;) {
        int spins = 0;
        while (atomic_load(&posted) == seen) {
            if (++spins < 20000) {
                _mm_pause();
                continue;
            }
            pthread_mutex_lock(&pool_mu);
            atomic_fetch_add(&sleepers, 1);
            while (atomic_load(&posted) == seen) pthread_cond_wait(&pool_cv, &pool_mu);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&pool_mu);
        }
        seen = atomic_load(&posted);
        run_chunks(seen);
    }
    return NULL;
}

static void start_pool(int threads) {
    if (pool_threads) return;
    pool_threads = threads < 1 ? 1 : threads;
    atomic_store(&state, (uint64_t)CLOSED);
    for (int i = 1; i < pool_threads; ++i) {
        pthread_t t;
        if (pthread_create(&t, NULL, helper_main, NULL) != 0) {
            pool_threads = i;
            break;
        }
        pthread_detach(t);
    }
}

/* fn(begin, end, arg) over rows 0 .. rows-1 in chunks of at least min_rows, each a
 * multiple of align rows (but the last). */
static void parallel_rows(long rows, long min_rows, long align, chunk_fn fn, const void *arg, int threads) {
    pthread_mutex_lock(&call_mu);  /* one job at a time */
    start_pool(threads);
    long chunks = pool_threads * 8L;
    long chunk_rows = (rows + chunks - 1) / chunks;
    if (chunk_rows < min_rows) chunk_rows = min_rows;
    chunk_rows = (chunk_rows + align - 1) / align * align;
    if (pool_threads == 1 || chunk_rows >= rows) {
        fn(0, rows, arg);
        pthread_mutex_unlock(&call_mu);
        return;
    }
    static uint32_t gen = 0;
    job.fn = fn;
    job.arg = arg;
    job.rows = rows;
    job.chunk_rows = chunk_rows;
    job.chunks = (uint32_t)((rows + chunk_rows - 1) / chunk_rows);
    atomic_store(&finished, 0);
    ++gen;
    atomic_store(&state, (uint64_t)gen << 32);
    atomic_store(&posted, gen);
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&pool_mu);
        pthread_cond_broadcast(&pool_cv);
        pthread_mutex_unlock(&pool_mu);
    }
    run_chunks(gen);
    while (atomic_load(&finished) < job.chunks) _mm_pause();
    atomic_store(&state, (uint64_t)gen << 32 | CLOSED);
    pthread_mutex_unlock(&call_mu);
}

typedef struct {
    int type;
    const uint8_t *w;
    long k, rb, m, ldx, ldy;
    const float *x;
    float *y;
    const int64_t *rows;
    float *out;
    const xq_t *xq; /* the integer k-quant products' activations */
} args_t;

/* Activation-row counts for which the weight rows are taken one at a time (the weight
 * stream the prefetcher follows best; up to SMALL_M x rows share each decoded row)
 * rather than in NR-row register tiles: GROUP_FEW < m <= SMALL_M. Both builds use tiles at
 * 1-2 rows (four accumulator chains where one row has one; with the tiles' prefetch, see
 * prefetch_weights, measured on the head as stated there) and one row at a time at 3-8
 * (a 3-row tile would decode each weight row two or three times; at 4 rows one row at a
 * time with the 1 KiB prefetch was faster than with a row-ahead one into L2, f16 head:
 * AVX-512 28.5 vs 32.5 ms, AVX2 31.1 vs 37.0). */
#ifndef GROUP_FEW
#define GROUP_FEW 2
#endif

/* Activation rows above which the integer k-quant products take the int16 scratch
 * (wide_rows_kq). Measured on 5632 x 1024, one thread: AVX-512 6 (Q4_K 8 rows 1.43 ms in the
 * scratch, 1.71 in 1 x 8 decode tiles; 7 rows 1.27, 1.38 (Q6_K 1.38, 1.31); 5 rows 0.96,
 * 0.79); AVX2 2, as its 16 registers hold the integer sums of at most 3 activation rows
 * (Q6_K 3 rows: 0.71 ms against 0.91 in 1 x 3 decode tiles). */
#ifndef DIRECT_M_KQ
#if VL == 16
#define DIRECT_M_KQ 6
#else
#define DIRECT_M_KQ 2
#endif
#endif

static void matmul_chunk(long begin, long end, const void *p) {
    const args_t *a = (const args_t *)p;
    if (a->xq) {
        if (a->m > DIRECT_M_KQ && wide_rows_kq(a->type, a->w, a->rb, a->xq, a->m, a->y, a->ldy, begin, end)) return;
        direct_rows_kq(a->type, a->w, a->rb, a->xq, a->m, a->y, a->ldy, begin, end, a->m <= GROUP_FEW || a->m > SMALL_M);
        return;
    }
    if (a->m > DIRECT_M && wide_rows(a->type, a->w, a->rb, a->k, a->x, a->ldx, a->m, a->y, a->ldy, begin, end))
        return;
    direct_rows(a->type, a->w, a->rb, a->k, a->x, a->ldx, a->m, a->y, a->ldy, begin, end,
                a->m <= GROUP_FEW || a->m > SMALL_M);
}

/* y (m x n, row stride ldy) = x (m x k, row stride ldx) @ W^T, W (n rows of row_bytes(type, k)).
 * k must be a multiple of the type's block (32 for f32/f16/bf16). ``threads`` sizes the
 * pool on the first call. */
static void quant_chunk(long begin, long end, const void *p) {
    const args_t *a = (const args_t *)p;
    const xq_t *q = a->xq;
    for (long i = begin; i < end; ++i) kq_quant_row(a->x + i * a->ldx, a->k, q->q + i * q->ld, q->s + i * q->nsb, q->xs + i * q->nsb * 8);
}

#define KQ_ROWS 64 /* activation rows quantized and multiplied at a time (64 x 4 bytes x k in L2) */

/* The integer k-quant product (see above), KQ_ROWS activation rows at a time; 0 when its
 * scratch could not be allocated. */
static int matmul_kq(int type, const uint8_t *w, long n, long k, const float *x, long ldx, long m, float *y, long ldy,
                     int threads) {
    const long mb = m < KQ_ROWS ? m : KQ_ROWS, nsb = k / 256;
    xq_t q = {aligned_alloc(64, (size_t)(mb * XQ_LD(k) * 2 + 63) / 64 * 64),
              aligned_alloc(64, (size_t)(mb * nsb * 4 + 63) / 64 * 64),
              aligned_alloc(64, (size_t)(mb * nsb * 32 + 63) / 64 * 64), nsb, XQ_LD(k)};
    if (!q.q || !q.s || !q.xs) {
        free(q.q);
        free(q.s);
        free(q.xs);
        return 0;
    }
    for (long m0 = 0; m0 < m; m0 += mb) {
        const long rows = m - m0 < mb ? m - m0 : mb;
        args_t a = {type, w, k, mw_row_bytes(type, k), rows, ldx, ldy, x + m0 * ldx, y + m0 * ldy, NULL, NULL, &q};
        parallel_rows(rows, 16, 1, quant_chunk, &a, threads);
        parallel_rows(n, 64, rows > DIRECT_M_KQ ? NR : NR_KQ, matmul_chunk, &a, threads);
    }
    free(q.q);
    free(q.s);
    free(q.xs);
    return 1;
}

void mw_matmul(int type, const uint8_t *w, long n, long k, const float *x, long ldx, long m, float *y,
               long ldy, int threads) {
    /* The integer k-quant products; should their scratch (m x 4k bytes at most 64 rows) not
     * be allocatable, the float kernels below (other bits: the process is out of memory). */
    if (kq_int(type) && matmul_kq(type, w, n, k, x, ldx, m, y, ldy, threads)) return;
    /* Decode-sized products read every activation row at once: rows a multiple of 4 KiB
     * apart would all map to the same L1 sets (8 rows and the weight stream overflow an
     * 8-way L1), so they are read from a copy padded by a cache line (the same values). */
    float *padded = NULL;
    if (m > 1 && m <= DIRECT_M && (ldx * 4) % 4096 == 0) {
        padded = aligned_alloc(64, (size_t)(m * PADDED(k) * 4 + 63) / 64 * 64);
        if (padded) {
            for (long i = 0; i < m; ++i) memcpy(padded + i * PADDED(k), x + i * ldx, k * 4);
            x = padded;
            ldx = PADDED(k);
        }
    }
    args_t a = {type, w, k, mw_row_bytes(type, k), m, ldx, ldy, x, y, NULL, NULL, NULL};
    parallel_rows(n, m > DIRECT_M ? 16 : 64, m > DIRECT_M ? NR_WIDE : NR, matmul_chunk, &a, threads);
    free(padded);
}

static void dequant_chunk(long begin, long end, const void *p) {
    const args_t *a = (const args_t *)p;
    for (long i = begin; i < end; ++i) {
        long r = a->rows ? (long)a->rows[i] : i;
        decode_rows(a->type, a->w + r * a->rb, a->rb, a->k, 1, a->out + i * a->k);
    }
}

/* out (count x k) = rows of W; rows == NULL means rows 0 .. count-1. */
void mw_dequant_rows(int type, const uint8_t *w, long k, const int64_t *rows, long count, float *out, int threads) {
    args_t a = {type, w, k, mw_row_bytes(type, k), 0, 0, 0, NULL, NULL, rows, out, NULL};
    parallel_rows(count, 16, 1, dequant_chunk, &a, threads);
}

/* ---- Attention rows ------------------------------------------------------------------
 * mw_attention: out[r][h] = sum_j p_j v_j over the keys of activation row r, with
 * p = softmax(scale * q[r][h] . k_j) (float32), for every query head h (KV head h / group,
 * GQA without repeated K/V). Row r's keys are the cache slots slots[off_r + lo .. off_r +
 * count_r), lo = max(0, count_r - window) for a sliding layer (window > 0), else 0; the
 * cache is slots x kv_heads x head_dim float32. Each row is computed from its own keys
 * alone, in one order: the dots over head_dim in vector lanes (v_sum), the maximum,
 * exp(s - max) per key (v_exp: the same value for a key wherever it sits in the row's
 * list), their sum in vector lanes over the keys in order, and the weighted sum of V in
 * key order for every output value. So a row's result does not depend on the other rows
 * of its chunk or step, nor on how many keys they see: a decode row gives the same bits
 * alone, beside other sequences, or beside a prompt chunk, and a prompt gives the same
 * K/V however it is chunked. Units of work are (row, KV head) pairs over the pool. */

/* e^x for x <= 0 (Cephes' expf polynomial, ~1 ulp; below -87.3 the result is ~1e-38). */
ALWAYS_INLINE vf v_exp(vf x) {
    x = v_max(x, v_set1(-87.3365478515625f));
    vf n = v_round(v_mul(x, v_set1(1.44269504088896341f)));
    vf r = v_fma(n, v_set1(-0.693359375f), x);
    r = v_fma(n, v_set1(2.12194440e-4f), r);
    vf p = v_set1(1.9875691500E-4f);
    p = v_fma(p, r, v_set1(1.3981999507E-3f));
    p = v_fma(p, r, v_set1(8.3334519073E-3f));
    p = v_fma(p, r, v_set1(4.1665795894E-2f));
    p = v_fma(p, r, v_set1(1.6666665459E-1f));
    p = v_fma(p, r, v_set1(5.0000001201E-1f));
    p = v_fma(p, v_mul(r, r), v_add(r, v_set1(1.0f)));
    return v_mul(p, v_pow2i(n));
}

typedef struct {
    const float *q, *kc, *vc;
    float *out;
    const int64_t *slots, *offsets, *counts;
    long heads, hd, kvh, window, max_keys;
    float scale;
    _Atomic int *failed;
} attn_args_t;

/* s[h * width + j] = scale * dot(q head h, key j) for NH heads and NK keys (one
 * accumulator per dot, over head_dim in order: NH x NK independent chains). */
ALWAYS_INLINE void key_dots(const int NH, const int NK, const float *q, long hd, const float *const *keys,
                            long j, float scale, float *s, long width) {
    vf acc[4][2];
    for (int h = 0; h < NH; ++h)
        for (int i = 0; i < NK; ++i) acc[h][i] = v_zero();
    for (long d = 0; d < hd; d += VL)
        for (int i = 0; i < NK; ++i) {
            const vf kv = v_load(keys[i] + d);
            for (int h = 0; h < NH; ++h) acc[h][i] = v_fma(v_load(q + h * hd + d), kv, acc[h][i]);
        }
    for (int h = 0; h < NH; ++h)
        for (int i = 0; i < NK; ++i) s[h * width + j + i] = v_sum(acc[h][i]) * scale;
}

ALWAYS_INLINE void key_dots_nh(const int NK, int nh, const float *q, long hd, const float *const *keys, long j,
                               float scale, float *s, long width) {
    switch (nh) {
    case 1: key_dots(1, NK, q, hd, keys, j, scale, s, width); break;
    case 2: key_dots(2, NK, q, hd, keys, j, scale, s, width); break;
    case 3: key_dots(3, NK, q, hd, keys, j, scale, s, width); break;
    default: key_dots(4, NK, q, hd, keys, j, scale, s, width); break;
    }
}

#define PV_VECS 4  /* output vectors of V accumulated per pass over a row's keys */

/* Softmax of s[0..n) in place (lanes up to the next multiple of VL are scratch). */
static void softmax_keys(float *s, long n) {
    float top = s[0];
    for (long j = 1; j < n; ++j) top = s[j] > top ? s[j] : top;
    const long padded = (n + VL - 1) / VL * VL;
    for (long j = n; j < padded; ++j) s[j] = top;
    const vf m = v_set1(top);
    vf total = v_zero();
    for (long j = 0; j < padded; j += VL) {
        vf e = v_exp(v_sub(v_load(s + j), m));
        v_store(s + j, e);
        if (j + VL > n)  /* the lanes past the last key add nothing */
            for (long l = n; l < padded; ++l) s[l] = 0.0f;
        total = v_add(total, v_load(s + j));
    }
    const vf sum = v_set1(v_sum(total));
    for (long j = 0; j < padded; j += VL) v_store(s + j, v_div(v_load(s + j), sum));
}

static void attention_chunk(long begin, long end, const void *p) {
    const attn_args_t *a = (const attn_args_t *)p;
    const long hd = a->hd, kvh = a->kvh, group = a->heads / a->kvh;
    const long width = (a->max_keys + VL - 1) / VL * VL;
    float *scores = aligned_alloc(64, (size_t)(group * width * 4 + 63) / 64 * 64);
    if (!scores) {
        atomic_store(a->failed, 1);
        return;
    }
    for (long u = begin; u < end; ++u) {
        const long r = u / kvh, g = u % kvh;
        const long count = a->counts[r];
        const long lo = a->window > 0 && count > a->window ? count - a->window : 0;
        const long n = count - lo;
        const int64_t *slot = a->slots + a->offsets[r] + lo;
        const float *qg = a->q + (r * a->heads + g * group) * hd;
        for (long h0 = 0; h0 < group; h0 += 4) {
            const int nh = (int)(group - h0 < 4 ? group - h0 : 4);
            long j = 0;
            for (; j + 2 <= n; j += 2) {
                const float *keys[2] = {a->kc + (slot[j] * kvh + g) * hd, a->kc + (slot[j + 1] * kvh + g) * hd};
                key_dots_nh(2, nh, qg + h0 * hd, hd, keys, j, a->scale, scores + h0 * width, width);
            }
            if (j < n) {
                const float *keys[1] = {a->kc + (slot[j] * kvh + g) * hd};
                key_dots_nh(1, nh, qg + h0 * hd, hd, keys, j, a->scale, scores + h0 * width, width);
            }
        }
        for (long h = 0; h < group; ++h) {
            float *s = scores + h * width;
            softmax_keys(s, n);
            float *o = a->out + (r * a->heads + g * group + h) * hd;
            long d0 = 0;
            for (; d0 + PV_VECS * VL <= hd; d0 += PV_VECS * VL) {
                vf acc[PV_VECS];
                for (int c = 0; c < PV_VECS; ++c) acc[c] = v_zero();
                for (long j = 0; j < n; ++j) {
                    const float *vj = a->vc + (slot[j] * kvh + g) * hd + d0;
                    const vf pj = v_set1(s[j]);
                    for (int c = 0; c < PV_VECS; ++c) acc[c] = v_fma(pj, v_load(vj + c * VL), acc[c]);
                }
                for (int c = 0; c < PV_VECS; ++c) v_store(o + d0 + c * VL, acc[c]);
            }
            for (; d0 < hd; d0 += VL) {
                vf acc = v_zero();
                for (long j = 0; j < n; ++j)
                    acc = v_fma(v_set1(s[j]), v_load(a->vc + (slot[j] * kvh + g) * hd + d0), acc);
                v_store(o + d0, acc);
            }
        }
    }
    free(scores);
}

/* out (rows x heads x hd) for q (rows x heads x hd), float32; hd % VL == 0, heads a
 * multiple of kvh, every count >= 1 and <= max_keys. Returns 0, or 1 when scratch
 * memory ran out (the caller then computes the attention another way). */
int mw_attention(const float *q, long rows, long heads, long hd, const float *kc, const float *vc, long kvh,
                 const int64_t *slots, const int64_t *offsets, const int64_t *counts, long window,
                 long max_keys, float scale, float *out, int threads) {
    _Atomic int failed = 0;
    attn_args_t a = {q, kc, vc, out, slots, offsets, counts, heads, hd, kvh, window, max_keys, scale, &failed};
    parallel_rows(rows * kvh, 1, 1, attention_chunk, &a, threads);
    return atomic_load(&failed);
}

/* ---- Wide products of float16 weights in float16 arithmetic ------------------------
 * Prefill chunks multiply hundreds of activation rows by every weight: compute, not
 * weight bytes, sets the pace. On CPUs with AVX512-FP16 a float16 FMA does 32
 * multiply-adds per instruction, twice float32's 16 (measured on the development
 * machine, 2 cores: 744 vs 332 GFLOP/s). mw_gemm_f16 rounds the activations to float16
 * (as llama.cpp rounds them for its f16 products) and multiplies them with the stored float16 weights in register tiles of NR weight rows x MR
 * activation rows, dot-product style: each of a tile's accumulators holds 32 partial
 * sums in float16 (each lane sums k/32 products), which are widened to float32 and
 * added up once at the end of the tile. The error this adds is below bfloat16
 * activations' (measured ~6e-4 / ~1e-3 of a product's magnitude at k = 1024 / 2816);
 * see docs/executor.md. Rows of x are taken in blocks of GEMM_MB that stay in L2
 * while a thread's weight rows stream past them. An output's sum does not depend on
 * the activation rows beside it (the tiles over x rows all sum in one order). */
#ifdef __AVX512FP16__
#define GEMM_MB 64

ALWAYS_INLINE float widen_sum(__m512h acc) {
    __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_castph_si512(acc)));
    __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(_mm512_castph_si512(acc), 1));
    return _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
}

ALWAYS_INLINE __m512 widen(__m512h acc) {
    __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_castph_si512(acc)));
    __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(_mm512_castph_si512(acc), 1));
    return _mm512_add_ps(lo, hi);
}

/* The four sums of a..d's lanes (widened to float32), in one transposed reduction. */
ALWAYS_INLINE __m128 widen_sum4(__m512h a, __m512h b, __m512h c, __m512h d) {
    __m512 sa = widen(a), sb = widen(b), sc = widen(c), sd = widen(d);
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(sa, sb), _mm512_unpackhi_ps(sa, sb));  /* a0 b0 a1 b1 .. */
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(sc, sd), _mm512_unpackhi_ps(sc, sd));
    __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));  /* a b c d per 128 */
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

/* 1 when any of v's lanes is an infinity or NaN. */
ALWAYS_INLINE int non_finite(__m128 v) {
    const __m128 magnitude = _mm_andnot_ps(_mm_set1_ps(-0.0f), v);
    return _mm_movemask_ps(_mm_cmp_ps(magnitude, _mm_set1_ps(__builtin_inff()), _CMP_NLT_UQ)) != 0;
}

/* y[m][j] = dot(W row j, x row m) for j < NRT, m < MRT; k % 32 == 0. Returns 1 when a
 * result is not finite (a float16 partial sum overflowed). */
ALWAYS_INLINE int tile_f16(const int NRT, const int MRT, const uint16_t *w, long ldw, long k,
                            const uint16_t *x, long ldx, float *y, long ldy) {
    __m512h acc[4][4];
    for (int j = 0; j < NRT; ++j)
        for (int m = 0; m < MRT; ++m) acc[j][m] = _mm512_setzero_ph();
    for (long kk = 0; kk < k; kk += 32) {
        __m512h xv[4];
        for (int m = 0; m < MRT; ++m) xv[m] = _mm512_loadu_ph(x + m * ldx + kk);
        for (int j = 0; j < NRT; ++j) {
            __m512h wv = _mm512_loadu_ph(w + j * ldw + kk);
            for (int m = 0; m < MRT; ++m) acc[j][m] = _mm512_fmadd_ph(wv, xv[m], acc[j][m]);
        }
    }
    int bad = 0;
    if (NRT == 4) {
        for (int m = 0; m < MRT; ++m) {
            __m128 r = widen_sum4(acc[0][m], acc[1][m], acc[2][m], acc[3][m]);
            bad |= non_finite(r);
            _mm_storeu_ps(y + m * ldy, r);
        }
    } else {
        for (int m = 0; m < MRT; ++m)
            for (int j = 0; j < NRT; ++j) {
                float r = widen_sum(acc[j][m]);
                bad |= non_finite(_mm_set1_ps(r));
                y[m * ldy + j] = r;
            }
    }
    return bad;
}

ALWAYS_INLINE int tile_f16_mr(const int NRT, int mr, const uint16_t *w, long ldw, long k, const uint16_t *x,
                              long ldx, float *y, long ldy) {
    switch (mr) {
    case 1: return tile_f16(NRT, 1, w, ldw, k, x, ldx, y, ldy);
    case 2: return tile_f16(NRT, 2, w, ldw, k, x, ldx, y, ldy);
    case 3: return tile_f16(NRT, 3, w, ldw, k, x, ldx, y, ldy);
    default: return tile_f16(NRT, 4, w, ldw, k, x, ldx, y, ldy);
    }
}

typedef struct {
    const uint16_t *w, *x;
    long k, ldw, m, ldx, ldy;
    float *y;
    _Atomic int *bad;
} gemm_args_t;

static void gemm_f16_chunk(long begin, long end, const void *p) {
    const gemm_args_t *a = (const gemm_args_t *)p;
    int bad = 0;
    for (long mb = 0; mb < a->m; mb += GEMM_MB) {
        long mend = mb + GEMM_MB < a->m ? mb + GEMM_MB : a->m;
        for (long r = begin; r < end; r += 4) {
            const int nr = end - r < 4 ? 1 : 4;
            for (long r1 = r; r1 < r + (nr == 4 ? 4 : end - r); r1 += nr) {
                const uint16_t *wr = a->w + r1 * a->ldw;
                for (long m0 = mb; m0 < mend; m0 += 4) {
                    int mr = (int)(mend - m0 < 4 ? mend - m0 : 4);
                    const uint16_t *xm = a->x + m0 * a->ldx;
                    float *ym = a->y + m0 * a->ldy + r1;
                    if (nr == 4) bad |= tile_f16_mr(4, mr, wr, a->ldw, a->k, xm, a->ldx, ym, a->ldy);
                    else bad |= tile_f16_mr(1, mr, wr, a->ldw, a->k, xm, a->ldx, ym, a->ldy);
                }
            }
        }
    }
    if (bad) atomic_store(a->bad, 1);
}

typedef struct {
    const float *x;
    long ldx, k;
    uint16_t *xh;
} half_args_t;

static void to_half_chunk(long begin, long end, const void *p) {
    const half_args_t *a = (const half_args_t *)p;
    for (long r = begin; r < end; ++r)
        for (long i = 0; i < a->k; i += 16)
            _mm256_storeu_si256((__m256i *)(a->xh + r * a->k + i),
                                _mm512_cvtps_ph(_mm512_loadu_ps(a->x + r * a->ldx + i), _MM_FROUND_TO_NEAREST_INT));
}

int mw_has_gemm_f16(void) { return 1; }

/* y (m x n, row stride ldy, float32) = x (m x k float32, row stride ldx) @ W^T in float16
 * arithmetic, W float16 (n rows of k values); xh: m x k float16 scratch (x rounded to
 * float16 lands there, on the pool's threads). k % 32 == 0. Returns 1 when a result is
 * not finite (an activation beyond float16's range, or a partial sum that overflowed):
 * the caller then computes the product in float32. */
int mw_gemm_f16(const uint16_t *w, long n, long k, const float *x, long ldx, long m, float *y, long ldy,
                uint16_t *xh, int threads) {
    _Atomic int bad = 0;
    half_args_t h = {x, ldx, k, xh};
    parallel_rows(m, 16, 1, to_half_chunk, &h, threads);
    gemm_args_t a = {w, xh, k, k, m, k, ldy, y, &bad};
    parallel_rows(n, 16, 1, gemm_f16_chunk, &a, threads);
    return atomic_load(&bad);
}
#else
int mw_has_gemm_f16(void) { return 0; }
int mw_gemm_f16(const uint16_t *w, long n, long k, const float *x, long ldx, long m, float *y, long ldy,
                uint16_t *xh, int threads) {
    (void)w; (void)n; (void)k; (void)x; (void)ldx; (void)m; (void)y; (void)ldy; (void)xh; (void)threads;
    return 1;
}
#endif
