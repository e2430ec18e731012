/* The decoder's RMS norms and residual adds of the torch-cpu executor in one call each, with
 * torch's float32 arithmetic step for step (musegl_cuda/cpu/row_norms.py loads this file and
 * checks it against torch before using it).
 *
 * A norm of a row x of n values is, as musegl_cuda/model.py writes it in torch:
 *     ms = sum(x*x) / n;  r = 1 / sqrt(ms + eps);  y = (x * r) * w
 * each operation rounded to float32 (no fused multiply-add: built with -ffp-contract=off).
 * The sum is the one torch's CPU sum kernel computes for a contiguous row (ATen's
 * SumKernel.cpp: vectorized_inner_sum -> row_sum -> multi_row_sum): the row read as vectors of
 * `lanes` floats (8 for torch 2.13's sum kernel, on AVX2 and AVX-512 machines alike), the vectors summed in 4 interleaved accumulators with 4 cascade levels, the
 * accumulators added, then the lanes added one by one onto the scalar tail's sum. Lanes are
 * independent, so the plain C below gives the vector code's bits. */

#include <stdint.h>
#include <string.h>
#include <math.h>

#define ILP 4
#define LEVELS 4
#define MAX_LANES 16

static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t bits = 0;
    uint64_t v = (uint64_t)(x - 1);
    while (v) { ++bits; v >>= 1; }
    return bits;
}

/* sum(x[i] * x[i]) as torch sums the squares x.pow(2) of a contiguous row of n >= lanes values */
static float sum_of_squares(const float *x, int64_t n, int lanes) {
    float acc[LEVELS][ILP][MAX_LANES];
    memset(acc, 0, sizeof acc);
    const int64_t vecs = n / lanes;
    const int64_t size = vecs / ILP;  /* rows of ILP vectors */
    int64_t power = ceil_log2(size) / LEVELS;
    if (power < 4) power = 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    int64_t i = 0;
    for (; i + step <= size;) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int k = 0; k < ILP; ++k) {
                const float *v = x + (i * ILP + k) * lanes;
                for (int l = 0; l < lanes; ++l) { float s = v[l] * v[l]; acc[0][k][l] += s; }
            }
        for (int j = 1; j < LEVELS; ++j) {
            for (int k = 0; k < ILP; ++k)
                for (int l = 0; l < lanes; ++l) { acc[j][k][l] += acc[j - 1][k][l]; acc[j - 1][k][l] = 0.0f; }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < size; ++i)
        for (int k = 0; k < ILP; ++k) {
            const float *v = x + (i * ILP + k) * lanes;
            for (int l = 0; l < lanes; ++l) { float s = v[l] * v[l]; acc[0][k][l] += s; }
        }
    for (int j = 1; j < LEVELS; ++j)
        for (int k = 0; k < ILP; ++k)
            for (int l = 0; l < lanes; ++l) acc[0][k][l] += acc[j][k][l];
    for (int64_t v = size * ILP; v < vecs; ++v)  /* row_sum's vectors past the last ILP row */
        for (int l = 0; l < lanes; ++l) { float s = x[v * lanes + l] * x[v * lanes + l]; acc[0][0][l] += s; }
    for (int k = 1; k < ILP; ++k)
        for (int l = 0; l < lanes; ++l) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t t = vecs * lanes; t < n; ++t) { float s = x[t] * x[t]; total += s; }
    for (int l = 0; l < lanes; ++l) total += acc[0][0][l];
    return total;
}

/* y = (x * (1 / sqrt(sum(x*x) / n + eps))) * w, one row */
static void norm_row(const float *x, int64_t n, const float *w, float eps, float *y, int lanes) {
    float ms = sum_of_squares(x, n, lanes) / (float)n;
    float r = 1.0f / sqrtf(ms + eps);
    for (int64_t i = 0; i < n; ++i) { float t = x[i] * r; y[i] = t * w[i]; }
}

int rn_supported(int64_t n, int lanes) {
    return lanes > 0 && lanes <= MAX_LANES && n >= lanes;
}

/* The norm of `rows` rows of n values (row stride n) with weight w: y = norm(x). */
int rn_norm(const float *x, int64_t rows, int64_t n, const float *w, float eps, float *y, int lanes) {
    if (!rn_supported(n, lanes)) return -1;
    for (int64_t r = 0; r < rows; ++r) norm_row(x + r * n, n, w, eps, y + r * n, lanes);
    return 0;
}

/* A residual add and the next norm: h_out = h + norm(o; add_w, add_eps), then, when
 * next_w is not NULL, x_out = norm(h_out; next_w, next_eps). Rows of n values (stride n);
 * `scratch` holds n floats. */
int rn_add_norm(const float *o, const float *h, int64_t rows, int64_t n, const float *add_w, float add_eps,
                const float *next_w, float next_eps, float *h_out, float *x_out, float *scratch, int lanes) {
    if (!rn_supported(n, lanes)) return -1;
    for (int64_t r = 0; r < rows; ++r) {
        norm_row(o + r * n, n, add_w, add_eps, scratch, lanes);
        const float *hr = h + r * n;
        float *out = h_out + r * n;
        for (int64_t i = 0; i < n; ++i) out[i] = hr[i] + scratch[i];
        if (next_w) norm_row(out, n, next_w, next_eps, x_out + r * n, lanes);
    }
    return 0;
}

/* The QK norm, q's scale and RoPE of a step's q and k, as musegl_cuda/model.py's
 * Attention._qk_norm_rope does them in torch: `qk` holds `rows` rows of (heads + kv_heads)
 * heads of hd values (contiguous); each head is normed without a weight (x * r), the first
 * `heads` of a row then multiplied by `q_scale`, then, when `cos` is not NULL, rotated with
 * the row's cos/sin (rows x hd): out = y * cos + rotate_half(y) * sin, rotate_half(y) being
 * (-y[hd/2:], y[:hd/2]). Each product and sum rounded to float32 in that order.
 * With `k_cache` (not NULL) the step's K/V rows are stored too, as torch's index_copy_ would:
 * row r's k heads (out's) and its v (`v` + r * v_stride, kv_heads * hd values) at slot
 * `slots[r]` of the flat caches (cache_slots slots of kv_heads * hd floats); a slot outside
 * them returns -2 before anything is written. */
int rn_qk_norm_rope(const float *qk, int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd, float eps,
                    float q_scale, const float *cos, const float *sin, float *out, float *scratch, int lanes,
                    float *k_cache, float *v_cache, const int64_t *slots, int64_t cache_slots, const float *v,
                    int64_t v_stride) {
    if (!rn_supported(hd, lanes) || hd % 2) return -1;
    const int64_t per_row = heads + kv_heads, half = hd / 2, kv = kv_heads * hd;
    if (k_cache)
        for (int64_t r = 0; r < rows; ++r)
            if (slots[r] < 0 || slots[r] >= cache_slots) return -2;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < per_row; ++j) {
            const float *x = qk + (r * per_row + j) * hd;
            float *y = out + (r * per_row + j) * hd;
            float ms = sum_of_squares(x, hd, lanes) / (float)hd;
            float inv = 1.0f / sqrtf(ms + eps);
            float *t = cos ? scratch : y;
            for (int64_t i = 0; i < hd; ++i) t[i] = x[i] * inv;
            if (j < heads)
                for (int64_t i = 0; i < hd; ++i) t[i] = t[i] * q_scale;
            if (!cos) continue;
            const float *c = cos + r * hd, *s = sin + r * hd;
            for (int64_t i = 0; i < hd; ++i) {
                float rot = i < half ? -t[i + half] : t[i - half];
                float a = t[i] * c[i];
                float b = rot * s[i];
                y[i] = a + b;
            }
        }
    if (k_cache)
        for (int64_t r = 0; r < rows; ++r) {
            memcpy(k_cache + slots[r] * kv, out + (r * per_row + heads) * hd, kv * sizeof(float));
            memcpy(v_cache + slots[r] * kv, v + r * v_stride, kv * sizeof(float));
        }
    return 0;
}
