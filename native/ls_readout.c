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
#include <immintrin.h>
#define LS_HAVE_Q8_0_X86 1
/* kernel 2 needs the compiler to know AVX-512 VNNI */
#ifdef LS_HAVE_AVX512_VNNI_TARGET
#define LS_HAVE_Q8_0_AVX512 1
#endif
#endif

#define LS_READOUT_BLOCK 64 /* weight rows per work item (680 B each for 640-wide Q8_0) */
#define LS_READOUT_GROUP 16 /* activation rows per pass over a block: even, a multiple of LS_Q8_ROWS */
_Static_assert(LS_READOUT_GROUP % 2 == 0 && LS_READOUT_GROUP % 4 == 0, "row groups hold whole pairs and whole 4-row sets");

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

LS_Q8_TARGET static inline __attribute__((always_inline)) void q8_rows_n(const ls_block_q8_0 *x, int nb,
                                                                       const ls_block_q8_0 *hq, const float *dy,
                                                                       int64_t r0, const int rr, float *out,
                                                                       int64_t g0, int64_t ld, int64_t v) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[LS_Q8_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < rr; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const float dx = _cvtsh_ss(x[b].d);
        const __m256i qx = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m256i ax = _mm256_sign_epi8(qx, qx);
#pragma GCC unroll 4
        for (int r = 0; r < rr; r++) { /* rr is a constant: unrolled, acc stays in registers */
            const ls_block_q8_0 *y = hq + (r0 + r) * nb + b;
            const __m256i sy = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y->qs), qx);
            const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx * dy[(r0 + r) * nb + b]), _mm256_cvtepi32_ps(s32), acc[r]);
        }
    }
    for (int r = 0; r < rr; r++) out[(r0 - g0 + r) * ld + v] = q8_hsum8(acc[r]);
}

/* ggml_vec_dot_q8_0_q8_0's AVX2 path (ggml-cpu/arch/x86/quants.c) for up to LS_Q8_ROWS
 * activation rows per weight row: per block, the 8 lanes of 4-byte integer dot products
 * (exact whatever instructions form them) as floats, fused-multiply-added with the scale
 * product x.d * y.d into 8 accumulators, then hsum_float_8. Same operations in the same
 * order, so the same bits; the weight block is loaded once for all rows. */
LS_Q8_TARGET static void q8_rows(const ls_block_q8_0 *x, int nb, const ls_block_q8_0 *hq, const float *dy, int64_t r0,
                                 int64_t rr, float *out, int64_t g0, int64_t ld, int64_t v) {
    switch (rr) {
    case 1: q8_rows_n(x, nb, hq, dy, r0, 1, out, g0, ld, v); break;
    case 2: q8_rows_n(x, nb, hq, dy, r0, 2, out, g0, ld, v); break;
    case 3: q8_rows_n(x, nb, hq, dy, r0, 3, out, g0, ld, v); break;
    case 4: q8_rows_n(x, nb, hq, dy, r0, 4, out, g0, ld, v); break;
    default: break;
    }
}

LS_Q8_TARGET static void q8_scales(const ls_block_q8_0 *hq, int64_t n, float *dy) {
    for (int64_t i = 0; i < n; i++) dy[i] = _cvtsh_ss(hq[i].d);
}

#ifdef LS_HAVE_Q8_0_AVX512
#define LS_Q8_TARGET512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))
#define LS_Q8_PAIRS 8 /* kernel 2: activation row pairs per pass over a weight row (16 rows) */

/* Kernel 2's activations, packed once per call: for pair p (rows 2p, 2p+1) and block b, at
 * index p * nb + b, the 64 int8 of both rows' blocks (row 2p's 32 first; zeros for a missing
 * row 2p+1), 16 int32 lanes -128 * (sum of each 4 bytes), and 16 floats, the rows' scales
 * repeated 8 times each. */
typedef struct {
    int8_t *yy;
    int32_t *corr;
    float *dy;
} ls_q8_pairs;

static void q8_free_pairs(ls_q8_pairs *pk) {
    if (pk->yy) _mm_free(pk->yy);
    if (pk->corr) _mm_free(pk->corr);
    if (pk->dy) _mm_free(pk->dy);
}

LS_Q8_TARGET static int q8_pack_pairs(const ls_block_q8_0 *hq, int64_t nr, int nb, ls_q8_pairs *pk) {
    const int64_t np = (nr + 1) / 2;
    pk->yy = _mm_malloc((size_t)(np * nb * 64), 64); /* freed with _mm_free (also on MinGW) */
    pk->corr = _mm_malloc((size_t)(np * nb * 64), 64);
    pk->dy = _mm_malloc((size_t)(np * nb * 64), 64);
    if (!pk->yy || !pk->corr || !pk->dy) return LS_ERR_NOMEM;
    for (int64_t p = 0; p < np; p++)
        for (int b = 0; b < nb; b++) {
            const int64_t o = p * nb + b;
            for (int h = 0; h < 2; h++) {
                const int64_t r = 2 * p + h;
                int8_t *y = pk->yy + o * 64 + h * 32;
                int32_t *c = pk->corr + o * 16 + h * 8;
                float *d = pk->dy + o * 16 + h * 8;
                const float dr = r < nr ? _cvtsh_ss(hq[r * nb + b].d) : 0.0f;
                for (int j = 0; j < 32; j++) y[j] = r < nr ? hq[r * nb + b].qs[j] : 0;
                for (int j = 0; j < 8; j++) {
                    c[j] = -128 * ((int32_t)y[4 * j] + y[4 * j + 1] + y[4 * j + 2] + y[4 * j + 3]);
                    d[j] = dr;
                }
            }
        }
    return 0;
}

/* The same lanes as q8_rows (ggml's AVX2 Q8_0 dot product), two activation rows per 512-bit
 * register: each lane's 4-byte integer dot product is formed by VNNI on the weight bytes
 * offset to unsigned (x + 128) and corrected by -128 * (sum of the 4 activation bytes), which
 * is exact; then, lane by lane, the same conversion, scale product dx * dy, fused multiply-add
 * in block order and hsum_float_8 as ggml's AVX2 path, so the same bits. One exception:
 * ggml's path forms sign(y, x) in int8, which wraps for an activation byte of -128 (never
 * produced by ggml's Q8_0 quantizer for finite rows; a NaN row may give it), so for such a
 * row the two differ, both garbage. */
LS_Q8_TARGET512 static inline __attribute__((always_inline)) void q8_pairs_n(const ls_block_q8_0 *x, int nb,
                                                                          const ls_q8_pairs *pk, int64_t p0,
                                                                          const int pp, int64_t nr, float *out,
                                                                          int64_t g0, int64_t ld, int64_t v) {
    __m512 acc[LS_Q8_PAIRS];
#pragma GCC unroll 8
    for (int p = 0; p < pp; p++) acc[p] = _mm512_setzero_ps();
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    const int32_t *corr = pk->corr + p0 * nb * 16;
    const int8_t *yy = pk->yy + p0 * nb * 64;
    const float *dy = pk->dy + p0 * nb * 16;
    for (int b = 0; b < nb; b++) {
        const __m512 dx = _mm512_set1_ps(_cvtsh_ss(x[b].d));
        const __m512i xu = _mm512_broadcast_i64x4(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)x[b].qs), bias));
#pragma GCC unroll 8
        for (int p = 0; p < pp; p++) { /* pp is a constant: unrolled, acc stays in registers */
            const int64_t o = (int64_t)p * nb + b;
            const __m512i s = _mm512_dpbusd_epi32(_mm512_load_si512(corr + o * 16), xu, _mm512_load_si512(yy + o * 64));
            acc[p] = _mm512_fmadd_ps(_mm512_mul_ps(dx, _mm512_load_ps(dy + o * 16)), _mm512_cvtepi32_ps(s), acc[p]);
        }
    }
    for (int p = 0; p < pp; p++) {
        const int64_t r = 2 * (p0 + p);
        out[(r - g0) * ld + v] = q8_hsum8(_mm512_castps512_ps256(acc[p]));
        if (r + 1 < nr) out[(r + 1 - g0) * ld + v] = q8_hsum8(_mm512_extractf32x8_ps(acc[p], 1));
    }
}

LS_Q8_TARGET512 static void q8_pairs(const ls_block_q8_0 *x, int nb, const ls_q8_pairs *pk, int64_t p0, int64_t pp,
                                     int64_t nr, float *out, int64_t g0, int64_t ld, int64_t v) {
    switch (pp) {
#define LS_Q8_PAIRS_CASE(k)                                                                                            \
    case k:                                                                                                            \
        q8_pairs_n(x, nb, pk, p0, k, nr, out, g0, ld, v);                                                             \
        break;
        LS_Q8_PAIRS_CASE(1)
        LS_Q8_PAIRS_CASE(2)
        LS_Q8_PAIRS_CASE(3)
        LS_Q8_PAIRS_CASE(4)
        LS_Q8_PAIRS_CASE(5)
        LS_Q8_PAIRS_CASE(6)
        LS_Q8_PAIRS_CASE(7)
        LS_Q8_PAIRS_CASE(8)
#undef LS_Q8_PAIRS_CASE
    default:
        break;
    }
}
#endif /* LS_HAVE_Q8_0_AVX512 */
#endif

int32_t ls_lm_head_kernel_available(int32_t kernel) {
    if (kernel == 0) return 1;
#ifdef LS_HAVE_Q8_0_X86
    if (kernel == 1 || kernel == 2) {
        if (kernel == 1) return ls_cpu_has(LS_CPU_AVX2_FMA_F16C);
#ifdef LS_HAVE_Q8_0_AVX512
        return ls_cpu_has(LS_CPU_AVX512_VNNI);
#else
        return 0;
#endif
    }
#endif
    return 0;
}

int32_t ls_lm_head(const void *w, int64_t n_vocab, int64_t row_bytes, int64_t n_embd, const float *h, int64_t nr,
                   ls_from_float_fn from_float, int64_t q_row_bytes, ls_vec_dot_fn vec_dot, float *logits,
                   int32_t n_threads, int32_t kernel) {
    if (!w || !h || !logits || !from_float || !vec_dot || n_vocab < 0 || row_bytes <= 0 || n_embd <= 0 || nr < 0 ||
        q_row_bytes <= 0 || n_embd > INT32_MAX || kernel < 0 || kernel > 2)
        return LS_ERR_ARG;
    if (kernel >= 1 && (!ls_lm_head_kernel_available(kernel) || n_embd % 32 || row_bytes != n_embd / 32 * 34 ||
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
#endif
#ifdef LS_HAVE_Q8_0_AVX512
    ls_q8_pairs pk = {NULL, NULL, NULL}; /* kernel 2 */
#endif
#ifdef LS_HAVE_Q8_0_X86
    if (kernel == 1) {
        dy = malloc(sizeof(float) * (size_t)(nr * nb));
        if (!dy) {
            free(hq);
            return LS_ERR_NOMEM;
        }
        q8_scales(hb, nr * nb, dy);
    }
#endif
#ifdef LS_HAVE_Q8_0_AVX512
    if (kernel == 2 && q8_pack_pairs(hb, nr, nb, &pk) != 0) {
        q8_free_pairs(&pk);
        free(hq);
        return LS_ERR_NOMEM;
    }
#endif
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t v0 = b * LS_READOUT_BLOCK;
        const int64_t v1 = v0 + LS_READOUT_BLOCK < n_vocab ? v0 + LS_READOUT_BLOCK : n_vocab;
        /* the block's logits of up to LS_READOUT_GROUP rows go to a tile, then to their rows
         * (stores to nr rows a whole vocabulary apart, one per weight row, made the time of
         * a decode of 8 rows vary 2x) */
        float tile[LS_READOUT_GROUP * LS_READOUT_BLOCK];
        for (int64_t g0 = 0; g0 < nr; g0 += LS_READOUT_GROUP) {
            const int64_t g1 = g0 + LS_READOUT_GROUP < nr ? g0 + LS_READOUT_GROUP : nr;
            for (int64_t v = v0; v < v1; v++) {
                const char *wr = wb + v * row_bytes;
#ifdef LS_HAVE_Q8_0_X86
                if (dy) {
                    for (int64_t r0 = g0; r0 < g1; r0 += LS_Q8_ROWS)
                        q8_rows((const ls_block_q8_0 *)wr, nb, hb, dy, r0, g1 - r0 < LS_Q8_ROWS ? g1 - r0 : LS_Q8_ROWS, tile,
                                g0, LS_READOUT_BLOCK, v - v0);
                    continue;
                }
#endif
#ifdef LS_HAVE_Q8_0_AVX512
                if (pk.yy) {
                    const int64_t pg1 = (g1 + 1) / 2;
                    for (int64_t p0 = g0 / 2; p0 < pg1; p0 += LS_Q8_PAIRS)
                        q8_pairs((const ls_block_q8_0 *)wr, nb, &pk, p0, pg1 - p0 < LS_Q8_PAIRS ? pg1 - p0 : LS_Q8_PAIRS,
                                 g1, tile, g0, LS_READOUT_BLOCK, v - v0);
                    continue;
                }
#endif
                for (int64_t r = g0; r < g1; r++)
                    vec_dot((int)n_embd, tile + (r - g0) * LS_READOUT_BLOCK + (v - v0), 0, wr, 0, hq + r * q_row_bytes, 0, 1);
            }
            for (int64_t r = g0; r < g1; r++)
                memcpy(logits + r * n_vocab + v0, tile + (r - g0) * LS_READOUT_BLOCK, sizeof(float) * (size_t)(v1 - v0));
        }
    }
#ifdef LS_HAVE_Q8_0_AVX512
    q8_free_pairs(&pk);
#endif
    free(dy);
    free(hq);
    return 0;
}
