/* Per-row transforms: bias, penalties, argmax, (log-)softmax, llama.cpp's truncation chain
 * (top-k -> top-p -> min-p -> temperature) and the seeded Gumbel-max choice.
 * Reference: localspec/sampling.py (LogitsProcessor). */
#include "ls_internal.h"

#if defined(__SSE2__) && !defined(LS_NO_VEC)
#define LS_SSE2 1
#include <emmintrin.h>
#endif

#define BLOCK 256

static inline int64_t chunk_lo(int64_t n, int nch, int c) { return (int64_t)((n * (int64_t)c) / nch); }

/* ---- simple transforms ----------------------------------------------------------------- */

/* x[ids[i]] += vals[i].   x: [n_vocab] float32 (in place) */
static void apply_bias(float *x, const int64_t *ids, const float *vals, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[ids[i]] += vals[i];
}

/* llama.cpp's penalties rule on x[ids[i]] with counts[i] (in place, float32 arithmetic):
 * v = v <= 0 ? v * repeat : v / repeat;  v = v - count * frequency - presence. */
static void apply_penalties(float *x, const int64_t *ids, const int32_t *counts, int64_t n, float repeat_penalty,
                            float frequency_penalty, float presence_penalty) {
    for (int64_t i = 0; i < n; i++) {
        float v = x[ids[i]];
        v = v <= 0.0f ? v * repeat_penalty : v / repeat_penalty;
        v = v - (float)counts[i] * frequency_penalty;
        v = v - presence_penalty;
        x[ids[i]] = v;
    }
}

const float *ls__adjust(const ls_sampling *s, const float *row, int64_t n, const int64_t *pen_ids,
                        const int32_t *pen_counts, int64_t n_pen, ls_workspace *ws) {
    int need_pen = n_pen > 0 && s->has_penalties;
    if (s->n_bias == 0 && !need_pen) return row;
    memcpy(ws->row, row, (size_t)n * sizeof(float));
    if (s->n_bias) apply_bias(ws->row, s->bias_ids, s->bias_vals, s->n_bias);
    if (need_pen)
        apply_penalties(ws->row, pen_ids, pen_counts, n_pen, s->repeat_penalty, s->frequency_penalty,
                        s->presence_penalty);
    return ws->row;
}

/* ---- maxima ------------------------------------------------------------------------------ */

/* max over [lo, hi) of the finite values and their number (-inf / 0 when none) */
LS_HOT static float max_finite_range(const float *x, int64_t lo, int64_t hi, int64_t *n_fin) {
    float r = -INFINITY;
    int64_t cnt = 0;
    int64_t i = lo;
#if LS_VEC
    const ls_v4f ninf = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    ls_v4f m[4] = {ninf, ninf, ninf, ninf};
    ls_v4i c[4] = {{0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}};
    for (; i + 16 <= hi; i += 16)
        for (int g = 0; g < 4; g++) {
            ls_v4f a = ls__load4(x + i + 4 * g);
            ls_v4i f = ls__finite4(a);
            a = ls__select4(f, a, ninf);
            m[g] = ls__select4(a > m[g], a, m[g]);
            c[g] -= f;
        }
    for (int g = 0; g < 4; g++)
        for (int j = 0; j < 4; j++) {
            r = m[g][j] > r ? m[g][j] : r;
            cnt += c[g][j];
        }
#endif
    for (; i < hi; i++) {
        float v = x[i];
        if (ls__isfinite(v)) {
            r = v > r ? v : r;
            cnt++;
        }
    }
    *n_fin = cnt;
    return r;
}

void ls__row_max(const float *x, int64_t n, int32_t n_threads, float *max_out, int64_t *n_finite_out) {
    int nch = n >= LS_PARALLEL_MIN ? LS_CHUNKS : 1;
    float cm[LS_CHUNKS];
    int64_t cc[LS_CHUNKS];
    int nt = ls__threads_for(n, n_threads);
    (void)nt;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int c = 0; c < nch; c++) cm[c] = max_finite_range(x, chunk_lo(n, nch, c), chunk_lo(n, nch, c + 1), &cc[c]);
    float m = -INFINITY;
    int64_t cnt = 0;
    for (int c = 0; c < nch; c++) {
        m = cm[c] > m ? cm[c] : m;
        cnt += cc[c];
    }
    *max_out = m;
    *n_finite_out = cnt;
}

/* np.argmax in one pass over memory: the maximum of each block of ARGMAX_BLOCK values (four
 * independent max chains; maxps(v, m) = v > m ? v : m, so NaN never enters), then the first
 * index holding the overall maximum, looked for only in the first block that has it.
 * NaN values are ignored; a row of -inf (or NaN) gives 0. */
#define ARGMAX_BLOCK 1024

#define LS_ARGMAX_BODY(VEC, W, LOADU, MAX, SET1, STOREU)                                      \
    float best = -INFINITY;                                                                  \
    int64_t best_block = -1, at = -1;                                                        \
    int64_t nb = n / ARGMAX_BLOCK;                                                           \
    for (int64_t b = 0; b < nb; b++) {                                                       \
        const float *p = x + b * ARGMAX_BLOCK;                                               \
        VEC m0 = SET1(-INFINITY), m1 = m0, m2 = m0, m3 = m0;                                 \
        for (int j = 0; j < ARGMAX_BLOCK; j += 4 * (W)) {                                    \
            m0 = MAX(LOADU(p + j), m0);                                                      \
            m1 = MAX(LOADU(p + j + (W)), m1);                                                \
            m2 = MAX(LOADU(p + j + 2 * (W)), m2);                                            \
            m3 = MAX(LOADU(p + j + 3 * (W)), m3);                                            \
        }                                                                                    \
        m0 = MAX(MAX(m0, m1), MAX(m2, m3));                                                  \
        float lanes[W];                                                                      \
        STOREU(lanes, m0);                                                                   \
        float bm = lanes[0];                                                                 \
        for (int j = 1; j < (W); j++) bm = lanes[j] > bm ? lanes[j] : bm;                    \
        if (bm > best) {                                                                     \
            best = bm;                                                                       \
            best_block = b;                                                                  \
        }                                                                                    \
    }                                                                                        \
    for (int64_t i = nb * ARGMAX_BLOCK; i < n; i++)                                          \
        if (x[i] > best) {                                                                   \
            best = x[i];                                                                     \
            at = i;                                                                          \
        }                                                                                    \
    if (at < 0 && best_block >= 0) {                                                         \
        const float *p = x + best_block * ARGMAX_BLOCK;                                      \
        for (int j = 0; j < ARGMAX_BLOCK; j++)                                               \
            if (p[j] == best) {                                                              \
                at = best_block * ARGMAX_BLOCK + j;                                          \
                break;                                                                       \
            }                                                                                \
    }                                                                                        \
    return at < 0 ? 0 : at;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(LS_NO_CLONES) && !defined(LS_NO_VEC)
#define LS_ARGMAX_AVX2 1
#include <immintrin.h>
/* with 8-lane AVX2 registers (picked at run time where the CPU has AVX2) */
__attribute__((target("avx2"))) static int64_t argmax_avx2(const float *x, int64_t n) {
    LS_ARGMAX_BODY(__m256, 8, _mm256_loadu_ps, _mm256_max_ps, _mm256_set1_ps, _mm256_storeu_ps)
}
#endif

#if LS_SSE2
static int64_t argmax_sse2(const float *x, int64_t n) {
    LS_ARGMAX_BODY(__m128, 4, _mm_loadu_ps, _mm_max_ps, _mm_set1_ps, _mm_storeu_ps)
}
#endif

int64_t ls_argmax(const float *x, int64_t n) {
    if (n < 1) return -1;
#if LS_ARGMAX_AVX2
    if (ls_cpu_has(LS_CPU_AVX2_FMA)) return argmax_avx2(x, n);
#endif
#if LS_SSE2
    return argmax_sse2(x, n);
#else
    float best = -INFINITY;
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++)
        if (x[i] > best) {
            best = x[i];
            at = i;
        }
    return at;
#endif
}

/* ---- exp sums -------------------------------------------------------------------------------- */

/* e[j] = exp(x[j] - M) for finite x[j], else 0;  j < len <= BLOCK */
LS_HOT static void exp_block(const float *x, int64_t len, double M, double *e) {
    for (int64_t j = 0; j < len; j++) {
        float v = x[j];
        double ev = ls__exp((double)v - M);
        e[j] = fabsf(v) <= FLT_MAX ? ev : 0.0;
    }
}

/* sum over [lo, hi) of exp(x - M) for finite x */
static double sum_exp_range(const float *x, int64_t lo, int64_t hi, double M) {
    double e[BLOCK];
    double total = 0.0;
    for (int64_t b = lo; b < hi; b += BLOCK) {
        int64_t len = hi - b < BLOCK ? hi - b : BLOCK;
        exp_block(x + b, len, M, e);
        total += ls__sum(e, len);
    }
    return total;
}

static double row_sum_exp(const float *x, int64_t n, double M, int32_t n_threads) {
    int nch = n >= LS_PARALLEL_MIN ? LS_CHUNKS : 1;
    double cs[LS_CHUNKS];
    int nt = ls__threads_for(n, n_threads);
    (void)nt;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int c = 0; c < nch; c++) cs[c] = sum_exp_range(x, chunk_lo(n, nch, c), chunk_lo(n, nch, c + 1), M);
    double t = 0.0;
    for (int c = 0; c < nch; c++) t += cs[c];
    return t;
}

static double logsumexp_threads(const float *x, int64_t n, int32_t n_threads) {
    float M;
    int64_t nf;
    ls__row_max(x, n, n_threads, &M, &nf);
    if (nf == 0) return -INFINITY;
    return (double)M + log(row_sum_exp(x, n, (double)M, n_threads));
}

double ls_logsumexp(const float *x, int64_t n) { return logsumexp_threads(x, n, 1); }

void ls_rows_logsumexp(const float *logits, int64_t stride, int64_t n_vocab, const int32_t *rows, int64_t n_rows,
                       double *out, int32_t n_threads) {
    int nt = (n_rows > 1 && n_threads > 1) ? n_threads : 1;
    (void)nt;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int64_t r = 0; r < n_rows; r++) out[r] = ls_logsumexp(logits + (int64_t)rows[r] * stride, n_vocab);
}

/* ---- selecting the largest values ------------------------------------------------------------ */

#define SCAN 16 /* values tested together before looking at them one by one */

/* does any finite value of x[0..SCAN) pass (strict ? v > thr : v >= thr)? */
static inline int any_passes(const float *x, float thr, int strict) {
#if LS_VEC
    ls_v4f t = {thr, thr, thr, thr};
    ls_v4i acc = {0, 0, 0, 0};
    for (int j = 0; j < SCAN; j += 4) {
        ls_v4f v = ls__load4(x + j);
        acc |= (strict ? (v > t) : (v >= t)) & ls__finite4(v);
    }
    return (acc[0] | acc[1] | acc[2] | acc[3]) != 0;
#else
    for (int j = 0; j < SCAN; j++)
        if (ls__isfinite(x[j]) && (strict ? x[j] > thr : x[j] >= thr)) return 1;
    return 0;
#endif
}

/* ids (ascending) of the finite x >= thr; returns their number */
LS_HOT static int64_t collect_ge(const float *x, int64_t n, float thr, int64_t *ids) {
    int64_t m = 0, i = 0;
    for (; i + SCAN <= n; i += SCAN) {
        if (!any_passes(x + i, thr, 0)) continue;
        for (int64_t j = i; j < i + SCAN; j++) {
            float v = x[j];
            ids[m] = j;
            m += (v >= thr) & (fabsf(v) <= FLT_MAX);
        }
    }
    for (; i < n; i++) {
        float v = x[i];
        ids[m] = i;
        m += (v >= thr) & (fabsf(v) <= FLT_MAX);
    }
    return m;
}

/* The top-k set (k < number of finite values), sorted by (x desc, id asc) into ws->ids[0..k).
 * One pass keeps a buffer of candidates; when it fills up it is cut to the best k, whose
 * k-th value becomes the bar later values must beat (ties lose to earlier ids). */
LS_HOT static int64_t top_k_sorted(const float *x, int64_t n, int64_t k, ls_workspace *ws) {
    int64_t *buf = ws->ids;
    int64_t cnt = 0, limit = 2 * k + 1024;
    float thr = -INFINITY;
    int strict = 0; /* before the first cut: every finite value is admitted */
    int64_t i = 0;
    for (; i < n; i += SCAN) {
        int64_t hi = i + SCAN < n ? i + SCAN : n;
        if (strict && hi - i == SCAN && !any_passes(x + i, thr, 1)) continue;
        for (int64_t j = i; j < hi; j++) {
            float v = x[j];
            buf[cnt] = j;
            cnt += (fabsf(v) <= FLT_MAX) & (strict ? v > thr : v >= thr);
        }
        if (cnt >= limit) {
            ls__sort_desc(x, buf, cnt, ws->keys, ws->keys2);
            cnt = k;
            thr = x[buf[k - 1]];
            strict = 1;
        }
    }
    ls__sort_desc(x, buf, cnt, ws->keys, ws->keys2);
    return k < cnt ? k : cnt;
}

int64_t ls_top_k(const float *x, int64_t n, int64_t k, ls_workspace *ws, int64_t *ids_out) {
    if (!ws || ws->n_vocab < n || n < 0 || k < 0) return LS_ERR_ARG;
    if (k == 0 || n == 0) return 0;
    float M;
    int64_t n_fin;
    ls__row_max(x, n, ws->n_threads, &M, &n_fin);
    if (n_fin == 0) return 0;
    int64_t m;
    if (k < n_fin) {
        m = top_k_sorted(x, n, k, ws);
    } else {
        m = collect_ge(x, n, -FLT_MAX, ws->ids);
        ls__sort_desc(x, ws->ids, m, ws->keys, ws->keys2);
    }
    memcpy(ids_out, ws->ids, (size_t)m * sizeof(int64_t));
    return m;
}

/* ---- the top-p cut ------------------------------------------------------------------------------- */

/* Mass histogram of x by distance below its maximum (bins of 1/LS_HIST_SCALE logits; the
 * last bin also takes non-finite values) over [lo, hi); returns the total mass. Four
 * interleaved copies of the histogram keep the scatter from waiting on itself. */
static double hist_range(const float *x, int64_t lo, int64_t hi, float M, double *mass) {
    double h4[4][LS_HIST_BINS];
    memset(h4, 0, sizeof h4);
    double e[BLOCK];
    int32_t bins[BLOCK];
    double total = 0.0;
    for (int64_t b = lo; b < hi; b += BLOCK) {
        int64_t len = hi - b < BLOCK ? hi - b : BLOCK;
        exp_block(x + b, len, (double)M, e);
        for (int64_t j = 0; j < len; j++) {
            float db = (M - x[b + j]) * LS_HIST_SCALE;
            db = db < (float)(LS_HIST_BINS - 1) ? db : (float)(LS_HIST_BINS - 1); /* inf, NaN -> last */
            bins[j] = (int32_t)db;
        }
        for (int64_t j = 0; j < len; j++) h4[j & 3][bins[j]] += e[j];
        total += ls__sum(e, len);
    }
    for (int q = 0; q < LS_HIST_BINS; q++) mass[q] = (h4[0][q] + h4[1][q]) + (h4[2][q] + h4[3][q]);
    return total;
}

/* Mass histogram of the whole row (fixed chunks, merged in order) into mass; returns the
 * total mass z = sum exp(x - M) over the finite values. */
static double row_hist(const float *x, int64_t n, float M, ls_workspace *ws, double *mass) {
    int nch = n >= LS_PARALLEL_MIN ? LS_CHUNKS : 1;
    double cs[LS_CHUNKS];
    int nt = ls__threads_for(n, ws->n_threads);
    (void)nt;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int c = 0; c < nch; c++)
        cs[c] = hist_range(x, chunk_lo(n, nch, c), chunk_lo(n, nch, c + 1), M, ws->hist_mass + (size_t)c * LS_HIST_BINS);
    double t = 0.0;
    for (int b = 0; b < LS_HIST_BINS; b++) mass[b] = 0.0;
    for (int c = 0; c < nch; c++) {
        t += cs[c];
        for (int b = 0; b < LS_HIST_BINS; b++) mass[b] += ws->hist_mass[(size_t)c * LS_HIST_BINS + b];
    }
    return t;
}

/* Threshold that keeps every value within `bins + 1` histogram bins of the maximum
 * (one bin of margin for rounding); -FLT_MAX keeps every finite value. */
static float bin_threshold(float M, int bins) {
    if (bins + 2 >= LS_HIST_BINS - 1) return -FLT_MAX;
    return M - (float)(bins + 2) / LS_HIST_SCALE;
}

/* ---- llama.cpp's truncation chain --------------------------------------------------------- */

/* Position of the top-p cut in the sorted ids[0..m) (cumulative mass / z >= top_p), or 0 */
static int64_t top_p_cut(const float *x, const int64_t *ids, int64_t m, double M, double z, double top_p) {
    double cum = 0.0;
    for (int64_t i = 0; i < m; i++) {
        cum += ls__exp((double)x[ids[i]] - M);
        if (cum / z >= top_p) return i + 1;
    }
    return 0;
}

/* min-p: how many of the sorted ids[0..m) have x >= x[ids[0]] + log(min_p) (double) */
static int64_t min_p_count(const float *x, const int64_t *ids, int64_t m, double min_p) {
    double thr = (double)x[ids[0]] + log(min_p);
    int64_t c = 0;
    for (int64_t i = 0; i < m; i++) c += (double)x[ids[i]] >= thr;
    return c;
}

/* top-p (then min-p) over every finite value: the sorted prefix into ws->ids; returns its
 * length (>= 1). */
static int64_t top_p_full(const ls_sampling *s, const float *x, int64_t n, float M, int64_t n_fin,
                          ls_workspace *ws) {
    double mass[LS_HIST_BINS];
    double z = row_hist(x, n, M, ws, mass);
    double target = s->top_p * z;
    double acc = 0.0;
    int b = 0;
    for (; b < LS_HIST_BINS - 1; b++) {
        acc += mass[b];
        if (acc >= target) break;
    }
    int64_t m, keep;
    for (;;) {
        float thr = bin_threshold(M, b);
        m = collect_ge(x, n, thr, ws->ids);
        ls__sort_desc(x, ws->ids, m, ws->keys, ws->keys2);
        keep = top_p_cut(x, ws->ids, m, (double)M, z, s->top_p);
        if (keep > 0) break;
        if (m >= n_fin) {
            keep = m; /* never reached (rounding): keep everything, as the reference does */
            break;
        }
        b += 16;
    }
    if (s->min_p > 0.0) {
        int64_t c = min_p_count(x, ws->ids, m, s->min_p);
        keep = c < keep ? c : keep;
    }
    return keep < 1 ? 1 : keep;
}

/* ids of x >= (float)(max + log(min_p)) among ids[0..m), order kept */
static int64_t min_p_filter_f32(const float *x, int64_t *ids, int64_t m, float M, double min_p) {
    float thr = (float)((double)M + log(min_p));
    int64_t k = 0;
    for (int64_t i = 0; i < m; i++) {
        ids[k] = ids[i];
        k += x[ids[i]] >= thr;
    }
    return k;
}

static inline int is_truncating(const ls_sampling *s) { return s->top_k > 0 || s->top_p < 1.0 || s->min_p > 0.0; }

/* The greedy token of an adjusted row: the first maximum (a +inf logit, i.e. a forced token,
 * wins); LS_ERR_BANNED when every value is -inf. */
static int64_t greedy_token(const float *x, int64_t n) {
    int64_t t = ls_argmax(x, n);
    return x[t] > -INFINITY ? t : LS_ERR_BANNED;
}

/* Is the row decided greedily at temperature > 0 (LogitsProcessor.greedy_row)? When a biased
 * token's adjusted logit is +inf (forced), or when the largest finite value M divided by the
 * float temperature is not finite (the division overflows: T = 1e-40, or (float)T == 0). */
static int greedy_at_temperature(const ls_sampling *s, const float *x, float M, int64_t n_fin) {
    for (int64_t i = 0; i < s->n_bias; i++)
        if (x[s->bias_ids[i]] == INFINITY) return 1;
    if (n_fin == 0) return 0;
    float q = M / (float)s->temperature;
    return !ls__isfinite(q);
}

/* Candidate ids of an adjusted row into ws->ids (reference order); logits / T into
 * ws->logits. */
int64_t ls__candidates(const ls_sampling *s, const float *x, int64_t n, ls_workspace *ws) {
    float M = -INFINITY;
    int64_t n_fin = 0;
    if (s->temperature > 0.0) ls__row_max(x, n, ws->n_threads, &M, &n_fin);
    if (s->temperature <= 0.0 || greedy_at_temperature(s, x, M, n_fin)) {
        int64_t t = greedy_token(x, n);
        if (t < 0) return t;
        ws->ids[0] = t;
        ws->logits[0] = 0.0f;
        return 1;
    }
    float temp = (float)s->temperature;
    int64_t m;
    if (!is_truncating(s)) {
        if (n_fin == 0) return LS_ERR_NONE_ALLOWED;
        m = n_fin == n ? n : collect_ge(x, n, -FLT_MAX, ws->ids);
        if (n_fin == n)
            for (int64_t i = 0; i < n; i++) ws->ids[i] = i;
    } else {
        int64_t k = s->top_k > 0 ? (int64_t)s->top_k : n;
        if (k > n_fin) k = n_fin;
        if (k <= 0) return LS_ERR_BANNED;
        if (k >= n) { /* no effective top-k, every value finite */
            if (s->top_p < 1.0) {
                m = top_p_full(s, x, n, M, n_fin, ws);
            } else { /* min-p only: ascending ids */
                for (int64_t i = 0; i < n; i++) ws->ids[i] = i;
                m = min_p_filter_f32(x, ws->ids, n, M, s->min_p);
            }
        } else if (k < n_fin) { /* a real top-k set */
            m = top_k_sorted(x, n, k, ws);
            if (s->top_p < 1.0) {
                double *e = ws->vals2;
                for (int64_t i = 0; i < m; i++) e[i] = ls__exp((double)x[ws->ids[i]] - (double)M);
                double z = ls__sum(e, m);
                int64_t keep = top_p_cut(x, ws->ids, m, (double)M, z, s->top_p);
                if (keep == 0) keep = m;
                if (s->min_p > 0.0) {
                    int64_t c = min_p_count(x, ws->ids, m, s->min_p);
                    keep = c < keep ? c : keep;
                }
                m = keep < 1 ? 1 : keep;
            } else if (s->min_p > 0.0) {
                m = min_p_filter_f32(x, ws->ids, m, M, s->min_p);
            }
        } else { /* k == n_fin < n: every finite value, sorted */
            if (s->top_p < 1.0) {
                m = top_p_full(s, x, n, M, n_fin, ws);
            } else {
                float thr = s->min_p > 0.0 ? (float)((double)M + log(s->min_p)) : -FLT_MAX;
                m = collect_ge(x, n, thr, ws->ids);
                ls__sort_desc(x, ws->ids, m, ws->keys, ws->keys2);
            }
        }
        if (m <= 0) return LS_ERR_BANNED;
    }
    for (int64_t i = 0; i < m; i++) ws->logits[i] = x[ws->ids[i]] / temp;
    return m;
}

int64_t ls_candidates(const ls_sampling *s, const float *row, int64_t n_vocab, const int64_t *pen_ids,
                      const int32_t *pen_counts, int64_t n_pen, ls_workspace *ws, int64_t *ids_out,
                      float *logits_out) {
    if (!ws || ws->n_vocab < n_vocab) return LS_ERR_ARG;
    const float *x = ls__adjust(s, row, n_vocab, pen_ids, pen_counts, n_pen, ws);
    int64_t m = ls__candidates(s, x, n_vocab, ws);
    if (m < 0) return m;
    memcpy(ids_out, ws->ids, (size_t)m * sizeof(int64_t));
    memcpy(logits_out, ws->logits, (size_t)m * sizeof(float));
    return m;
}

void ls__candidate_probs(ls_workspace *ws, int64_t m) {
    const float *l = ws->logits;
    int64_t unused;
    float mx = max_finite_range(l, 0, m, &unused);
    double *p = ws->vals;
    for (int64_t i = 0; i < m; i++) p[i] = ls__exp((double)l[i] - (double)mx);
    double z = ls__sum(p, m);
    for (int64_t i = 0; i < m; i++) p[i] /= z;
}

/* ---- seeded Gumbel-max ------------------------------------------------------------------------ */

#define GUMBEL_BANDS 64

/* Exact argmax of l_i + g_i that computes g only where it can win. A candidate whose logit
 * is j..j+1 below the largest logit L can only beat the best z found so far if its noise
 * exceeds c_j = best - L + j, i.e. if its uniform exceeds exp(-exp(-c_j)): one integer
 * comparison of its random bits with lim[j]. Bands >= GUMBEL_BANDS - 1 are out of reach
 * (the noise of a 53-bit uniform never exceeds 38). */
typedef struct {
    double L;
    double best_z;
    int64_t best_pos; /* position in candidate order (ties: the first) */
    int64_t lim[GUMBEL_BANDS];
} gumbel_state;

static void gumbel_limits(gumbel_state *g) {
    for (int j = 0; j < GUMBEL_BANDS; j++) {
        double c = g->best_z - g->L + (double)j;
        c -= 1e-9 * (1.0 + fabs(c)); /* margin for rounding: evaluate slightly more */
        double u = exp(-exp(-c));
        if (!(u < 1.0)) {
            g->lim[j] = INT64_MAX;
        } else {
            double lim = floor(u * 9007199254740992.0) - 1.0;
            g->lim[j] = lim < 0.0 ? -1 : (int64_t)lim;
        }
    }
    g->lim[GUMBEL_BANDS - 1] = INT64_MAX;
}

static inline void gumbel_consider(gumbel_state *g, uint64_t key, int64_t id, float l, int64_t pos) {
    float d = (float)g->L - l;
    d = d < (float)(GUMBEL_BANDS - 1) ? d : (float)(GUMBEL_BANDS - 1);
    int j = (int)d;
    int64_t lim = g->lim[j];
    if (lim == INT64_MAX) return;
    uint64_t h = ls__bits53(key, (uint64_t)id);
    if ((int64_t)h <= lim) return;
    double z = (double)l + ls__gumbel_of_bits(h);
    if (z > g->best_z || (z == g->best_z && pos < g->best_pos)) {
        g->best_z = z;
        g->best_pos = pos;
        gumbel_limits(g);
    }
}

LS_HOT static void gumbel_range(gumbel_state *g, uint64_t key, const float *x, int64_t lo, int64_t hi, float temp) {
    for (int64_t i = lo; i < hi; i++) gumbel_consider(g, key, i, x[i] / temp, i);
}

/* over an explicit candidate list; returns the chosen position */
static int64_t gumbel_list(uint64_t key, const int64_t *ids, const float *l, int64_t m) {
    int64_t unused;
    float L = max_finite_range(l, 0, m, &unused);
    int64_t top = 0;
    while (l[top] != L) top++;
    gumbel_state g;
    g.L = (double)L;
    g.best_pos = top;
    g.best_z = (double)L + ls__gumbel_of_bits(ls__bits53(key, (uint64_t)ids[top]));
    gumbel_limits(&g);
    for (int64_t i = 0; i < m; i++) gumbel_consider(&g, key, ids[i], l[i], i);
    return g.best_pos;
}

/* over every finite value of the row (logits x / T, ids = positions) */
static int64_t gumbel_row(uint64_t key, const float *x, int64_t n, float M, float temp, int32_t n_threads) {
    float L = M / temp;
    int64_t top = 0;
    while (!(ls__isfinite(x[top]) && x[top] / temp == L)) top++;
    gumbel_state g0;
    g0.L = (double)L;
    g0.best_pos = top;
    g0.best_z = (double)L + ls__gumbel_of_bits(ls__bits53(key, (uint64_t)top));
    gumbel_limits(&g0);
    int nch = n >= LS_PARALLEL_MIN ? LS_CHUNKS : 1;
    gumbel_state gs[LS_CHUNKS];
    int nt = ls__threads_for(n, n_threads);
    (void)nt;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int c = 0; c < nch; c++) {
        gs[c] = g0;
        gumbel_range(&gs[c], key, x, chunk_lo(n, nch, c), chunk_lo(n, nch, c + 1), temp);
    }
    gumbel_state *best = &gs[0];
    for (int c = 1; c < nch; c++)
        if (gs[c].best_z > best->best_z || (gs[c].best_z == best->best_z && gs[c].best_pos < best->best_pos))
            best = &gs[c];
    return best->best_pos;
}

int64_t ls__choose(const ls_sampling *s, const float *x, int64_t n, int64_t pos, ls_workspace *ws) {
    if (s->temperature <= 0.0) return greedy_token(x, n);
    uint64_t key = ls_stream_key(s->seed, pos, LS_STREAM_GUMBEL);
    if (!is_truncating(s)) {
        float M;
        int64_t n_fin;
        ls__row_max(x, n, ws->n_threads, &M, &n_fin);
        if (greedy_at_temperature(s, x, M, n_fin)) return greedy_token(x, n);
        if (n_fin == 0) return LS_ERR_NONE_ALLOWED;
        return gumbel_row(key, x, n, M, (float)s->temperature, ws->n_threads);
    }
    int64_t m = ls__candidates(s, x, n, ws);
    if (m < 0) return m;
    if (m == 1) return ws->ids[0];
    return ws->ids[gumbel_list(key, ws->ids, ws->logits, m)];
}

int64_t ls_choose(const ls_sampling *s, const float *row, int64_t n_vocab, const int64_t *pen_ids,
                  const int32_t *pen_counts, int64_t n_pen, int64_t pos, ls_workspace *ws) {
    if (!ws || ws->n_vocab < n_vocab) return LS_ERR_ARG;
    const float *x = ls__adjust(s, row, n_vocab, pen_ids, pen_counts, n_pen, ws);
    return ls__choose(s, x, n_vocab, pos, ws);
}

int64_t ls__sample_sparse(const int64_t *ids, const double *vals, int64_t m, double u) {
    double total = 0.0;
    for (int64_t j = 0; j < m; j++) total += vals[j];
    double target = u * total;
    double c = 0.0;
    int64_t j = 0;
    for (; j < m; j++) {
        c += vals[j];
        if (c > target) break;
    }
    if (j >= m) j = m - 1;
    while (j >= 0 && vals[j] <= 0.0) j--;
    if (j < 0) return 0;
    return ids ? ids[j] : j;
}

int64_t ls_sample_from(const double *probs, int64_t n, double u) {
    return n < 1 ? -1 : ls__sample_sparse(NULL, probs, n, u);
}
