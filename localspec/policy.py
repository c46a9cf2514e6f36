"""Adaptive speculation: how many draft tokens to verify at each step, down to none.

The expected number of tokens a step emits when it verifies the tree ``T`` is

    E(T) = 1 + sum over draft nodes v in T of P(target accepts the path root..v)

(the 1 is the recovered/bonus token, always emitted). Drafters put their estimate of that
path probability in ``TokenTree.score``. For each candidate batch size b the best tree is the
b highest-scoring nodes (scores never increase down a path, so that set is a subtree), and
the policy picks the b that maximises expected tokens per second::

    rate(b) = E(best b-node subtree) / (t_decode(b) + t_host(b))

with ``t_decode`` from the measured ``CostModel`` and ``t_host`` (drafting, verification,
bookkeeping) tracked online. b = 1 is a plain decode step, so speculation is only used
when it is expected to be faster. Acceptance estimates are calibrated online by
``AcceptanceTracker`` so that optimistic drafters are corrected within a few steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .costmodel import CostModel
from .tree import TokenTree


class AcceptanceTracker:
    """Online estimate of P(a draft node is accepted | its parent was), per feature bucket.

    Two levels: long-run per-bucket rates (kept for the life of the drafter, starting from
    ``prior``), and per-request per-bucket counts with exponential forgetting, which dominate
    once a bucket has a few observations in the current request, so that a request in "copy
    mode" (summaries, repeated code, loops) or in free generation is recognised quickly.
    Drafters feed it every node whose parent the target reached, including nodes the policy
    did not verify (their outcome is known from the tokens the target emitted).

    Args:
        prior: [n_buckets] float prior acceptance rates.
        prior_weight: pseudo-observations behind the prior.
        local_weight: pseudo-observations of the long-run rate behind a request estimate.
        decay: forgetting of request counts per step.
    """

    def __init__(self, prior, *, prior_weight: float = 8.0, local_weight: float = 3.0, decay: float = 0.95) -> None:
        self.prior = np.asarray(prior, dtype=np.float64)
        self.prior_weight = prior_weight
        self.local_weight = local_weight
        self.decay = decay
        self.acc = np.zeros_like(self.prior)
        self.n = np.zeros_like(self.prior)
        self.reset_request()

    def reset_request(self) -> None:
        self.local_acc = np.zeros_like(self.prior)
        self.local_n = np.zeros_like(self.prior)

    def base_rate(self, bucket: int) -> float:
        return float((self.acc[bucket] + self.prior_weight * self.prior[bucket]) / (self.n[bucket] + self.prior_weight))

    def estimate(self, bucket: int) -> float:
        w = self.local_weight
        p = (self.local_acc[bucket] + w * self.base_rate(bucket)) / (self.local_n[bucket] + w)
        return float(min(0.995, p))

    def estimates(self) -> list[float]:
        """``estimate(b)`` of every bucket (one vectorised computation per step)."""
        base = (self.acc + self.prior_weight * self.prior) / (self.n + self.prior_weight)
        w = self.local_weight
        p = (self.local_acc + w * base) / (self.local_n + w)
        return np.minimum(p, 0.995).tolist()

    def end_step(self) -> None:
        self.local_acc *= self.decay
        self.local_n *= self.decay

    def record(self, bucket: int, accepted: bool) -> None:
        a = 1.0 if accepted else 0.0
        self.local_acc[bucket] += a
        self.local_n[bucket] += 1.0
        self.acc[bucket] += a
        self.n[bucket] += 1.0


@dataclass
class Choice:
    """The policy's decision for one step."""

    n_nodes: int  # batch size b (root included); 1 = plain decode
    expected_tokens: float
    expected_rate: float  # tokens per µs


class SpeculationPolicy:
    """Chooses the verified tree for each step (see module docstring).

    Args:
        cost: the target's ``CostModel``.
        max_nodes: largest tree to verify (root included).
        min_gain: speculate only when the expected rate beats plain decoding by this fraction
            (estimation errors make marginal choices lose on average).
    """

    def __init__(self, cost: CostModel, *, max_nodes: int = 64, min_gain: float = 0.05) -> None:
        self.cost = cost
        self.max_nodes = max_nodes
        self.min_gain = min_gain
        self.t_host_base_us = 1500.0  # per step, refined online
        self.t_host_node_us = 100.0  # per extra node, refined online
        self._alpha = 0.1

    def host_us(self, b: int) -> float:
        return self.t_host_base_us + self.t_host_node_us * (b - 1)

    def choose(self, tree: TokenTree, *, max_nodes: int | None = None) -> Choice:
        """Best batch size for ``tree`` (the candidate tree from the drafter)."""
        limit = min(self.max_nodes, tree.n_nodes, max_nodes or self.max_nodes)
        if limit <= 1:
            return Choice(1, 1.0, 1.0 / (self.cost.t_decode_us(1) + self.host_us(1)))
        scores = np.sort(tree.score[1:])[::-1]
        exp_tokens = 1.0 + np.concatenate([[0.0], np.cumsum(scores)])  # index b-1 -> E(b)
        plain = Choice(1, 1.0, 1.0 / (self.cost.t_decode_us(1) + self.host_us(1)))
        best = plain
        for b in self.cost.sizes:
            if b > limit:
                break
            e = float(exp_tokens[b - 1])
            rate = e / (self.cost.t_decode_us(b) + self.host_us(b))
            if rate > best.expected_rate:
                best = Choice(b, e, rate)
        # estimates are noisy: speculate only for a clear expected gain over plain decoding
        if best.expected_rate < plain.expected_rate * (1.0 + self.min_gain):
            return plain
        return best

    def observe_step(self, b: int, t_decode_us: float, t_host_us: float) -> None:
        """Feed back the measured decode and host time of a step of ``b`` nodes."""
        self.cost.observe(b, t_decode_us)
        a = self._alpha
        if b == 1:
            self.t_host_base_us += a * (t_host_us - self.t_host_base_us)
        else:
            per_node = max(0.0, (t_host_us - self.t_host_base_us) / (b - 1))
            self.t_host_node_us += a * (per_node - self.t_host_node_us)
