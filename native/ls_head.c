/* The EAGLE-3 head's matrix products and attention on the host (localspec/drafters/eagle3_host.py).
 *
 * Weights in Q8_0 as llama.cpp stores them (blocks of 32 int8 with one scale each; the scales
 * here are float32 copies of the file's float16) times activations quantised the way ggml's
 * CPU backend quantises them for a Q8_0 product (quantize_row_q8_0: per block of 32,
 * d = amax / 127 rounded to float16, q = round-to-nearest-even(x * 127 / amax)), so a row
 * matches llama.cpp's up to the order of its float sums.
 * Reference: numpy over the dequantised matrices (tests/test_eagle3_host.py). */
#include "ls_internal.h"

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__)) && !defined(LS_NO_VEC)
#include <immintrin.h>
#define LS_HEAD_X86 1
#endif

#define LS_Q8_BLOCK 32

/* float32 -> float16 -> float32 (round to nearest even; normal and subnormal halves) */
static float ls__round_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = x & 0x80000000u;
    float a = fabsf(f);
    if (!(a < 65520.0f)) return f; /* inf / nan / overflow: not reached for scales */
    if (a < 6.103515625e-05f) {    /* subnormal half: multiples of 2^-24 */
        float q = nearbyintf(a * 16777216.0f) / 16777216.0f;
        uint32_t y;
        memcpy(&y, &q, 4);
        y |= sign;
        memcpy(&q, &y, 4);
        return q;
    }
    uint32_t ax = x & 0x7fffffffu;
    uint32_t lsb = (ax >> 13) & 1u;
    ax = (ax + 0x0fffu + lsb) & ~0x1fffu;
    ax |= sign;
    float out;
    memcpy(&out, &ax, 4);
    return out;
}

#if defined(LS_HEAD_X86) && defined(LS_HAVE_AVX512_VNNI_TARGET)
static int ls__has_avx512f(void);
/* the same quantisation with AVX-512, the same bits: amax is a maximum (exact in any order),
 * x * id the same float product, and vcvtps2dq rounds to nearest even as nearbyintf does in
 * the default rounding mode (|x * id| <= 127.0001, so never out of range). The scalar loop
 * took 15x as long for 64 rows of 1,280 on Zen 4 (fmaxf is a library call at the baseline ISA). */
__attribute__((target("avx512f,avx512bw"))) static void q8_quantize_avx512(const float *x, int64_t nr, int64_t k, int8_t *q,
                                                                        float *d) {
    const int64_t nb = k / LS_Q8_BLOCK;
    for (int64_t i = 0; i < nr * nb; i++) {
        const float *xb = x + i * LS_Q8_BLOCK;
        const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        const __m512 a = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
        __m256 h = _mm256_max_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
        __m128 s = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        s = _mm_max_ss(s, _mm_movehdup_ps(s));
        const float amax = _mm_cvtss_f32(s);
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        d[i] = ls__round_f16(amax / 127.0f);
        const __m512 vid = _mm512_set1_ps(id);
        _mm_storeu_si128((__m128i *)(q + i * LS_Q8_BLOCK), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vid))));
        _mm_storeu_si128((__m128i *)(q + i * LS_Q8_BLOCK + 16),
                         _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vid))));
    }
}
#endif

int32_t ls_q8_quantize_rows(const float *x, int64_t nr, int64_t k, int8_t *q, float *d) {
    if (!x || !q || !d || nr < 0 || k < 0 || k % LS_Q8_BLOCK) return LS_ERR_ARG;
    int64_t nb = k / LS_Q8_BLOCK;
#if defined(LS_HEAD_X86) && defined(LS_HAVE_AVX512_VNNI_TARGET)
    if (ls__has_avx512f()) {
        q8_quantize_avx512(x, nr, k, q, d);
        return 0;
    }
#endif
    for (int64_t r = 0; r < nr; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * k + b * LS_Q8_BLOCK;
            int8_t *qb = q + r * k + b * LS_Q8_BLOCK;
            float amax = 0.0f;
            for (int j = 0; j < LS_Q8_BLOCK; j++) amax = fmaxf(amax, fabsf(xb[j]));
            float id = amax != 0.0f ? 127.0f / amax : 0.0f;
            d[r * nb + b] = ls__round_f16(amax / 127.0f);
            for (int j = 0; j < LS_Q8_BLOCK; j++) qb[j] = (int8_t)nearbyintf(xb[j] * id);
        }
    return 0;
}

/* sum over the k / 32 blocks of (int dot of the block) * wd[b] * xd[b] */
static float dot_q8_plain(const int8_t *w, const float *wd, const int8_t *x, const float *xd, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int32_t s = 0;
        for (int j = 0; j < LS_Q8_BLOCK; j++) s += (int32_t)w[b * LS_Q8_BLOCK + j] * (int32_t)x[b * LS_Q8_BLOCK + j];
        acc += (float)s * (wd[b] * xd[b]);
    }
    return acc;
}

#ifdef LS_HEAD_X86
static inline float ls__hsum256(__m256 acc) __attribute__((target("avx2,fma")));
static inline float ls__hsum256(__m256 acc) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the 16 lanes summed, halves first (what _mm512_reduce_add_ps does; that one needs GCC 7) */
static inline float ls__hsum512(__m512 a) __attribute__((target("avx512f")));
static inline float ls__hsum512(__m512 a) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* one matrix row against up to 4 activation rows: the block of the matrix loaded once */
__attribute__((target("avx2,fma"))) static void dot4_q8_avx2(const int8_t *w, const float *wd, const int8_t *x,
                                                            const float *xd, int64_t nb, int64_t k, int nr,
                                                            float *out) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + b * LS_Q8_BLOCK));
        __m256i aw = _mm256_sign_epi8(wv, wv);
        const float dw = wd[b];
        for (int r = 0; r < nr; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x + r * k + b * LS_Q8_BLOCK));
            __m256i p16 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv));
            __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[r * nb + b]), p, acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = ls__hsum256(acc[r]);
}

/* four matrix rows against NR (1 or 2) activation rows, AVX2, the rows packed by ls_q8_pack4
 * (w4g, d4g: their group; see rows4_q8_vnni_n): every output bit for bit what dot4_q8_avx2
 * gives row by row (each row's blocks added in order into its own accumulator, the same
 * products), with 4 * NR independent accumulators instead of NR; NR stops at 2 so that they
 * stay in the 16 registers. out[r * ldo + j] = row j . activation row r. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
rows4_q8_avx2_n(const int8_t *w4g, const float *d4g, const int8_t *x, const float *xd, int64_t nb, int64_t k,
                const int nr, float *out, int64_t ldo) {
    __m256 acc[4][2];
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < 2; r++) acc[j][r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t np = nb / 2;
    for (int64_t b = 0; b < nb; b++) {
        /* block b of row j: in its pair's 64 bytes, or after the pairs (an odd last block) */
        const int8_t *wb = b < 2 * np ? w4g + (b / 2) * 4 * 64 + (b % 2) * LS_Q8_BLOCK : w4g + np * 4 * 64;
        const int64_t wstride = b < 2 * np ? 64 : LS_Q8_BLOCK;
        const float *db = b < 2 * np ? d4g + (b / 2) * 8 + b % 2 : d4g + np * 8;
        const int64_t dstride = b < 2 * np ? 2 : 1;
        __m256i xv[2];
        for (int r = 0; r < nr; r++) xv[r] = _mm256_loadu_si256((const __m256i *)(x + r * k + b * LS_Q8_BLOCK));
        for (int j = 0; j < 4; j++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(wb + j * wstride));
            const __m256i aw = _mm256_sign_epi8(wv, wv);
            const float dw = db[j * dstride];
            for (int r = 0; r < nr; r++) {
                const __m256i p16 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[r], wv));
                const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
                acc[j][r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[r * nb + b]), p, acc[j][r]);
            }
        }
    }
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < nr; r++) out[r * ldo + j] = ls__hsum256(acc[j][r]);
}

__attribute__((target("avx2,fma"))) static void rows4_q8_avx2(const int8_t *w4g, const float *d4g, const int8_t *x,
                                                             const float *xd, int64_t nb, int64_t k, int nr,
                                                             float *out, int64_t ldo) {
    if (nr == 1)
        rows4_q8_avx2_n(w4g, d4g, x, xd, nb, k, 1, out, ldo);
    else
        rows4_q8_avx2_n(w4g, d4g, x, xd, nb, k, 2, out, ldo);
}

#ifdef LS_HAVE_AVX512_VNNI_TARGET
/* the same with AVX-512 VNNI: two blocks per instruction. VNNI multiplies unsigned by signed
 * bytes, so the activations come offset by 128 (xu = x + 128, [nr, k] uint8) and the offset's
 * share, 128 * (sum of each 4 weights), is computed once per weight pair of blocks and starts
 * every row's sum: -128 sum w + sum (x + 128) w = sum x w, the same integers as x times w.
 * xs holds, per activation row, its block scales each repeated 8 times ([nr, nb * 8]), so that
 * a block pair's scales are one load. x (signed) serves an odd last block. */
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni"))) static void dot4_q8_vnni(
    const int8_t *w, const float *wd, const uint8_t *xu, const int8_t *x, const float *xs, const float *xd, int64_t nb,
    int64_t k, int nr, float *out) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const __m512i zero = _mm512_setzero_si512(), c128 = _mm512_set1_epi8((char)0x80);
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const __m512i wv = _mm512_loadu_si512((const void *)(w + b * LS_Q8_BLOCK));
        const __m512i start = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, c128, wv));
        const __m512 ws = _mm512_insertf32x8(_mm512_set1_ps(wd[b]), _mm256_set1_ps(wd[b + 1]), 1);
        for (int r = 0; r < nr; r++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xu + r * k + b * LS_Q8_BLOCK));
            const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, xv, wv));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(ws, _mm512_loadu_ps(xs + (r * nb + b) * 8)), p, acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) {
        float t = ls__hsum512(acc[r]);
        for (int64_t bb = b; bb < nb; bb++) { /* an odd last block */
            int32_t si = 0;
            for (int j = 0; j < LS_Q8_BLOCK; j++)
                si += (int32_t)w[bb * LS_Q8_BLOCK + j] * (int32_t)x[r * k + bb * LS_Q8_BLOCK + j];
            t += (float)si * (wd[bb] * xd[r * nb + bb]);
        }
        out[r] = t;
    }
}

/* four matrix rows against NR (1-4) activation rows, VNNI, the rows packed by ls_q8_pack4
 * (w4g, d4g: their group): the same sums, in the same order, as dot4_q8_vnni row by row (every
 * output bit for bit what that kernel gives), with 4 * NR independent accumulators instead of
 * NR. A row of 640 is only 10 block pairs: one row's chain of dependent adds kept the core
 * waiting, 1.4x this kernel's time for a head level on Zen 4. Packed, the four rows are read
 * in memory order, which the hardware prefetchers follow when a level's first products read
 * the weights from memory; four unpacked rows side by side made those products 1.3x slower
 * than one row at a time. out[r * ldo + j] = row j . activation row r. */
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni"), always_inline)) static inline void
rows4_q8_vnni_n(const int8_t *w4g, const float *d4g, const uint8_t *xu, const int8_t *x, const float *xs,
                const float *xd, int64_t nb, int64_t k, const int nr, float *out, int64_t ldo) {
    __m512 acc[4][4];
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < 4; r++) acc[j][r] = _mm512_setzero_ps();
    const __m512i zero = _mm512_setzero_si512(), c128 = _mm512_set1_epi8((char)0x80);
    const int64_t np = nb / 2;
    for (int64_t p = 0; p < np; p++) {
        const int64_t b = 2 * p;
        __m512i xv[4];
        __m512 xsv[4];
        for (int r = 0; r < nr; r++) {
            xv[r] = _mm512_loadu_si512((const void *)(xu + r * k + b * LS_Q8_BLOCK));
            xsv[r] = _mm512_loadu_ps(xs + (r * nb + b) * 8);
        }
        for (int j = 0; j < 4; j++) {
            const __m512i wv = _mm512_loadu_si512((const void *)(w4g + (p * 4 + j) * 64));
            const __m512i start = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, c128, wv));
            const float *dj = d4g + p * 8 + j * 2;
            const __m512 ws = _mm512_insertf32x8(_mm512_set1_ps(dj[0]), _mm256_set1_ps(dj[1]), 1);
            for (int r = 0; r < nr; r++) {
                const __m512 pr = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, xv[r], wv));
                acc[j][r] = _mm512_fmadd_ps(_mm512_mul_ps(ws, xsv[r]), pr, acc[j][r]);
            }
        }
    }
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < nr; r++) {
            float t = ls__hsum512(acc[j][r]);
            if (nb % 2) { /* an odd last block, added as dot4_q8_vnni adds it */
                const int8_t *wj = w4g + np * 4 * 64 + j * LS_Q8_BLOCK, *xr = x + r * k + 2 * np * LS_Q8_BLOCK;
                int32_t si = 0;
                for (int q = 0; q < LS_Q8_BLOCK; q++) si += (int32_t)wj[q] * (int32_t)xr[q];
                t += (float)si * (d4g[np * 8 + j] * xd[r * nb + 2 * np]);
            }
            out[r * ldo + j] = t;
        }
}

__attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni"))) static void
rows4_q8_vnni(const int8_t *w4g, const float *d4g, const uint8_t *xu, const int8_t *x, const float *xs, const float *xd,
              int64_t nb, int64_t k, int nr, float *out, int64_t ldo) {
    switch (nr) { /* a constant NR each: the accumulators stay in registers */
    case 1: rows4_q8_vnni_n(w4g, d4g, xu, x, xs, xd, nb, k, 1, out, ldo); break;
    case 2: rows4_q8_vnni_n(w4g, d4g, xu, x, xs, xd, nb, k, 2, out, ldo); break;
    case 3: rows4_q8_vnni_n(w4g, d4g, xu, x, xs, xd, nb, k, 3, out, ldo); break;
    default: rows4_q8_vnni_n(w4g, d4g, xu, x, xs, xd, nb, k, 4, out, ldo); break;
    }
}
#endif

/* the AVX-512 paths, unless LS_HEAD_NO_AVX512 is set (the tests' way to run the AVX2 ones) */
static int ls__no_avx512(void) {
    static volatile int v = -1; /* every thread computes the same value: a race only repeats getenv */
    if (v < 0) v = getenv("LS_HEAD_NO_AVX512") != NULL;
    return v;
}

static int ls__has_vnni(void) {
#ifdef LS_HAVE_AVX512_VNNI_TARGET
    return ls_cpu_has(LS_CPU_AVX512_VNNI) && !ls__no_avx512();
#else
    return 0;
#endif
}

static int ls__has_avx2(void) { return ls_cpu_has(LS_CPU_AVX2_FMA); }

static int ls__has_avx512f(void) { return ls_cpu_has(LS_CPU_AVX512F) && !ls__no_avx512(); }
#endif

int32_t ls_q8_pack4(const int8_t *w, const float *wd, int64_t m, int64_t k, int8_t *w4, float *d4) {
    if (!w || !wd || !w4 || !d4 || m < 0 || k < 0 || k % LS_Q8_BLOCK) return LS_ERR_ARG;
    const int64_t nb = k / LS_Q8_BLOCK, np = nb / 2;
    for (int64_t g = 0; g < m / 4; g++) {
        int8_t *og = w4 + g * 4 * k;
        float *dg = d4 + g * 4 * nb;
        for (int j = 0; j < 4; j++) {
            const int8_t *row = w + (g * 4 + j) * k;
            const float *rd = wd + (g * 4 + j) * nb;
            for (int64_t p = 0; p < np; p++) {
                memcpy(og + (p * 4 + j) * 64, row + p * 64, 64);
                dg[p * 8 + j * 2] = rd[2 * p];
                dg[p * 8 + j * 2 + 1] = rd[2 * p + 1];
            }
            if (nb % 2) {
                memcpy(og + np * 4 * 64 + j * LS_Q8_BLOCK, row + np * 64, LS_Q8_BLOCK);
                dg[np * 8 + j] = rd[2 * np];
            }
        }
    }
    return 0;
}

/* ls_gemm_q8, reading the first m / 4 * 4 rows from their ls_q8_pack4 copy (w4, d4) where the
 * CPU has AVX-512 VNNI or AVX2 (w4 NULL: every row from w, wd) */
static int32_t gemm_q8(const int8_t *w, const float *wd, const int8_t *w4, const float *d4, int64_t m, int64_t k,
                       const float *x, int64_t nr, float *y, int32_t n_threads) {
    if (!w || !wd || !x || !y || m < 0 || k < 0 || nr < 0 || k % LS_Q8_BLOCK || (w4 && !d4)) return LS_ERR_ARG;
    if (nr == 0 || m == 0) return 0;
    int64_t nb = k / LS_Q8_BLOCK;
    int8_t *xq = (int8_t *)malloc((size_t)(nr * k) + 64);
    float *xd = (float *)malloc(sizeof(float) * (size_t)(nr * nb + 1));
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return LS_ERR_NOMEM;
    }
    ls_q8_quantize_rows(x, nr, k, xq, xd);
    int use_avx2 = 0, use_vnni = 0;
    float *xs = NULL;
    uint8_t *xu = NULL;
#ifdef LS_HEAD_X86
    use_avx2 = ls__has_avx2();
    use_vnni = ls__has_vnni();
    if (use_vnni) {
        xs = (float *)malloc(sizeof(float) * (size_t)(nr * nb * 8 + 1));
        xu = (uint8_t *)malloc((size_t)(nr * k) + 64);
        if (!xs || !xu) {
            free(xq);
            free(xd);
            free(xs);
            free(xu);
            return LS_ERR_NOMEM;
        }
        for (int64_t i = 0; i < nr * nb; i++)
            for (int j = 0; j < 8; j++) xs[i * 8 + j] = xd[i];
        for (int64_t i = 0; i < nr * k; i++) xu[i] = (uint8_t)((int)xq[i] + 128);
    }
#endif
    (void)use_avx2;
    (void)use_vnni;
    (void)w4; /* read only by the x86 paths */
    (void)d4;
    int nt = n_threads < 1 ? 1 : n_threads;
    if (nt > m) nt = (int)m;
    /* threads take whole groups of 4 rows (the packed kernel's), the last one the rest */
    const int64_t m4 = m / 4;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int t = 0; t < nt; t++) {
        int64_t lo = m4 * t / nt * 4, hi = t == nt - 1 ? m : m4 * (t + 1) / nt * 4;
        float o4[4];
        (void)o4;
        int64_t i = lo;
#if defined(LS_HEAD_X86) && defined(LS_HAVE_AVX512_VNNI_TARGET)
        if (use_vnni && w4)
            for (; i + 4 <= hi; i += 4)
                for (int64_t r0 = 0; r0 < nr; r0 += 4)
                    rows4_q8_vnni(w4 + i * k, d4 + i * nb, xu + r0 * k, xq + r0 * k, xs + r0 * nb * 8, xd + r0 * nb, nb,
                                  k, nr - r0 < 4 ? (int)(nr - r0) : 4, y + r0 * m + i, m);
#endif
#ifdef LS_HEAD_X86
        if (!use_vnni && use_avx2 && w4)
            for (; i + 4 <= hi; i += 4)
                for (int64_t r0 = 0; r0 < nr; r0 += 2)
                    rows4_q8_avx2(w4 + i * k, d4 + i * nb, xq + r0 * k, xd + r0 * nb, nb, k, nr - r0 < 2 ? 1 : 2,
                                  y + r0 * m + i, m);
#endif
        for (; i < hi; i++) { /* the matrix row once, against every activation row */
            const int8_t *wi = w + i * k;
            const float *wdi = wd + i * nb;
            for (int64_t r0 = 0; r0 < nr; r0 += 4) {
                int rr = nr - r0 < 4 ? (int)(nr - r0) : 4;
#ifdef LS_HEAD_X86
#ifdef LS_HAVE_AVX512_VNNI_TARGET
                if (use_vnni) {
                    dot4_q8_vnni(wi, wdi, xu + r0 * k, xq + r0 * k, xs + r0 * nb * 8, xd + r0 * nb, nb, k, rr, o4);
                    for (int r = 0; r < rr; r++) y[(r0 + r) * m + i] = o4[r];
                    continue;
                }
#endif
                if (use_avx2) {
                    dot4_q8_avx2(wi, wdi, xq + r0 * k, xd + r0 * nb, nb, k, rr, o4);
                    for (int r = 0; r < rr; r++) y[(r0 + r) * m + i] = o4[r];
                    continue;
                }
#endif
                for (int r = 0; r < rr; r++) y[(r0 + r) * m + i] = dot_q8_plain(wi, wdi, xq + (r0 + r) * k, xd + (r0 + r) * nb, nb);
            }
        }
    }
    free(xq);
    free(xd);
    free(xs);
    free(xu);
    return 0;
}

int32_t ls_gemm_q8(const int8_t *w, const float *wd, int64_t m, int64_t k, const float *x, int64_t nr, float *y,
                   int32_t n_threads) {
    return gemm_q8(w, wd, NULL, NULL, m, k, x, nr, y, n_threads);
}

/* ---- attention --------------------------------------------------------------------------- */

/* The attention's two inner loops, written out per instruction set. Key and value rows are
 * found through key_idx: index r < n0 is row r of (k0, v0), a larger one row r - n0 of (k1, v1).
 *
 * ls_dot:  a . b over len floats (lanes summed at the end, a scalar remainder in order)
 * ls_wsum: o[0:len] = sum_j p[j] v_{ix[j]}[off : off + len] over j in [0, c), summed in key
 *          order per element (len <= 64). Written out because the plain loop's LS_HOT clones
 *          keep the sums in memory: 1.2-1.3x the attention's time at 200-1,000 keys. */
typedef struct {
    const float *k0, *v0, *k1, *v1;
    int64_t n0, kv_w;
} ls_pools_t;

static inline const float *ls__krow(const ls_pools_t *pl, int64_t r) {
    return r < pl->n0 ? pl->k0 + r * pl->kv_w : pl->k1 + (r - pl->n0) * pl->kv_w;
}

static inline const float *ls__vrow(const ls_pools_t *pl, int64_t r) {
    return r < pl->n0 ? pl->v0 + r * pl->kv_w : pl->v1 + (r - pl->n0) * pl->kv_w;
}

static float ls_dot_plain(const float *a, const float *b, int64_t len) {
    float t = 0.0f;
    for (int64_t i = 0; i < len; i++) t += a[i] * b[i];
    return t;
}

static void ls_wsum_plain(const ls_pools_t *pl, const float *p, const int64_t *ix, int64_t c, int64_t off, int64_t len,
                          float *o) {
    float acc[64];
    for (int64_t i = 0; i < len; i++) acc[i] = 0.0f;
    for (int64_t j = 0; j < c; j++) {
        const float *v = ls__vrow(pl, ix[j]) + off;
        for (int64_t i = 0; i < len; i++) acc[i] += p[j] * v[i];
    }
    memcpy(o, acc, sizeof(float) * (size_t)len);
}

#ifdef LS_HEAD_X86
__attribute__((target("avx512f"))) static float ls_dot_avx512(const float *a, const float *b, int64_t len) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= len; i += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), a1);
    }
    if (i + 16 <= len) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), a0);
        i += 16;
    }
    float t = ls__hsum512(_mm512_add_ps(a0, a1));
    for (; i < len; i++) t += a[i] * b[i];
    return t;
}

__attribute__((target("avx512f"))) static void ls_wsum_avx512(const ls_pools_t *pl, const float *p, const int64_t *ix,
                                                              int64_t c, int64_t off, int64_t len, float *o) {
    if (len != 64) {
        ls_wsum_plain(pl, p, ix, c, off, len, o);
        return;
    }
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t j = 0; j < c; j++) {
        const float *v = ls__vrow(pl, ix[j]) + off;
        const __m512 pj = _mm512_set1_ps(p[j]);
        a0 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v), a0);
        a1 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + 16), a1);
        a2 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + 32), a2);
        a3 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + 48), a3);
    }
    _mm512_storeu_ps(o, a0);
    _mm512_storeu_ps(o + 16, a1);
    _mm512_storeu_ps(o + 32, a2);
    _mm512_storeu_ps(o + 48, a3);
}

__attribute__((target("avx2,fma"))) static float ls_dot_avx2(const float *a, const float *b, int64_t len) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
    }
    if (i + 8 <= len) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
        i += 8;
    }
    float t = ls__hsum256(_mm256_add_ps(a0, a1));
    for (; i < len; i++) t += a[i] * b[i];
    return t;
}

__attribute__((target("avx2,fma"))) static void ls_wsum_avx2(const ls_pools_t *pl, const float *p, const int64_t *ix,
                                                             int64_t c, int64_t off, int64_t len, float *o) {
    if (len != 64) {
        ls_wsum_plain(pl, p, ix, c, off, len, o);
        return;
    }
    __m256 a[8];
    for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
    for (int64_t j = 0; j < c; j++) {
        const float *v = ls__vrow(pl, ix[j]) + off;
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * u), a[u]);
    }
    for (int u = 0; u < 8; u++) _mm256_storeu_ps(o + 8 * u, a[u]);
}
#endif

typedef float (*ls_dot_fn)(const float *, const float *, int64_t);
typedef void (*ls_wsum_fn)(const ls_pools_t *, const float *, const int64_t *, int64_t, int64_t, int64_t, float *);

/* ls_head_attn over two key pools: key index j < n0 reads row j of (k0, v0), a larger one row
 * j - n0 of (k1, v1) (a request's committed entries, then the level's new entries).
 *
 * Three passes, each split over threads without changing a single sum (so every thread count
 * gives the same bits): the scores of every (entry, head, key), split by key; each (entry,
 * head)'s softmax in place, split by pair; the weighted sums of value rows, split by (pair,
 * 64-wide slice), each slice summed over its keys in order, then divided by the pair's sum of
 * weights (the weights are exp(s - max) <= 1: the sums overflow only where values near
 * float32's largest add up, which the head's float16-rounded values never reach). Work:
 * 2 n * n_head * c * head_dim multiply-adds for c keys an entry, vectorised over head_dim. */
static int32_t head_attn2(const float *q, int64_t n, int32_t n_head, int32_t n_head_kv, int32_t head_dim,
                          const float *k0, const float *v0, int64_t n0, const float *k1, const float *v1,
                          int64_t n1, const int64_t *key_off, const int64_t *key_idx, float scale, float *out,
                          int32_t n_threads) {
    if (!q || !key_off || !key_idx || !out || n < 0 || n_head < 1 || n_head_kv < 1 || head_dim < 1 ||
        n_head % n_head_kv || key_off[0] != 0)
        return LS_ERR_ARG;
    const int64_t kv_w = (int64_t)n_head_kv * head_dim, q_w = (int64_t)n_head * head_dim;
    const int rep = n_head / n_head_kv;
    for (int64_t e = 0; e < n; e++) {
        if (key_off[e + 1] - key_off[e] < 1) return LS_ERR_ARG;
        for (int64_t j = key_off[e]; j < key_off[e + 1]; j++)
            if (key_idx[j] < 0 || key_idx[j] >= n0 + n1 || (key_idx[j] < n0 && !k0) || (key_idx[j] >= n0 && !k1))
                return LS_ERR_ARG;
    }
    const ls_pools_t pl = {k0, v0, k1, v1, n0, kv_w};
    const int64_t n_keys = key_off[n], n_pairs = n * n_head;
    const int64_t chunk = 64, slice = 64, n_slices = (head_dim + slice - 1) / slice;
    /* tasks of the score pass: (entry, 64 keys); task_off[e] is entry e's first */
    int64_t *task_off = (int64_t *)malloc(sizeof(int64_t) * (size_t)(n + 1));
    /* s: per entry e, [n_head, c_e] scores (then probabilities) from n_head * key_off[e]; then 1 / z per pair */
    float *s = (float *)malloc(sizeof(float) * (size_t)(n_head * n_keys + n_pairs + 1));
    if (!s || !task_off) {
        free(s);
        free(task_off);
        return LS_ERR_NOMEM;
    }
    float *zinv = s + n_head * n_keys;
    task_off[0] = 0;
    for (int64_t e = 0; e < n; e++) task_off[e + 1] = task_off[e] + (key_off[e + 1] - key_off[e] + chunk - 1) / chunk;
    const int64_t n_tasks = task_off[n];
    ls_dot_fn dot = ls_dot_plain;
    ls_wsum_fn wsum = ls_wsum_plain;
#ifdef LS_HEAD_X86
    if (ls__has_avx512f()) {
        dot = ls_dot_avx512;
        wsum = ls_wsum_avx512;
    } else if (ls__has_avx2()) {
        dot = ls_dot_avx2;
        wsum = ls_wsum_avx2;
    }
#endif
    int nt = n_threads < 1 ? 1 : n_threads;
    if (n_keys * q_w < 65536) nt = 1; /* a few µs of work: a parallel region would cost more than it saves */
    (void)nt;
#if defined(_OPENMP)
#pragma omp parallel num_threads(nt) if (nt > 1)
#endif
    {
        int64_t e_t = 0;
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (int64_t t = 0; t < n_tasks; t++) { /* scores of 64 keys of one entry */
            while (task_off[e_t + 1] <= t) e_t++; /* a thread's tasks rise (static schedule) */
            const int64_t c = key_off[e_t + 1] - key_off[e_t], j0 = (t - task_off[e_t]) * chunk;
            const int64_t j1 = j0 + chunk < c ? j0 + chunk : c, *ix = key_idx + key_off[e_t];
            const float *qe = q + e_t * q_w;
            float *se = s + n_head * key_off[e_t]; /* [n_head, c] */
            for (int64_t j = j0; j < j1; j++) {
                const float *kr = ls__krow(&pl, ix[j]);
                for (int h = 0; h < n_head; h++)
                    se[h * c + j] = dot(qe + (int64_t)h * head_dim, kr + (int64_t)(h / rep) * head_dim, head_dim) * scale;
            }
        }
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (int64_t ph = 0; ph < n_pairs; ph++) { /* softmax of each (entry, head) in place */
            const int64_t e = ph / n_head, h = ph % n_head, c = key_off[e + 1] - key_off[e];
            float *se = s + n_head * key_off[e] + h * c;
            float mx = -INFINITY, z = 0.0f;
            for (int64_t j = 0; j < c; j++) mx = fmaxf(mx, se[j]);
            for (int64_t j = 0; j < c; j++) {
                se[j] = expf(se[j] - mx);
                z += se[j];
            }
            zinv[ph] = 1.0f / z;
        }
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (int64_t t = 0; t < n_pairs * n_slices; t++) { /* one 64-wide slice of a head's weighted sum */
            const int64_t ph = t / n_slices, e = ph / n_head, h = ph % n_head, c = key_off[e + 1] - key_off[e];
            const int64_t d0 = (t % n_slices) * slice, len = head_dim - d0 < slice ? head_dim - d0 : slice;
            float *o = out + e * q_w + h * head_dim + d0;
            wsum(&pl, s + n_head * key_off[e] + h * c, key_idx + key_off[e], c, (int64_t)(h / rep) * head_dim + d0, len, o);
            for (int64_t i = 0; i < len; i++) o[i] *= zinv[ph];
        }
    }
    free(s);
    free(task_off);
    return 0;
}

int32_t ls_head_attn(const float *q, int64_t n, int32_t n_head, int32_t n_head_kv, int32_t head_dim, const float *kpool,
                     const float *vpool, const int64_t *key_off, const int64_t *key_idx, float scale, float *out,
                     int32_t n_threads) {
    if (!kpool || !vpool) return LS_ERR_ARG;
    return head_attn2(q, n, n_head, n_head_kv, head_dim, kpool, vpool, INT64_MAX, NULL, NULL, 0, key_off, key_idx, scale,
                      out, n_threads);
}

int32_t ls_rms_norm_rows(const float *x, int64_t nr, int64_t k, const float *w, float eps, float *out) {
    if (!x || !w || !out || nr < 0 || k < 1) return LS_ERR_ARG;
    for (int64_t r = 0; r < nr; r++) {
        const float *xr = x + r * k;
        double ss = 0.0; /* ggml_compute_forward_rms_norm_f32 sums in double */
        for (int64_t i = 0; i < k; i++) ss += (double)xr[i] * (double)xr[i];
        const float scale = 1.0f / sqrtf((float)(ss / (double)k) + eps);
        float *o = out + r * k;
        for (int64_t i = 0; i < k; i++) o[i] = xr[i] * scale * w[i];
    }
    return 0;
}

int32_t ls_rope_norm(float *x, int64_t nr, int32_t n_heads, int32_t head_dim, int32_t n_rot, const int64_t *pos,
                     const double *inv_freq) {
    if (!x || !pos || !inv_freq || nr < 0 || n_heads < 1 || head_dim < 1 || n_rot < 0 || n_rot > head_dim || n_rot % 2)
        return LS_ERR_ARG;
    for (int64_t r = 0; r < nr; r++)
        for (int32_t i = 0; i < n_rot / 2; i++) {
            const double a = (double)pos[r] * inv_freq[i];
            const float c = (float)cos(a), s = (float)sin(a);
            for (int32_t h = 0; h < n_heads; h++) {
                float *v = x + (r * n_heads + h) * (int64_t)head_dim + 2 * i;
                const float x0 = v[0], x1 = v[1];
                v[0] = x0 * c - x1 * s;
                v[1] = x0 * s + x1 * c;
            }
        }
    return 0;
}

int32_t ls_swiglu_rows(const float *gu, int64_t nr, int64_t n_ff, float *out) {
    if (!gu || !out || nr < 0 || n_ff < 1) return LS_ERR_ARG;
    for (int64_t r = 0; r < nr; r++)
        for (int64_t i = 0; i < n_ff; i++) {
            const float g = gu[r * 2 * n_ff + i], u = gu[r * 2 * n_ff + n_ff + i];
            out[r * n_ff + i] = g / (1.0f + expf(-g)) * u;
        }
    return 0;
}

/* ---- 16-bit float matrices ------------------------------------------------------------ */

/* float16 bits -> float32 (normals, subnormals, inf, nan) */
static float ls__f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t ex = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (ex == 0x1fu)
        bits = sign | 0x7f800000u | (man << 13);
    else if (ex != 0)
        bits = sign | ((ex + 112u) << 23) | (man << 13);
    else if (man == 0)
        bits = sign;
    else { /* subnormal: normalise */
        ex = 113u;
        while (!(man & 0x400u)) {
            man <<= 1;
            ex--;
        }
        bits = sign | (ex << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float ls__h16(uint16_t h, int bf16) {
    if (!bf16) return ls__f16_to_f32(h);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#ifdef LS_HEAD_X86
static inline __m512 ls__load16_h(const uint16_t *p, int bf16) __attribute__((target("avx512f")));
static inline __m512 ls__load16_h(const uint16_t *p, int bf16) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    return _mm512_cvtph_ps(v);
}

/* one matrix row against up to 4 activation rows, two accumulators each (32 values per step) */
__attribute__((target("avx512f"))) static void dot4_h16_avx512(const uint16_t *w, int bf16, const float *x, int64_t k,
                                                             int nr, float *out) {
    __m512 a0[4], a1[4];
    for (int r = 0; r < 4; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= k; j += 32) {
        __m512 w0 = ls__load16_h(w + j, bf16), w1 = ls__load16_h(w + j + 16, bf16);
        for (int r = 0; r < nr; r++) {
            a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * k + j), a0[r]);
            a1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * k + j + 16), a1[r]);
        }
    }
    for (int r = 0; r < nr; r++) {
        float t = ls__hsum512(_mm512_add_ps(a0[r], a1[r]));
        for (int64_t jj = j; jj < k; jj++) t += ls__h16(w[jj], bf16) * x[r * k + jj];
        out[r] = t;
    }
}

/* the same with AVX2 + F16C: 8 values per load, two accumulators (16 per step) */
static inline __m256 ls__load8_h(const uint16_t *p, int bf16) __attribute__((target("avx2,f16c")));
static inline __m256 ls__load8_h(const uint16_t *p, int bf16) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
    return _mm256_cvtph_ps(v);
}

__attribute__((target("avx2,fma,f16c"))) static void dot4_h16_avx2(const uint16_t *w, int bf16, const float *x, int64_t k,
                                                                  int nr, float *out) {
    __m256 a0[4], a1[4];
    for (int r = 0; r < 4; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {
        __m256 w0 = ls__load8_h(w + j, bf16), w1 = ls__load8_h(w + j + 8, bf16);
        for (int r = 0; r < nr; r++) {
            a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * k + j), a0[r]);
            a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * k + j + 8), a1[r]);
        }
    }
    for (int r = 0; r < nr; r++) {
        float t = ls__hsum256(_mm256_add_ps(a0[r], a1[r]));
        for (int64_t jj = j; jj < k; jj++) t += ls__h16(w[jj], bf16) * x[r * k + jj];
        out[r] = t;
    }
}

static int ls__has_f16c(void) { return ls_cpu_has(LS_CPU_AVX2_FMA_F16C); }

#endif

static void dot4_h16_plain(const uint16_t *w, int bf16, const float *x, int64_t k, int nr, float *out) {
    for (int r = 0; r < nr; r++) {
        float t = 0.0f;
        for (int64_t j = 0; j < k; j++) t += ls__h16(w[j], bf16) * x[r * k + j];
        out[r] = t;
    }
}

int32_t ls_gemm_h16(const uint16_t *w, int32_t bf16, int64_t m, int64_t k, const float *x, int64_t nr, float *y,
                    int32_t n_threads) {
    if (!w || !x || !y || m < 0 || k < 0 || nr < 0) return LS_ERR_ARG;
    if (nr == 0 || m == 0) return 0;
    int use512 = 0, use256 = 0;
#ifdef LS_HEAD_X86
    use512 = ls__has_avx512f();
    use256 = ls__has_f16c();
#endif
    int nt = n_threads < 1 ? 1 : n_threads;
    if (nt > m) nt = (int)m;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int t = 0; t < nt; t++) {
        int64_t lo = m * t / nt, hi = m * (t + 1) / nt;
        float o4[4];
        for (int64_t i = lo; i < hi; i++)
            for (int64_t r0 = 0; r0 < nr; r0 += 4) {
                int rr = nr - r0 < 4 ? (int)(nr - r0) : 4;
#ifdef LS_HEAD_X86
                if (use512)
                    dot4_h16_avx512(w + i * k, bf16, x + r0 * k, k, rr, o4);
                else if (use256)
                    dot4_h16_avx2(w + i * k, bf16, x + r0 * k, k, rr, o4);
                else
#endif
                    dot4_h16_plain(w + i * k, bf16, x + r0 * k, k, rr, o4);
                for (int r = 0; r < rr; r++) y[(r0 + r) * m + i] = o4[r];
            }
    }
    (void)use512;
    (void)use256;
    return 0;
}

/* ---- one level of the head -------------------------------------------------------------- */

int32_t ls_mat_apply(const ls_mat_t *a, const float *x, int64_t nr, float *y, int32_t n_threads) {
    if (!a || !a->w) return LS_ERR_ARG;
    switch (a->kind) {
    case LS_MAT_Q8:
        return gemm_q8((const int8_t *)a->w, (const float *)a->d, (const int8_t *)a->w4, (const float *)a->d4, a->m, a->k, x,
                       nr, y, n_threads);
    case LS_MAT_F32T:
        return ls_gemm_t((const float *)a->w, a->k, a->m, x, nr, y, n_threads);
    case LS_MAT_F16:
    case LS_MAT_BF16: {
        int32_t rc = ls_gemm_h16((const uint16_t *)a->w, a->kind == LS_MAT_BF16, a->m, a->k, x, nr, y, n_threads);
        if (rc == 0 && a->out_scale != 1.0f)
            for (int64_t j = 0; j < nr * a->m; j++) y[j] *= a->out_scale;
        return rc;
    }
    default:
        return LS_ERR_ARG;
    }
}

/* a value stored as float16 (llama.cpp's float16 V cache): beyond float16's range it is +-inf */
static float ls__round_f16_value(float f) {
    if (fabsf(f) >= 65520.0f) return copysignf(INFINITY, f);
    return ls__round_f16(f);
}

static float ls__round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

int32_t ls_head_level(const ls_head_t *hd, int64_t n, const float *e, const float *g, const int64_t *pos,
                      const float *ctx_k, const float *ctx_v, int64_t n_ctx, int64_t n_out, const int64_t *out_rows,
                      const int64_t *key_off, const int64_t *key_idx, float *k_out, float *v_out, float *h_out,
                      float *rows_out, int32_t n_threads) {
    if (!hd || !e || !g || !pos || !out_rows || !key_off || !key_idx || !k_out || !v_out || !h_out || !rows_out || n < 1 ||
        n_out < 1 || n_ctx < 0 || (n_ctx > 0 && (!ctx_k || !ctx_v)))
        return LS_ERR_ARG;
    if (!hd->rope_inv || !hd->attn_norm || !hd->hidden_norm || !hd->ffn_norm || !hd->output_norm || hd->head_dim < 1 ||
        hd->n_head_kv < 1 || hd->n_head % hd->n_head_kv || hd->n_rot < 0 || hd->n_rot > hd->head_dim || hd->n_rot % 2 ||
        n > ((int64_t)1 << 32) || n_out > n)
        return LS_ERR_ARG;
    const int64_t E = hd->n_embd, nq = (int64_t)hd->n_head * hd->head_dim, nkv = (int64_t)hd->n_head_kv * hd->head_dim;
    const int64_t nff = hd->n_ff;
    if (E < 1 || nq < 1 || nkv < 1 || nff < 1 || hd->kv.m != 2 * nkv || hd->kv.k != 2 * E || hd->wq.m != nq ||
        hd->wq.k != 2 * E || hd->wo.m != E || hd->wo.k != nq || hd->gate_up.m != 2 * nff || hd->gate_up.k != E ||
        hd->down.m != E || hd->down.k != nff || hd->output.k != E || hd->output.m < 1)
        return LS_ERR_ARG;
    for (int64_t o = 0; o < n_out; o++)
        if (out_rows[o] < 0 || out_rows[o] >= n) return LS_ERR_ARG;
    if (key_off[0] != 0) return LS_ERR_ARG;
    const size_t sz = (size_t)(n * 2 * E + n * 2 * nkv + n_out * (2 * E + 2 * nq + 4 * E + 3 * nff));
    /* one allocation: the query positions first (8-byte aligned), then the float32 buffers */
    int64_t *qpos = (int64_t *)malloc(sizeof(int64_t) * (size_t)n_out + sizeof(float) * sz);
    if (!qpos) return LS_ERR_NOMEM;
    float *buf = (float *)(qpos + n_out);
    float *x = buf, *kvb = x + n * 2 * E, *xs = kvb + n * 2 * nkv, *q = xs + n_out * 2 * E, *att = q + n_out * nq;
    float *r = att + n_out * nq, *nrm = r + n_out * E, *gu = nrm + n_out * E, *sw = gu + n_out * 2 * nff;
    float *on = sw + n_out * nff;
    int32_t rc = 0;
    /* x = [rmsnorm(E[t]) attn_norm ; rmsnorm(g) hidden_norm] */
    for (int64_t i = 0; i < n; i++) {
        ls_rms_norm_rows(e + i * E, 1, E, hd->attn_norm, hd->eps, x + i * 2 * E);
        ls_rms_norm_rows(g + i * E, 1, E, hd->hidden_norm, hd->eps, x + i * 2 * E + E);
    }
    /* every entry's keys (RoPE, bfloat16) and values (float16): the head context's KV types */
    if ((rc = ls_mat_apply(&hd->kv, x, n, kvb, n_threads)) < 0) goto done;
    for (int64_t i = 0; i < n; i++) {
        memcpy(k_out + i * nkv, kvb + i * 2 * nkv, sizeof(float) * (size_t)nkv);
        for (int64_t j = 0; j < nkv; j++) v_out[i * nkv + j] = ls__round_f16_value(kvb[i * 2 * nkv + nkv + j]);
    }
    if ((rc = ls_rope_norm(k_out, n, hd->n_head_kv, hd->head_dim, hd->n_rot, pos, hd->rope_inv)) < 0) goto done;
    for (int64_t j = 0; j < n * nkv; j++) k_out[j] = ls__round_bf16(k_out[j]);
    /* queries of the output entries only */
    for (int64_t o = 0; o < n_out; o++) {
        memcpy(xs + o * 2 * E, x + out_rows[o] * 2 * E, sizeof(float) * (size_t)(2 * E));
        qpos[o] = pos[out_rows[o]];
    }
    if ((rc = ls_mat_apply(&hd->wq, xs, n_out, q, n_threads)) < 0) goto done;
    if ((rc = ls_rope_norm(q, n_out, hd->n_head, hd->head_dim, hd->n_rot, qpos, hd->rope_inv)) < 0) goto done;
    for (int64_t j = 0; j < n_out * nq; j++) q[j] = ls__round_bf16(q[j]);
    if ((rc = head_attn2(q, n_out, hd->n_head, hd->n_head_kv, hd->head_dim, ctx_k, ctx_v, n_ctx, k_out, v_out, n,
                         key_off, key_idx, (float)pow((double)hd->head_dim, -0.5), att, n_threads)) < 0)
        goto done;
    /* r = a Wo^T + residual; h = r + Wdown(silu(Wgate n) * Wup n), n = rmsnorm(r) ffn_norm */
    if ((rc = ls_mat_apply(&hd->wo, att, n_out, r, n_threads)) < 0) goto done;
    for (int64_t o = 0; o < n_out; o++) {
        const float *res = hd->norm_before_residual ? xs + o * 2 * E + E : g + out_rows[o] * E;
        for (int64_t j = 0; j < E; j++) r[o * E + j] += res[j];
    }
    ls_rms_norm_rows(r, n_out, E, hd->ffn_norm, hd->eps, nrm);
    if ((rc = ls_mat_apply(&hd->gate_up, nrm, n_out, gu, n_threads)) < 0) goto done;
    ls_swiglu_rows(gu, n_out, nff, sw);
    if ((rc = ls_mat_apply(&hd->down, sw, n_out, h_out, n_threads)) < 0) goto done;
    for (int64_t j = 0; j < n_out * E; j++) h_out[j] += r[j];
    /* the draft-vocabulary rows */
    ls_rms_norm_rows(h_out, n_out, E, hd->output_norm, hd->eps, on);
    rc = ls_mat_apply(&hd->output, on, n_out, rows_out, n_threads);
done:
    free(qpos);
    return rc < 0 ? rc : 0;
}
