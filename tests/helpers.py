"""Test drafters and comparison helpers for the real-model tests."""

from __future__ import annotations

import numpy as np

from localspec.bench.specbench import divergence, top2_gap
from localspec.tree import TokenSource, TokenTree, TreeBuilder

NEAR_TIE = 0.5  # top-2 logit gap below which batched vs single decodes may disagree on CPU


class ScriptedDrafter:
    """Proposes the continuation of a known token sequence (an "oracle"), optionally with
    wrong tokens mixed in, as chains or as trees with decoy branches.

    Args:
        script: the full expected sequence (prompt + continuation).
        chain: draft length per step.
        wrong_every: make every k-th draft token wrong (0 = never).
        decoys: extra wrong siblings per depth (makes a tree).
    """

    name = "scripted"
    source = TokenSource.NGRAM

    def __init__(self, script, chain=4, wrong_every=0, decoys=0, seed=0, decoys_first=False):
        self.script = list(script)
        self.chain = chain
        self.wrong_every = wrong_every
        self.decoys = decoys
        self.decoy_score = 0.95 if decoys_first else 0.1  # best-first order puts decoys first
        self.rng = np.random.default_rng(seed)
        self.history: list[int] = []
        self.proposed = 0

    def begin(self, history):
        self.history = list(history)

    def accept(self, tokens):
        self.history.extend(tokens)

    def observe(self, tree, result):
        pass

    def close(self):
        pass

    def propose(self, max_depth, max_nodes):
        n = len(self.history)
        b = TreeBuilder(self.history[-1])
        if self.history != self.script[:n]:
            return b.build()  # off script: nothing to propose
        node = 0
        for d in range(min(self.chain, max_depth)):
            if n + d >= len(self.script) or len(b) >= max_nodes:
                break
            tok = self.script[n + d]
            self.proposed += 1
            if self.wrong_every and self.proposed % self.wrong_every == 0:
                tok = (tok + 17) % 200000
            for _ in range(self.decoys):
                if len(b) < max_nodes - 1:
                    b.add(node, int(self.rng.integers(1000, 200000)), source=TokenSource.NGRAM, score=self.decoy_score)
            node = b.add(node, tok, source=TokenSource.NGRAM, score=0.9 ** (d + 1) * (0.5 if self.decoy_score > 0.5 else 1))
        return b.build()


class RandomDrafter(ScriptedDrafter):
    """Proposes random tokens (trees of random chains): an adversary for greedy decoding."""

    name = "random"

    def __init__(self, width=3, depth=4, seed=0):
        super().__init__([], seed=seed)
        self.width, self.depth = width, depth

    def propose(self, max_depth, max_nodes):
        b = TreeBuilder(self.history[-1])
        for _ in range(self.width):
            node = 0
            for _d in range(min(self.depth, max_depth)):
                if len(b) >= max_nodes:
                    break
                node = b.add(node, int(self.rng.integers(0, 262144)), source=TokenSource.NGRAM, score=0.5)
        return b.build()


def assert_same_up_to_near_ties(engine, prompt_tokens, plain_ids, spec_ids, max_gap=NEAR_TIE):
    """Identical, or the first divergence sits at a near-tie of the plain distribution."""
    div = divergence(plain_ids, spec_ids)
    if div is None:
        return None
    assert div < len(plain_ids) and div < len(spec_ids), "one output is a strict prefix of the other"
    engine.reset()
    gap = top2_gap(engine, list(prompt_tokens) + list(plain_ids[:div]))
    assert gap < max_gap, f"outputs diverge at {div} where the top-2 gap is {gap:.3f} (not a near-tie)"
    return gap


def tree_of(*paths, root):
    b = TreeBuilder(root)
    for path in paths:
        node = 0
        for t in path:
            node = b.add(node, t, source=TokenSource.NGRAM)
    return b.build()


def chain(root, toks) -> TokenTree:
    return TokenTree.chain(root, toks)


def perturbed_gap(engine, prefix, sampling):
    """Top-2 gap of the seeded Gumbel-perturbed processed logits after ``prefix``: the
    margin by which plain decoding chose its token at that position."""
    from localspec.sampler import RequestSampler
    from localspec.sampling import gumbel_noise
    from localspec.tree import TokenTree

    engine.reset()
    engine.cache.prefill(prefix[:-1])
    tree = TokenTree.root_only(prefix[-1])
    lay, lg = engine.cache.decode_tree(tree)
    row = lg[0].copy()
    engine.cache.commit(tree, lay, [])
    req = RequestSampler(sampling, engine.model, prefix)
    c = req.processor.candidates(row, req.penalties.counts if req.penalties else None, None)
    z = np.sort(c.logits + gumbel_noise(req.seed, len(prefix), c.ids))
    engine.reset()
    return float(z[-1] - z[-2]) if z.size > 1 else float("inf")
