/*
 * localspec_native.h -- localspec's own C kernels: sampling transforms over logits rows,
 * verification walks of token trees, and the incremental n-gram index.
 *
 * Plain C11. No Python API, no llama.cpp headers: everything works on float rows
 * ([n_vocab] float32 logits, row-major [n_rows, n_vocab] blocks) and int32 token arrays.
 * Loaded by localspec/native/ through ctypes; localspec's numpy code
 * (localspec/sampling.py, verify.py, drafters/ngram_index.py, drafters/ngram.py) is the
 * reference these kernels are tested against: same candidate sets and token choices,
 * probabilities equal to ~1e-12 (the tests ask for 1e-6).
 *
 * Conventions
 *   - "requires:" lists what the caller guarantees; "returns:" what comes back.
 *   - Errors are negative return values (LS_ERR_*); nothing is printed, nothing aborts.
 *   - Array arguments carry shape comments; every pointer is caller-owned unless a
 *     function says it allocates (then a matching *_free exists).
 *   - Random numbers are the counter-based streams of localspec.sampling: the uniform of
 *     stream key K at counter c is ((splitmix64(K + (c + 1) * golden) >> 11) + 0.5) / 2^53,
 *     bit-for-bit; Gumbel noise is -log(-log(u)) in double.
 *   - Results never depend on the number of threads (row reductions use a fixed chunking).
 */
#ifndef LOCALSPEC_NATIVE_H
#define LOCALSPEC_NATIVE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define LS_API __declspec(dllexport)
#elif defined(__GNUC__)
#define LS_API __attribute__((visibility("default")))
#else
#define LS_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define LS_ABI_VERSION 13

/* error codes (negative returns) */
#define LS_ERR_BANNED (-1)         /* every token is banned (-inf) by logit bias */
#define LS_ERR_NONE_ALLOWED (-2)   /* no finite logit at all (temperature without truncation) */
#define LS_ERR_ZERO_DRAFT_PROB (-3) /* a stochastic child has draft probability <= 0 */
#define LS_ERR_NO_DRAFT_DIST (-4)  /* a stochastic child's parent has no draft distribution */
#define LS_ERR_NOMEM (-5)
#define LS_ERR_BAD_TREE (-6)       /* parents[0] != -1 or parents[i] >= i */
#define LS_ERR_ARG (-7)            /* an argument is out of range */

/* stream domains (localspec.sampling.STREAM_*) */
#define LS_STREAM_GUMBEL 0
#define LS_STREAM_ACCEPT 1
#define LS_STREAM_RESIDUAL 2

/* verification modes */
#define LS_VERIFY_GREEDY 0    /* argmax (temperature 0) or seeded Gumbel-max walk */
#define LS_VERIFY_REJECTION 1 /* rejection sampling (ratio test / point mass, residuals) */
#define LS_VERIFY_THRESHOLD 2 /* LOSSY: SGLang's acceptance thresholds (ls_verify_thresholds only) */

/* ABI version (LS_ABI_VERSION) and whether the library was built with OpenMP (1/0). */
LS_API int32_t ls_abi_version(void);
LS_API int32_t ls_has_openmp(void);

/* ---- random streams ------------------------------------------------------------------ */

/* returns: key of the stream (seed, pos, stream) -- localspec.sampling.stream_key (used inside
 * ls_choose and ls_verify; exported for the test hooks below). */
LS_API uint64_t ls_stream_key(uint64_t seed, int64_t pos, int32_t stream);
/* Test hooks: the generators that ls_verify (uniforms) and ls_choose (Gumbel noise) draw
 * from inside C, exported so that tests/test_native.py checks them bit for bit against
 * localspec.sampling.uniforms / gumbel_noise. */
/* out[i] = uniform in (0, 1) of stream `key` at counters[i].   counters: [n] int64, out: [n] float64 */
LS_API void ls_uniforms(uint64_t key, const int64_t *counters, int64_t n, double *out);
/* out[i] = -log(-log(uniform(key, ids[i]))).   ids: [n] int64, out: [n] float64 */
LS_API void ls_gumbel_noise(uint64_t key, const int64_t *ids, int64_t n, double *out);

/* ---- sampling parameters and workspaces ----------------------------------------------- */

/* localspec.SamplingParams, plus the processor's logit bias (suppressed tokens included). */
typedef struct ls_sampling {
    double temperature;        /* 0 = greedy; the division uses (float)temperature; a row is
                                  also greedy when a biased logit is +inf (forced) or when
                                  max finite logit / (float)temperature is not finite */
    double top_p;              /* 1 = off */
    double min_p;              /* 0 = off */
    int32_t top_k;             /* 0 = off */
    int32_t penalty_last_n;    /* 0 = off, -1 = whole history */
    int32_t has_penalties;     /* SamplingParams.has_penalties */
    int32_t _pad;
    float repeat_penalty, frequency_penalty, presence_penalty, _padf;
    const int64_t *bias_ids;   /* [n_bias] distinct token ids */
    const float *bias_vals;    /* [n_bias] added to the logits (-inf bans) */
    int64_t n_bias;
    uint64_t seed;
} ls_sampling;

/* Scratch memory for one vocabulary size (a few bytes x n_vocab x 12). Not thread-safe:
 * one workspace per concurrent caller. n_threads <= 1 runs single-threaded; more threads
 * are used for whole-row passes where the library was built with OpenMP.
 * returns: a workspace, or NULL (out of memory / n_vocab < 1). */
typedef struct ls_workspace ls_workspace;
LS_API ls_workspace *ls_workspace_new(int64_t n_vocab, int32_t n_threads);
LS_API void ls_workspace_free(ls_workspace *ws);
LS_API void ls_workspace_set_threads(ls_workspace *ws, int32_t n_threads);

/* ---- per-row transforms ---------------------------------------------------------------- */

/* Test hook: the greedy pick of ls_choose and ls_verify (SIMD), exported so that
 * tests/test_native.py checks ties and tails against np.argmax.
 * returns: index of the first maximum of x[0..n) (np.argmax), -1 when n < 1. */
LS_API int64_t ls_argmax(const float *x, int64_t n);
/* returns: log(sum(exp(x))) in double over the finite entries (-inf when none). */
LS_API double ls_logsumexp(const float *x, int64_t n);
/* logsumexp of each of rows[0..n_rows) of the block (threads over rows).
 * logits: [*, n_vocab] float32 with row stride `stride` floats; rows: [n_rows]; out: [n_rows] */
LS_API void ls_rows_logsumexp(const float *logits, int64_t stride, int64_t n_vocab,
                              const int32_t *rows, int64_t n_rows, double *out, int32_t n_threads);

/* The top-k of a row: the k largest finite values of x (fewer when fewer are finite),
 * sorted by (x desc, id asc) -- drafters.tree_expand._top_k_children without the softmax.
 * requires: ids_out [min(k, n)] int64.
 * returns: the number of ids written (0 when no value is finite), or LS_ERR_ARG. */
LS_API int64_t ls_top_k(const float *x, int64_t n, int64_t k, ls_workspace *ws, int64_t *ids_out);

/* The processed distribution of one row: logit bias, penalties (pen_ids/pen_counts: the
 * penalty window's distinct tokens and counts), then top-k -> top-p -> min-p ->
 * temperature, exactly as LogitsProcessor.candidates without a grammar.
 * requires: row [n_vocab] float32; ids_out [n_vocab] int64; logits_out [n_vocab] float32.
 * returns: m >= 1 candidates in ids_out / logits_out (logits divided by the temperature;
 *   greedy: the argmax with logit 0), in the reference's order; or LS_ERR_BANNED /
 *   LS_ERR_NONE_ALLOWED. */
LS_API int64_t ls_candidates(const ls_sampling *s, const float *row, int64_t n_vocab,
                             const int64_t *pen_ids, const int32_t *pen_counts, int64_t n_pen,
                             ls_workspace *ws, int64_t *ids_out, float *logits_out);
/* The token at absolute position `pos`: greedy argmax, or the seeded Gumbel-max sample
 * argmax_i(logits_i / T + g(seed, pos, i)) over the candidates (LogitsProcessor.choose).
 * returns: a token id >= 0, or an LS_ERR_* code. */
LS_API int64_t ls_choose(const ls_sampling *s, const float *row, int64_t n_vocab,
                         const int64_t *pen_ids, const int32_t *pen_counts, int64_t n_pen,
                         int64_t pos, ls_workspace *ws);
/* Test hook: the residual draw of ls_verify's rejection sampling (ls__sample_sparse over a
 * dense row), exported so that tests/test_native.py checks it against verify.sample_from.
 * Inverse-CDF draw from probs: the first i with cumsum(probs)[i] > u * sum(probs), stepping
 * back over zero-probability entries.  probs: [n] float64.  returns: -1 when n < 1. */
LS_API int64_t ls_sample_from(const double *probs, int64_t n, double u);

/* ---- verification of token trees ------------------------------------------------------ */

/* A token tree in topological order (localspec.tree.TokenTree). */
typedef struct ls_tree {
    int32_t n_nodes;
    int32_t _pad;
    const int32_t *token_ids;   /* [n_nodes]; token_ids[0] is the root */
    const int32_t *parents;     /* [n_nodes]; parents[0] = -1, parents[i] < i */
    const float *draft_probs;   /* [n_nodes]; NaN = deterministic child (point mass) */
    const void *const *draft_dists; /* [n_nodes]: node -> [n_vocab] draft distribution its
                                       stochastic children were drawn from, or NULL (the
                                       whole table may be NULL: no distributions) */
    const int8_t *dist_is_f64;  /* [n_nodes]: 1 = that distribution is float64, 0 = float32 */
    const int64_t *const *dist_ids; /* [n_nodes] or NULL: node -> ascending token ids of a
                                       *sparse* distribution (then draft_dists[node] holds
                                       dist_len[node] float64 probabilities of those ids and
                                       every other token has probability 0), or NULL (dense) */
    const int64_t *dist_len;    /* [n_nodes]: entries of each sparse distribution */
} ls_tree;

/* Walk `tree` as localspec.verify does (mode LS_VERIFY_GREEDY: verify_greedy, the argmax /
 * seeded Gumbel walk; LS_VERIFY_REJECTION: verify_rejection), using the per-position
 * streams of s->seed starting at absolute position `pos` (the root's successor).
 * requires: logits row i (stride `stride` floats, n_vocab wide) = logits after node i;
 *   window [n_window] = the penalty window before `pos` (oldest first, at most
 *   penalty_last_n tokens unless that is -1); path_out [n_nodes]; tokens_out [n_nodes + 1].
 * returns: accept_length (>= 0): path_out[0..len) = accepted nodes top-down,
 *   tokens_out[0..len] = accepted tokens then the recovered/bonus token; or an LS_ERR_*
 *   code with *err_node = the node concerned. */
LS_API int32_t ls_verify(const ls_tree *tree, const float *logits, int64_t stride, int64_t n_vocab,
                         const ls_sampling *s, int32_t mode, int64_t pos,
                         const int32_t *window, int64_t n_window, ls_workspace *ws,
                         int32_t *path_out, int32_t *tokens_out, int32_t *err_node);

/* LOSSY below 1.0: SGLang's thresholded walk (verify.threshold_walk + verify_thresholds): at a
 * node ONE coin uniform(stream ACCEPT of its position, 0); child k (a token already tried at the
 * node is skipped) is accepted when target_prob(k) >= threshold_single or coin <= prob_acc /
 * threshold_acc, prob_acc being the target mass of the tokens tried so far (k included). With
 * none accepted the last token is an inverse-CDF draw (stream RESIDUAL, 0) from the target with
 * the tried children removed and renormalised; a childless node draws from the target. Draft
 * probabilities are not read. Arguments and returns as ls_verify; LS_ERR_ARG unless both
 * thresholds are in (0, 1]. */
LS_API int32_t ls_verify_thresholds(const ls_tree *tree, const float *logits, int64_t stride, int64_t n_vocab,
                                    const ls_sampling *s, double threshold_single, double threshold_acc,
                                    int64_t pos, const int32_t *window, int64_t n_window, ls_workspace *ws,
                                    int32_t *path_out, int32_t *tokens_out, int32_t *err_node);

/* ---- n-gram index ----------------------------------------------------------------------- */

/* n-gram -> end positions of its occurrences, for n in [1, max_n], over a token history.
 * append: O(max_n^2) per token (amortised: the table grows by doubling); truncate:
 * O(max_n^2) per removed token; lookups read at most max_occurrences entries per order,
 * whatever the history length. Same answers as drafters.ngram_index.NgramIndex. */
typedef struct ls_ngram ls_ngram;
/* returns: a new empty index, or NULL (max_n < 1 or out of memory) */
LS_API ls_ngram *ls_ngram_new(int32_t max_n);
LS_API void ls_ngram_free(ls_ngram *ix);
LS_API int64_t ls_ngram_len(const ls_ngram *ix);
/* returns: 0, or LS_ERR_NOMEM (the index is unchanged) */
LS_API int32_t ls_ngram_extend(ls_ngram *ix, const int32_t *tokens, int64_t n);
/* forget every token from `length` on (no-op when length >= len) */
LS_API void ls_ngram_truncate(ls_ngram *ix, int64_t length);
/* copies tokens[start, start + n) of the history to out; returns how many were copied */
LS_API int64_t ls_ngram_tokens(const ls_ngram *ix, int64_t start, int64_t n, int32_t *out);
/* Matches of the history's suffix for every order from min(max_n, len - 1) down to min_n
 * that occurred before (NgramIndex.lookup_all); first_only stops at the longest.
 * requires: orders_out [max_n], counts_out [max_n], starts_out [max_n * max_occurrences]
 * returns: number of matches k; match j has order orders_out[j] and counts_out[j] starts
 *   (continuation positions, most recent first) at starts_out[j * max_occurrences]. */
LS_API int32_t ls_ngram_lookup(const ls_ngram *ix, int32_t min_n, int32_t max_occurrences, int32_t first_only,
                               int32_t *orders_out, int32_t *counts_out, int64_t *starts_out);

/* The n-gram drafter's trie of continuations (drafters.ngram.NgramDrafter.propose):
 * occurrences of the longest matching suffixes (deduplicated, at most max_occurrences),
 * each continued for depth_by_match[its match length] tokens, merged into a trie of at most
 * node_cap nodes whose nodes carry the longest match length and the number of occurrences
 * through them (support); each node gets its acceptance bucket (match-length bucket x rank
 * among siblings) and score = parent score * estimates[bucket]. */
typedef struct ls_draft_params {
    int32_t min_n, max_n;        /* drafter's orders (match lengths are measured at max_n) */
    int32_t max_occurrences, depth_cap;
    int32_t node_cap;            /* most nodes, root included */
    int32_t max_match;           /* cap of the measured match length */
    int32_t n_len_edges;         /* lower edges of the match-length buckets (ascending) */
    int32_t n_rank;              /* rank buckets per length bucket (4) */
    int32_t n_depth_by_match;
    int32_t _pad;
    const int32_t *len_edges;    /* [n_len_edges] */
    const int32_t *depth_by_match; /* [n_depth_by_match]: continuation length of an occurrence
                                      with match length m: [min(m, n - 1)] (<= depth_cap) */
    const double *estimates;     /* [n_len_edges * n_rank] acceptance estimate per bucket */
} ls_draft_params;

/* requires: every *_out array holds cap >= min(node_cap, 1 + max_occurrences * depth_cap)
 *   entries.
 * returns: the number of nodes (>= 1; the root is the last history token), 0 when the
 *   history is empty, or an LS_ERR_* code. */
LS_API int32_t ls_ngram_draft(const ls_ngram *ix, const ls_draft_params *p, int32_t cap,
                              int32_t *token_ids_out, int32_t *parents_out, int32_t *depth_out,
                              double *score_out, int32_t *bucket_out, int32_t *match_len_out,
                              int32_t *support_out);

/* ---- drafting memory (ls_memory.c) ------------------------------------------------------- */

/* A bounded store of token sequences (documents) shared by requests: a ring of `cap`
 * tokens (the oldest unread ones evicted first; runs a draft read are written again, see
 * ls_memory.c) indexed by n-grams of orders [min_n, max_n] like
 * ls_ngram. Writes cost O(max_n^2) per token; a draft reads at most max_occurrences
 * occurrences, whatever is stored. Not thread-safe (the caller locks). */
typedef struct ls_memory ls_memory;
/* bytes allocated by a memory of `cap` tokens and n_orders orders */
LS_API int64_t ls_memory_bytes(int64_t cap, int32_t n_orders);
/* returns: a new empty memory, or NULL (cap < 16 or > 2^31, orders out of [1, 32], no memory) */
LS_API ls_memory *ls_memory_new(int64_t cap, int32_t min_n, int32_t max_n);
LS_API void ls_memory_free(ls_memory *m);
/* out[6]: tokens ever written (separators included), first stored position, capacity,
 * table entries, table slots, bytes allocated */
LS_API void ls_memory_stats(const ls_memory *m, int64_t *out);
/* appends one document (tokens >= 0; separators are added around it).
 * returns: 0, or LS_ERR_ARG (a negative token; nothing written) */
LS_API int32_t ls_memory_write(ls_memory *m, const int32_t *tokens, int64_t n);
/* copies stored positions [start, start + n) (clipped to what is stored; -1 = separator);
 * returns how many were copied */
LS_API int64_t ls_memory_tokens(const ls_memory *m, int64_t start, int64_t n, int32_t *out);
/* Merges the memory's continuations of `query` (the request's history; its last token is
 * the root of the tree) into a given tree of n_in nodes (topological order; node 0 = root):
 * the occurrences (at most p->max_occurrences, most recent first) of the longest suffix of
 * the query of order >= the memory's min_n that is stored, each continued for
 * p->depth_by_match[its match length] tokens, are merged into a trie counting the
 * occurrences through each node; a node whose count is below min_share of its parent's is
 * dropped with its subtree. Each kept node gets bucket = bucket_offset + (match-length
 * bucket) * 5 + share rank (0: share >= 0.8 and >= 3 occurrences, 1: ... 2 occurrences,
 * 2: one occurrence, 3: share in [0.4, 0.8), 4: below 0.4), score = parent's score *
 * p->estimates[bucket - bucket_offset], and is merged with a sibling of the same token (the
 * larger score and its bucket win) or appended (at most p->node_cap nodes in all).
 * p->min_n, p->max_n are not used (the memory's orders apply); p->n_rank must be 5.
 * requires: every *_out array holds cap >= n_in entries; info_out[3].
 * Raises the read count of the stored tokens each occurrence gave the tree (eviction keeps them).
 * returns: the new number of nodes (>= n_in), or LS_ERR_ARG / LS_ERR_NOMEM / LS_ERR_BAD_TREE;
 *   info_out = (order matched, occurrences read, nodes added). */
LS_API int32_t ls_memory_draft(ls_memory *m, const int32_t *query, int64_t n_query, const ls_draft_params *p,
                               double min_share, int32_t bucket_offset, int32_t n_in, int32_t cap,
                               int32_t *token_ids, int32_t *parents, int32_t *depth, double *score,
                               int32_t *bucket, int32_t *info_out);

/* ---- dense heads (ls_matvec.c) --------------------------------------------------------- */

/* Y = X @ wt: X [nr, n], Y [nr, m] row-major float32, wt [n, m] row-major (the transposed
 * weight W^T of y = W x); the matrix is read once per 8 rows (every drafting request's row of a
 * Medusa head). Each Y[r, i] sums over j = 0 .. n-1 in order: a row's result does not depend
 * on the other rows or on n_threads (which split the columns).
 * returns: 0, or LS_ERR_ARG. */
LS_API int32_t ls_gemm_t(const float *wt, int64_t n, int64_t m, const float *x, int64_t nr, float *y,
                         int32_t n_threads);

/* ---- the EAGLE-3 head on the host (ls_head.c) ------------------------------------------ */

/* Quantise float32 rows the way ggml's CPU backend does for a Q8_0 product: per block of 32
 * values d = amax / 127 rounded to float16, q = round-to-nearest-even(x * 127 / amax).
 * x [nr, k]; q [nr, k] int8; d [nr, k / 32] float32. returns: 0, or LS_ERR_ARG (k % 32). */
LS_API int32_t ls_q8_quantize_rows(const float *x, int64_t nr, int64_t k, int8_t *q, float *d);

/* Y = X W^T with W in Q8_0: w [m, k] int8 (row i = output i), wd [m, k / 32] float32 block
 * scales, x [nr, k] float32 (quantised inside, ls_q8_quantize_rows), y [nr, m] float32. Each
 * matrix row is read once for all nr rows; threads split the output columns and never change
 * a result. returns: 0, LS_ERR_ARG or LS_ERR_NOMEM. */
LS_API int32_t ls_gemm_q8(const int8_t *w, const float *wd, int64_t m, int64_t k, const float *x, int64_t nr,
                          float *y, int32_t n_threads);

/* The first m / 4 * 4 rows of a Q8_0 matrix (ls_gemm_q8's w, wd) again, four rows side by side,
 * so that a product over four rows at once reads memory in order: for group g (rows 4g..4g+3)
 * w4[g] = for each block pair p: the 64 bytes of pair p of rows 4g..4g+3, then an odd last
 * block of the four rows (32 bytes each); d4[g] = for each pair: 2 scales of each row, then
 * the odd block's scale of each row. w4 [m / 4, 4 k] int8, d4 [m / 4, 4 k / 32] float32.
 * returns: 0, or LS_ERR_ARG. */
LS_API int32_t ls_q8_pack4(const int8_t *w, const float *wd, int64_t m, int64_t k, int8_t *w4, float *d4);

/* Softmax attention of n entries, each over its own keys: q [n, n_head * head_dim] (roped),
 * kpool / vpool [*, n_head_kv * head_dim] float32, the keys of entry e are rows
 * key_idx[key_off[e] .. key_off[e + 1]) (key_off[0] = 0; at least one each); query head h reads
 * kv head h / (n_head / n_head_kv). out [n, n_head * head_dim] = softmax(scale q k^T) v.
 * Threads split keys, (entry, head) pairs and head slices and never change a result.
 * returns: 0, LS_ERR_ARG or LS_ERR_NOMEM. */
LS_API int32_t ls_head_attn(const float *q, int64_t n, int32_t n_head, int32_t n_head_kv, int32_t head_dim,
                            const float *kpool, const float *vpool, const int64_t *key_off, const int64_t *key_idx,
                            float scale, float *out, int32_t n_threads);

/* out = x / sqrt(mean(x^2) + eps) * w per row (ggml_rms_norm times w; the sum in double).
 * x, out [nr, k] (may alias). returns: 0, or LS_ERR_ARG. */
LS_API int32_t ls_rms_norm_rows(const float *x, int64_t nr, int64_t k, const float *w, float eps, float *out);

/* RoPE NORM in place (llama.cpp mode 0: adjacent pairs (2i, 2i + 1) of the first n_rot dims of
 * every head rotated by pos[r] * inv_freq[i]): x [nr, n_heads * head_dim], pos [nr],
 * inv_freq [n_rot / 2] float64. returns: 0, or LS_ERR_ARG. */
LS_API int32_t ls_rope_norm(float *x, int64_t nr, int32_t n_heads, int32_t head_dim, int32_t n_rot, const int64_t *pos,
                            const double *inv_freq);

/* out[r] = silu(gu[r, :n_ff]) * gu[r, n_ff:] (a stacked gate / up product): gu [nr, 2 n_ff],
 * out [nr, n_ff]. returns: 0, or LS_ERR_ARG. */
LS_API int32_t ls_swiglu_rows(const float *gu, int64_t nr, int64_t n_ff, float *out);

/* Y = X W^T with W [m, k] in 16-bit floats (bf16 = 0: IEEE float16, 1: bfloat16), x [nr, k]
 * and y [nr, m] float32; products and sums in float32. Each matrix row is read once for all
 * nr rows; threads split the output columns and never change a result.
 * returns: 0, or LS_ERR_ARG. */
LS_API int32_t ls_gemm_h16(const uint16_t *w, int32_t bf16, int64_t m, int64_t k, const float *x, int64_t nr, float *y,
                           int32_t n_threads);

/* A weight matrix of the head, y = x W^T for W [m, k]: kind LS_MAT_Q8 (w int8 [m, k], d [m, k / 32]
 * float32 block scales: ls_gemm_q8), LS_MAT_F32T (w float32 [k, m], transposed: ls_gemm_t),
 * LS_MAT_F16 / LS_MAT_BF16 (w uint16 [m, k]: ls_gemm_h16, then y times out_scale: a float16
 * matrix may hold W times a power of two, so that small weights stay out of float16's
 * subnormal range; out_scale is its inverse, 1 otherwise; ignored by the other kinds). */
enum { LS_MAT_Q8 = 0, LS_MAT_F32T = 1, LS_MAT_F16 = 2, LS_MAT_BF16 = 3 };
typedef struct {
    int32_t kind;
    float out_scale;
    int64_t m, k;
    const void *w;
    const void *d;
    const void *w4, *d4; /* LS_MAT_Q8: its rows packed by ls_q8_pack4 (read where the CPU has
                          * AVX-512 VNNI or AVX2), or NULL */
} ls_mat_t;

/* y [nr, m] = x [nr, k] W^T for any kind above. returns: 0, LS_ERR_ARG or LS_ERR_NOMEM. */
LS_API int32_t ls_mat_apply(const ls_mat_t *a, const float *x, int64_t nr, float *y, int32_t n_threads);

/* An EAGLE-3 head's decoder layer (llama.cpp's eagle3 graph, one layer): sizes, RoPE NORM
 * (rope_inv [n_rot / 2] float64: the angle per position of each pair), the four norms' weights
 * [n_embd] float32, and its matrices: wq [H hd, 2 e], kv [2 Hkv hd, 2 e] (K rows then V rows),
 * wo [e, H hd], gate_up [2 n_ff, e] (gate rows then up rows), down [e, n_ff], output [n_draft, e]. */
typedef struct {
    int32_t n_embd, n_head, n_head_kv, head_dim, n_rot, n_ff, norm_before_residual, pad;
    float eps, pad2;
    const double *rope_inv;
    const float *attn_norm, *hidden_norm, *ffn_norm, *output_norm;
    ls_mat_t wq, kv, wo, gate_up, down, output;
} ls_head_t;

/* One level of the head for n entries (every drafting request's, concatenated):
 *   x = [rmsnorm(e) attn_norm ; rmsnorm(g) hidden_norm]                       [n, 2 e]
 *   k = bf16(RoPE(x Wk^T)), v = f16(x Wv^T) for every entry -> k_out, v_out     [n, Hkv hd]
 *   for the n_out output entries out_rows[o]: q = bf16(RoPE(x Wq^T)), attention over
 *   key_idx[key_off[o] .. key_off[o + 1]) (j < n_ctx: row j of ctx_k / ctx_v, else entry
 *   j - n_ctx of this call), r = a Wo^T + g (or + rmsnorm(g) hidden_norm with
 *   norm_before_residual), h = r + Wdown(silu(Wgate m) * Wup m), m = rmsnorm(r) ffn_norm -> h_out
 *   [n_out, e]; rows_out [n_out, n_draft] = rmsnorm(h) output_norm Wout^T.
 * e, g [n, e] float32; pos [n] int64; ctx_k, ctx_v [n_ctx, Hkv hd] float32 (NULL when n_ctx = 0).
 * returns: 0, LS_ERR_ARG (sizes that do not match, indices out of range, an entry without
 * keys) or LS_ERR_NOMEM. */
LS_API int32_t ls_head_level(const ls_head_t *hd, int64_t n, const float *e, const float *g, const int64_t *pos,
                             const float *ctx_k, const float *ctx_v, int64_t n_ctx, int64_t n_out,
                             const int64_t *out_rows, const int64_t *key_off, const int64_t *key_idx, float *k_out,
                             float *v_out, float *h_out, float *rows_out, int32_t n_threads);

/* ---- graph taps (ls_tap.c) ------------------------------------------------------------ */

/* A ggml_backend_sched_eval_callback (llama.cpp's cb_eval) that copies the rows of named
 * float32 graph tensors during decodes, in C: backend.features.FeatureTap / FinalNormTap
 * without a Python call per graph node. The layout of struct ggml_tensor is given by the
 * caller (byte offsets of `type`, `ne` and `name`), and so is ggml_backend_tensor_get (the
 * copy works for any backend's buffer), so this library does not link ggml.
 * The callback answers ask = true with "observe" only for the named tensors; on observe it
 * appends the tensor's ne[1] rows of ne[0] == width floats to that name's buffer (a decode
 * split into micro-batches appends once per split, in order). It only reads: the decode
 * computes the same numbers as without it. A tensor of another type or width, or memory
 * exhausted, sets the tap's error (ls_tap_error) and is skipped; the decode goes on. */
typedef void (*ls_tensor_get_fn)(const void *tensor, void *data, size_t offset, size_t size);
typedef struct ls_tap ls_tap;
/* names: n_names NUL-terminated names (< 64 bytes each, n_names <= 8); width: floats per row.
 * returns: a new tap, or NULL (bad arguments or out of memory) */
LS_API ls_tap *ls_tap_new(int32_t n_names, const char *const *names, int64_t width, int64_t off_type,
                          int64_t off_ne, int64_t off_name, ls_tensor_get_fn get);
LS_API void ls_tap_free(ls_tap *tap);
/* the callback; user_data is the ls_tap * */
LS_API bool ls_tap_eval(void *tensor, bool ask, void *user_data);
/* rows captured for name i since the last clear, and their address ([rows, width] float32) */
LS_API int64_t ls_tap_rows(const ls_tap *tap, int32_t i);
LS_API const float *ls_tap_data(const ls_tap *tap, int32_t i);
/* 0, LS_ERR_ARG (a tensor of another type or width) or LS_ERR_NOMEM, since the last clear */
LS_API int32_t ls_tap_error(const ls_tap *tap);
/* forget the rows and the error (the buffers are kept) */
LS_API void ls_tap_clear(ls_tap *tap);
/* graph nodes the callback was asked about, and tensors it copied, since ls_tap_new */
LS_API int64_t ls_tap_n_asked(const ls_tap *tap);
LS_API int64_t ls_tap_n_copied(const ls_tap *tap);
/* paused != 0: the callback answers no to every node (nothing copied, and the scheduler runs
 * the graph without the splits the observed nodes cost) until it is set to 0 again */
LS_API void ls_tap_set_paused(ls_tap *tap, int32_t paused);
/* The stop node: name i (-1: none). stopping mode 0: name i is not observed at all; 1: its
 * rows are copied; 2: its rows are copied and then the callback answers false, so ggml's
 * scheduler skips the rest of that graph split (for llama.cpp: the lm_head after
 * ``result_norm``; ggml-backend.cpp, ggml_backend_sched_compute_splits). */
LS_API void ls_tap_set_stop(ls_tap *tap, int32_t i);
LS_API void ls_tap_set_stopping(ls_tap *tap, int32_t mode);
/* Record src[0] and src[1] (struct ggml_tensor *, at byte offset off_src of the struct) of the
 * node called `name` whenever the callback is asked about it (the lm_head weight is src[0] of
 * llama.cpp's ``result_output``); ls_tap_watched_src(tap, j) reads them (NULL: not seen). */
LS_API int32_t ls_tap_watch(ls_tap *tap, const char *name, int64_t off_src);
LS_API const void *ls_tap_watched_src(const ls_tap *tap, int32_t j);
/* Chain another eval callback (NULL: none): it is asked about every node too and observes
 * exactly the nodes it asked to observe (before this tap copies them), as if it were the
 * context's only callback; its false answer is passed on. */
typedef bool (*ls_eval_fn)(void *tensor, bool ask, void *user_data);
LS_API void ls_tap_set_next(ls_tap *tap, ls_eval_fn next, void *next_ud);

/* ---- the lm_head readout (ls_readout.c) ---------------------------------------------- */

/* ggml's CPU type traits, passed in by the caller (this library does not link ggml):
 * from_float quantizes a float row to the weight's vec_dot type, vec_dot is ggml's dot product
 * of one weight row with one quantized row (ggml_vec_dot_t with nrc = 1). */
typedef void (*ls_from_float_fn)(const float *x, void *y, int64_t k);
typedef void (*ls_vec_dot_fn)(int n, float *s, size_t bs, const void *x, size_t bx, const void *y, size_t by, int nrc);
/* logits[r, v] = vec_dot(w row v, from_float(h row r)) for r < nr, v < n_vocab: what ggml's
 * CPU mul_mat computes for a quantized lm_head on its vec_dot path, bit for bit, with the
 * weight matrix read once for all rows.
 * kernel 0: ggml's own vec_dot per (weight row, row) (the same functions on the same bytes);
 * kernel 1: Q8_0 weights on x86 with AVX2/FMA/F16C only: ggml_vec_dot_q8_0_q8_0's AVX2 path
 * written out for 4 rows per weight block (the same operations in the same order; the caller
 * checks it against ggml's before use);
 * kernel 2: the same lanes as kernel 1 with AVX-512 (F/BW/DQ/VL) and VNNI, two rows per 512-bit
 * register: each lane's integer dot product formed by VPDPBUSD on the weight bytes offset by
 * 128 and corrected by -128 * the activation bytes' sum (exact), then the same conversion,
 * scale product, fused multiply-add and horizontal sum per row (checked the same way).
 * w: [n_vocab] rows of row_bytes; h: [nr, n_embd] float32; q_row_bytes: bytes of one row of
 * n_embd in the vec_dot type; logits: [nr, n_vocab] float32.
 * returns: 0, LS_ERR_ARG (also: kernel 1 or 2 unavailable here) or LS_ERR_NOMEM */
LS_API int32_t ls_lm_head(const void *w, int64_t n_vocab, int64_t row_bytes, int64_t n_embd, const float *h, int64_t nr,
                          ls_from_float_fn from_float, int64_t q_row_bytes, ls_vec_dot_fn vec_dot, float *logits,
                          int32_t n_threads, int32_t kernel);
/* 1 when kernel `kernel` (0, 1, 2) of ls_lm_head can run on this CPU, else 0 */
LS_API int32_t ls_lm_head_kernel_available(int32_t kernel);

#ifdef __cplusplus
}
#endif
#endif /* LOCALSPEC_NATIVE_H */
