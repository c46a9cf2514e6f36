"""Sampling parameters and the logits -> distribution pipeline (numpy reference path).

The same pipeline is applied at every verified position, with and without speculation, in
llama.cpp's default order::

    logit bias (+ the model's suppressed tokens = -inf)
    -> repetition / frequency / presence penalties over the last ``penalty_last_n`` tokens
       (prompt included, and the earlier tokens of the same accepted block)
    -> GBNF grammar mask
    -> top-k -> top-p -> min-p -> temperature

Temperature 0 is greedy: the argmax after bias, penalties and grammar (no division by 0).
A row is also decided greedily at temperature > 0 in two cases (``greedy_row``), identically
here and in the C kernels:

* a token whose adjusted logit is ``+inf`` (a ``+inf`` logit bias) is *forced*: it is chosen
  with probability 1 at every temperature (several: the lowest id, llama.cpp's argmax; with a
  grammar, the lowest grammar-allowed one; a grammar that allows none of them treats them as
  banned). llama.cpp's ``--logit-bias TOKEN=+inf`` has this meaning at temperature 0 (its
  argmax keeps the first maximum) and no defined one at temperature > 0 (its softmax of
  ``inf - inf`` is NaN); ``+1e30`` forces the token in both.
* the temperature is so small that the largest finite adjusted logit divided by it
  (float32, as the division is done) is not finite, e.g. ``T = 1e-40`` or ``1e-300``: the
  distribution is the greedy point mass within float precision, so it is taken as such.

**Seeded, reproducible sampling.** At temperature > 0 the token at absolute position ``pos`` is
``argmax_i(processed_logits_i + g_i)`` with Gumbel noise ``g_i = -log(-log(u_i))`` and
``u_i = hash(seed, pos, i)`` (a counter-based hash, splitmix64). That is an exact sample of
``softmax(processed_logits)`` (Gumbel-max), and because the noise depends only on
``(seed, pos, token)``, the token at a position is fixed by the seed whatever was drafted:
verifying a tree is greedy verification on perturbed logits, and plain and speculative
decoding give the same text for a seed (up to numerical near-ties of the logits).
"""

from __future__ import annotations

import collections
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

import numpy as np

from . import native
from .errors import GrammarError, InvalidRequestError
from .native import rows as native_rows

MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
# Domains of the random streams, so that Gumbel noise, ratio tests and residual draws of the
# same (seed, pos) are independent.
STREAM_GUMBEL = 0
STREAM_ACCEPT = 1
STREAM_RESIDUAL = 2
STREAM_DRAFT = 3  # draft models sampling their own (stochastic) draft tokens


class CandidateFilter(Protocol):
    """A stateless transform of one position's candidate set.

    ``__call__(ids, logits)`` takes the candidates that survived top-k / top-p / min-p
    (``ids`` [m] int64, ``logits`` [m] float32, before temperature) and returns the
    candidates to sample from, as a new ``(ids, logits)`` pair. It must depend on nothing
    but its arguments, so that every verified position gets exactly what plain decoding
    would get there.
    """

    name: str

    def __call__(self, ids: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. Defaults are llama.cpp's (``llama-cli`` / ``llama-server``).

    Attributes:
        temperature: 0 = greedy; > 0 divides the logits (applied last); a temperature so
            small that the division overflows float32 decides the row greedily.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set of most likely tokens whose mass reaches p (1 = off; 0
            keeps only the most likely token, as llama.cpp's top-p keeps at least one).
        min_p: drop tokens with prob < min_p * max prob (0 = off).
        repeat_penalty: divide positive / multiply negative logits of recent tokens (1 = off).
        frequency_penalty: subtract count * this from recent tokens' logits (0 = off).
        presence_penalty: subtract this from recent tokens' logits (0 = off).
        penalty_last_n: window of recent tokens for penalties (0 = off, -1 = whole context).
        logit_bias: token id -> value added to its logit (``-inf`` bans it, ``+inf`` forces
            it, see the module docstring; NaN is refused).
        seed: seed of the per-position random streams; None draws one (reported in stats).
        grammar: GBNF grammar text constraining the output, or None.
        grammar_root: start rule of ``grammar``.
        verify: how speculative drafts are checked at temperature > 0:
            ``"gumbel"`` (default) - greedy verification on seeded Gumbel-perturbed logits;
            the same seed gives the same text with or without speculation.
            ``"rejection"`` - classic rejection sampling (Leviathan et al. 2023; SpecInfer for
            trees), using the drafter's own probabilities where it has them; the seed makes
            it reproducible for the same drafter only.
        logprobs: None = no log-probabilities; n >= 0 = the emitted token's log-prob under the
            raw model distribution plus the top-n alternatives.
        candidate_filter: a stateless per-position transform of the candidate set (e.g.
            llama.cpp's ``infill`` sampler, see ``CandidateFilter``), applied after top-k /
            top-p / min-p and before temperature, identically with and without speculation.
        accept_threshold_single / accept_threshold_acc: **LOSSY**, opt-in. SGLang's acceptance
            thresholds (``localspec.verify.verify_thresholds``), each in (0, 1]; None = the
            engine's (``Engine(accept_threshold_single=...)``, 1.0 unless set). With both at
            1.0 verification is lossless and runs exactly as without them; a value < 1 at
            temperature > 0 accepts drafts the target would not always have chosen, so the
            output is no longer the target's distribution (``lossy``). At temperature 0 greedy
            verification is used and they do not apply.
        draft_memory: not a sampling choice but the request's privacy choice: False keeps its
            text out of the process's drafting memory (``drafters.memory.DraftMemory``): the
            request neither drafts from it nor is written to it. The output does not depend on it.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    grammar: str | None = None
    grammar_root: str = "root"
    verify: Literal["gumbel", "rejection"] = "gumbel"
    logprobs: int | None = None
    candidate_filter: "CandidateFilter | None" = None
    accept_threshold_single: float | None = None
    accept_threshold_acc: float | None = None
    draft_memory: bool = True

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise InvalidRequestError(f"{name} must be a number, got {v!r}")
        for name, none_ok in (("top_k", False), ("penalty_last_n", False), ("seed", True), ("logprobs", True)):
            v = getattr(self, name)
            if not (none_ok and v is None) and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
                raise InvalidRequestError(f"{name} must be an integer{' or None' if none_ok else ''}, got {v!r}")
        if not isinstance(self.logit_bias, Mapping):
            raise InvalidRequestError(f"logit_bias must map token ids to biases, got {self.logit_bias!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise InvalidRequestError(f"grammar must be GBNF text or None, got {type(self.grammar).__name__}")
        for name in ("accept_threshold_single", "accept_threshold_acc"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 < v <= 1.0):
                raise InvalidRequestError(f"{name} must be in (0, 1] (1 = lossless), got {v!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise InvalidRequestError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        if self.penalty_last_n < -1:
            raise InvalidRequestError(f"penalty_last_n must be >= -1, got {self.penalty_last_n}")
        if self.verify not in ("gumbel", "rejection"):
            raise InvalidRequestError(f"verify must be 'gumbel' or 'rejection', got {self.verify!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 100:
            raise InvalidRequestError(f"logprobs must be in [0, 100], got {self.logprobs}")
        for t, v in dict(self.logit_bias).items():
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise InvalidRequestError(f"logit_bias keys must be token ids (integers), got {t!r}")
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or math.isnan(v):
                raise InvalidRequestError(f"logit_bias of token {t} must be a number, got {v!r}")
        for name in ("frequency_penalty", "presence_penalty", "repeat_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be finite, got {getattr(self, name)}")
        if self.seed is not None and not 0 <= int(self.seed) <= MASK64:
            raise InvalidRequestError(f"seed must be an integer in 0..{MASK64}, got {self.seed}")

    @classmethod
    def greedy(cls, **kw) -> "SamplingParams":
        """Temperature 0, no truncation: the target's argmax at every position."""
        base = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
        base.update(kw)
        return cls(**base)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return self.penalty_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        )

    @property
    def acceptance_thresholds(self) -> tuple[float, float]:
        """``(accept_threshold_single, accept_threshold_acc)`` with None read as 1.0 (lossless)."""
        return self.accept_threshold_single or 1.0, self.accept_threshold_acc or 1.0

    @property
    def lossy(self) -> bool:
        """Whether the lossy acceptance thresholds are in effect: one of them below 1 at
        temperature > 0 (at temperature 0 greedy verification ignores them)."""
        return not self.is_greedy and min(self.acceptance_thresholds) < 1.0

    def with_seed(self, seed: int) -> "SamplingParams":
        return replace(self, seed=int(seed))


def random_seed() -> int:
    """A fresh 63-bit seed from the OS."""
    return int.from_bytes(os.urandom(8), "little") >> 1


# -- counter-based random streams ---------------------------------------------------------------


def _mix64_scalar(z: int) -> int:
    z &= MASK64
    z = ((z ^ (z >> 30)) * _M1) & MASK64
    z = ((z ^ (z >> 27)) * _M2) & MASK64
    return z ^ (z >> 31)


def stream_key(seed: int, pos: int, stream: int = STREAM_GUMBEL) -> int:
    """64-bit key of the random stream of ``(seed, pos, stream)``."""
    k = _mix64_scalar(int(seed) * _GOLDEN + int(pos) + 1)
    return _mix64_scalar(k ^ ((int(stream) + 1) * _M2))


def uniforms(key: int, counters: np.ndarray) -> np.ndarray:
    """Uniforms in (0, 1) of stream ``key`` at ``counters`` ([n] int, e.g. token ids): [n] float64.

    ``u = ((splitmix64(key + (c + 1) * golden) >> 11) + 0.5) / 2**53``.
    """
    with np.errstate(over="ignore"):
        z = np.uint64(key) + (np.asarray(counters, dtype=np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)


def uniform(key: int, counter: int) -> float:
    """One uniform of stream ``key`` (same value as ``uniforms(key, [counter])[0]``)."""
    z = _mix64_scalar((key + (counter + 1) * _GOLDEN) & MASK64)
    return ((z >> 11) + 0.5) * (1.0 / 9007199254740992.0)


def gumbel_noise(seed: int, pos: int, token_ids: np.ndarray) -> np.ndarray:
    """Gumbel(0, 1) noise of ``token_ids`` at position ``pos``: [n] float64."""
    u = uniforms(stream_key(seed, pos, STREAM_GUMBEL), token_ids)
    return -np.log(-np.log(u))


# -- penalties ----------------------------------------------------------------------------------


class PenaltyWindow:
    """Counts of the last ``n`` tokens (``n = -1``: all), updated one token at a time."""

    def __init__(self, n: int, tokens: Sequence[int] = ()) -> None:
        self.n = n
        self.window: collections.deque[int] = collections.deque()
        self.counts: collections.Counter[int] = collections.Counter()
        for t in tokens[-n:] if n > 0 else (tokens if n < 0 else ()):
            self.push(t)

    def push(self, token: int) -> None:
        if self.n == 0:
            return
        self.window.append(int(token))
        self.counts[int(token)] += 1
        if 0 < self.n < len(self.window):
            old = self.window.popleft()
            c = self.counts[old] - 1
            if c:
                self.counts[old] = c
            else:
                del self.counts[old]

    def copy(self) -> "PenaltyWindow":
        w = PenaltyWindow.__new__(PenaltyWindow)
        w.n = self.n
        w.window = collections.deque(self.window)
        w.counts = collections.Counter(self.counts)
        return w


def apply_penalties(x: np.ndarray, counts: Mapping[int, int], params: SamplingParams) -> None:
    """In place on ``x`` ([n_vocab] float32), llama.cpp's ``penalties`` sampler rule."""
    if not counts:
        return
    ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
    cnt = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
    v = x[ids]
    rp = np.float32(params.repeat_penalty)
    v = np.where(v <= 0, v * rp, v / rp)
    v = v - cnt * np.float32(params.frequency_penalty) - np.float32(params.presence_penalty)
    x[ids] = v


# -- the pipeline -------------------------------------------------------------------------------


@dataclass
class Candidates:
    """Tokens that survive the pipeline and their processed logits (temperature applied).

    ``ids`` [m] int64 and ``logits`` [m] float32; ``softmax(logits)`` is the distribution a
    token is drawn from. For greedy decoding ``m == 1``.
    """

    ids: np.ndarray
    logits: np.ndarray

    def probs(self) -> np.ndarray:
        """[m] float64 probabilities."""
        z = self.logits.astype(np.float64)
        z -= z.max()
        e = np.exp(z)
        return e / e.sum()

    def dense_probs(self, n_vocab: int) -> np.ndarray:
        """[n_vocab] float64 probabilities (zeros outside ``ids``)."""
        out = np.zeros(n_vocab, dtype=np.float64)
        out[self.ids] = self.probs()
        return out


class LogitsProcessor:
    """Applies ``SamplingParams`` to logits rows.

    The numpy code here is the reference implementation. Rows without a grammar go through
    the C kernels of ``localspec.native`` when they are available (same candidates and
    tokens; the tests compare both).

    Args:
        params: the sampling parameters.
        n_vocab: vocabulary size.
        suppress_ids: token ids the model never emits ([k] int; get ``-inf``).
        use_native: None follows ``localspec.native.enabled()`` at each call; False always
            runs the numpy reference; True requires the native kernels.
    Raises:
        InvalidRequestError: a logit_bias token id outside the vocabulary.
        RuntimeError: ``use_native=True`` but the native library is not available.
    """

    _CHUNK = 512

    def __init__(
        self,
        params: SamplingParams,
        n_vocab: int,
        suppress_ids: Sequence[int] = (),
        *,
        use_native: bool | None = None,
    ) -> None:
        self.params = params
        self.n_vocab = n_vocab
        bias = dict(params.logit_bias)
        for t in suppress_ids:
            bias[int(t)] = -math.inf
        for t in bias:
            if not 0 <= int(t) < n_vocab:
                raise InvalidRequestError(f"logit_bias token id {t} is outside the vocabulary (0..{n_vocab - 1})")
        self._bias_ids = np.fromiter((int(t) for t in bias), dtype=np.int64, count=len(bias))
        self._bias_val = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        self._has_posinf_bias = bool(np.isposinf(self._bias_val).any())
        self._all_ids = None
        if use_native and not native.AVAILABLE:
            raise RuntimeError(f"the native kernels are not available: {native.LOAD_ERROR}")
        self.use_native = use_native
        self._native_state = None

    def native_state(self):
        """The C kernels' view of these parameters when they serve this processor, else None."""
        if self.use_native is False or (self.use_native is None and not native.enabled()):
            return None
        if self.params.candidate_filter is not None:  # the C kernels know no candidate filters
            return None
        if self._native_state is None:
            self._native_state = native_rows.SamplingState(self.params, self._bias_ids, self._bias_val)
        return self._native_state

    @property
    def all_ids(self) -> np.ndarray:
        if self._all_ids is None:
            self._all_ids = np.arange(self.n_vocab, dtype=np.int64)
        return self._all_ids

    def adjusted(self, row: np.ndarray, counts: Mapping[int, int] | None) -> np.ndarray:
        """``row`` with bias and penalties applied: [n_vocab] float32 (a copy when changed)."""
        p = self.params
        needs_pen = counts and p.has_penalties
        if self._bias_ids.size == 0 and not needs_pen:
            return row
        x = np.array(row, dtype=np.float32, copy=True)
        if self._bias_ids.size:
            x[self._bias_ids] += self._bias_val
        if needs_pen:
            apply_penalties(x, counts, p)
        return x

    def _valid_desc(self, x: np.ndarray, need: int, grammar) -> np.ndarray:
        """Up to ``need`` grammar-valid token ids in descending ``x`` order (ties: lower id)."""
        out: list[np.ndarray] = []
        have = 0
        finite = np.isfinite(x)
        n_finite = int(finite.sum())
        if n_finite == 0:
            return np.zeros(0, dtype=np.int64)
        take = min(max(self._CHUNK, need), n_finite)
        order = None
        start = 0
        while have < need and start < n_finite:
            if order is None or start + take > order.size:
                k = min(n_finite, max(start + take, 2 * (order.size if order is not None else 0)))
                order = _top_sorted(x, k)
            chunk = order[start : start + take]
            if grammar is not None:
                chunk = chunk[grammar.allowed(chunk)]
            out.append(chunk)
            have += chunk.size
            start += take
            take *= 4
        ids = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
        return ids[:need]

    def _forced_ids(self, x: np.ndarray) -> np.ndarray:
        """Ascending ids whose adjusted logit is ``+inf`` (only a logit bias can make one)."""
        if not self._has_posinf_bias:
            return np.zeros(0, dtype=np.int64)
        ids = self._bias_ids[np.isposinf(x[self._bias_ids])]
        return np.unique(ids)

    def greedy_row(self, x: np.ndarray, grammar=None) -> bool:
        """Whether the row with adjusted logits ``x`` ([n_vocab] float32) is decided greedily.

        True at temperature 0; at temperature > 0 when a token is forced (``+inf`` logit bias,
        allowed by ``grammar``) or when ``float32(max finite x) / float32(T)`` is not finite
        (the division would overflow). The C kernels apply the same rule (``ls_rows.c``).
        """
        p = self.params
        if p.is_greedy:
            return True
        forced = self._forced_ids(x)
        if forced.size and (grammar is None or grammar.allowed(forced).any()):
            return True
        m = x.max()
        if not np.isfinite(m):
            if m == -np.inf or np.isnan(m):
                return False  # nothing finite: the caller reports it
            fin = x[np.isfinite(x)]
            if fin.size == 0:
                return False
            m = fin.max()
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            return not np.isfinite(np.float32(m) / np.float32(p.temperature))

    def _greedy(self, x: np.ndarray, grammar) -> Candidates:
        """The greedy point mass of adjusted logits ``x``: a forced token, else the argmax."""
        if grammar is None:
            t = int(np.argmax(x))
            if not x[t] > -np.inf:
                raise InvalidRequestError("every token is banned by logit_bias")
            return Candidates(np.array([t], dtype=np.int64), np.array([0.0], dtype=np.float32))
        forced = self._forced_ids(x)
        if forced.size:
            forced = forced[grammar.allowed(forced)]
            if forced.size:
                return Candidates(forced[:1], np.array([0.0], dtype=np.float32))
        ids = self._valid_desc(x, 1, grammar)
        if ids.size == 0:
            raise GrammarError("no token can continue the grammar here")
        return Candidates(ids, np.array([0.0], dtype=np.float32))

    def candidates(self, row: np.ndarray, counts: Mapping[int, int] | None = None, grammar=None) -> Candidates:
        """The processed distribution of one row.

        Args:
            row: [n_vocab] float32 raw logits.
            counts: token -> count in the penalty window of this position.
            grammar: ``GrammarState`` at this position, or None.
        Raises:
            GrammarError: no token is allowed.
            InvalidRequestError: every token is banned by the logit bias.
        """
        p = self.params
        if grammar is None:
            state = self.native_state()
            if state is not None:
                return Candidates(*native_rows.candidates(state, row, counts))
        x = self.adjusted(row, counts)
        greedy = self.greedy_row(x, grammar)
        if p.candidate_filter is not None:
            return self._filtered(x, grammar, greedy)
        if greedy:
            return self._greedy(x, grammar)
        truncating = p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0
        if not truncating:
            if grammar is not None:
                mask = grammar.allowed(self.all_ids) & np.isfinite(x)
            else:
                mask = np.isfinite(x)
            ids = self.all_ids if mask.all() else np.flatnonzero(mask)
            if ids.size == 0:
                raise GrammarError("no token is allowed here (grammar / logit_bias)")
            return Candidates(ids, self._scaled(x[ids]))
        ids = self._truncated(x, grammar)
        return Candidates(ids, self._scaled(x[ids]))

    def _scaled(self, logits: np.ndarray) -> np.ndarray:
        """``logits / T`` in float32 (finite maximum, as ``greedy_row`` checked; lower logits
        may become ``-inf``, probability 0 within float precision)."""
        with np.errstate(over="ignore"):
            return (logits / np.float32(self.params.temperature)).astype(np.float32)

    def _truncated(self, x: np.ndarray, grammar) -> np.ndarray:
        """Token ids surviving grammar -> top-k -> top-p -> min-p on adjusted logits ``x``."""
        p = self.params
        # sorted candidate prefix (descending), grammar applied before truncation
        k = p.top_k if p.top_k > 0 else self.n_vocab
        if grammar is None:
            ids = _truncate(x, k, p.top_p, p.min_p)
        else:
            if p.top_k <= 0:
                valid = np.flatnonzero(grammar.allowed(self.all_ids) & np.isfinite(x))
                sorted_ids = valid[_top_sorted(x[valid], valid.size)]
            else:
                sorted_ids = self._valid_desc(x, k, grammar)
            if sorted_ids.size == 0:
                raise GrammarError("no token can continue the grammar here")
            ids = _truncate_sorted(sorted_ids, x, p.top_p, p.min_p)
        if ids.size == 0:
            raise InvalidRequestError("every token is banned by logit_bias")
        return ids

    def _filtered(self, x: np.ndarray, grammar, greedy: bool) -> Candidates:
        """The pipeline with a ``candidate_filter`` between truncation and temperature.

        Truncation applies also at temperature 0 here, because the filter sees the truncated
        set (llama.cpp's chain ``top_k -> top_p -> infill -> temperature(0)``); greedy then
        takes the highest logit among the filtered candidates. A forced token (``+inf`` bias)
        skips truncation and the filter.
        """
        p = self.params
        forced = self._forced_ids(x)
        if forced.size and (grammar is None or grammar.allowed(forced).any()):
            return self._greedy(x, grammar)
        ids = self._truncated(x, grammar)
        ids, logits = p.candidate_filter(ids, x[ids].astype(np.float32))
        keep = np.isfinite(logits)
        ids, logits = np.asarray(ids, dtype=np.int64)[keep], np.asarray(logits, dtype=np.float32)[keep]
        if ids.size == 0:
            raise InvalidRequestError(f"the {p.candidate_filter.name} sampler left no candidate")
        if greedy:
            i = int(np.argmax(logits))
            return Candidates(ids[i : i + 1], np.array([0.0], dtype=np.float32))
        return Candidates(ids, self._scaled(logits))

    def choose(self, row: np.ndarray, pos: int, seed: int, counts=None, grammar=None) -> int:
        """The token at absolute position ``pos``: greedy (see ``greedy_row``), or seeded
        Gumbel-max over the processed distribution. Exactly a sample of
        ``softmax(candidates.logits)``."""
        p = self.params
        if grammar is None:
            state = self.native_state()
            if state is not None:
                return native_rows.choose(state, row, pos, seed, counts)
        if p.is_greedy:
            return int(self.candidates(row, counts, grammar).ids[0])
        truncating = p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0
        if grammar is not None and not truncating and p.candidate_filter is None:
            # argmax over grammar-valid tokens of (x/T + g): walk the perturbed order, check grammar lazily
            x = self.adjusted(row, counts)
            if self.greedy_row(x, grammar):
                return int(self._greedy(x, grammar).ids[0])
            z = x.astype(np.float64) / p.temperature + gumbel_noise(seed, pos, self.all_ids)
            ids = self._valid_desc(z, 1, grammar)
            if ids.size == 0:
                raise GrammarError("no token can continue the grammar here")
            return int(ids[0])
        c = self.candidates(row, counts, grammar)
        if c.ids.size == 1:
            return int(c.ids[0])
        z = c.logits.astype(np.float64) + gumbel_noise(seed, pos, c.ids)
        return int(c.ids[int(np.argmax(z))])


def top_k(x: np.ndarray, k: int) -> np.ndarray:
    """[<= k] int64 indices of the ``k`` largest finite values of ``x`` ([n] float), sorted by
    (value desc, index asc); fewer when fewer values are finite. The one top-k rule: float32
    rows go through the C kernel (``ls_top_k``) when it is built, everything else through
    ``_top_sorted``, its reference (tests/test_native.py compares them, ties included)."""
    if x.dtype == np.float32 and native.enabled():
        return native_rows.top_k(x, k)
    return _top_sorted(x, k)


def _top_sorted(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest finite values of ``x``, sorted descending (ties: lower index)."""
    n = x.shape[0]
    k = min(k, n)
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    if k < n:
        part = np.argpartition(-x, k - 1)[:k]
        # include every index tied with the k-th value so tie-breaking is by index, not luck
        kth = x[part].min()
        ties = np.flatnonzero(x == kth)
        part = np.union1d(part[x[part] > kth], ties)
    else:
        part = np.arange(n)
    vals = x[part]
    order = np.lexsort((part, -vals))
    out = part[order][:k]
    return out[np.isfinite(x[out])].astype(np.int64)


def _truncate(x: np.ndarray, k: int, top_p: float, min_p: float) -> np.ndarray:
    """llama.cpp's top-k -> top-p -> min-p; returns the surviving token ids.

    ``x`` is the full row ([n_vocab] float32). top-p keeps the first i+1 tokens (descending) at which the cumulative probability,
    normalised over the top-k set, first reaches ``top_p``; min-p keeps logits
    >= max + log(min_p). At least one token always survives.
    """
    finite = np.isfinite(x)
    n_fin = int(finite.sum())
    k = min(k, n_fin)
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    if top_p >= 1.0:
        ids = _top_set(x, k)
        if min_p > 0.0:
            thr = float(x[ids].max()) + math.log(min_p)
            ids = ids[x[ids] >= thr]
        return ids
    # normaliser of top-p over the top-k set
    topk_vals = x[_top_set(x, k)].astype(np.float64)
    mx = float(topk_vals.max())
    z = float(np.exp(topk_vals - mx).sum())
    m = min(k, 256)
    while True:
        sorted_ids = _top_sorted(x, m)
        vals = x[sorted_ids].astype(np.float64)
        cum = np.cumsum(np.exp(vals - mx)) / z
        if cum[-1] >= top_p or m >= k:
            break
        m = min(k, m * 4)
    return _cut_prefix(sorted_ids, vals, cum, top_p, min_p)


def _truncate_sorted(sorted_ids: np.ndarray, x: np.ndarray, top_p: float, min_p: float) -> np.ndarray:
    """top-p -> min-p on ``sorted_ids`` ([m] descending, the whole candidate set)."""
    vals = x[sorted_ids].astype(np.float64)
    mx = vals[0]
    e = np.exp(vals - mx)
    cum = np.cumsum(e) / e.sum()
    return _cut_prefix(sorted_ids, vals, cum, top_p, min_p)


def _cut_prefix(sorted_ids: np.ndarray, vals: np.ndarray, cum: np.ndarray, top_p: float, min_p: float) -> np.ndarray:
    keep = sorted_ids.size
    if top_p < 1.0:
        hit = np.flatnonzero(cum >= top_p)
        if hit.size:
            keep = int(hit[0]) + 1
    if min_p > 0.0:
        thr = vals[0] + math.log(min_p)
        keep = min(keep, int(np.count_nonzero(vals >= thr)))
    return sorted_ids[: max(1, keep)]


def _top_set(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values of ``x`` (unordered; ties at the k-th: lower index)."""
    n = x.shape[0]
    if k >= n:
        return np.flatnonzero(np.isfinite(x)).astype(np.int64)
    return _top_sorted(x, k)
