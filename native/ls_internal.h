/* Helpers shared by the localspec kernels (not part of the public API). */
#ifndef LS_INTERNAL_H
#define LS_INTERNAL_H

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "localspec_native.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#define LS_GOLDEN 0x9E3779B97F4A7C15ULL
#define LS_M1 0xBF58476D1CE4E5B9ULL
#define LS_M2 0x94D049BB133111EBULL

/* Whole-row passes split the row into this many fixed chunks (when it is long enough), so
 * partial results are combined in the same order whatever the number of threads. */
#define LS_CHUNKS 16
#define LS_PARALLEL_MIN 65536

/* Histogram of a row by distance below its maximum: bins of 1/LS_HIST_SCALE logits, the
 * last bin collects everything farther (and non-finite values). */
#define LS_HIST_BINS 512
#define LS_HIST_SCALE 8.0f

static inline uint64_t ls__mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * LS_M1;
    z = (z ^ (z >> 27)) * LS_M2;
    return z ^ (z >> 31);
}

/* 53 random bits of stream `key` at `counter` (the uniform is (h + 0.5) / 2^53). */
static inline uint64_t ls__bits53(uint64_t key, uint64_t counter) {
    return ls__mix64(key + (counter + 1u) * LS_GOLDEN) >> 11;
}

static inline double ls__u_of_bits(uint64_t h) { return ((double)h + 0.5) * (1.0 / 9007199254740992.0); }

/* the uniform in (0, 1) of stream `key` at `counter` (sampling.uniform) */
static inline double ls__uniform(uint64_t key, int64_t counter) { return ls__u_of_bits(ls__bits53(key, (uint64_t)counter)); }

static inline double ls__gumbel_of_bits(uint64_t h) { return -log(-log(ls__u_of_bits(h))); }

static inline int ls__isfinite(float v) { return fabsf(v) <= FLT_MAX; }

/* Portable 4-lane vectors (GCC / Clang vector extensions; plain loops elsewhere, or with
 * -DLS_NO_VEC: tests/test_native.py builds that variant and checks it gives the same answers). */
#if (defined(__GNUC__) || defined(__clang__)) && !defined(LS_NO_VEC)
#define LS_VEC 1
typedef float ls_v4f __attribute__((vector_size(16)));
typedef int32_t ls_v4i __attribute__((vector_size(16)));
static inline ls_v4f ls__load4(const float *p) {
    ls_v4f v;
    memcpy(&v, p, sizeof v);
    return v;
}
/* lanes of a where mask is set, else lanes of b */
static inline ls_v4f ls__select4(ls_v4i mask, ls_v4f a, ls_v4f b) {
    return (ls_v4f)(((ls_v4i)a & mask) | ((ls_v4i)b & ~mask));
}
/* -1 where the lane is finite (not inf, not NaN) */
static inline ls_v4i ls__finite4(ls_v4f v) {
    const ls_v4i abs_mask = {0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF};
    const ls_v4i flt_max = {0x7F7FFFFF, 0x7F7FFFFF, 0x7F7FFFFF, 0x7F7FFFFF};
    return ((ls_v4i)v & abs_mask) <= flt_max;
}
#endif

/* Hot row loops get an AVX2 clone picked at load time where the toolchain supports it
 * (GCC on x86-64 Linux). No FMA and no reassociation: every clone computes the same bits. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && !defined(LS_NO_CLONES)
#define LS_HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LS_HOT
#endif

/* x86 instruction sets the kernels pick at run time: what the CPU reports (CPUID) and the OS
 * saves on a context switch (XCR0: the YMM state for AVX2, the ZMM and mask state too for
 * AVX-512), probed once (ls_cpu_has, ls_core.c). 0 everywhere else. */
enum {
    LS_CPU_AVX2_FMA = 1,      /* AVX2 and FMA */
    LS_CPU_AVX2_FMA_F16C = 2, /* and F16C */
    LS_CPU_AVX512F = 3,       /* AVX-512 F (with AVX2, FMA, F16C) */
    LS_CPU_AVX512_VNNI = 4,   /* AVX-512 F/BW/DQ/VL/VNNI (with AVX2, FMA, F16C) */
};
int ls_cpu_has(int set);
/* the compiler knows AVX-512 VNNI as a target: GCC 8, LLVM clang 8, Apple clang 11 (Apple's
 * own version numbers run ahead of LLVM's) */
#if defined(__apple_build_version__)
#define LS_CLANG_VNNI (__clang_major__ >= 11)
#else
#define LS_CLANG_VNNI (__clang_major__ >= 8)
#endif
#if (defined(__x86_64__) || defined(__i386__)) && \
    ((defined(__clang__) && LS_CLANG_VNNI) || (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 8))
#define LS_HAVE_AVX512_VNNI_TARGET 1
#endif

/* exp(r) for r <= ~700 in double, branch-free (vectorisable), within ~2 ulp of libm;
 * exactly 0 below -708 (where libm gives subnormals). */
static inline double ls__exp(double r) {
    const double shifter = 6755399441055744.0; /* 1.5 * 2^52 */
    const double log2e = 1.4426950408889634;
    const double ln2_hi = 6.93147180369123816490e-01;
    const double ln2_lo = 1.90821492927058770002e-10;
    double rc = r < -708.0 ? -708.0 : r;
    double t = rc * log2e + shifter;
    double kd = t - shifter;
    uint64_t ti;
    memcpy(&ti, &t, sizeof ti);
    double f = (rc - kd * ln2_hi) - kd * ln2_lo;
    double p = 1.0 / 6227020800.0;
    p = p * f + 1.0 / 479001600.0;
    p = p * f + 1.0 / 39916800.0;
    p = p * f + 1.0 / 3628800.0;
    p = p * f + 1.0 / 362880.0;
    p = p * f + 1.0 / 40320.0;
    p = p * f + 1.0 / 5040.0;
    p = p * f + 1.0 / 720.0;
    p = p * f + 1.0 / 120.0;
    p = p * f + 1.0 / 24.0;
    p = p * f + 1.0 / 6.0;
    p = p * f + 0.5;
    p = p * f + 1.0;
    p = p * f + 1.0;
    uint64_t sb = (ti + 1023u) << 52;
    double sc;
    memcpy(&sc, &sb, sizeof sc);
    double res = p * sc;
    return r < -708.0 ? 0.0 : res;
}

/* Sum of a[0..n) with 8 interleaved accumulators inside blocks and pairwise combination of
 * blocks (numpy's scheme): accurate, vectorisable and independent of threads. */
double ls__sum(const double *a, int64_t n);

/* Workspace (see localspec_native.h). */
struct ls_workspace {
    int64_t n_vocab;
    int32_t n_threads;
    float *row;          /* [n] adjusted row */
    int64_t *ids;        /* [n] candidates */
    float *logits;       /* [n] candidate logits / T */
    double *vals;        /* [n] probabilities / residual (candidate order) */
    double *vals2;       /* [n] scratch */
    int64_t *ids2;       /* [n] scratch ids */
    uint64_t *keys;      /* [n] sort keys */
    uint64_t *keys2;     /* [n] sort scratch */
    double *hist_mass;   /* [LS_CHUNKS * LS_HIST_BINS] */
};

/* Sort ids[0..m) by (x[id] descending, id ascending): the order of sampling._top_sorted. */
void ls__sort_desc(const float *x, int64_t *ids, int64_t m, uint64_t *keys, uint64_t *tmp);
/* Sort ids[0..m) ascending, carrying vals along. */
void ls__sort_ids(int64_t *ids, double *vals, int64_t m, uint64_t *keys, uint64_t *tmp, double *vtmp);

/* Adjusted row: bias, then penalties; returns row itself when nothing applies. */
const float *ls__adjust(const ls_sampling *s, const float *row, int64_t n, const int64_t *pen_ids,
                        const int32_t *pen_counts, int64_t n_pen, ls_workspace *ws);
/* Candidates of an adjusted row (see ls_candidates). */
int64_t ls__candidates(const ls_sampling *s, const float *x, int64_t n, ls_workspace *ws);
/* Token of an adjusted row at `pos` (see ls_choose). */
int64_t ls__choose(const ls_sampling *s, const float *x, int64_t n, int64_t pos, ls_workspace *ws);
/* Softmax of the candidate logits ws->logits[0..m) into ws->vals (float64). */
void ls__candidate_probs(ls_workspace *ws, int64_t m);
/* verify.sample_from over a sparse distribution: vals[j] is the probability of token
 * ids[j] (ids ascending; ids NULL = j itself), every other token has probability 0. Returns
 * the token the dense inverse-CDF draw picks. */
int64_t ls__sample_sparse(const int64_t *ids, const double *vals, int64_t m, double u);
/* max over finite entries and their number */
void ls__row_max(const float *x, int64_t n, int32_t n_threads, float *max_out, int64_t *n_finite_out);

static inline int ls__threads_for(int64_t n, int32_t n_threads) {
#if defined(_OPENMP)
    return (n >= LS_PARALLEL_MIN && n_threads > 1) ? n_threads : 1;
#else
    (void)n;
    (void)n_threads;
    return 1;
#endif
}

#endif
