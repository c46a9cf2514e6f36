/* Verification walks of token trees: greedy / seeded Gumbel, and rejection sampling with
 * stochastic children (ratio test + residual) and deterministic children (point mass).
 * SGLang's LOSSY thresholded walk shares the rejection walk's sparse target distribution.
 * Reference: localspec/verify.py (verify_greedy, verify_rejection, threshold_walk, sample_from) and
 * localspec/sampler.py (Cursor: penalty window, per-position streams). */
#include "ls_internal.h"

/* ---- the penalty window of a walk (sampling.PenaltyWindow) ------------------------------ */

typedef struct {
    int32_t n_last;   /* penalty_last_n (-1 = everything) */
    int32_t *ring;    /* window tokens, oldest at head */
    int64_t head, len, cap;
    int32_t *keys;    /* open addressing: token -> count (count 0 = gone) */
    int32_t *cnts;
    int64_t mask;
    int64_t *ids;     /* distinct tokens with count > 0, for ls__adjust */
    int32_t *counts;
    int64_t n_ids;
} penalty_window;

static void pw_free(penalty_window *w) {
    free(w->ring);
    free(w->keys);
    free(w->cnts);
    free(w->ids);
    free(w->counts);
}

static void pw_add(penalty_window *w, int32_t t, int32_t delta) {
    uint64_t h = ls__mix64((uint64_t)(uint32_t)t + 0x51ED27u);
    int64_t i = (int64_t)(h & (uint64_t)w->mask);
    while (w->keys[i] != -1 && w->keys[i] != t) i = (i + 1) & w->mask;
    w->keys[i] = t;
    w->cnts[i] += delta;
}

static void pw_push(penalty_window *w, int32_t t) {
    if (w->n_last == 0) return;
    w->ring[(w->head + w->len) % w->cap] = t;
    w->len++;
    pw_add(w, t, 1);
    if (w->n_last > 0 && w->len > w->n_last) {
        pw_add(w, w->ring[w->head], -1);
        w->head = (w->head + 1) % w->cap;
        w->len--;
    }
}

static int pw_init(penalty_window *w, int32_t n_last, const int32_t *window, int64_t n_window, int64_t extra) {
    memset(w, 0, sizeof *w);
    w->n_last = n_last;
    w->cap = n_window + extra + 1;
    int64_t size = 16;
    while (size < 2 * w->cap) size *= 2;
    w->mask = size - 1;
    w->ring = (int32_t *)malloc((size_t)w->cap * sizeof(int32_t));
    w->keys = (int32_t *)malloc((size_t)size * sizeof(int32_t));
    w->cnts = (int32_t *)calloc((size_t)size, sizeof(int32_t));
    w->ids = (int64_t *)malloc((size_t)size * sizeof(int64_t));
    w->counts = (int32_t *)malloc((size_t)size * sizeof(int32_t));
    if (!w->ring || !w->keys || !w->cnts || !w->ids || !w->counts) {
        pw_free(w);
        return LS_ERR_NOMEM;
    }
    for (int64_t i = 0; i < size; i++) w->keys[i] = -1;
    for (int64_t i = 0; i < n_window; i++) pw_push(w, window[i]);
    return 0;
}

/* refresh w->ids / w->counts from the table */
static void pw_counts(penalty_window *w) {
    int64_t k = 0;
    for (int64_t i = 0; i <= w->mask; i++)
        if (w->keys[i] != -1 && w->cnts[i] > 0) {
            w->ids[k] = w->keys[i];
            w->counts[k] = w->cnts[i];
            k++;
        }
    w->n_ids = k;
}

/* ---- tree helpers --------------------------------------------------------------------------- */

typedef struct {
    int32_t *first, *next; /* children in index (insertion) order */
} children;

static int children_init(children *ch, const ls_tree *t) {
    int32_t n = t->n_nodes;
    ch->first = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    ch->next = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    int32_t *last = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    if (!ch->first || !ch->next || !last) {
        free(ch->first);
        free(ch->next);
        free(last);
        return LS_ERR_NOMEM;
    }
    for (int32_t i = 0; i < n; i++) ch->first[i] = ch->next[i] = last[i] = -1;
    int rc = t->parents[0] == -1 ? 0 : LS_ERR_BAD_TREE;
    for (int32_t i = 1; i < n && rc == 0; i++) {
        int32_t p = t->parents[i];
        if (p < 0 || p >= i) {
            rc = LS_ERR_BAD_TREE;
            break;
        }
        if (last[p] < 0)
            ch->first[p] = i;
        else
            ch->next[last[p]] = i;
        last[p] = i;
    }
    free(last);
    if (rc) {
        free(ch->first);
        free(ch->next);
    }
    return rc;
}

static void children_free(children *ch) {
    free(ch->first);
    free(ch->next);
}

static inline int is_stochastic(const ls_tree *t, int32_t node) { return !isnan(t->draft_probs[node]); }

static inline int is_sparse(const ls_tree *t, int32_t node) { return t->dist_ids && t->dist_ids[node]; }

static int64_t find_id(const int64_t *ids, int64_t m, int64_t token);

/* draft probability of token i under the distribution at node (dense or sparse) */
static inline double dist_at(const ls_tree *t, int32_t node, int64_t i) {
    const void *d = t->draft_dists[node];
    if (is_sparse(t, node)) {
        int64_t at = find_id(t->dist_ids[node], t->dist_len[node], i);
        return at >= 0 ? ((const double *)d)[at] : 0.0;
    }
    return t->dist_is_f64[node] ? ((const double *)d)[i] : (double)((const float *)d)[i];
}

/* index of token in the ascending ids[0..m), or -1 */
static int64_t find_id(const int64_t *ids, int64_t m, int64_t token) {
    int64_t lo = 0, hi = m;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (ids[mid] < token)
            lo = mid + 1;
        else
            hi = mid;
    }
    return (lo < m && ids[lo] == token) ? lo : -1;
}

/* ---- the walks -------------------------------------------------------------------------------- */

/* SGLang's thresholded walk at one node (verify.threshold_walk): children tried in order with
 * ONE coin, prob_acc = the target mass of the distinct tokens tried so far; returns the
 * accepted child or -1. res[0..m) (ascending ids) is then the distribution of the last token:
 * the target's with the tried children removed and renormalised (kept as it is when they held
 * all of its mass); tmp is scratch of m entries. */
static int32_t threshold_node(const ls_tree *tree, const children *ch, int32_t node, const int64_t *ids, double *res,
                              double *tmp, int64_t m, double coin, double t_single, double t_acc) {
    double prob_acc = 0.0;
    int any_tried = 0;
    for (int32_t c = ch->first[node]; c >= 0; c = ch->next[c]) {
        int32_t xt = tree->token_ids[c];
        int dup = 0;
        for (int32_t d = ch->first[node]; d != c; d = ch->next[d])
            if (tree->token_ids[d] == xt) {
                dup = 1;
                break;
            }
        if (dup) continue; /* a token already tried counts once */
        int64_t at = find_id(ids, m, xt);
        double p = at >= 0 ? res[at] : 0.0;
        prob_acc += p;
        if (p >= t_single || coin <= prob_acc / t_acc) return c;
        if (p > 0.0) {
            if (!any_tried) memcpy(tmp, res, (size_t)m * sizeof *tmp);
            any_tried = 1;
            tmp[at] = 0.0;
        }
    }
    if (any_tried) {
        double z = ls__sum(tmp, m);
        if (z > 0.0)
            for (int64_t j = 0; j < m; j++) res[j] = tmp[j] / z;
    }
    return -1;
}

/* Rejection sampling at one node (verify.verify_rejection: Leviathan et al. 2023, Chen et al.
 * 2023; multi-round over siblings as in SpecInfer, Miao et al. 2024): children tried in order,
 * child k with uniform k of the node's accept stream.
 * A deterministic child is accepted with its residual probability, else removed from the
 * residual; a sampled child (draft distribution q at the node) with min(1, res/q), else the
 * residual becomes max(res - q, 0) renormalised. Sets *accepted (or leaves it -1) and returns 0,
 * or an LS_ERR_* with *err_node the child at fault. res/ids/tmp as in threshold_node. */
static int rejection_node(const ls_tree *tree, const children *ch, int32_t node, const int64_t *ids, double *res,
                          double *tmp, int64_t m, uint64_t akey, int32_t *accepted, int32_t *err_node) {
    int32_t k = 0;
    for (int32_t c = ch->first[node]; c >= 0; c = ch->next[c], k++) {
        int32_t xt = tree->token_ids[c];
        double u = ls__uniform(akey, k);
        int64_t at = find_id(ids, m, xt);
        double r = at >= 0 ? res[at] : 0.0;
        if (is_stochastic(tree, c)) {
            if (!tree->draft_dists || !tree->draft_dists[node]) {
                *err_node = c;
                return LS_ERR_NO_DRAFT_DIST;
            }
            double qx = dist_at(tree, node, xt);
            if (qx <= 0.0) {
                *err_node = c;
                return LS_ERR_ZERO_DRAFT_PROB;
            }
            double ratio = r / qx;
            if (u < (ratio < 1.0 ? ratio : 1.0)) {
                *accepted = c;
                return 0;
            }
            if (is_sparse(tree, node)) { /* both supports ascending: one merge pass */
                const int64_t *qi = tree->dist_ids[node];
                const double *qv = (const double *)tree->draft_dists[node];
                int64_t nq = tree->dist_len[node], a = 0;
                for (int64_t j = 0; j < m; j++) {
                    while (a < nq && qi[a] < ids[j]) a++;
                    double q = (a < nq && qi[a] == ids[j]) ? qv[a] : 0.0;
                    double v = res[j] - q;
                    tmp[j] = v > 0.0 ? v : (v == v ? 0.0 : v);
                }
            } else {
                for (int64_t j = 0; j < m; j++) {
                    double v = res[j] - dist_at(tree, node, ids[j]);
                    tmp[j] = v > 0.0 ? v : (v == v ? 0.0 : v);
                }
            }
            double z = ls__sum(tmp, m);
            if (z > 0.0) { /* all-zero residual: draft == target, keep it */
                for (int64_t j = 0; j < m; j++) res[j] = tmp[j] / z;
            }
        } else {
            if (u < r) {
                *accepted = c;
                return 0;
            }
            if (at >= 0) res[at] = 0.0;
            double z = ls__sum(res, m);
            if (z > 0.0) {
                for (int64_t j = 0; j < m; j++) res[j] = res[j] / z;
            } else if (at >= 0) {
                res[at] = 1.0; /* the residual was a point mass on this token */
            }
        }
    }
    return 0;
}

static int32_t walk(const ls_tree *tree, const float *logits, int64_t stride, int64_t n_vocab, const ls_sampling *s,
                    int32_t mode, double t_single, double t_acc, int64_t pos, const int32_t *window, int64_t n_window,
                    ls_workspace *ws, int32_t *path_out, int32_t *tokens_out, int32_t *err_node) {
    *err_node = -1;
    if (!ws || ws->n_vocab < n_vocab || tree->n_nodes < 1 ||
        (mode != LS_VERIFY_GREEDY && mode != LS_VERIFY_REJECTION && mode != LS_VERIFY_THRESHOLD))
        return LS_ERR_ARG;
    children ch;
    int rc = children_init(&ch, tree);
    if (rc) return rc;
    penalty_window pw;
    int use_pen = s->has_penalties != 0;
    if (use_pen && (rc = pw_init(&pw, s->penalty_last_n, window, n_window, tree->n_nodes)) != 0) {
        children_free(&ch);
        return rc;
    }
    int rejection = mode != LS_VERIFY_GREEDY; /* rejection and threshold walks share the sparse residual */
    int32_t node = 0, n_path = 0;
    for (;;) {
        const float *row = logits + (int64_t)node * stride;
        if (use_pen) pw_counts(&pw);
        const float *x = ls__adjust(s, row, n_vocab, use_pen ? pw.ids : NULL, use_pen ? pw.counts : NULL,
                                    use_pen ? pw.n_ids : 0, ws);
        int32_t accepted = -1;
        int64_t token;
        if (!rejection) {
            token = ls__choose(s, x, n_vocab, pos, ws);
            if (token < 0) {
                rc = (int)token;
                *err_node = node;
                break;
            }
            for (int32_t c = ch.first[node]; c >= 0; c = ch.next[c])
                if (tree->token_ids[c] == token) {
                    accepted = c;
                    break;
                }
        } else {
            int64_t m = ls__candidates(s, x, n_vocab, ws);
            if (m < 0) {
                rc = (int)m;
                *err_node = node;
                break;
            }
            /* residual = target_probs, as a sparse vector with ascending ids */
            ls__candidate_probs(ws, m);
            int64_t *ids = ws->ids2;
            double *res = ws->vals, *tmp = ws->vals2;
            memcpy(ids, ws->ids, (size_t)m * sizeof *ids);
            ls__sort_ids(ids, res, m, ws->keys, ws->keys2, tmp);
            uint64_t akey = ls_stream_key(s->seed, pos, LS_STREAM_ACCEPT);
            if (mode == LS_VERIFY_THRESHOLD) {
                if (ch.first[node] >= 0)
                    accepted = threshold_node(tree, &ch, node, ids, res, tmp, m, ls__uniform(akey, 0), t_single, t_acc);
            } else {
                rc = rejection_node(tree, &ch, node, ids, res, tmp, m, akey, &accepted, err_node);
            }
            if (rc) break;
            token = accepted >= 0 ? tree->token_ids[accepted]
                                  : ls__sample_sparse(ids, res, m, ls__uniform(ls_stream_key(s->seed, pos, LS_STREAM_RESIDUAL), 0));
        }
        tokens_out[n_path] = (int32_t)token;
        if (accepted < 0) {
            rc = n_path;
            break;
        }
        path_out[n_path++] = accepted;
        if (use_pen) pw_push(&pw, (int32_t)token);
        pos++;
        node = accepted;
    }
    if (use_pen) pw_free(&pw);
    children_free(&ch);
    return rc;
}

int32_t ls_verify(const ls_tree *tree, const float *logits, int64_t stride, int64_t n_vocab, const ls_sampling *s,
                  int32_t mode, int64_t pos, const int32_t *window, int64_t n_window, ls_workspace *ws,
                  int32_t *path_out, int32_t *tokens_out, int32_t *err_node) {
    if (mode == LS_VERIFY_THRESHOLD) return LS_ERR_ARG; /* needs its thresholds: ls_verify_thresholds */
    return walk(tree, logits, stride, n_vocab, s, mode, 1.0, 1.0, pos, window, n_window, ws, path_out, tokens_out,
                err_node);
}

int32_t ls_verify_thresholds(const ls_tree *tree, const float *logits, int64_t stride, int64_t n_vocab,
                             const ls_sampling *s, double threshold_single, double threshold_acc, int64_t pos,
                             const int32_t *window, int64_t n_window, ls_workspace *ws, int32_t *path_out,
                             int32_t *tokens_out, int32_t *err_node) {
    *err_node = -1;
    if (!(threshold_single > 0.0 && threshold_single <= 1.0 && threshold_acc > 0.0 && threshold_acc <= 1.0))
        return LS_ERR_ARG;
    return walk(tree, logits, stride, n_vocab, s, LS_VERIFY_THRESHOLD, threshold_single, threshold_acc, pos, window,
                n_window, ws, path_out, tokens_out, err_node);
}
