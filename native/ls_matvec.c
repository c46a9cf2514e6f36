/* Dense matrix products for small heads on the target's hidden states (Medusa heads:
 * localspec/drafters/medusa.py). Reference: numpy ``x @ wt`` (tests/test_medusa.py). */
#include "ls_internal.h"

#define LS_GEMV_COLS 64

/* Y[r, i0..i1) = X[r, :] @ wt[:, i0..i1) for r < nr <= LS_GEMM_ROWS: the column block of
 * every row in registers, the matrix read once for all rows */
#define LS_GEMM_ROWS 8
LS_HOT static void gemm_t_block(const float *wt, int64_t n, int64_t m, const float *x, int64_t nr, float *y, int64_t i0,
                                int64_t i1) {
    for (int64_t c0 = i0; c0 < i1; c0 += LS_GEMV_COLS) {
        int64_t w = i1 - c0 < LS_GEMV_COLS ? i1 - c0 : LS_GEMV_COLS;
        float acc[LS_GEMM_ROWS][LS_GEMV_COLS];
        for (int64_t r = 0; r < nr; r++)
            for (int c = 0; c < LS_GEMV_COLS; c++) acc[r][c] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float *row = wt + j * m + c0;
            if (w == LS_GEMV_COLS) {
                for (int64_t r = 0; r < nr; r++) {
                    const float xj = x[r * n + j];
                    for (int c = 0; c < LS_GEMV_COLS; c++) acc[r][c] += xj * row[c];
                }
            } else {
                for (int64_t r = 0; r < nr; r++) {
                    const float xj = x[r * n + j];
                    for (int64_t c = 0; c < w; c++) acc[r][c] += xj * row[c];
                }
            }
        }
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = 0; c < w; c++) y[r * m + c0 + c] = acc[r][c];
    }
}

int32_t ls_gemm_t(const float *wt, int64_t n, int64_t m, const float *x, int64_t nr, float *y, int32_t n_threads) {
    if (!wt || !x || !y || n < 0 || m < 0 || nr < 0) return LS_ERR_ARG;
    int nt = n_threads < 1 ? 1 : n_threads;
    int64_t nblk = (m + LS_GEMV_COLS - 1) / LS_GEMV_COLS;
    if (nt > nblk) nt = (int)(nblk > 0 ? nblk : 1);
    for (int64_t r0 = 0; r0 < nr; r0 += LS_GEMM_ROWS) {
        int64_t rr = nr - r0 < LS_GEMM_ROWS ? nr - r0 : LS_GEMM_ROWS;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
        for (int t = 0; t < nt; t++) {
            int64_t lo = (nblk * t) / nt * LS_GEMV_COLS, hi = (nblk * (t + 1)) / nt * LS_GEMV_COLS;
            if (hi > m) hi = m;
            if (lo < hi) gemm_t_block(wt, n, m, x + r0 * n, rr, y + r0 * m, lo, hi);
        }
    }
    return 0;
}
