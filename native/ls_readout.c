/* The lm_head readout: a quantized lm_head applied to a few final-norm rows with ggml's own
 * CPU kernels (see localspec_native.h and localspec/backend/readout.py).
 *
 * For a handful of rows llama.cpp's CPU mul_mat reads the whole lm_head once per row through
 * its tiled paths (for 262,144 x 640 Q8_0: ~7 ms a row on 2 cores, 27 ms for 8 rows), while
 * the product is bound by reading the matrix once (~4.5 ms). Here every block of weight rows
 * is multiplied with all rows while it is in cache. The dot products are ggml's vec_dot on
 * the same quantized activations, so every logit has the bits the vec_dot path gives. */
#include "ls_internal.h"

#define LS_READOUT_BLOCK 64 /* weight rows per work item (680 B each for 640-wide Q8_0) */

int32_t ls_lm_head(const void *w, int64_t n_vocab, int64_t row_bytes, int64_t n_embd, const float *h, int64_t nr,
                   ls_from_float_fn from_float, int64_t q_row_bytes, ls_vec_dot_fn vec_dot, float *logits,
                   int32_t n_threads) {
    if (!w || !h || !logits || !from_float || !vec_dot || n_vocab < 0 || row_bytes <= 0 || n_embd <= 0 || nr < 0 ||
        q_row_bytes <= 0 || n_embd > INT32_MAX)
        return LS_ERR_ARG;
    if (nr == 0 || n_vocab == 0) return 0;
    char *hq = malloc((size_t)(q_row_bytes * nr));
    if (!hq) return LS_ERR_NOMEM;
    for (int64_t r = 0; r < nr; r++) from_float(h + r * n_embd, hq + r * q_row_bytes, n_embd);
    const char *wb = w;
    const int64_t nblk = (n_vocab + LS_READOUT_BLOCK - 1) / LS_READOUT_BLOCK;
    int nt = n_threads < 1 ? 1 : n_threads;
    (void)nt;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t v0 = b * LS_READOUT_BLOCK;
        const int64_t v1 = v0 + LS_READOUT_BLOCK < n_vocab ? v0 + LS_READOUT_BLOCK : n_vocab;
        for (int64_t v = v0; v < v1; v++) {
            const char *wr = wb + v * row_bytes;
            for (int64_t r = 0; r < nr; r++)
                vec_dot((int)n_embd, logits + r * n_vocab + v, 0, wr, 0, hq + r * q_row_bytes, 0, 1);
        }
    }
    free(hq);
    return 0;
}
