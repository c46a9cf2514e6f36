"""``Generation``: the state of one request on the speculative step.

Everything one request carries from step to step, for the engine (one request) and the
batch scheduler (many) alike: the prompt, the sampling state (``RequestState``), the drafter
and its score calibration, the text assembly with stop strings, the emitted tokens with their
sources and log-probabilities, and the statistics. ``localspec.step`` runs the step over a
list of them; this module holds the per-request rules:

* ``stop_reason`` - whether the request ends before its next step (token budget, context,
  cancel, time);
* ``limits`` - the largest tree the next step may verify for it;
* ``emit`` - the tokens a step produced, cut at an end-of-generation token, a stop string or
  ``max_tokens``;
* ``finish`` - the result, everything cut at the same point, statistics finalised;
* ``check_max_tokens`` - the token budget a request may ask for.
"""

from __future__ import annotations

import numbers
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from .drafters import Drafter
from .errors import InvalidRequestError
from .policy import ScoreCalibration
from .request_state import RequestState
from .results import GenerationResult, StreamChunk, TokenLogprob
from .stats import GenerationStats
from .text import TextAssembler
from .tree import TokenSource, TokenTree
from .verify import VerifyResult


def check_max_tokens(max_tokens) -> int:
    """``max_tokens`` as an ``int`` (a whole number >= 0; numpy integers too).

    Raises:
        InvalidRequestError: anything else (None, a float, a bool, a negative number).
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) or max_tokens < 0:
        raise InvalidRequestError(f"max_tokens must be a whole number >= 0, got {max_tokens!r}")
    return int(max_tokens)


def check_stop(stop) -> list[str]:
    """``stop`` as a list of stop strings: one string (as the OpenAI API takes it) or a
    sequence of them; ``list("year")`` would be four one-letter stops.

    Raises:
        InvalidRequestError: anything else, or an empty string (it would stop at once).
    """
    stops = [stop] if isinstance(stop, str) else stop
    if isinstance(stops, (bytes, bytearray)) or not isinstance(stops, Iterable):
        raise InvalidRequestError(f"stop must be a string or a sequence of strings, got {type(stop).__name__}")
    stops = list(stops)
    odd = [x for x in stops if not isinstance(x, str)]
    if odd:
        raise InvalidRequestError(f"stop must be a string or a sequence of strings, got an item {odd[0]!r}")
    if any(not x for x in stops):
        raise InvalidRequestError("stop strings must not be empty")
    return stops


def now_us() -> float:
    """The step's clock (µs, ``time.perf_counter``)."""
    return time.perf_counter() * 1e6


class Generation:
    """One request's state (see the module docstring).

    Args:
        prompt: the prompt's token ids (its last token is the first tree's root).
        state: the request's ``RequestState`` (closed by ``finish``).
        drafter: the request's drafter, or None for plain decoding.
        calibration: the request's ``ScoreCalibration`` (``ScoreCalibration.for_request``),
            or None without a drafter.
        max_tokens: most tokens to emit.
        stop: stop strings.
        token_bytes / is_eog: the target's token pieces and end-of-generation test.
        max_time_ms: end with ``"time"`` once this much time has passed since the first step.
        t_start_us: when the request arrived (``now_us``).
        draft_limits: per-request caps on what is drafted (``DraftLimits``) or None.
        cancelled: the event that cancels the request (default: a new one).
    """

    def __init__(
        self,
        prompt: Sequence[int],
        state: RequestState,
        drafter: Drafter | None,
        *,
        calibration: ScoreCalibration | None,
        max_tokens: int,
        stop: Sequence[str],
        token_bytes: Callable[[int], bytes],
        is_eog: Callable[[int], bool],
        max_time_ms: float | None = None,
        t_start_us: float | None = None,
        draft_limits=None,
        cancelled: threading.Event | None = None,
    ) -> None:
        self.prompt = [int(t) for t in prompt]
        self.state = state
        self.drafter = drafter
        self.calibration = calibration
        self.max_tokens = int(max_tokens)
        self.max_time_ms = max_time_ms
        self.draft_limits = draft_limits
        self._is_eog = is_eog
        self.assembler = TextAssembler(token_bytes, stop)
        self.stats = GenerationStats(drafter=drafter.name if drafter is not None else "none", seed=state.seed)
        self.stats.set_thresholds(state.params, drafted=drafter is not None)
        self.stats.n_prompt_tokens = len(self.prompt)
        self.t_start_us = now_us() if t_start_us is None else t_start_us
        self.t_gen0_us = 0.0  # the first step's start (0: no step yet)
        self.root = self.prompt[-1]  # the next tree's root: the last prompt or emitted token
        self.out_tokens: list[int] = []
        self.out_sources: list[TokenSource] = []
        self.out_depths: list[int] = []  # depth of each emitted token (0: not an accepted draft)
        self.out_logprobs: list[TokenLogprob] = []
        self.step_drafted: list[int] = []  # depth of each step's verified tree
        self.finish_reason: str | None = None
        self.stop_name: str | None = None
        self.cancelled = cancelled if cancelled is not None else threading.Event()
        self.error: BaseException | None = None  # why a step ended it with "error"
        self.result: GenerationResult | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def want_logprobs(self) -> int | None:
        return self.state.params.logprobs

    def stop_reason(self, n_free: int) -> str | None:
        """Why the request ends before its next step (``n_free``: KV cells it has left), or None."""
        if self.cancelled.is_set():
            return "cancelled"
        if self.max_tokens - len(self.out_tokens) <= 0 or n_free < 1:
            return "length"
        if self.max_time_ms is not None and self.stats.n_steps and now_us() - self.t_gen0_us >= 1e3 * self.max_time_ms:
            return "time"
        return None

    def limits(self, n_free: int, max_tree_nodes: int) -> tuple[int, int]:
        """``(max_depth, max_nodes)`` of the next tree: no deeper than the tokens still to emit
        (the bonus token included) nor the free cells, no larger than ``max_tree_nodes`` nor
        the free cells."""
        remaining = self.max_tokens - len(self.out_tokens)
        return min(remaining - 1, n_free - 1), min(max_tree_nodes, n_free)

    def emit(self, tree: TokenTree, res: VerifyResult, logprobs: list[TokenLogprob] | None) -> list[StreamChunk]:
        """Record a verified step: its tree (statistics) and the emitted tokens, up to an
        end-of-generation token, a stop string or ``max_tokens`` (then ``done``). Returns the
        chunks to stream."""
        st = self.stats
        step = st.n_steps
        st.n_steps += 1
        if tree.n_nodes > 1:
            st.n_spec_steps += 1
            st.num_draft_tokens += tree.n_nodes - 1
        self.step_drafted.append(tree.max_depth())
        chunks: list[StreamChunk] = []
        for i, tok in enumerate(res.tokens):
            st.n_step_tokens += 1
            if self._is_eog(tok):
                self.finish_reason, self.stop_name = "stop", "<eog>"
                break
            if len(self.out_tokens) >= self.max_tokens:
                self.finish_reason = "length"
                break
            text = self.assembler.push(tok)
            self.out_tokens.append(int(tok))
            self.out_sources.append(res.sources[i])
            self.out_depths.append(res.depths[i] if i < len(res.depths) else 0)
            lp = logprobs[i] if logprobs is not None else None
            if lp is not None:
                self.out_logprobs.append(lp)
            chunks.append(StreamChunk(text, int(tok), res.sources[i], step, lp))
            if self.assembler.stop_hit is not None:
                self.finish_reason, self.stop_name = "stop", self.assembler.stop_hit.stop
                break
        self.root = int(res.tokens[-1])
        if self.finish_reason is None and len(self.out_tokens) >= self.max_tokens:
            self.finish_reason = "length"
        return chunks

    def finish(self, reason: str | None = None) -> StreamChunk | None:
        """End the request (``reason``, or the one ``emit`` found): cut tokens, sources and
        log-probabilities at the stop string, finalise the statistics, set ``result``, close
        the sampling state. Returns a last chunk with held-back text, or None. Idempotent."""
        if self.result is not None:
            return None
        if reason in ("cancelled", "error") or (reason is not None and self.finish_reason is None):
            self.finish_reason = reason  # a cancel or an error overrides what emit found
        reason = self.finish_reason or "length"
        if self.assembler.stop_hit is not None:
            n = self.assembler.stop_hit.n_tokens
            del self.out_tokens[n:], self.out_sources[n:], self.out_depths[n:], self.out_logprobs[n:]
        tail = self.assembler.finish()
        self.stats.finalise(self.out_sources, self.out_depths, self.step_drafted,
                            t_gen0_us=self.t_gen0_us, t_end_us=now_us(), t_start_us=self.t_start_us)
        self.state.close()
        self.result = GenerationResult(
            text=self.assembler.text,
            token_ids=list(self.out_tokens),
            finish_reason=reason,
            stop=self.stop_name,
            sources=list(self.out_sources),
            logprobs=list(self.out_logprobs) if self.want_logprobs is not None else None,
            stats=self.stats,
        )
        return StreamChunk(tail, -1, TokenSource.DECODE, self.stats.n_steps) if tail else None
