"""A token tree laid out as the sequences of one multi-sequence ``llama_decode`` batch.

This is llama.cpp batch layout (sequence ids, positions), so it lives with the other owned
wrappers over llama.cpp; ``localspec.tree`` holds the tree itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..tree import TokenTree


@dataclass
class TreeLayout:
    """A token tree laid out as sequences of one multi-sequence ``llama_decode`` batch.

    Each leaf gets its own sequence id (``leaf_seq``); a node carries the ids of every leaf
    below it, so it attends to exactly its ancestors and itself. Before decoding, the
    committed prefix (seq 0) is copied to every leaf id. A chain needs no copies: it is laid
    out in seq 0 directly (``uses_seq0``).

    ::

        root(r) ── a ── b         leaves b, c  -> seq ids 1, 2
           └────── c              r: {1, 2}   a: {1}   b: {1}   c: {2}

    Attributes:
        pos:      [n] int32 ``n_past + depth``.
        seq_sets: [n, k] int32 sequence ids of each node (first ``n_seq[i]`` valid).
        n_seq:    [n] int32.
        leaf_nodes: [L] node index of each leaf.
        leaf_seq:   [L] its sequence id.
        node_leaf_seq: [n] a sequence id whose path contains the node (for commit).
        uses_seq0: True for chains laid out in seq 0.
    """

    pos: np.ndarray
    seq_sets: np.ndarray
    n_seq: np.ndarray
    leaf_nodes: np.ndarray
    leaf_seq: np.ndarray
    node_leaf_seq: np.ndarray
    uses_seq0: bool


def layout_tree(tree: TokenTree, n_past: int) -> TreeLayout:
    """Lay ``tree`` out as sequences (see ``TreeLayout``). Leaf ``j`` gets sequence ``j + 1``."""
    n = tree.n_nodes
    if n == 1:  # a plain step (most steps): the root in seq 0, nothing to compute
        zero = np.zeros(1, dtype=np.int32)
        return TreeLayout(np.array([n_past], dtype=np.int32), zero.reshape(1, 1), np.ones(1, dtype=np.int32),
                          zero, zero, zero, True)  # fmt: skip
    pos = (n_past + tree.depth).astype(np.int32)
    if tree.is_chain():
        leaf = np.array([n - 1], dtype=np.int32)
        return TreeLayout(
            pos=pos,
            seq_sets=np.zeros((n, 1), dtype=np.int32),
            n_seq=np.ones(n, dtype=np.int32),
            leaf_nodes=leaf,
            leaf_seq=np.zeros(1, dtype=np.int32),
            node_leaf_seq=np.zeros(n, dtype=np.int32),
            uses_seq0=True,
        )
    leaves = tree.leaves()
    leaf_seq = np.arange(1, leaves.size + 1, dtype=np.int32)
    anc = tree.ancestors_matrix()  # [n, n]
    member = anc[leaves, :].T  # [n, L]: node j lies on the path of leaf l
    n_seq = member.sum(axis=1).astype(np.int32)
    order = np.argsort(~member, axis=1, kind="stable")  # member columns first, in leaf order
    seq_sets = leaf_seq[order].astype(np.int32)
    k = int(n_seq.max())
    seq_sets = np.ascontiguousarray(seq_sets[:, :k])
    return TreeLayout(
        pos=pos,
        seq_sets=seq_sets,
        n_seq=n_seq,
        leaf_nodes=leaves.astype(np.int32),
        leaf_seq=leaf_seq,
        node_leaf_seq=seq_sets[:, 0].copy(),
        uses_seq0=False,
    )
