/* Graph taps: llama.cpp's cb_eval in C (see localspec_native.h, "graph taps").
 *
 * ggml's scheduler calls the callback twice per graph node it may hand over: with ask = true
 * ("do you want to observe this node?"), and, for the nodes answered yes, with ask = false
 * once the node is computed. A Python callback pays a ctypes transition on each of those
 * calls (~760 per decode of the default model, about 0.6 ms); this one compares a name. */

#include <stdlib.h>
#include <string.h>

#include "ls_internal.h"

#define LS_TAP_MAX_NAMES 8
#define LS_TAP_NAME_LEN 64 /* GGML_MAX_NAME */
#define LS_GGML_TYPE_F32 0

struct ls_tap {
    int32_t n_names;
    char names[LS_TAP_MAX_NAMES][LS_TAP_NAME_LEN];
    int64_t width;
    int64_t off_type, off_ne, off_name;
    ls_tensor_get_fn get;
    float *buf[LS_TAP_MAX_NAMES];
    int64_t cap[LS_TAP_MAX_NAMES]; /* rows */
    int64_t rows[LS_TAP_MAX_NAMES];
    int32_t err;
    int32_t paused;
    int32_t stop;  /* name index after whose copy the rest of the graph is skipped, or -1 */
    int32_t stopping; /* 0: the stop node is not observed; 1: copied; 2: copied, then the split stops */
    char watch[LS_TAP_NAME_LEN]; /* a node whose sources are recorded when asked about */
    int64_t off_src;
    const void *watch_src[2];
    ls_eval_fn next; /* the callback this one chains to (or NULL) and its user data */
    void *next_ud;
    const void *asked;  /* the node asked about last, and whether `next` wanted to observe it */
    int32_t next_wants;
    int64_t n_asked, n_copied;
};

ls_tap *ls_tap_new(int32_t n_names, const char *const *names, int64_t width, int64_t off_type, int64_t off_ne,
                   int64_t off_name, ls_tensor_get_fn get) {
    if (n_names < 1 || n_names > LS_TAP_MAX_NAMES || !names || width < 1 || !get || off_type < 0 || off_ne < 0 ||
        off_name < 0)
        return NULL;
    ls_tap *tap = calloc(1, sizeof *tap);
    if (!tap) return NULL;
    for (int32_t i = 0; i < n_names; i++) {
        if (!names[i] || strlen(names[i]) >= LS_TAP_NAME_LEN) {
            free(tap);
            return NULL;
        }
        strcpy(tap->names[i], names[i]);
    }
    tap->n_names = n_names;
    tap->width = width;
    tap->off_type = off_type;
    tap->off_ne = off_ne;
    tap->off_name = off_name;
    tap->get = get;
    tap->stop = -1;
    return tap;
}

void ls_tap_free(ls_tap *tap) {
    if (!tap) return;
    for (int32_t i = 0; i < tap->n_names; i++) free(tap->buf[i]);
    free(tap);
}

static int32_t tap_index(const ls_tap *tap, const char *name) {
    for (int32_t i = 0; i < tap->n_names; i++)
        if (strncmp(name, tap->names[i], LS_TAP_NAME_LEN) == 0) return i;
    return -1;
}

bool ls_tap_eval(void *tensor, bool ask, void *user_data) {
    ls_tap *tap = user_data;
    if (!tap) return !ask; /* no tap given (a caller forgot cb_eval_user_data): observe nothing */
    const char *t = tensor;
    int32_t i = tap_index(tap, t + tap->off_name);
    if (ask) {
        tap->n_asked++;
        if (tap->watch[0] && strncmp(t + tap->off_name, tap->watch, LS_TAP_NAME_LEN) == 0)
            memcpy((void *)tap->watch_src, t + tap->off_src, sizeof tap->watch_src);
        bool mine = i >= 0 && !tap->paused && (i != tap->stop || tap->stopping);
        bool theirs = tap->next ? tap->next(tensor, true, tap->next_ud) : false;
        tap->asked = tensor;
        tap->next_wants = theirs;
        return mine || theirs;
    }
    /* ggml observes only the node it asked about last. The chained callback observes it
     * first, and only if it asked to (as ggml would call it alone); its answer is kept: a tap
     * never cancels a decode except at its own stop node */
    bool go_on = true;
    if (tap->next && tensor == tap->asked && tap->next_wants) go_on = tap->next(tensor, false, tap->next_ud);
    if (i < 0 || tap->paused || (i == tap->stop && !tap->stopping)) return go_on;
    int32_t type;
    int64_t ne[2];
    memcpy(&type, t + tap->off_type, sizeof type);
    memcpy(ne, t + tap->off_ne, sizeof ne);
    if (type != LS_GGML_TYPE_F32 || ne[0] != tap->width || ne[1] < 0) {
        tap->err = LS_ERR_ARG;
        return go_on; /* nothing captured, the graph runs on (the caller sees ls_tap_error) */
    }
    int64_t need = tap->rows[i] + ne[1];
    if (need > tap->cap[i]) {
        int64_t cap = tap->cap[i] ? tap->cap[i] : 64;
        while (cap < need) cap *= 2;
        float *b = realloc(tap->buf[i], (size_t)cap * (size_t)tap->width * sizeof *b);
        if (!b) {
            tap->err = LS_ERR_NOMEM;
            return go_on;
        }
        tap->buf[i] = b;
        tap->cap[i] = cap;
    }
    if (ne[1] > 0)
        tap->get(tensor, tap->buf[i] + tap->rows[i] * tap->width, 0, (size_t)(ne[1] * tap->width) * sizeof(float));
    tap->rows[i] = need;
    tap->n_copied++;
    return go_on && !(i == tap->stop && tap->stopping == 2);
}

int64_t ls_tap_rows(const ls_tap *tap, int32_t i) { return (i >= 0 && i < tap->n_names) ? tap->rows[i] : -1; }

const float *ls_tap_data(const ls_tap *tap, int32_t i) { return (i >= 0 && i < tap->n_names) ? tap->buf[i] : NULL; }

int32_t ls_tap_error(const ls_tap *tap) { return tap->err; }

void ls_tap_clear(ls_tap *tap) {
    for (int32_t i = 0; i < tap->n_names; i++) tap->rows[i] = 0;
    tap->err = 0;
}

int64_t ls_tap_n_asked(const ls_tap *tap) { return tap->n_asked; }

int64_t ls_tap_n_copied(const ls_tap *tap) { return tap->n_copied; }

void ls_tap_set_paused(ls_tap *tap, int32_t paused) { tap->paused = paused != 0; }

void ls_tap_set_stop(ls_tap *tap, int32_t i) { tap->stop = (i >= 0 && i < tap->n_names) ? i : -1; }

void ls_tap_set_stopping(ls_tap *tap, int32_t mode) { tap->stopping = mode < 0 ? 0 : mode > 2 ? 2 : mode; }

int32_t ls_tap_watch(ls_tap *tap, const char *name, int64_t off_src) {
    if (!name || strlen(name) >= LS_TAP_NAME_LEN || off_src < 0) return LS_ERR_ARG;
    strcpy(tap->watch, name);
    tap->off_src = off_src;
    tap->watch_src[0] = tap->watch_src[1] = NULL;
    return 0;
}

const void *ls_tap_watched_src(const ls_tap *tap, int32_t j) { return (j == 0 || j == 1) ? tap->watch_src[j] : NULL; }

void ls_tap_set_next(ls_tap *tap, ls_eval_fn next, void *next_ud) {
    tap->next = next;
    tap->next_ud = next_ud;
}
