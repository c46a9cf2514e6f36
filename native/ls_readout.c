/* The lm_head readout: a quantized lm_head applied to a few final-norm rows with ggml's own
 * CPU kernels (see localspec_native.h and localspec/backend/readout.py).
 *
 * For a handful of rows llama.cpp's CPU mul_mat reads the whole lm_head once per row through
 * its tiled paths (for 262,144 x 640 Q8_0: ~7 ms a row on 2 cores, 27 ms for 8 rows), while
 * the product is bound by reading the matrix once (~4.5 ms). Here every block of weight rows
 * is multiplied with all rows while it is in cache. The dot products are ggml's vec_dot on
 * the same quantized activations, so every logit has the bits the vec_dot path gives. */
#include "ls_internal.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define LS_HAVE_Q8_0_X86 1
#endif

#define LS_READOUT_BLOCK 64 /* weight rows per work item (680 B each for 640-wide Q8_0) */

#ifdef LS_HAVE_Q8_0_X86
/* ggml's block_q8_0: an fp16 scale and 32 int8 values */
typedef struct {
    uint16_t d;
    int8_t qs[32];
} ls_block_q8_0;

#define LS_Q8_TARGET __attribute__((target("avx2,fma,f16c")))

/* ggml-cpu/arch/x86/quants.c hsum_float_8: the same additions in the same order */
LS_Q8_TARGET static inline float q8_hsum8(__m256 x) {
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

#define LS_Q8_ROWS 4

/* ggml_vec_dot_q8_0_q8_0's AVX2 path (ggml-cpu/arch/x86/quants.c) for up to LS_Q8_ROWS
 * activation rows per weight row: per block, the 8 lanes of 4-byte integer dot products
 * (exact whatever instructions form them) as floats, fused-multiply-added with the scale
 * product x.d * y.d into 8 accumulators, then hsum_float_8. Same operations in the same
 * order, so the same bits; the weight block is loaded once for all rows. */
LS_Q8_TARGET static void q8_rows(const ls_block_q8_0 *x, int nb, const ls_block_q8_0 *hq, const float *dy, int64_t r0,
                                 int64_t rr, float *out, int64_t n_vocab, int64_t v) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[LS_Q8_ROWS];
    for (int r = 0; r < LS_Q8_ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const float dx = _cvtsh_ss(x[b].d);
        const __m256i qx = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m256i ax = _mm256_sign_epi8(qx, qx);
        for (int64_t r = 0; r < rr; r++) {
            const ls_block_q8_0 *y = hq + (r0 + r) * nb + b;
            const __m256i sy = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y->qs), qx);
            const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx * dy[(r0 + r) * nb + b]), _mm256_cvtepi32_ps(s32), acc[r]);
        }
    }
    for (int64_t r = 0; r < rr; r++) out[(r0 + r) * n_vocab + v] = q8_hsum8(acc[r]);
}

LS_Q8_TARGET static void q8_scales(const ls_block_q8_0 *hq, int64_t n, float *dy) {
    for (int64_t i = 0; i < n; i++) dy[i] = _cvtsh_ss(hq[i].d);
}
#endif

#ifdef LS_HAVE_Q8_0_X86
static int32_t q8_probe(void) {
    __builtin_cpu_init();
    /* F16C from CPUID leaf 1 (ECX bit 29): older compilers do not know "f16c" as a feature name */
    unsigned a = 0, b = 0, c = 0, d = 0;
    int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
}
#endif

int32_t ls_lm_head_q8_0_available(void) {
#ifdef LS_HAVE_Q8_0_X86
    /* probed once (CPUID traps to the hypervisor in a VM); every caller computes the same value,
     * so a race between threads only repeats the probe */
    static volatile int32_t known = -1;
    if (known < 0) known = q8_probe();
    return known;
#else
    return 0;
#endif
}

int32_t ls_lm_head(const void *w, int64_t n_vocab, int64_t row_bytes, int64_t n_embd, const float *h, int64_t nr,
                   ls_from_float_fn from_float, int64_t q_row_bytes, ls_vec_dot_fn vec_dot, float *logits,
                   int32_t n_threads, int32_t kernel) {
    if (!w || !h || !logits || !from_float || !vec_dot || n_vocab < 0 || row_bytes <= 0 || n_embd <= 0 || nr < 0 ||
        q_row_bytes <= 0 || n_embd > INT32_MAX || kernel < 0 || kernel > 1)
        return LS_ERR_ARG;
    if (kernel == 1 && (!ls_lm_head_q8_0_available() || n_embd % 32 || row_bytes != n_embd / 32 * 34 ||
                        q_row_bytes != row_bytes))
        return LS_ERR_ARG;
    if (nr == 0 || n_vocab == 0) return 0;
    char *hq = malloc((size_t)(q_row_bytes * nr));
    if (!hq) return LS_ERR_NOMEM;
    for (int64_t r = 0; r < nr; r++) from_float(h + r * n_embd, hq + r * q_row_bytes, n_embd);
    const char *wb = w;
    const int64_t nblk = (n_vocab + LS_READOUT_BLOCK - 1) / LS_READOUT_BLOCK;
    int nt = n_threads < 1 ? 1 : n_threads;
    (void)nt;
    float *dy = NULL; /* kernel 1: the activation rows' block scales as floats */
#ifdef LS_HAVE_Q8_0_X86
    const int nb = (int)(n_embd / 32);
    const ls_block_q8_0 *hb = (const ls_block_q8_0 *)hq;
    if (kernel == 1) {
        dy = malloc(sizeof(float) * (size_t)(nr * nb));
        if (!dy) {
            free(hq);
            return LS_ERR_NOMEM;
        }
        q8_scales(hb, nr * nb, dy);
    }
#endif
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t v0 = b * LS_READOUT_BLOCK;
        const int64_t v1 = v0 + LS_READOUT_BLOCK < n_vocab ? v0 + LS_READOUT_BLOCK : n_vocab;
        for (int64_t v = v0; v < v1; v++) {
            const char *wr = wb + v * row_bytes;
#ifdef LS_HAVE_Q8_0_X86
            if (dy) {
                for (int64_t r0 = 0; r0 < nr; r0 += LS_Q8_ROWS)
                    q8_rows((const ls_block_q8_0 *)wr, nb, hb, dy, r0, nr - r0 < LS_Q8_ROWS ? nr - r0 : LS_Q8_ROWS, logits,
                            n_vocab, v);
                continue;
            }
#endif
            for (int64_t r = 0; r < nr; r++)
                vec_dot((int)n_embd, logits + r * n_vocab + v, 0, wr, 0, hq + r * q_row_bytes, 0, 1);
        }
    }
    free(dy);
    free(hq);
    return 0;
}
