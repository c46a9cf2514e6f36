/* Random streams, sums, sorting and workspaces shared by the kernels. */
#include "ls_internal.h"

int32_t ls_abi_version(void) { return LS_ABI_VERSION; }

int32_t ls_has_openmp(void) {
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}

/* ---- the CPU's instruction sets (ls_internal.h) ---------------------------------------- */

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
static int ls__cpu_probe(int set) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    /* FMA (ECX 12), OSXSAVE (27), AVX (28), F16C (29) */
    int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx || !fma) return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0x6u) != 0x6u) return 0; /* XMM and YMM state */
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    int avx2 = (b >> 5) & 1;
    if (!avx2) return 0;
    if (set == LS_CPU_AVX2_FMA) return 1;
    if (!f16c) return 0;
    if (set == LS_CPU_AVX2_FMA_F16C) return 1;
    /* AVX-512: F (EBX 16), DQ (17), BW (30), VL (31), VNNI (ECX 11); opmask, ZMM 0-15 upper, ZMM 16-31 */
    int f = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1, vnni = (c >> 11) & 1;
    if (!f || (lo & 0xE6u) != 0xE6u) return 0;
    if (set == LS_CPU_AVX512F) return 1;
    return set == LS_CPU_AVX512_VNNI && dq && bw && vl && vnni;
}
#else
static int ls__cpu_probe(int set) {
    (void)set;
    return 0;
}
#endif

int ls_cpu_has(int set) {
    /* probed once per set (CPUID traps to the hypervisor in a VM); every caller computes the
     * same value, so a race between threads only repeats the probe */
    static volatile int known[5] = {0, -1, -1, -1, -1};
    if (set < 1 || set > 4) return 0;
    if (known[set] < 0) known[set] = ls__cpu_probe(set);
    return known[set];
}

/* ---- random streams (localspec.sampling) ---------------------------------------------- */

uint64_t ls_stream_key(uint64_t seed, int64_t pos, int32_t stream) {
    uint64_t k = ls__mix64(seed * LS_GOLDEN + (uint64_t)pos + 1u);
    return ls__mix64(k ^ ((uint64_t)((int64_t)stream + 1) * LS_M2));
}

void ls_uniforms(uint64_t key, const int64_t *counters, int64_t n, double *out) {
    for (int64_t i = 0; i < n; i++) out[i] = ls__uniform(key, counters[i]);
}

void ls_gumbel_noise(uint64_t key, const int64_t *ids, int64_t n, double *out) {
    for (int64_t i = 0; i < n; i++) out[i] = ls__gumbel_of_bits(ls__bits53(key, (uint64_t)ids[i]));
}

/* ---- sums ------------------------------------------------------------------------------ */

double ls__sum(const double *a, int64_t n) {
    if (n < 8) {
        double r = 0.0;
        for (int64_t i = 0; i < n; i++) r += a[i];
        return r;
    }
    if (n <= 128) {
        double r[8];
        for (int j = 0; j < 8; j++) r[j] = a[j];
        int64_t i = 8;
        for (; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return ls__sum(a, n2) + ls__sum(a + n2, n - n2);
}

/* ---- sorting ----------------------------------------------------------------------------- */

/* LSD radix sort of 64-bit keys, 8 bits a pass, skipping passes where every key shares the
 * digit. Small inputs use insertion sort. */
static void radix_sort_u64(uint64_t *keys, int64_t m, uint64_t *tmp) {
    if (m < 48) {
        for (int64_t i = 1; i < m; i++) {
            uint64_t k = keys[i];
            int64_t j = i - 1;
            while (j >= 0 && keys[j] > k) {
                keys[j + 1] = keys[j];
                j--;
            }
            keys[j + 1] = k;
        }
        return;
    }
    uint64_t *src = keys, *dst = tmp;
    for (int shift = 0; shift < 64; shift += 8) {
        int64_t count[256];
        memset(count, 0, sizeof count);
        for (int64_t i = 0; i < m; i++) count[(src[i] >> shift) & 0xFF]++;
        if (count[(src[0] >> shift) & 0xFF] == m) continue; /* all keys share this digit */
        int64_t off = 0;
        for (int b = 0; b < 256; b++) {
            int64_t c = count[b];
            count[b] = off;
            off += c;
        }
        for (int64_t i = 0; i < m; i++) dst[count[(src[i] >> shift) & 0xFF]++] = src[i];
        uint64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != keys) memcpy(keys, src, (size_t)m * sizeof *keys);
}

/* A key whose ascending order is descending float order (+0 and -0 equal). */
static inline uint32_t desc_key(float v) {
    v = v + 0.0f; /* -0 -> +0 */
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u); /* ascending */
    return ~u;
}

void ls__sort_desc(const float *x, int64_t *ids, int64_t m, uint64_t *keys, uint64_t *tmp) {
    for (int64_t i = 0; i < m; i++) keys[i] = ((uint64_t)desc_key(x[ids[i]]) << 32) | (uint64_t)(uint32_t)ids[i];
    radix_sort_u64(keys, m, tmp);
    for (int64_t i = 0; i < m; i++) ids[i] = (int64_t)(uint32_t)(keys[i] & 0xFFFFFFFFu);
}

void ls__sort_ids(int64_t *ids, double *vals, int64_t m, uint64_t *keys, uint64_t *tmp, double *vtmp) {
    int64_t i0 = 1;
    while (i0 < m && ids[i0] > ids[i0 - 1]) i0++;
    if (i0 >= m) return; /* already ascending (no truncation, or min-p only): nothing to move */
    for (int64_t i = 0; i < m; i++) keys[i] = ((uint64_t)(uint32_t)ids[i] << 32) | (uint64_t)i;
    radix_sort_u64(keys, m, tmp);
    for (int64_t i = 0; i < m; i++) vtmp[i] = vals[keys[i] & 0xFFFFFFFFu];
    for (int64_t i = 0; i < m; i++) {
        ids[i] = (int64_t)(keys[i] >> 32);
        vals[i] = vtmp[i];
    }
}

/* ---- workspaces ---------------------------------------------------------------------------- */

ls_workspace *ls_workspace_new(int64_t n_vocab, int32_t n_threads) {
    if (n_vocab < 1 || n_vocab > 0x7FFFFFFF) return NULL;
    ls_workspace *ws = (ls_workspace *)calloc(1, sizeof *ws);
    if (!ws) return NULL;
    size_t n = (size_t)n_vocab;
    ws->n_vocab = n_vocab;
    ws->n_threads = n_threads < 1 ? 1 : n_threads;
    ws->row = (float *)malloc(n * sizeof(float));
    ws->ids = (int64_t *)malloc(n * sizeof(int64_t));
    ws->logits = (float *)malloc(n * sizeof(float));
    ws->vals = (double *)malloc(n * sizeof(double));
    ws->vals2 = (double *)malloc(n * sizeof(double));
    ws->ids2 = (int64_t *)malloc(n * sizeof(int64_t));
    ws->keys = (uint64_t *)malloc(n * sizeof(uint64_t));
    ws->keys2 = (uint64_t *)malloc(n * sizeof(uint64_t));
    ws->hist_mass = (double *)malloc(LS_CHUNKS * LS_HIST_BINS * sizeof(double));
    if (!ws->row || !ws->ids || !ws->logits || !ws->vals || !ws->vals2 || !ws->ids2 || !ws->keys ||
        !ws->keys2 || !ws->hist_mass) {
        ls_workspace_free(ws);
        return NULL;
    }
    return ws;
}

void ls_workspace_free(ls_workspace *ws) {
    if (!ws) return;
    free(ws->row);
    free(ws->ids);
    free(ws->logits);
    free(ws->vals);
    free(ws->vals2);
    free(ws->ids2);
    free(ws->keys);
    free(ws->keys2);
    free(ws->hist_mass);
    free(ws);
}

void ls_workspace_set_threads(ls_workspace *ws, int32_t n_threads) {
    if (ws) ws->n_threads = n_threads < 1 ? 1 : n_threads;
}
