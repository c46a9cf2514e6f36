/* Drafting memory: a bounded store of earlier requests' token sequences that every request
 * drafts from (localspec/drafters/memory.py, DraftMemory).
 *
 * Tokens live in a ring of `cap` slots addressed by absolute position (token i at
 * tok[i % cap]; the stored positions are [base, total)). Documents are separated by
 * LS_MEM_SEP; no indexed n-gram and no continuation crosses a separator.
 *
 * Eviction keeps what is drafted from (second chance, as the CLOCK approximation of LRU):
 * every stored token has a read count (0..LS_MEM_MAX_READS) that a draft raises on the
 * tokens it used (the matched n-gram and the continuation it merged into the tree). A write
 * that needs room evicts from the oldest position; a run of tokens whose count is > 0 is
 * copied out (at most as many tokens as the write brings, and at least 64, up to `salv_cap`:
 * writes cost at most about twice their length) and written again, before the new document,
 * as documents of their own with their counts lowered by one. Text that drafts keep reading
 * survives any amount of text written but never read; text never read leaves oldest first.
 *
 * As in ls_ngram.c, for every end position p (the n-gram is tokens [p - n, p)) and order n in
 * [min_n, max_n] the store keeps the distance back to the previous occurrence of the same
 * n-gram (0 = none), and an open-addressing table (fixed size, load <= 2/3) maps each
 * distinct n-gram to its most recent end position. An n-gram's entry is deleted when its
 * first token is evicted and it has no later occurrence, so every entry points at stored
 * tokens and the table never fills. A lookup walks at most max_occurrences links: its cost
 * does not depend on how much is stored. */
#include "ls_internal.h"

#define LS_MEM_SEP (-1)
#define LS_MEM_MAX_N 32
#define LS_MEM_MAX_READS 3

struct ls_memory {
    int32_t min_n, max_n, n_orders;
    int32_t _pad;
    int64_t cap;      /* ring slots (tokens) */
    int64_t total;    /* tokens ever written (absolute end) */
    int64_t base;     /* first stored position (total - base <= cap) */
    int32_t *tok;     /* [cap] */
    uint8_t *reads;   /* [cap]: read count of the token at tok[i] */
    int64_t salv_cap; /* most tokens (and separators) copied out per write */
    int32_t *salv;    /* [salv_cap] tokens copied out of the evicted text, LS_MEM_SEP between runs */
    uint8_t *salv_reads; /* [salv_cap] their read counts, lowered by one */
    uint32_t *prev;   /* [cap * n_orders]: for end position p, at ((p - 1) % cap) * n_orders + (n - min_n) */
    uint64_t *slot;   /* [n_slots]: end position * 64 + order; 0 = empty */
    int64_t n_slots, n_used;
};

static inline int32_t tok_at(const ls_memory *m, int64_t i) { return m->tok[i % m->cap]; }
static inline int64_t mem_base(const ls_memory *m) { return m->base; }

/* hash of g[0..n) built from the last token backwards (so one pass gives every order) */
static inline uint64_t hash_step(uint64_t acc, int32_t t, int32_t n) {
    return ls__mix64(acc + (uint64_t)(uint32_t)t * LS_GOLDEN + (uint64_t)n);
}
#define HASH_SEED 0x2545F4914F6CDD1DULL

static uint64_t gram_hash(const int32_t *g, int32_t n) {
    uint64_t acc = HASH_SEED;
    for (int32_t k = 1; k <= n; k++) acc = hash_step(acc, g[n - k], k);
    return acc;
}

static int gram_equal(const ls_memory *m, int64_t p, int32_t n, const int32_t *g) {
    for (int32_t k = 0; k < n; k++)
        if (tok_at(m, p - n + k) != g[k]) return 0;
    return 1;
}

/* slot of the n-gram g (order n) and whether it is there; else the empty slot to fill */
static int64_t find_slot(const ls_memory *m, const int32_t *g, int32_t n, uint64_t h, int *found) {
    int64_t i = (int64_t)(h % (uint64_t)m->n_slots);
    while (m->slot[i] != 0) {
        uint64_t v = m->slot[i];
        if ((int32_t)(v & 63) == n && gram_equal(m, (int64_t)(v >> 6), n, g)) {
            *found = 1;
            return i;
        }
        if (++i == m->n_slots) i = 0;
    }
    *found = 0;
    return i;
}

static uint64_t slot_home(const ls_memory *m, uint64_t v) {
    int32_t n = (int32_t)(v & 63);
    int64_t p = (int64_t)(v >> 6);
    int32_t g[LS_MEM_MAX_N];
    for (int32_t k = 0; k < n; k++) g[k] = tok_at(m, p - n + k);
    return gram_hash(g, n) % (uint64_t)m->n_slots;
}

/* backward-shift deletion (linear probing) */
static void delete_slot(ls_memory *m, int64_t i) {
    int64_t j = i;
    for (;;) {
        if (++j == m->n_slots) j = 0;
        if (m->slot[j] == 0) break;
        int64_t k = (int64_t)slot_home(m, m->slot[j]);
        int in_range = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!in_range) {
            m->slot[i] = m->slot[j];
            i = j;
        }
    }
    m->slot[i] = 0;
    m->n_used--;
}

/* table slots: 3/2 of the most entries (one per stored token and order) */
static int64_t n_slots_for(int64_t cap, int32_t n_orders) { return cap * n_orders + (cap * n_orders) / 2 + 1; }
/* tokens copied out per write: an eighth of the ring */
static int64_t salv_cap_for(int64_t cap) { return cap / 8; }

int64_t ls_memory_bytes(int64_t cap, int32_t n_orders) {
    if (cap < 1 || n_orders < 1) return 0;
    int64_t slots = n_slots_for(cap, n_orders);
    return cap * (int64_t)(sizeof(int32_t) + sizeof(uint8_t)) + cap * n_orders * (int64_t)sizeof(uint32_t) +
           slots * (int64_t)sizeof(uint64_t) + salv_cap_for(cap) * (int64_t)(sizeof(int32_t) + sizeof(uint8_t));
}

ls_memory *ls_memory_new(int64_t cap, int32_t min_n, int32_t max_n) {
    if (cap < 16 || min_n < 1 || max_n < min_n || max_n > LS_MEM_MAX_N || cap > ((int64_t)1 << 31)) return NULL;
    ls_memory *m = (ls_memory *)calloc(1, sizeof *m);
    if (!m) return NULL;
    m->min_n = min_n;
    m->max_n = max_n;
    m->n_orders = max_n - min_n + 1;
    m->cap = cap;
    int64_t slots = n_slots_for(cap, m->n_orders);
    m->n_slots = slots;
    m->salv_cap = salv_cap_for(cap);
    m->tok = (int32_t *)malloc((size_t)cap * sizeof(int32_t));
    m->reads = (uint8_t *)calloc((size_t)cap, sizeof(uint8_t));
    m->prev = (uint32_t *)malloc((size_t)cap * (size_t)m->n_orders * sizeof(uint32_t));
    m->slot = (uint64_t *)calloc((size_t)slots, sizeof(uint64_t));
    m->salv = (int32_t *)malloc((size_t)m->salv_cap * sizeof(int32_t));
    m->salv_reads = (uint8_t *)malloc((size_t)m->salv_cap * sizeof(uint8_t));
    if (!m->tok || !m->reads || !m->prev || !m->slot || !m->salv || !m->salv_reads) {
        ls_memory_free(m);
        return NULL;
    }
    return m;
}

void ls_memory_free(ls_memory *m) {
    if (!m) return;
    free(m->tok);
    free(m->reads);
    free(m->prev);
    free(m->slot);
    free(m->salv);
    free(m->salv_reads);
    free(m);
}

void ls_memory_stats(const ls_memory *m, int64_t *out) {
    out[0] = m->total;
    out[1] = mem_base(m);
    out[2] = m->cap;
    out[3] = m->n_used;
    out[4] = m->n_slots;
    out[5] = ls_memory_bytes(m->cap, m->n_orders);
}

/* forget the n-grams that start at the oldest token (it is about to be overwritten) */
static void evict_oldest(ls_memory *m) {
    int64_t e = mem_base(m);
    int32_t g[LS_MEM_MAX_N];
    for (int32_t n = m->min_n; n <= m->max_n; n++) {
        int64_t p = e + n;
        if (p > m->total) break;
        int sep = 0;
        for (int32_t k = 0; k < n; k++) {
            g[k] = tok_at(m, e + k);
            sep |= g[k] < 0;
        }
        if (sep) break; /* longer orders contain the separator too */
        int found;
        int64_t i = find_slot(m, g, n, gram_hash(g, n), &found);
        if (found && (int64_t)(m->slot[i] >> 6) == p) delete_slot(m, i);
    }
    m->base++;
}

static void append_one(ls_memory *m, int32_t t, uint8_t reads) {
    if (m->total - m->base >= m->cap) evict_oldest(m);
    m->tok[m->total % m->cap] = t;
    m->reads[m->total % m->cap] = reads;
    m->total++;
    int64_t p = m->total;
    uint32_t *pv = m->prev + ((p - 1) % m->cap) * m->n_orders;
    for (int32_t o = 0; o < m->n_orders; o++) pv[o] = 0;
    int64_t avail = p - mem_base(m);
    int32_t g[LS_MEM_MAX_N];
    int32_t nmax = avail < m->max_n ? (int32_t)avail : m->max_n;
    /* the last nmax tokens, oldest first, and the longest separator-free suffix */
    int32_t clean = 0;
    for (int32_t k = 0; k < nmax; k++) {
        int32_t v = tok_at(m, p - 1 - k);
        if (v < 0) break;
        g[nmax - 1 - k] = v;
        clean++;
    }
    uint64_t acc = HASH_SEED;
    for (int32_t n = 1; n <= clean; n++) {
        acc = hash_step(acc, g[nmax - n], n);
        if (n < m->min_n) continue;
        const int32_t *gram = g + nmax - n;
        int found;
        int64_t i = find_slot(m, gram, n, acc, &found);
        if (found) {
            pv[n - m->min_n] = (uint32_t)(p - (int64_t)(m->slot[i] >> 6));
        } else {
            m->n_used++;
        }
        m->slot[i] = ((uint64_t)p << 6) | (uint64_t)n;
    }
}

/* one document and its separators (at most n + 2 positions); reads = NULL: all 0 */
static void append_doc(ls_memory *m, const int32_t *tokens, const uint8_t *reads, int64_t n) {
    if (m->total > m->base && tok_at(m, m->total - 1) != LS_MEM_SEP) append_one(m, LS_MEM_SEP, 0);
    for (int64_t k = 0; k < n; k++) append_one(m, tokens[k], reads ? reads[k] : 0);
    append_one(m, LS_MEM_SEP, 0);
}

/* Evict from the oldest position until `need` positions and room for the copied-out runs
 * are free; a token with reads > 0 is copied out to salv (at most max(need, 64) entries,
 * and salv_cap), so only unread tokens make room. returns the length of salv (runs separated by LS_MEM_SEP). */
static int64_t make_room(ls_memory *m, int64_t need) {
    int64_t ns = 0, last = -2;
    if (need + m->salv_cap + 1 > m->cap) return 0; /* a document this long replaces everything */
    int64_t most = need < 64 ? 64 : need;
    if (most > m->salv_cap) most = m->salv_cap;
    while (m->cap - (m->total - m->base) < need + ns + 1) {
        int64_t e = m->base;
        int32_t t = tok_at(m, e);
        uint8_t r = m->reads[e % m->cap];
        if (t >= 0 && r > 0 && ns + 2 <= most) {
            if (ns > 0 && last != e - 1) m->salv[ns] = LS_MEM_SEP, m->salv_reads[ns++] = 0;
            m->salv[ns] = t;
            m->salv_reads[ns++] = (uint8_t)(r - 1);
            last = e;
        }
        evict_oldest(m);
    }
    return ns;
}

int32_t ls_memory_write(ls_memory *m, const int32_t *tokens, int64_t n) {
    for (int64_t k = 0; k < n; k++)
        if (tokens[k] < 0) return LS_ERR_ARG;
    if (n <= 0) return 0;
    /* written below: the runs (ns + 1 positions, + 1 if the last stored one is not a
     * separator) and the document (n + 1) */
    int64_t ns = make_room(m, n + 2);
    for (int64_t a = 0; a < ns;) { /* the runs that drafts read, written again (older first) */
        int64_t b = a;
        while (b < ns && m->salv[b] != LS_MEM_SEP) b++;
        append_doc(m, m->salv + a, m->salv_reads + a, b - a);
        a = b + 1;
    }
    append_doc(m, tokens, NULL, n);
    return 0;
}

int64_t ls_memory_tokens(const ls_memory *m, int64_t start, int64_t n, int32_t *out) {
    int64_t base = mem_base(m);
    if (start < base) start = base;
    if (start >= m->total || n <= 0) return 0;
    if (n > m->total - start) n = m->total - start;
    for (int64_t k = 0; k < n; k++) out[k] = tok_at(m, start + k);
    return n;
}

/* ---- drafting ------------------------------------------------------------------------------ */

static int32_t len_bucket(const ls_draft_params *p, int32_t match_len) {
    int32_t b = 0;
    for (int32_t i = 0; i < p->n_len_edges; i++)
        if (match_len >= p->len_edges[i]) b = i;
    return b;
}

/* share buckets: 0 = share >= 0.8 with >= 3 occurrences, 1 = ... with 2, 2 = a single
 * occurrence, 3 = share in [0.4, 0.8), 4 = below 0.4 */
static int32_t share_rank(int32_t count, int32_t parent_count) {
    double share = (double)count / (double)parent_count;
    if (share >= 0.8) return count >= 3 ? 0 : (count == 2 ? 1 : 2);
    return share >= 0.4 ? 3 : 4;
}

int32_t ls_memory_draft(ls_memory *m, const int32_t *query, int64_t n_query, const ls_draft_params *p,
                        double min_share, int32_t bucket_offset, int32_t n_in, int32_t cap, int32_t *tok_out,
                        int32_t *parent_out, int32_t *depth_out, double *score_out, int32_t *bucket_out,
                        int32_t *info_out) {
    info_out[0] = info_out[1] = info_out[2] = 0; /* order matched, occurrences, nodes added */
    if (n_in < 1 || cap < n_in || p->n_rank != 5 || p->n_len_edges < 1 || p->n_depth_by_match < 1 ||
        p->max_occurrences < 0 || p->depth_cap < 0)
        return LS_ERR_ARG;
    int32_t node_cap = p->node_cap < cap ? p->node_cap : cap;
    if (n_query < 1 || m->total == 0 || p->depth_cap == 0 || p->max_occurrences == 0 || n_in >= node_cap) return n_in;
    for (int64_t k = 0; k < n_query; k++)
        if (query[k] < 0) return LS_ERR_ARG;
    int64_t base = mem_base(m);
    int32_t max_occ = p->max_occurrences;
    /* 1. occurrences of the longest suffix of the query that is stored */
    int32_t top = m->max_n < n_query ? m->max_n : (int32_t)n_query;
    int32_t order = 0, n_occ = 0;
    int64_t *starts = (int64_t *)malloc((size_t)max_occ * sizeof(int64_t));
    int64_t mcap = 1 + (int64_t)max_occ * p->depth_cap;
    int32_t *mtok = (int32_t *)malloc((size_t)mcap * sizeof(int32_t));
    int32_t *mpar = (int32_t *)malloc((size_t)mcap * sizeof(int32_t));
    int32_t *mcount = (int32_t *)malloc((size_t)mcap * sizeof(int32_t));
    int32_t *mlen = (int32_t *)malloc((size_t)mcap * sizeof(int32_t));
    int32_t *mfirst = (int32_t *)malloc((size_t)mcap * sizeof(int32_t));
    int32_t *mnext = (int32_t *)malloc((size_t)mcap * sizeof(int32_t));
    int32_t *mout = (int32_t *)malloc((size_t)mcap * sizeof(int32_t));
    int32_t *mdep = (int32_t *)malloc((size_t)mcap * sizeof(int32_t));
    int32_t *leaf = (int32_t *)malloc((size_t)max_occ * sizeof(int32_t));
    int32_t *first = (int32_t *)malloc((size_t)cap * sizeof(int32_t));
    int32_t *next = (int32_t *)malloc((size_t)cap * sizeof(int32_t));
    int32_t n = n_in;
    if (!starts || !mtok || !mpar || !mcount || !mlen || !mfirst || !mnext || !mout || !mdep || !leaf || !first || !next) {
        n = LS_ERR_NOMEM;
        goto done;
    }
    for (int32_t o = top; o >= m->min_n && n_occ == 0; o--) {
        const int32_t *g = query + n_query - o;
        int found;
        int64_t i = find_slot(m, g, o, gram_hash(g, o), &found);
        if (!found) continue;
        int64_t e = (int64_t)(m->slot[i] >> 6);
        for (int32_t links = 0; e - o >= base && n_occ < max_occ && links < 4 * max_occ; links++) {
            if (e < m->total && tok_at(m, e) >= 0) starts[n_occ++] = e;
            uint32_t d = m->prev[((e - 1) % m->cap) * m->n_orders + (o - m->min_n)];
            if (d == 0) break;
            e -= d;
        }
        if (n_occ) order = o;
    }
    info_out[0] = order;
    info_out[1] = n_occ;
    if (n_occ == 0) goto done;
    /* 2. their continuations, merged into a trie that counts the occurrences through each node */
    int32_t mn = 1;
    mtok[0] = query[n_query - 1];
    mpar[0] = -1;
    mcount[0] = n_occ;
    mlen[0] = 0;
    mdep[0] = 0;
    mfirst[0] = mnext[0] = -1;
    for (int32_t q = 0; q < n_occ; q++) {
        int64_t s = starts[q];
        int32_t ml = 0;
        while (ml < p->max_match && s - 1 - ml >= base && n_query - 1 - ml >= 0 &&
               tok_at(m, s - 1 - ml) == query[n_query - 1 - ml])
            ml++;
        int32_t depth = p->depth_by_match[ml < p->n_depth_by_match ? ml : p->n_depth_by_match - 1];
        if (depth > p->depth_cap) depth = p->depth_cap;
        int32_t node = 0;
        for (int32_t d = 0; d < depth && s + d < m->total; d++) {
            int32_t t = tok_at(m, s + d);
            if (t < 0) break;
            int32_t c = mfirst[node];
            while (c >= 0 && mtok[c] != t) c = mnext[c];
            if (c < 0) {
                c = mn++;
                mtok[c] = t;
                mpar[c] = node;
                mcount[c] = 0;
                mlen[c] = 0;
                mdep[c] = d + 1;
                mfirst[c] = -1;
                mnext[c] = mfirst[node]; /* order among siblings does not matter here */
                mfirst[node] = c;
            }
            mcount[c]++;
            if (ml + d + 1 > mlen[c]) mlen[c] = ml + d + 1;
            node = c;
        }
        leaf[q] = node;
    }
    /* 3. merge the nodes whose share of their parent's occurrences is >= min_share into the
     * given tree (a node already there keeps the larger score, and that score's bucket) */
    for (int32_t i = 0; i < n; i++) first[i] = next[i] = -1;
    for (int32_t i = n - 1; i >= 1; i--) { /* children lists of the given tree */
        int32_t par = parent_out[i];
        if (par < 0 || par >= i) {
            n = LS_ERR_BAD_TREE;
            goto done;
        }
        next[i] = first[par];
        first[par] = i;
    }
    mout[0] = 0;
    for (int32_t c = 1; c < mn; c++) {
        mout[c] = -1;
        int32_t pc = mpar[c];
        int32_t at = mout[pc];
        if (at < 0 || (double)mcount[c] < min_share * (double)mcount[pc]) continue;
        int32_t b = len_bucket(p, mlen[c]) * p->n_rank + share_rank(mcount[c], mcount[pc]);
        double s = score_out[at] * p->estimates[b];
        int32_t k = first[at];
        while (k >= 0 && tok_out[k] != mtok[c]) k = next[k];
        if (k >= 0) {
            if (s > score_out[k]) {
                score_out[k] = s;
                bucket_out[k] = bucket_offset + b;
            }
        } else {
            if (n >= node_cap) continue;
            k = n++;
            tok_out[k] = mtok[c];
            parent_out[k] = at;
            depth_out[k] = depth_out[at] + 1;
            score_out[k] = s;
            bucket_out[k] = bucket_offset + b;
            first[k] = -1;
            next[k] = first[at];
            first[at] = k;
            info_out[2]++;
        }
        mout[c] = k;
    }
    /* 4. raise the read count of the tokens each occurrence gave the tree: its matched n-gram
     * and its continuation down to the deepest node that was kept */
    for (int32_t q = 0; q < n_occ; q++) {
        int32_t c = leaf[q];
        while (c > 0 && mout[c] < 0) c = mpar[c];
        if (c == 0) continue;
        for (int64_t i = starts[q] - order; i < starts[q] + mdep[c]; i++) {
            uint8_t *r = &m->reads[i % m->cap];
            if (*r < LS_MEM_MAX_READS) (*r)++;
        }
    }
done:
    free(starts);
    free(mtok);
    free(mpar);
    free(mcount);
    free(mlen);
    free(mfirst);
    free(mnext);
    free(mout);
    free(mdep);
    free(leaf);
    free(first);
    free(next);
    return n;
}
