/* cblas_sgemm for MLX's CPU build on Linux, forwarded to an optimized BLAS.
 *
 * The mlx-cpu wheel links the netlib reference BLAS, whose sgemm is a plain
 * loop (a few GFLOP/s). Loaded with RTLD_GLOBAL before MLX, this library's
 * cblas_sgemm is the one MLX binds to; it calls the function given to
 * musegl_blas_route() (OpenBLAS's, from the scipy-openblas32 wheel, whose
 * symbols carry a prefix and so cannot stand in directly).
 *
 * Rows stay independent of the batch. OpenBLAS takes other code paths for
 * small problems (a GEMV for one row, "small matrix" kernels below about a
 * million multiply-adds) whose results differ from the general kernel's in
 * the last bits, so a row's logits would depend on how many rows shared its
 * product: the same seeded request, once alone and once after a prefix-cache
 * hit, could sample differently. A row-major product with fewer than
 * max(2, PAD_MNK / (n*k)) rows is therefore computed with that many rows
 * (zero rows appended, at most PAD_ROWS), which always takes the general
 * kernel; measured on this OpenBLAS, a row's result is then the same for every
 * row count (and for every n).
 *
 * musegl_blas_calls() counts the calls, so the plugin can check that MLX
 * really took this path.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111 };
#define PAD_MNK 1.05e6
#define PAD_ROWS 4096

typedef void (*sgemm_fn)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                         const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc);

static sgemm_fn target;
static atomic_long calls;

void musegl_blas_route(sgemm_fn fn) { target = fn; }

long musegl_blas_calls(void) { return atomic_load(&calls); }

/* The row count a row-major product of m rows is computed with. */
int musegl_blas_rows(int m, int n, int k) {
  if (n <= 0 || k <= 0) return m;
  double want = PAD_MNK / ((double)n * (double)k) + 1.0;
  int rows = want > PAD_ROWS ? PAD_ROWS : (int)want;
  if (rows < 2) rows = 2;
  return m >= rows ? m : rows;
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  atomic_fetch_add_explicit(&calls, 1, memory_order_relaxed);
  int rows = order == ROW_MAJOR ? musegl_blas_rows(m, n, k) : m;
  if (rows == m || m <= 0) {
    target(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  /* A with `rows` rows in A's own layout (so OpenBLAS packs it the same way), C likewise. */
  size_t a_size = (size_t)rows * (size_t)k, c_size = (size_t)rows * (size_t)n;
  float *pa = calloc(a_size + c_size, sizeof(float));
  if (pa == NULL) { /* no memory for padding: the unpadded product is still correct */
    target(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  float *pc = pa + a_size;
  int plda;
  if (trans_a == NO_TRANS) { /* A is m x k */
    plda = k;
    for (int i = 0; i < m; i++) memcpy(pa + (size_t)i * k, a + (size_t)i * lda, sizeof(float) * k);
  } else { /* A is k x m */
    plda = rows;
    for (int i = 0; i < k; i++) memcpy(pa + (size_t)i * rows, a + (size_t)i * lda, sizeof(float) * m);
  }
  if (beta != 0.0f)
    for (int i = 0; i < m; i++) memcpy(pc + (size_t)i * n, c + (size_t)i * ldc, sizeof(float) * n);
  target(order, trans_a, trans_b, rows, n, k, alpha, pa, plda, b, ldb, beta, pc, n);
  for (int i = 0; i < m; i++) memcpy(c + (size_t)i * ldc, pc + (size_t)i * n, sizeof(float) * n);
  free(pa);
}
