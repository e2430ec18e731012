/* Matrix products that read weights in their stored form, for decode steps on the CPU.
 *
 * y[m, n] = sum_k x[m, k] * W[n, k] for a few activation rows x (float32) and a
 * weight W kept as float16, bfloat16 or GGUF blocks (Q8_0, Q4_0, Q4_K). Each
 * weight row is decoded 16 values at a time in registers and multiplied into
 * every activation row, so the weight is read from memory once per call, at
 * its stored size: decode is bound by weight bytes, which is what halving or
 * quartering them buys. With several activation rows, 4 weight rows x up to 4
 * activation rows are multiplied per register tile (see "Register-tiled
 * products"). Rows are split in chunks over a small pool of threads (see
 * "Thread pool" below).
 *
 * mw_dequant_rows decodes whole rows to float32 (embedding lookups, prefill).
 *
 * Block layouts (ggml):
 *   Q8_0: 32 values, 34 bytes: f16 d, int8 q[32]; v = d*q.
 *   Q4_0: 32 values, 18 bytes: f16 d, uint8 q[16]; v[j] = d*((q[j]&15)-8), v[j+16] = d*((q[j]>>4)-8).
 *   Q4_K: 256 values, 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) for
 *         8 sub-blocks of 32, uint8 q[128]; each 64 values use 32 bytes of q: low
 *         nibbles the first 32 (sub-block 2i), high nibbles the next 32 (2i+1);
 *         v = d*scale*nibble - dmin*min.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

enum { MW_F32 = 0, MW_F16 = 1, MW_BF16 = 2, MW_Q8_0 = 8, MW_Q4_0 = 4, MW_Q4_K = 12 };
#define MAX_TILE 8

static inline float half_to_float(uint16_t h) {
    return _cvtsh_ss(h);
}

/* Bytes of one row of K values. */
long mw_row_bytes(int type, long k) {
    switch (type) {
    case MW_F32: return 4 * k;
    case MW_F16: case MW_BF16: return 2 * k;
    case MW_Q8_0: return k / 32 * 34;
    case MW_Q4_0: return k / 32 * 18;
    case MW_Q4_K: return k / 256 * 144;
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

/* Two accumulator sets (values 0-15 and 16-31 of every 32) halve the FMA dependency
 * chains; acc[m] += w0 * x[m][k..k+16), acc2[m] += w1 * x[m][k+16..k+32). */
#define FMA_PAIR(w0, w1, koff)                                                            \
    for (int m = 0; m < mt; ++m) {                                                        \
        acc[m] = _mm512_fmadd_ps((w0), _mm512_loadu_ps(x + (long)m * ldx + (koff)), acc[m]);       \
        acc2[m] = _mm512_fmadd_ps((w1), _mm512_loadu_ps(x + (long)m * ldx + (koff) + 16), acc2[m]); \
    }
#define PREFETCH(p) _mm_prefetch((const char *)(p) + 1024, _MM_HINT_T0)

static inline __m512 bf16x16(const uint16_t *w) {
    __m512i wi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wi, 16));
}

/* One weight row against an x tile of mt <= MAX_TILE rows; out[m] = dot. k % 32 == 0. */
static void row_dot(int type, const uint8_t *wrow, long k, const float *x, long ldx, int mt, float *out) {
    __m512 acc[MAX_TILE], acc2[MAX_TILE];
    for (int m = 0; m < mt; ++m) acc[m] = acc2[m] = _mm512_setzero_ps();
    if (type == MW_F32) {
        const float *w = (const float *)wrow;
        for (long i = 0; i < k; i += 32) {
            PREFETCH(w + i);
            __m512 w0 = _mm512_loadu_ps(w + i), w1 = _mm512_loadu_ps(w + i + 16);
            FMA_PAIR(w0, w1, i);
        }
    } else if (type == MW_F16) {
        const uint16_t *w = (const uint16_t *)wrow;
        for (long i = 0; i < k; i += 32) {
            PREFETCH(w + i);
            __m512 w0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i)));
            __m512 w1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i + 16)));
            FMA_PAIR(w0, w1, i);
        }
    } else if (type == MW_BF16) {
        const uint16_t *w = (const uint16_t *)wrow;
        for (long i = 0; i < k; i += 32) {
            PREFETCH(w + i);
            __m512 w0 = bf16x16(w + i), w1 = bf16x16(w + i + 16);
            FMA_PAIR(w0, w1, i);
        }
    } else if (type == MW_Q8_0) {
        for (long b = 0; b < k / 32; ++b) {
            const uint8_t *blk = wrow + b * 34;
            PREFETCH(blk);
            uint16_t dh;
            memcpy(&dh, blk, 2);
            __m512 d = _mm512_set1_ps(half_to_float(dh));
            const int8_t *q = (const int8_t *)(blk + 2);
            __m512 w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))));
            __m512 w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))));
            FMA_PAIR(w0, w1, b * 32);
        }
    } else if (type == MW_Q4_0) {
        const __m512i low = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
        for (long b = 0; b < k / 32; ++b) {
            const uint8_t *blk = wrow + b * 18;
            PREFETCH(blk);
            uint16_t dh;
            memcpy(&dh, blk, 2);
            __m512 d = _mm512_set1_ps(half_to_float(dh));
            __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)));
            __m512 w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(q, low), eight)));
            __m512 w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight)));
            FMA_PAIR(w0, w1, b * 32);
        }
    } else if (type == MW_Q4_K) {
        const __m512i low = _mm512_set1_epi32(15);
        for (long b = 0; b < k / 256; ++b) {
            const uint8_t *blk = wrow + b * 144;
            PREFETCH(blk);
            uint16_t dh, mh;
            memcpy(&dh, blk, 2);
            memcpy(&mh, blk + 2, 2);
            const float d = half_to_float(dh), dmin = half_to_float(mh);
            const uint8_t *scales = blk + 4, *q = blk + 16;
            for (int j = 0; j < 4; ++j) {  /* 64 values: sub-blocks 2j (low nibbles), 2j+1 (high) */
                int sc0, mn0, sc1, mn1;
                q4k_scale_min(2 * j, scales, &sc0, &mn0);
                q4k_scale_min(2 * j + 1, scales, &sc1, &mn1);
                __m512 d0 = _mm512_set1_ps(d * sc0), m0 = _mm512_set1_ps(dmin * mn0);
                __m512 d1 = _mm512_set1_ps(d * sc1), m1 = _mm512_set1_ps(dmin * mn1);
                long base = b * 256 + j * 64;
                __m512i qa = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + j * 32)));
                __m512i qb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + j * 32 + 16)));
                __m512 wa0 = _mm512_fmsub_ps(d0, _mm512_cvtepi32_ps(_mm512_and_si512(qa, low)), m0);
                __m512 wb0 = _mm512_fmsub_ps(d0, _mm512_cvtepi32_ps(_mm512_and_si512(qb, low)), m0);
                FMA_PAIR(wa0, wb0, base);
                __m512 wa1 = _mm512_fmsub_ps(d1, _mm512_cvtepi32_ps(_mm512_srli_epi32(qa, 4)), m1);
                __m512 wb1 = _mm512_fmsub_ps(d1, _mm512_cvtepi32_ps(_mm512_srli_epi32(qb, 4)), m1);
                FMA_PAIR(wa1, wb1, base + 32);
            }
        }
    }
    for (int m = 0; m < mt; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acc2[m]));
}


/* ---- Register-tiled products ---------------------------------------------------------
 * For more than MAX_TILE activation rows row_dot decodes each weight row once per tile
 * of 8 and loads x once per FMA. The tiled kernel below multiplies NR = 4 weight rows by MR <= 4 activation rows
 * at once, with NR x MR accumulators in registers: per 16 values it decodes 4 weight
 * vectors and loads MR x vectors for 4·MR FMAs, so for MR = 4 the FMA units, not the
 * loads, set the pace (measured on the bench shapes, 2 cores: 1.3-1.5x row_dot's speed
 * at 16-64 rows; at 2-8 rows row_dot, whose weight stream the prefetcher follows better,
 * stays ahead, so it keeps those). decode32 gives the 32 values of one 32-value block of a row as
 * two vectors; the type and MR are compile-time constants in every instantiation
 * (always_inline + a switch outside the loops). */

#define NR 4
#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE void decode32(const int type, const uint8_t *wrow, long b, __m512 *w0, __m512 *w1) {
    if (type == MW_F32) {
        const float *w = (const float *)wrow + b * 32;
        *w0 = _mm512_loadu_ps(w);
        *w1 = _mm512_loadu_ps(w + 16);
    } else if (type == MW_F16) {
        const uint16_t *w = (const uint16_t *)wrow + b * 32;
        *w0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
        *w1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 16)));
    } else if (type == MW_BF16) {
        const uint16_t *w = (const uint16_t *)wrow + b * 32;
        *w0 = bf16x16(w);
        *w1 = bf16x16(w + 16);
    } else if (type == MW_Q8_0) {
        const uint8_t *blk = wrow + b * 34;
        uint16_t dh;
        memcpy(&dh, blk, 2);
        __m512 d = _mm512_set1_ps(half_to_float(dh));
        const int8_t *q = (const int8_t *)(blk + 2);
        *w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))));
        *w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))));
    } else if (type == MW_Q4_0) {
        const uint8_t *blk = wrow + b * 18;
        uint16_t dh;
        memcpy(&dh, blk, 2);
        __m512 d = _mm512_set1_ps(half_to_float(dh));
        __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)));
        const __m512i low = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
        *w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(q, low), eight)));
        *w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight)));
    } else {  /* MW_Q4_K: 32-value sub-block s of super-block b / 8 */
        const uint8_t *blk = wrow + (b >> 3) * 144;
        const int s = (int)(b & 7);
        uint16_t dh, mh;
        memcpy(&dh, blk, 2);
        memcpy(&mh, blk + 2, 2);
        int sc, mn;
        q4k_scale_min(s, blk + 4, &sc, &mn);
        __m512 d = _mm512_set1_ps(half_to_float(dh) * sc), m = _mm512_set1_ps(half_to_float(mh) * mn);
        const uint8_t *q = blk + 16 + (s >> 1) * 32;
        __m512i qa = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        __m512i qb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
        if (s & 1) {
            qa = _mm512_srli_epi32(qa, 4);
            qb = _mm512_srli_epi32(qb, 4);
        } else {
            const __m512i low = _mm512_set1_epi32(15);
            qa = _mm512_and_si512(qa, low);
            qb = _mm512_and_si512(qb, low);
        }
        *w0 = _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(qa), m);
        *w1 = _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(qb), m);
    }
}

/* y[m][r + j] = dot(W row r + j, x row m) for j < NR, m < MR. k % 32 == 0. */
ALWAYS_INLINE void tile_dot(const int type, const int MR, const uint8_t *w, long rb, long k, const float *x,
                            long ldx, float *y, long ldy) {
    __m512 acc[NR][4];
    for (int j = 0; j < NR; ++j)
        for (int m = 0; m < MR; ++m) acc[j][m] = _mm512_setzero_ps();
    const long bytes = rb / (k / 32);  /* stored bytes per 32 values (Q4_K: an average) */
    for (long b = 0; b < k / 32; ++b) {
        __m512 xa[4], xb[4];
        for (int m = 0; m < MR; ++m) {
            xa[m] = _mm512_loadu_ps(x + m * ldx + b * 32);
            xb[m] = _mm512_loadu_ps(x + m * ldx + b * 32 + 16);
        }
        for (int j = 0; j < NR; ++j) {
            PREFETCH(w + j * rb + b * bytes);
            __m512 w0, w1;
            decode32(type, w + j * rb, b, &w0, &w1);
            for (int m = 0; m < MR; ++m) {
                acc[j][m] = _mm512_fmadd_ps(w0, xa[m], acc[j][m]);
                acc[j][m] = _mm512_fmadd_ps(w1, xb[m], acc[j][m]);
            }
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int j = 0; j < NR; ++j) y[m * ldy + j] = _mm512_reduce_add_ps(acc[j][m]);
}

ALWAYS_INLINE void tile_dot_mr(const int type, int mr, const uint8_t *w, long rb, long k, const float *x,
                               long ldx, float *y, long ldy) {
    switch (mr) {
    case 1: tile_dot(type, 1, w, rb, k, x, ldx, y, ldy); break;
    case 2: tile_dot(type, 2, w, rb, k, x, ldx, y, ldy); break;
    case 3: tile_dot(type, 3, w, rb, k, x, ldx, y, ldy); break;
    default: tile_dot(type, 4, w, rb, k, x, ldx, y, ldy); break;
    }
}

/* Rows [begin, end) of W (end - begin a multiple of NR) against all m activation rows. */
static void tiled_rows(int type, const uint8_t *w, long rb, long k, const float *x, long ldx, long m,
                       float *y, long ldy, long begin, long end) {
    for (long r = begin; r < end; r += NR) {
        const uint8_t *wr = w + r * rb;
        for (long m0 = 0; m0 < m; m0 += 4) {
            int mr = (int)(m - m0 < 4 ? m - m0 : 4);
            const float *xm = x + m0 * ldx;
            float *ym = y + m0 * ldy + r;
            switch (type) {
            case MW_F32: tile_dot_mr(MW_F32, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            case MW_F16: tile_dot_mr(MW_F16, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            case MW_BF16: tile_dot_mr(MW_BF16, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            case MW_Q8_0: tile_dot_mr(MW_Q8_0, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            case MW_Q4_0: tile_dot_mr(MW_Q4_0, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            default: tile_dot_mr(MW_Q4_K, mr, wr, rb, k, xm, ldx, ym, ldy); break;
            }
        }
    }
}

/* ---- Thread pool ------------------------------------------------------------------
 * A call is cut into chunks of rows; the calling thread and the helper threads
 * claim chunks with one atomic compare-and-swap on (job generation, next chunk),
 * and the caller waits only for chunks a helper has claimed and not finished.
 * Unlike an OpenMP region, which ends at a barrier every team thread must reach,
 * a call never waits for a helper the OS has not scheduled yet: on a loaded
 * machine the caller then simply does all the chunks. Idle helpers spin briefly
 * and then sleep on a condition variable. */

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

/* fn(begin, end, arg) over rows 0 .. rows-1 in chunks of at least min_rows. */
static void parallel_rows(long rows, long min_rows, chunk_fn fn, const void *arg, int threads) {
    pthread_mutex_lock(&call_mu);  /* one job at a time */
    start_pool(threads);
    long chunks = pool_threads * 8L;
    long chunk_rows = (rows + chunks - 1) / chunks;
    if (chunk_rows < min_rows) chunk_rows = min_rows;
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
} args_t;

static void matmul_chunk(long begin, long end, const void *p) {
    const args_t *a = (const args_t *)p;
    float out[MAX_TILE];
    if (a->m > MAX_TILE) {  /* many activation rows: NR-row register tiles, row_dot for the rest */
        long tiled_end = begin + (end - begin) / NR * NR;
        tiled_rows(a->type, a->w, a->rb, a->k, a->x, a->ldx, a->m, a->y, a->ldy, begin, tiled_end);
        begin = tiled_end;
    }
    for (long r = begin; r < end; ++r) {
        for (long m0 = 0; m0 < a->m; m0 += MAX_TILE) {
            int mt = (int)(a->m - m0 < MAX_TILE ? a->m - m0 : MAX_TILE);
            row_dot(a->type, a->w + r * a->rb, a->k, a->x + m0 * a->ldx, a->ldx, mt, out);
            for (int i = 0; i < mt; ++i) a->y[(m0 + i) * a->ldy + r] = out[i];
        }
    }
}

/* y (m x n, row stride ldy) = x (m x k, row stride ldx) @ W^T, W (n rows of row_bytes(type, k)).
 * k must be a multiple of the type's block (32 for f32/f16/bf16). ``threads`` sizes the
 * pool on the first call. */
void mw_matmul(int type, const uint8_t *w, long n, long k, const float *x, long ldx, long m, float *y,
               long ldy, int threads) {
    args_t a = {type, w, k, mw_row_bytes(type, k), m, ldx, ldy, x, y, NULL, NULL};
    parallel_rows(n, 64, matmul_chunk, &a, threads);
}

static void dequant_row(int type, const uint8_t *wrow, long k, float *out) {
    if (type == MW_F32) {
        memcpy(out, wrow, 4 * k);
    } else if (type == MW_F16) {
        const uint16_t *w = (const uint16_t *)wrow;
        for (long i = 0; i < k; i += 16)
            _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i))));
    } else if (type == MW_BF16) {
        const uint16_t *w = (const uint16_t *)wrow;
        for (long i = 0; i < k; i += 16) {
            __m512i wi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + i)));
            _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(wi, 16)));
        }
    } else if (type == MW_Q8_0) {
        for (long b = 0; b < k / 32; ++b) {
            const uint8_t *blk = wrow + b * 34;
            uint16_t dh;
            memcpy(&dh, blk, 2);
            const float d = half_to_float(dh);
            const int8_t *q = (const int8_t *)(blk + 2);
            for (int j = 0; j < 32; ++j) out[b * 32 + j] = d * q[j];
        }
    } else if (type == MW_Q4_0) {
        for (long b = 0; b < k / 32; ++b) {
            const uint8_t *blk = wrow + b * 18;
            uint16_t dh;
            memcpy(&dh, blk, 2);
            const float d = half_to_float(dh);
            for (int j = 0; j < 16; ++j) {
                out[b * 32 + j] = d * ((blk[2 + j] & 15) - 8);
                out[b * 32 + j + 16] = d * ((blk[2 + j] >> 4) - 8);
            }
        }
    } else if (type == MW_Q4_K) {
        for (long b = 0; b < k / 256; ++b) {
            const uint8_t *blk = wrow + b * 144;
            uint16_t dh, mh;
            memcpy(&dh, blk, 2);
            memcpy(&mh, blk + 2, 2);
            const float d = half_to_float(dh), dmin = half_to_float(mh);
            const uint8_t *scales = blk + 4, *q = blk + 16;
            for (int j = 0; j < 4; ++j) {
                int sc0, mn0, sc1, mn1;
                q4k_scale_min(2 * j, scales, &sc0, &mn0);
                q4k_scale_min(2 * j + 1, scales, &sc1, &mn1);
                float *o = out + b * 256 + j * 64;
                for (int l = 0; l < 32; ++l) {
                    o[l] = d * sc0 * (q[j * 32 + l] & 15) - dmin * mn0;
                    o[l + 32] = d * sc1 * (q[j * 32 + l] >> 4) - dmin * mn1;
                }
            }
        }
    }
}

static void dequant_chunk(long begin, long end, const void *p) {
    const args_t *a = (const args_t *)p;
    for (long i = begin; i < end; ++i) {
        long r = a->rows ? (long)a->rows[i] : i;
        dequant_row(a->type, a->w + r * a->rb, a->k, a->out + i * a->k);
    }
}

/* out (count x k) = rows of W; rows == NULL means rows 0 .. count-1. */
void mw_dequant_rows(int type, const uint8_t *w, long k, const int64_t *rows, long count, float *out, int threads) {
    args_t a = {type, w, k, mw_row_bytes(type, k), 0, 0, 0, NULL, NULL, rows, out};
    parallel_rows(count, 16, dequant_chunk, &a, threads);
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
 * while a thread's weight rows stream past them. */
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
    parallel_rows(m, 16, to_half_chunk, &h, threads);
    gemm_args_t a = {w, xh, k, k, m, k, ldy, y, &bad};
    parallel_rows(n, 16, gemm_f16_chunk, &a, threads);
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
