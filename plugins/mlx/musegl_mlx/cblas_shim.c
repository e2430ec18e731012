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
 * million multiply-adds, other kernels below about a dozen rows on some
 * cores) whose results differ from the general kernel's in the last bits, and
 * its own threads split a product along M or along N depending on its shape,
 * which moves the columns that fall in a narrower edge tile. Either way a row's
 * logits would depend on how many rows shared its product: the same seeded
 * request, once alone and once batched or after a prefix-cache hit, could
 * sample differently. So:
 * - a row-major product with fewer than max(MIN_ROWS, PAD_MNK / (n*k)) rows
 *   is computed with that many rows (zero rows appended, at most PAD_ROWS),
 *   which takes the general kernel;
 * - OpenBLAS runs single-threaded and this shim splits a large product's
 *   columns over its own threads, at boundaries that depend on n and k only.
 * Measured on OpenBLAS 0.3.34's Haswell kernels (an AMD EPYC), a row's result
 * is then the same for every row count. A column's result can still depend
 * on how many columns share the product there, which the plugin checks before
 * routing (musegl_mlx.blas.batch_variance).
 *
 * musegl_blas_calls() counts the calls, so the plugin can check that MLX
 * really took this path.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111 };
#define PAD_MNK 1.05e6
#define PAD_ROWS 4096
#define MIN_ROWS 16
#define SPLIT_NK 262144 /* products with n*k below this run on one thread */
#define SPLIT_ALIGN 64  /* column boundaries between threads are multiples of this */
#define MAX_THREADS 64

typedef void (*sgemm_fn)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                         const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc);

static sgemm_fn target;
static int threads = 1, padding = 1;
static atomic_long calls;

/* fn: OpenBLAS's cblas_sgemm, set to one thread by the caller; n_threads: the shim's own; pad: 0 to
 * forward every product as it is (to a BLAS that needs no padding, such as the reference one). */
void musegl_blas_route(sgemm_fn fn, int n_threads, int pad) {
  target = fn;
  threads = n_threads < 1 ? 1 : (n_threads > MAX_THREADS ? MAX_THREADS : n_threads);
  padding = pad;
}

long musegl_blas_calls(void) { return atomic_load(&calls); }

/* The row count a row-major product of m rows is computed with. */
int musegl_blas_rows(int m, int n, int k) {
  if (!padding || n <= 0 || k <= 0) return m;
  double want = PAD_MNK / ((double)n * (double)k) + 1.0;
  int rows = want > PAD_ROWS ? PAD_ROWS : (int)want;
  if (rows < MIN_ROWS) rows = MIN_ROWS;
  return m >= rows ? m : rows;
}

typedef struct {
  int order, trans_a, trans_b, m, n, k, lda, ldb, ldc;
  float alpha, beta;
  const float *a, *b;
  float *c;
} part_t;

static void *run_part(void *arg) {
  part_t *p = arg;
  target(p->order, p->trans_a, p->trans_b, p->m, p->n, p->k, p->alpha, p->a, p->lda, p->b, p->ldb, p->beta, p->c,
         p->ldc);
  return NULL;
}

/* The product, its columns split over the shim's threads where it is large enough (row-major only). */
static void split_call(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a,
                       int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  int parts = threads;
  if (order != ROW_MAJOR || (double)n * (double)k < SPLIT_NK) parts = 1;
  while (parts > 1 && n / parts < SPLIT_ALIGN) parts--;
  if (parts <= 1) {
    target(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  part_t part[MAX_THREADS];
  pthread_t tid[MAX_THREADS];
  int started[MAX_THREADS] = {0};
  for (int j = 0; j < parts; j++) {
    int lo = (int)(((long long)n * j / parts) / SPLIT_ALIGN * SPLIT_ALIGN);
    int hi = j + 1 == parts ? n : (int)(((long long)n * (j + 1) / parts) / SPLIT_ALIGN * SPLIT_ALIGN);
    /* row-major: B is n x k (transposed) or k x n; C is m x n */
    const float *bj = trans_b == NO_TRANS ? b + lo : b + (size_t)lo * (size_t)ldb;
    part[j] = (part_t){order, trans_a, trans_b, m, hi - lo, k, lda, ldb, ldc, alpha, beta, a, bj, c + lo};
  }
  for (int j = 1; j < parts; j++) started[j] = pthread_create(&tid[j], NULL, run_part, &part[j]) == 0;
  run_part(&part[0]);
  for (int j = 1; j < parts; j++) {
    if (started[j])
      pthread_join(tid[j], NULL);
    else
      run_part(&part[j]); /* no thread to be had: this thread does that part too */
  }
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  atomic_fetch_add_explicit(&calls, 1, memory_order_relaxed);
  int rows = order == ROW_MAJOR ? musegl_blas_rows(m, n, k) : m;
  if (rows == m || m <= 0) {
    split_call(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  /* A with `rows` rows in A's own layout (so OpenBLAS packs it the same way), C likewise. */
  size_t a_size = (size_t)rows * (size_t)k, c_size = (size_t)rows * (size_t)n;
  float *pa = calloc(a_size + c_size, sizeof(float));
  if (pa == NULL) { /* no memory for padding: the unpadded product is still correct */
    split_call(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
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
  split_call(order, trans_a, trans_b, rows, n, k, alpha, pa, plda, b, ldb, beta, pc, n);
  for (int i = 0; i < m; i++) memcpy(c + (size_t)i * ldc, pc + (size_t)i * n, sizeof(float) * n);
  free(pa);
}
