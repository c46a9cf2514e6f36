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

int32_t ls_q8_quantize_rows(const float *x, int64_t nr, int64_t k, int8_t *q, float *d) {
    if (!x || !q || !d || nr < 0 || k < 0 || k % LS_Q8_BLOCK) return LS_ERR_ARG;
    int64_t nb = k / LS_Q8_BLOCK;
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

/* the same with AVX-512 VNNI: two blocks per instruction. xs holds, per activation row, its
 * block scales each repeated 8 times ([nr, nb * 8]), so that a block pair's scales are one load. */
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni"))) static void dot4_q8_vnni(
    const int8_t *w, const float *wd, const int8_t *x, const float *xs, const float *xd, int64_t nb, int64_t k,
    int nr, float *out) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const __m512i zero = _mm512_setzero_si512();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m512i wv = _mm512_loadu_si512((const void *)(w + b * LS_Q8_BLOCK));
        __m512i aw = _mm512_abs_epi8(wv);
        __mmask64 neg = _mm512_movepi8_mask(wv);
        __m512 ws = _mm512_insertf32x8(_mm512_set1_ps(wd[b]), _mm256_set1_ps(wd[b + 1]), 1);
        for (int r = 0; r < nr; r++) {
            __m512i xv = _mm512_loadu_si512((const void *)(x + r * k + b * LS_Q8_BLOCK));
            __m512i sx = _mm512_mask_sub_epi8(xv, neg, zero, xv);
            __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, aw, sx));
            __m512 sc = _mm512_mul_ps(ws, _mm512_loadu_ps(xs + (r * nb + b) * 8));
            acc[r] = _mm512_fmadd_ps(sc, p, acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) {
        float t = _mm512_reduce_add_ps(acc[r]);
        for (int64_t bb = b; bb < nb; bb++) { /* an odd last block */
            int32_t si = 0;
            for (int j = 0; j < LS_Q8_BLOCK; j++)
                si += (int32_t)w[bb * LS_Q8_BLOCK + j] * (int32_t)x[r * k + bb * LS_Q8_BLOCK + j];
            t += (float)si * (wd[bb] * xd[r * nb + bb]);
        }
        out[r] = t;
    }
}

static int ls__has_vnni(void) {
    static int v = -1;
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
            __builtin_cpu_supports("avx512vnni") && getenv("LS_HEAD_NO_AVX512") == NULL;
    }
    return v;
}

static int ls__has_avx2(void) {
    static int v = -1;
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return v;
}
#endif

int32_t ls_gemm_q8(const int8_t *w, const float *wd, int64_t m, int64_t k, const float *x, int64_t nr, float *y,
                   int32_t n_threads) {
    if (!w || !wd || !x || !y || m < 0 || k < 0 || nr < 0 || k % LS_Q8_BLOCK) return LS_ERR_ARG;
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
#ifdef LS_HEAD_X86
    use_avx2 = ls__has_avx2();
    use_vnni = ls__has_vnni();
    if (use_vnni) {
        xs = (float *)malloc(sizeof(float) * (size_t)(nr * nb * 8 + 1));
        if (!xs) {
            free(xq);
            free(xd);
            return LS_ERR_NOMEM;
        }
        for (int64_t i = 0; i < nr * nb; i++)
            for (int j = 0; j < 8; j++) xs[i * 8 + j] = xd[i];
    }
#endif
    (void)use_avx2;
    (void)use_vnni;
    int nt = n_threads < 1 ? 1 : n_threads;
    if (nt > m) nt = (int)m;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int t = 0; t < nt; t++) {
        int64_t lo = m * t / nt, hi = m * (t + 1) / nt;
        float o4[4];
        (void)o4;
        for (int64_t i = lo; i < hi; i++) { /* the matrix row once, against every activation row */
            const int8_t *wi = w + i * k;
            const float *wdi = wd + i * nb;
            for (int64_t r0 = 0; r0 < nr; r0 += 4) {
                int rr = nr - r0 < 4 ? (int)(nr - r0) : 4;
#ifdef LS_HEAD_X86
                if (use_vnni) {
                    dot4_q8_vnni(wi, wdi, xq + r0 * k, xs + r0 * nb * 8, xd + r0 * nb, nb, k, rr, o4);
                    for (int r = 0; r < rr; r++) y[(r0 + r) * m + i] = o4[r];
                    continue;
                }
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
    return 0;
}

int32_t ls_head_attn(const float *q, int64_t n, int32_t n_head, int32_t n_head_kv, int32_t head_dim, const float *kpool,
                     const float *vpool, const int64_t *key_off, const int64_t *key_idx, float scale, float *out) {
    if (!q || !kpool || !vpool || !key_off || !key_idx || !out || n < 0 || n_head < 1 || n_head_kv < 1 ||
        head_dim < 1 || n_head % n_head_kv)
        return LS_ERR_ARG;
    const int64_t kv_w = (int64_t)n_head_kv * head_dim, q_w = (int64_t)n_head * head_dim;
    const int rep = n_head / n_head_kv;
    int64_t most = 0;
    for (int64_t e = 0; e < n; e++) {
        int64_t c = key_off[e + 1] - key_off[e];
        if (c < 1) return LS_ERR_ARG;
        if (c > most) most = c;
    }
    float *s = (float *)malloc(sizeof(float) * (size_t)(most + 1));
    if (!s) return LS_ERR_NOMEM;
    for (int64_t e = 0; e < n; e++) {
        const int64_t *ix = key_idx + key_off[e];
        const int64_t c = key_off[e + 1] - key_off[e];
        for (int h = 0; h < n_head; h++) {
            const float *qh = q + e * q_w + (int64_t)h * head_dim;
            const int64_t kh = (int64_t)(h / rep) * head_dim;
            float mx = -INFINITY;
            for (int64_t j = 0; j < c; j++) {
                const float *kr = kpool + ix[j] * kv_w + kh;
                float a = 0.0f;
                for (int i = 0; i < head_dim; i++) a += qh[i] * kr[i];
                s[j] = a * scale;
                mx = fmaxf(mx, s[j]);
            }
            float z = 0.0f;
            for (int64_t j = 0; j < c; j++) {
                s[j] = expf(s[j] - mx);
                z += s[j];
            }
            float *o = out + e * q_w + (int64_t)h * head_dim;
            for (int i = 0; i < head_dim; i++) o[i] = 0.0f;
            for (int64_t j = 0; j < c; j++) {
                const float *vr = vpool + ix[j] * kv_w + kh;
                const float p = s[j] / z;
                for (int i = 0; i < head_dim; i++) o[i] += p * vr[i];
            }
        }
    }
    free(s);
    return 0;
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
