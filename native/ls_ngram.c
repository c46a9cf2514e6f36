/* Incremental n-gram index over a token history and the n-gram drafter's trie of
 * continuations. Reference: localspec/drafters/ngram_index.py (NgramIndex) and
 * localspec/drafters/ngram.py (NgramDrafter.propose).
 *
 * For every end position p (1-based: the n-gram is tokens[p - n, p)) and order n the index
 * keeps prev[p][n], the end position of the previous occurrence of the same n-gram (0 =
 * none), and a hash table maps each distinct n-gram to its most recent end position. The
 * occurrences of the history's suffix of order n, most recent first, are then the chain
 * prev[len][n], prev[prev[len][n]][n], ...: a lookup costs O(occurrences read), whatever
 * the history length. */
#include "ls_internal.h"

struct ls_ngram {
    int32_t max_n;
    int32_t *tok;   /* [cap] */
    int32_t *prev;  /* [cap * max_n]: prev[(p - 1) * max_n + (n - 1)] */
    int64_t len, cap;
    /* hash table, linear probing; slot_end 0 = empty */
    int32_t *slot_end;
    int32_t *slot_order;
    uint64_t *slot_hash;
    int64_t n_slots, n_used;
};

/* hashes of the n-grams ending at p for n = 1..nmax (h[n - 1]) */
static void ngram_hashes(const ls_ngram *ix, int64_t p, int32_t nmax, uint64_t *h) {
    uint64_t acc = 0x2545F4914F6CDD1DULL;
    for (int32_t n = 1; n <= nmax; n++) {
        acc = ls__mix64(acc + (uint64_t)(uint32_t)ix->tok[p - n] * LS_GOLDEN + (uint64_t)n);
        h[n - 1] = acc;
    }
}

static int64_t find_slot(const ls_ngram *ix, int64_t p, int32_t n, uint64_t h, int *found) {
    int64_t mask = ix->n_slots - 1;
    int64_t i = (int64_t)(h & (uint64_t)mask);
    while (ix->slot_end[i] != 0) {
        if (ix->slot_hash[i] == h && ix->slot_order[i] == n) {
            int64_t e = ix->slot_end[i];
            if (memcmp(ix->tok + e - n, ix->tok + p - n, (size_t)n * sizeof(int32_t)) == 0) {
                *found = 1;
                return i;
            }
        }
        i = (i + 1) & mask;
    }
    *found = 0;
    return i;
}

static int grow_table(ls_ngram *ix, int64_t n_slots) {
    int32_t *end = (int32_t *)calloc((size_t)n_slots, sizeof(int32_t));
    int32_t *order = (int32_t *)malloc((size_t)n_slots * sizeof(int32_t));
    uint64_t *hash = (uint64_t *)malloc((size_t)n_slots * sizeof(uint64_t));
    if (!end || !order || !hash) {
        free(end);
        free(order);
        free(hash);
        return LS_ERR_NOMEM;
    }
    int64_t mask = n_slots - 1;
    for (int64_t i = 0; i < ix->n_slots; i++) {
        if (ix->slot_end[i] == 0) continue;
        int64_t j = (int64_t)(ix->slot_hash[i] & (uint64_t)mask);
        while (end[j] != 0) j = (j + 1) & mask;
        end[j] = ix->slot_end[i];
        order[j] = ix->slot_order[i];
        hash[j] = ix->slot_hash[i];
    }
    free(ix->slot_end);
    free(ix->slot_order);
    free(ix->slot_hash);
    ix->slot_end = end;
    ix->slot_order = order;
    ix->slot_hash = hash;
    ix->n_slots = n_slots;
    return 0;
}

/* backward-shift deletion (linear probing) */
static void delete_slot(ls_ngram *ix, int64_t i) {
    int64_t mask = ix->n_slots - 1;
    int64_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (ix->slot_end[j] == 0) break;
        int64_t k = (int64_t)(ix->slot_hash[j] & (uint64_t)mask);
        /* move j to i unless its home k lies cyclically in (i, j] */
        int in_range = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!in_range) {
            ix->slot_end[i] = ix->slot_end[j];
            ix->slot_order[i] = ix->slot_order[j];
            ix->slot_hash[i] = ix->slot_hash[j];
            i = j;
        }
    }
    ix->slot_end[i] = 0;
    ix->n_used--;
}

ls_ngram *ls_ngram_new(int32_t max_n) {
    if (max_n < 1 || max_n > 64) return NULL;
    ls_ngram *ix = (ls_ngram *)calloc(1, sizeof *ix);
    if (!ix) return NULL;
    ix->max_n = max_n;
    if (grow_table(ix, 1024) != 0) {
        free(ix);
        return NULL;
    }
    return ix;
}

void ls_ngram_free(ls_ngram *ix) {
    if (!ix) return;
    free(ix->tok);
    free(ix->prev);
    free(ix->slot_end);
    free(ix->slot_order);
    free(ix->slot_hash);
    free(ix);
}

int64_t ls_ngram_len(const ls_ngram *ix) { return ix->len; }

/* room for `more` tokens (and their table entries) before anything changes */
static int reserve(ls_ngram *ix, int64_t more) {
    int64_t need = ix->len + more;
    if (need > 0x7FFFFFFE) return LS_ERR_NOMEM;
    if (need > ix->cap) {
        int64_t cap = ix->cap ? ix->cap : 1024;
        while (cap < need) cap *= 2;
        int32_t *tok = (int32_t *)realloc(ix->tok, (size_t)cap * sizeof(int32_t));
        if (!tok) return LS_ERR_NOMEM;
        ix->tok = tok;
        int32_t *prev = (int32_t *)realloc(ix->prev, (size_t)cap * (size_t)ix->max_n * sizeof(int32_t));
        if (!prev) return LS_ERR_NOMEM;
        ix->prev = prev;
        ix->cap = cap;
    }
    int64_t slots = ix->n_slots;
    while (2 * (ix->n_used + more * ix->max_n) > slots) slots *= 2;
    if (slots != ix->n_slots) return grow_table(ix, slots);
    return 0;
}

int32_t ls_ngram_extend(ls_ngram *ix, const int32_t *tokens, int64_t n) {
    int rc = reserve(ix, n);
    if (rc) return rc;
    uint64_t h[64];
    for (int64_t t = 0; t < n; t++) {
        ix->tok[ix->len++] = tokens[t];
        int64_t p = ix->len;
        int32_t nmax = p < ix->max_n ? (int32_t)p : ix->max_n;
        ngram_hashes(ix, p, nmax, h);
        int32_t *pv = ix->prev + (p - 1) * ix->max_n;
        for (int32_t o = 1; o <= nmax; o++) {
            int found;
            int64_t i = find_slot(ix, p, o, h[o - 1], &found);
            if (found) {
                pv[o - 1] = ix->slot_end[i];
            } else {
                pv[o - 1] = 0;
                ix->slot_order[i] = o;
                ix->slot_hash[i] = h[o - 1];
                ix->n_used++;
            }
            ix->slot_end[i] = (int32_t)p;
        }
    }
    return 0;
}

void ls_ngram_truncate(ls_ngram *ix, int64_t length) {
    if (length < 0) length = 0;
    uint64_t h[64];
    while (ix->len > length) {
        int64_t p = ix->len;
        int32_t nmax = p < ix->max_n ? (int32_t)p : ix->max_n;
        ngram_hashes(ix, p, nmax, h);
        const int32_t *pv = ix->prev + (p - 1) * ix->max_n;
        for (int32_t o = 1; o <= nmax; o++) {
            int found;
            int64_t i = find_slot(ix, p, o, h[o - 1], &found);
            if (!found) continue; /* cannot happen: p is the n-gram's latest occurrence */
            if (pv[o - 1])
                ix->slot_end[i] = pv[o - 1];
            else
                delete_slot(ix, i);
        }
        ix->len--;
    }
}

int64_t ls_ngram_tokens(const ls_ngram *ix, int64_t start, int64_t n, int32_t *out) {
    if (start < 0) start = 0;
    if (start >= ix->len || n <= 0) return 0;
    if (n > ix->len - start) n = ix->len - start;
    memcpy(out, ix->tok + start, (size_t)n * sizeof(int32_t));
    return n;
}

static inline int32_t prev_of(const ls_ngram *ix, int64_t p, int32_t o) { return ix->prev[(p - 1) * ix->max_n + (o - 1)]; }

int32_t ls_ngram_lookup(const ls_ngram *ix, int32_t min_n, int32_t max_occurrences, int32_t first_only,
                        int32_t *orders_out, int32_t *counts_out, int64_t *starts_out) {
    int64_t end = ix->len;
    int32_t top = ix->max_n;
    if (end - 1 < top) top = (int32_t)(end - 1);
    if (min_n < 1) min_n = 1;
    if (max_occurrences < 0) max_occurrences = 0;
    int32_t k = 0;
    for (int32_t o = top; o >= min_n; o--) {
        int32_t s = prev_of(ix, end, o);
        if (s == 0) continue;
        int32_t c = 0;
        int64_t *out = starts_out + (int64_t)k * max_occurrences;
        while (s != 0 && c < max_occurrences) {
            out[c++] = s;
            s = prev_of(ix, s, o);
        }
        orders_out[k] = o;
        counts_out[k] = c;
        k++;
        if (first_only) break;
    }
    return k;
}

/* ---- the drafter's trie ---------------------------------------------------------------------- */

/* how many tokens before `start` equal the last tokens of the history (at most cap) */
static int32_t match_length(const ls_ngram *ix, int64_t start, int32_t cap) {
    int64_t end = ix->len;
    int32_t n = 0;
    while (n < cap && start - 1 - n >= 0 && ix->tok[start - 1 - n] == ix->tok[end - 1 - n]) n++;
    return n;
}

static int32_t bucket_of(const ls_draft_params *p, int32_t match_len, int32_t best_sibling_len, int32_t support) {
    int32_t rank;
    if (match_len > best_sibling_len)
        rank = support >= 2 ? 0 : 1;
    else if (match_len == best_sibling_len)
        rank = 2;
    else
        rank = 3;
    int32_t b = 0;
    for (int32_t i = 0; i < p->n_len_edges; i++)
        if (match_len >= p->len_edges[i]) b = i;
    return b * p->n_rank + rank;
}

int32_t ls_ngram_draft(const ls_ngram *ix, const ls_draft_params *p, int32_t cap, int32_t *tok_out,
                       int32_t *parent_out, int32_t *depth_out, double *score_out, int32_t *bucket_out,
                       int32_t *mlen_out, int32_t *support_out) {
    int64_t n_hist = ix->len;
    if (n_hist == 0) return 0;
    int64_t need = 1 + (int64_t)p->max_occurrences * p->depth_cap;
    if (p->node_cap < need) need = p->node_cap < 1 ? 1 : p->node_cap;
    if (p->max_occurrences < 0 || p->depth_cap < 0 || cap < 1 || cap < need || p->n_rank < 1 || p->n_len_edges < 1 ||
        p->n_depth_by_match < 1)
        return LS_ERR_ARG;
    tok_out[0] = ix->tok[n_hist - 1];
    parent_out[0] = -1;
    depth_out[0] = 0;
    score_out[0] = 1.0;
    bucket_out[0] = 0;
    mlen_out[0] = 0;
    support_out[0] = 0;
    if (p->depth_cap <= 0 || n_hist < 2 || p->max_occurrences == 0) return 1;
    int32_t max_occ = p->max_occurrences;
    int32_t *orders = (int32_t *)malloc((size_t)ix->max_n * sizeof(int32_t));
    int32_t *counts = (int32_t *)malloc((size_t)ix->max_n * sizeof(int32_t));
    int64_t *starts = (int64_t *)malloc((size_t)ix->max_n * (size_t)max_occ * sizeof(int64_t));
    int64_t *seen = (int64_t *)malloc((size_t)max_occ * sizeof(int64_t));
    int32_t *first = (int32_t *)malloc((size_t)cap * sizeof(int32_t));
    int32_t *next = (int32_t *)malloc((size_t)cap * sizeof(int32_t));
    int32_t *last = (int32_t *)malloc((size_t)cap * sizeof(int32_t));
    int32_t n = 1;
    if (!orders || !counts || !starts || !seen || !first || !next || !last) {
        n = LS_ERR_NOMEM;
        goto done;
    }
    first[0] = next[0] = last[0] = -1;
    int32_t n_matches = ls_ngram_lookup(ix, p->min_n, max_occ, 0, orders, counts, starts);
    int32_t n_occ = 0;
    for (int32_t mi = 0; mi < n_matches && n_occ < max_occ && n < p->node_cap; mi++) {
        for (int32_t si = 0; si < counts[mi]; si++) {
            int64_t s = starts[(int64_t)mi * max_occ + si];
            int dup = 0;
            for (int32_t q = 0; q < n_occ; q++) dup |= seen[q] == s;
            if (dup || n_occ >= max_occ) continue;
            seen[n_occ++] = s;
            int32_t mlen = orders[mi] >= p->max_n ? match_length(ix, s, p->max_match) : orders[mi];
            int32_t depth = p->depth_by_match[mlen < p->n_depth_by_match ? mlen : p->n_depth_by_match - 1];
            if (depth > p->depth_cap) depth = p->depth_cap;
            int32_t node = 0;
            int64_t stop = s + depth < n_hist ? s + depth : n_hist;
            for (int64_t q = s; q < stop; q++) {
                int32_t t = ix->tok[q];
                int32_t d = (int32_t)(q - s);
                int32_t child = first[node];
                while (child >= 0 && tok_out[child] != t) child = next[child];
                if (child < 0) {
                    if (n >= p->node_cap) break;
                    child = n++;
                    tok_out[child] = t;
                    parent_out[child] = node;
                    depth_out[child] = depth_out[node] + 1;
                    mlen_out[child] = 0;
                    support_out[child] = 0;
                    first[child] = next[child] = last[child] = -1;
                    if (last[node] < 0)
                        first[node] = child;
                    else
                        next[last[node]] = child;
                    last[node] = child;
                }
                if (mlen + d > mlen_out[child]) mlen_out[child] = mlen + d;
                support_out[child]++;
                node = child;
            }
        }
    }
    /* buckets and scores: each child against the best of its siblings */
    for (int32_t par = 0; par < n; par++) {
        if (first[par] < 0) continue;
        int32_t top = -1, top_at = -1, second = 0;
        for (int32_t c = first[par]; c >= 0; c = next[c])
            if (mlen_out[c] > top) {
                top = mlen_out[c];
                top_at = c;
            }
        for (int32_t c = first[par]; c >= 0; c = next[c])
            if (c != top_at && mlen_out[c] > second) second = mlen_out[c];
        for (int32_t c = first[par]; c >= 0; c = next[c]) {
            int32_t other = mlen_out[c] == top ? second : top;
            int32_t b = bucket_of(p, mlen_out[c], other, support_out[c]);
            bucket_out[c] = b;
            score_out[c] = score_out[par] * p->estimates[b];
        }
    }
done:
    free(orders);
    free(counts);
    free(starts);
    free(seen);
    free(first);
    free(next);
    free(last);
    return n;
}
