"""Tree verification in C (``ls_verify`` / ``ls_verify_thresholds``): the greedy / seeded Gumbel
walk, the rejection-sampling walk and the LOSSY thresholded walk of ``localspec.verify``, on the
same per-position random streams, so each gives the reference's accepted path and tokens."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from . import _lib, lib, workspace
from ..tree import SparseDist
from .rows import raise_for


@dataclass
class Walk:
    """What the walk decided.

    Attributes:
        path: accepted draft node indices, top-down (``accept_length`` long).
        tokens: accepted tokens then the recovered/bonus token (``len(path) + 1`` long).
    """

    path: list[int]
    tokens: list[int]


def walk(
    tree, logits: np.ndarray, state, *, seed: int, pos: int, window, rejection: bool, thresholds: tuple | None = None
) -> Walk:
    """Verify ``tree`` against ``logits``.

    Args:
        tree: ``TokenTree``.
        logits: [>= n_nodes, n_vocab] float32, row i = logits after node i.
        state: the processor's ``rows.SamplingState``.
        seed: seed of the request's random streams; pos: absolute position of the root's
            successor.
        window: the penalty window before ``pos`` (oldest first), or None.
        rejection: classic rejection sampling instead of the greedy / Gumbel walk.
        thresholds: ``(threshold_single, threshold_acc)``, each in (0, 1]: SGLang's **LOSSY**
            thresholded walk (``verify.threshold_walk``) instead of either; draft
            distributions are not read.
    Raises:
        ValueError: a stochastic child with zero draft probability, or a malformed tree.
        KeyError: a stochastic child whose parent has no draft distribution.
        InvalidRequestError / GrammarError: every token banned (as the reference).
    """
    n = tree.n_nodes
    if logits.dtype != np.float32 or logits.ndim != 2 or logits.strides[1] != 4:
        logits = np.ascontiguousarray(logits, dtype=np.float32)
    if logits.shape[0] < n:
        raise ValueError(f"{logits.shape[0]} logits rows for a tree of {n} nodes")
    n_vocab = logits.shape[1]
    token_ids = np.ascontiguousarray(tree.token_ids, dtype=np.int32)
    parents = np.ascontiguousarray(tree.parents, dtype=np.int32)
    draft_probs = np.ascontiguousarray(tree.draft_probs, dtype=np.float32)
    t = _lib.Tree()
    t.n_nodes = n
    t.token_ids = token_ids.ctypes.data
    t.parents = parents.ctypes.data
    t.draft_probs = draft_probs.ctypes.data
    keep = []  # arrays the C side reads, alive until the call returns
    if rejection and thresholds is None and tree.draft_dists:
        ptrs = (ctypes.c_void_p * n)()
        f64 = (ctypes.c_int8 * n)()
        sparse_ids = None
        for node, dist in tree.draft_dists.items():
            if isinstance(dist, SparseDist):  # ascending int64 ids + float64 probs (checked there)
                if sparse_ids is None:
                    sparse_ids = (ctypes.c_void_p * n)()
                    sparse_len = np.zeros(n, dtype=np.int64)
                    keep.append(sparse_len)
                    t.dist_ids = ctypes.addressof(sparse_ids)
                    t.dist_len = sparse_len.ctypes.data
                if dist.ids.size and (dist.ids[0] < 0 or dist.ids[-1] >= n_vocab):
                    raise ValueError(f"draft distribution of node {node} has token ids outside the vocabulary")
                keep.append(dist)
                sparse_ids[int(node)] = dist.ids.ctypes.data
                sparse_len[int(node)] = dist.ids.size
                ptrs[int(node)] = dist.probs.ctypes.data
                f64[int(node)] = 1
                continue
            d = np.asarray(dist)
            if d.dtype not in (np.float32, np.float64) or not d.flags.c_contiguous:
                d = np.ascontiguousarray(d, dtype=np.float64)
            if d.shape[0] < n_vocab:
                raise ValueError(f"draft distribution of node {node} has {d.shape[0]} entries, the vocabulary {n_vocab}")
            keep.append(d)
            ptrs[int(node)] = d.ctypes.data
            f64[int(node)] = 1 if d.dtype == np.float64 else 0
        t.draft_dists = ctypes.addressof(ptrs)
        t.dist_is_f64 = ctypes.addressof(f64)
    win = None if window is None else np.fromiter(window, dtype=np.int32, count=len(window))
    path = np.empty(n, dtype=np.int32)
    tokens = np.empty(n + 1, dtype=np.int32)
    err_node = ctypes.c_int32(-1)
    win_args = (win.ctypes.data if win is not None and win.size else None, 0 if win is None else int(win.size))
    out_args = (workspace(n_vocab), path.ctypes.data, tokens.ctypes.data, ctypes.byref(err_node))
    row_args = (ctypes.byref(t), logits.ctypes.data, logits.strides[0] // 4, n_vocab, state.with_seed(seed))
    if thresholds is not None:
        ts, ta = (float(x) for x in thresholds)
        if not (0.0 < ts <= 1.0 and 0.0 < ta <= 1.0):
            raise ValueError(f"acceptance thresholds must be in (0, 1], got {ts!r} and {ta!r}")
        rc = lib.ls_verify_thresholds(*row_args, ts, ta, int(pos), *win_args, *out_args)
    else:
        mode = _lib.VERIFY_REJECTION if rejection else _lib.VERIFY_GREEDY
        rc = lib.ls_verify(*row_args, mode, int(pos), *win_args, *out_args)
    if rc < 0:
        node = int(err_node.value)
        if rc == _lib.ERR_ZERO_DRAFT_PROB:
            raise ValueError(f"draft node {node} has zero probability under its draft distribution")
        if rc == _lib.ERR_NO_DRAFT_DIST:
            raise KeyError(int(tree.parents[node]))
        if rc == _lib.ERR_BAD_TREE:
            raise ValueError("malformed tree: parents[0] must be -1 and parents[i] < i")
        raise_for(rc, f"at node {node}")
    return Walk(path[:rc].tolist(), tokens[: rc + 1].tolist())
