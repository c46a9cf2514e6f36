"""Prompt-lookup n-gram drafter that proposes token *trees*.

The history (prompt + generated tokens) is indexed incrementally (``NgramIndex``). At each
step the longest suffix of the history that occurred before is looked up; the continuations
that followed its most recent occurrences (and, when those are few, the occurrences of
shorter suffixes) are merged into a trie. Where the occurrences disagree the trie branches,
so the target can accept whichever continuation it agrees with in the same batched call.

Node scores estimate P(the target accepts the path to the node) as a product, along the
path, of per-node acceptance rates from an ``AcceptanceTracker`` bucketed by the match
length (how far back the history agrees with the text before the occurrence, beyond the
indexed order: long matches mean the text is being copied) and by whether the node's
occurrences match longer than its siblings'. The
tracker learns from every verification, so the policy drafts long trees when the text is
being copied and nothing when it is not.

References: prompt lookup decoding (Saxena 2023), llama.cpp's ``ngram`` speculative modes;
trees of continuations as in REST (He et al. 2024) and Lookahead decoding (Fu et al. 2024).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import native
from ..policy import AcceptanceTracker, tried_nodes
from ..tree import TokenSource, TokenTree, TreeBuilder
from .ngram_index import NgramIndex

# An acceptance bucket is (match-length bucket, rank bucket). The match length of an
# occurrence is how far back the history agrees with the text before it (beyond the indexed
# order, up to _MAX_MATCH): a long match means the text is being copied or is looping, and
# copies are accepted. A node's match length is the longest among the occurrences through it;
# its rank says how it compares with its siblings: 0 = longest, and backed by >= 2
# occurrences (the phrase recurs: loops, lists, boilerplate), 1 = longest, one occurrence,
# 2 = tied with a disagreeing sibling, 3 = a sibling has a longer match.
_MAX_MATCH = 64
_LEN_EDGES = (1, 2, 3, 4, 6, 9, 16, 32)  # lower edges of the match-length buckets
_N_LEN = len(_LEN_EDGES)
_N_RANK = 4
# Priors from scripts/calibrate_ngram_priors.py (Python standard-library docstrings and
# sources as prompts, Gemma 3 270M, greedy; never the Spec-Bench evaluation prompts). The
# tracker refines them online.
_PRIOR = np.array(
    [
        # longest+recurring, longest, tied, beaten
        [0.53, 0.32, 0.16, 0.04],  # match 1
        [0.81, 0.42, 0.13, 0.05],  # 2
        [0.84, 0.51, 0.19, 0.04],  # 3
        [0.89, 0.50, 0.11, 0.16],  # 4-5
        [0.91, 0.82, 0.37, 0.18],  # 6-8
        [0.96, 0.83, 0.18, 0.09],  # 9-15
        [0.98, 0.95, 0.17, 0.09],  # 16-31
        [0.99, 0.99, 0.45, 0.10],  # 32+
    ]
).ravel()


def _len_bucket_slow(match_len: int) -> int:
    b = 0
    for i, edge in enumerate(_LEN_EDGES):
        if match_len >= edge:
            b = i
    return b


_LEN_BUCKET = [_len_bucket_slow(n) for n in range(_MAX_MATCH + 257)]


def _len_bucket(match_len: int) -> int:
    return _LEN_BUCKET[min(match_len, len(_LEN_BUCKET) - 1)]


def _bucket(match_len: int, best_sibling_len: int, support: int) -> int:
    if match_len > best_sibling_len:
        rank = 0 if support >= 2 else 1
    elif match_len == best_sibling_len:
        rank = 2
    else:
        rank = 3
    return _len_bucket(match_len) * _N_RANK + rank


def _node_cap(max_nodes: int) -> int:
    """Most trie nodes built for a step: occurrences come best first, and the policy keeps
    at most ``max_nodes`` of them."""
    return 3 * max_nodes


def _occurrence_depth(match_len: int, depth_cap: int) -> int:
    """How far an occurrence is continued: weak matches rarely continue for long, so their
    depth (and the cost) is bounded."""
    return depth_cap if match_len >= 8 else min(depth_cap, 16 if match_len >= 4 else 6)


def match_length(tokens: list[int], start: int, cap: int = _MAX_MATCH) -> int:
    """How many tokens before ``start`` equal the last tokens of the history (at most cap)."""
    end = len(tokens)
    n = 0
    while n < cap and start - 1 - n >= 0 and tokens[start - 1 - n] == tokens[end - 1 - n]:
        n += 1
    return n


_NATIVE_NGRAM = None


def _native_ngram():
    """``localspec.native.ngram`` (imported on first use: it imports this package)."""
    global _NATIVE_NGRAM
    if _NATIVE_NGRAM is None:
        from ..native import ngram

        _NATIVE_NGRAM = ngram
    return _NATIVE_NGRAM


class NgramDrafter:
    """Drafts token trees from earlier occurrences of the history's suffix.

    Args:
        max_n: longest suffix matched (and indexed).
        min_n: shortest suffix matched.
        max_occurrences: most recent occurrences read per suffix order (bounds the cost).
        max_depth: longest continuation drafted.
        index: an ``NgramIndex``-compatible object; by default the C index
            (``native.ngram.NativeNgramIndex``) when the native kernels are enabled, else
            ``NgramIndex``. With the C index, ``propose`` builds the trie in C too
            (``native.ngram.draft_trie``: the same tree, node for node).
        memory: a ``DraftMemory`` shared with other requests, or None. Its continuations of
            the history are merged into every tree (acceptance buckets after the n-gram
            ones, ``memory_bucket_offset``, learned by ``memory_tracker``), and each request's text (context, prompt and
            output) is written to it when the request ends (the next ``begin`` or ``close``),
            unless the request opted out (``SamplingParams.draft_memory`` False, seen through
            ``set_sampling``): such a request neither drafts from the memory nor writes to it.
    """

    name = "ngram"
    source = TokenSource.NGRAM

    def __init__(
        self,
        *,
        max_n: int = 8,
        min_n: int = 1,
        max_occurrences: int = 12,
        max_depth: int = 48,
        index=None,
        memory=None,
    ) -> None:
        self.max_n = max_n
        self.min_n = min_n
        self.max_occurrences = max_occurrences
        self.max_depth = max_depth
        if index is None:
            index = _native_ngram().NativeNgramIndex(max_n) if native.enabled() else NgramIndex(max_n)
        self.index = index
        self.memory = memory
        self.memory_bucket_offset = _PRIOR.size
        self.tracker = AcceptanceTracker(_PRIOR)
        # the memory's buckets have their own tracker: a request whose memory drafts fail
        # lowers their estimates (its request factor), not those of its own n-grams
        self.memory_tracker = AcceptanceTracker(memory.rates()) if memory is not None else None
        self._folded = None if memory is None else (self.memory_tracker.acc.copy(), self.memory_tracker.n.copy())
        self._use_memory = self._next_use_memory = memory is not None
        self._written: np.ndarray | None = None  # the last text this drafter wrote to the memory
        self._in_request = False
        self._mem_params = None
        self._mem_buf: _MemoryBuffers | None = None
        self._trie = None  # native.ngram.TrieBuilder, made on first use
        self._depth_tables: dict[int, np.ndarray] = {}

    # -- protocol -----------------------------------------------------------------------------

    def set_sampling(self, sampler) -> None:
        """Called before ``begin``: the request's ``SamplingParams.draft_memory`` says whether
        it may use the drafting memory."""
        self._next_use_memory = self.memory is not None and getattr(sampler.params, "draft_memory", True)

    def begin(self, history: Sequence[int], context: Sequence[Sequence[int]] = ()) -> None:
        """Index ``context`` (extra token sequences to draft from) followed by ``history``
        (first writing the previous request to the memory)."""
        self._end_request()
        self._use_memory, self._next_use_memory = self._next_use_memory, self.memory is not None
        self._in_request = True
        toks: list[int] = []
        for c in context:
            toks.extend(c)
        toks.extend(history)
        self.index.reset(toks)
        self.tracker.reset_request()
        if self.memory_tracker is not None:
            self.memory_tracker.reset_request()

    def accept(self, tokens: Sequence[int]) -> None:
        self.index.extend(tokens)

    def propose(self, max_depth: int, max_nodes: int) -> TokenTree:
        tree = self._propose_ngram(max_depth, max_nodes, self.tracker.estimates_array())
        if self._use_memory and self.memory.n_written and min(max_depth, self.max_depth) > 0 and max_nodes > 1:
            est = self.memory_tracker.estimates_array()
            tree = self._merge_memory(tree, min(max_depth, self.max_depth), max_nodes, est)
        return tree

    def _propose_ngram(self, max_depth: int, max_nodes: int, est: np.ndarray) -> TokenTree:
        if native.AVAILABLE and isinstance(self.index, _native_ngram().NativeNgramIndex):
            return self._propose_native(max_depth, max_nodes, est)
        toks = self.index.tokens
        builder = TreeBuilder(toks[-1])
        depth_cap = min(max_depth, self.max_depth)
        if depth_cap <= 0 or max_nodes <= 1 or len(toks) < 2:
            return builder.build()
        matches = self.index.lookup_all(min_n=self.min_n, max_occurrences=self.max_occurrences)
        # trie of continuations
        orders = [0]  # longest match length of the occurrences through each node
        support = [0]  # occurrences through each node
        seen: set[int] = set()
        n_hist = len(toks)
        n_occ = 0
        node_cap = _node_cap(max_nodes)
        for m in matches:
            if n_occ >= self.max_occurrences or len(builder) >= node_cap:
                break
            for s in m.starts:
                if s in seen or n_occ >= self.max_occurrences:
                    continue
                seen.add(s)
                n_occ += 1
                mlen = match_length(toks, s) if m.order >= self.max_n else m.order
                depth = _occurrence_depth(mlen, depth_cap)
                node = 0
                # once the target accepts a node, the history matches one token further
                for d, t in enumerate(toks[s : min(s + depth, n_hist)]):
                    child = builder.find(node, t)
                    if child < 0:
                        if len(builder) >= node_cap:
                            break
                        child = builder.add(node, t, source=TokenSource.NGRAM, score=0.0)
                        orders.append(0)
                        support.append(0)
                    orders[child] = max(orders[child], mlen + d)
                    support[child] += 1
                    node = child
        n = len(builder)
        score = builder.score
        parents = builder.parents
        kids: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            kids[parents[i]].append(i)
        buckets = [0] * n
        est = est.tolist()
        for p in range(n):
            ks = kids[p]
            if not ks:
                continue
            lens = [orders[c] for c in ks]
            top = max(lens)
            second = max((x for j, x in enumerate(lens) if j != lens.index(top)), default=0)
            for c in ks:
                other = second if orders[c] == top else top
                b = _bucket(orders[c], other, support[c])
                buckets[c] = b
                score[c] = score[p] * est[b]
        builder.feature = buckets
        return builder.build()

    def _propose_native(self, max_depth: int, max_nodes: int, est: np.ndarray) -> TokenTree:
        """``propose`` with the trie built in C from the native index (same tree)."""
        depth_cap = min(max_depth, self.max_depth)
        if depth_cap <= 0 or max_nodes <= 1 or len(self.index) < 2:
            return TreeBuilder(self.index.last()).build()
        if self._trie is None:
            self._trie = _native_ngram().TrieBuilder(
                min_n=self.min_n,
                max_n=self.max_n,
                max_occurrences=self.max_occurrences,
                max_match=_MAX_MATCH,
                len_edges=_LEN_EDGES,
                n_rank=_N_RANK,
            )
        depths = self._depths(depth_cap)
        trie = self._trie.build(
            self.index, depth_cap=depth_cap, node_cap=_node_cap(max_nodes), depth_by_match=depths, estimates=est
        )
        n = trie.token_ids.size
        source = np.full(n, int(TokenSource.NGRAM), dtype=np.int8)
        source[0] = int(TokenSource.DECODE)
        return TokenTree(
            token_ids=trie.token_ids,
            parents=trie.parents,
            depth=trie.depth,
            source=source,
            score=trie.score,
            draft_probs=np.full(n, np.nan, dtype=np.float32),
            feature=trie.bucket,
        )

    def _depths(self, depth_cap: int) -> np.ndarray:
        depths = self._depth_tables.get(depth_cap)
        if depths is None:
            k = max(_MAX_MATCH, self.max_n) + 1
            depths = self._depth_tables[depth_cap] = np.array([_occurrence_depth(m, depth_cap) for m in range(k)], dtype=np.int32)
        return depths

    def _merge_memory(self, tree: TokenTree, depth_cap: int, max_nodes: int, est: np.ndarray) -> TokenTree:
        """``tree`` with the memory's continuations of the history merged in (C,
        ``DraftMemory.draft_into``)."""
        from .memory import LEN_EDGES, MAX_MATCH, N_RANK

        mem = self.memory
        n_in = tree.n_nodes
        cap = n_in + _node_cap(max_nodes)
        buf = self._mem_buf
        if buf is None or buf.cap < cap:
            buf = self._mem_buf = _MemoryBuffers(max(cap, 256))
        if self._mem_params is None:
            from ..native import _lib

            p = _lib.DraftParams()
            self._mem_edges = np.ascontiguousarray(LEN_EDGES, dtype=np.int32)
            p.min_n, p.max_n = mem.min_n, mem.max_n
            p.max_occurrences, p.max_match = mem.max_occurrences, MAX_MATCH
            p.n_len_edges, p.len_edges, p.n_rank = self._mem_edges.size, self._mem_edges.ctypes.data, N_RANK
            self._mem_params = p
        p = self._mem_params
        depths = self._depths(depth_cap)
        est = np.ascontiguousarray(est)
        p.depth_cap, p.node_cap = depth_cap, cap
        p.n_depth_by_match, p.depth_by_match, p.estimates = depths.size, depths.ctypes.data, est.ctypes.data
        buf.tok[:n_in] = tree.token_ids
        buf.par[:n_in] = tree.parents
        buf.dep[:n_in] = tree.depth
        buf.score[:n_in] = tree.score
        buf.bucket[:n_in] = tree.feature if tree.feature is not None else 0
        if isinstance(self.index, NgramIndex):
            query = np.asarray(self.index.tokens[-(MAX_MATCH + 1) :], dtype=np.int32)
        else:
            query = self.index.tail(MAX_MATCH + 1)
        n = mem.draft_into(query, buf, params=p, n_in=n_in, bucket_offset=self.memory_bucket_offset, cap=cap)
        if n == n_in and np.array_equal(tree.score, buf.score[:n]):
            return tree  # nothing merged
        source = np.full(n, int(TokenSource.NGRAM), dtype=np.int8)
        source[0] = int(TokenSource.DECODE)
        return TokenTree(
            token_ids=buf.tok[:n].copy(),
            parents=buf.par[:n].copy(),
            depth=buf.dep[:n].copy(),
            source=source,
            score=buf.score[:n].copy(),
            draft_probs=np.full(n, np.nan, dtype=np.float32),
            feature=buf.bucket[:n].copy(),
            base_score=np.asarray(tree.score, dtype=np.float64),  # the memory adds, never displaces
        )

    def observe(self, tree: TokenTree, emitted: Sequence[int]) -> None:
        """Learn from a step: ``tree`` as proposed (before the policy pruned it) and the tokens
        the target emitted (see ``AcceptanceTracker.learn``); memory nodes teach the memory's
        tracker."""
        mt = self.memory_tracker
        if mt is None:
            self.tracker.learn(tree, emitted)
            return
        if tree.n_nodes > 1 and tree.feature is not None:
            k = self.memory_bucket_offset
            for c, hit in tried_nodes(tree, emitted):
                b = int(tree.feature[c])
                if b >= k:
                    mt.record(b - k, hit)
                else:
                    self.tracker.record(b, hit)
        self.tracker.end_step()
        mt.end_step()

    def _end_request(self) -> None:
        """Write the request that ran (context, prompt, output) to the memory unless it opted
        out, and give the memory what the tracker learned about its buckets."""
        if self.memory is None or not self._in_request:
            return
        self._in_request = False
        mt = self.memory_tracker
        self.memory.fold(mt.acc - self._folded[0], mt.n - self._folded[1])
        self._folded = (mt.acc.copy(), mt.n.copy())
        if not self._use_memory:
            return
        toks = np.asarray(self.index.tokens, dtype=np.int32)
        start = 0
        last = self._written
        if last is not None:  # the engine's next request repeats the last one's text (a chat): write what is new
            m = min(last.size, toks.size)
            diff = np.flatnonzero(last[:m] != toks[:m])
            common = int(diff[0]) if diff.size else m
            if common == toks.size:
                return
            start = max(0, common - _MEMORY_OVERLAP)
        self.memory.write(toks[start:])
        self._written = toks

    def close(self) -> None:
        """End the current request (write it to the memory)."""
        self._end_request()


# a text that continues the previous one is written from this many tokens before it differs
# (so that its first n-grams have their context)
_MEMORY_OVERLAP = 16


class _MemoryBuffers:
    """Node buffers ``DraftMemory.draft_into`` merges into (reused between steps)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.tok = np.empty(cap, dtype=np.int32)
        self.par = np.empty(cap, dtype=np.int32)
        self.dep = np.empty(cap, dtype=np.int32)
        self.bucket = np.empty(cap, dtype=np.int32)
        self.score = np.empty(cap, dtype=np.float64)
        self.addr = tuple(a.ctypes.data for a in (self.tok, self.par, self.dep, self.score, self.bucket))
