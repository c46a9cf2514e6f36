"""The engine: prefill -> (propose -> verify -> commit)* -> stop.

One loop serves plain and speculative decoding: a step verifies a token tree whose root is
the last emitted token; with no drafter (or when the policy decides drafting does not pay)
the tree is just the root, and the step is an ordinary decode::

    tree   = policy.plan(drafter.propose(...))          # decided once: root + draft tokens
    logits = cache.decode_tree(tree)                    # one llama_decode
    result = verify(tree, logits, sampler.cursor(pos))  # accepted path + recovered/bonus token
    cache.commit(tree, result.path)                     # keep the accepted KV, checked
    emit(result.tokens)                                 # stops, max_tokens, stream, stats

The engine owns one target context and keeps the committed token sequence in it between
requests, so a request that shares a prefix with the previous one (chat turns, editor
keystrokes) only prefills the new part.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .backend import Context, Model, SequenceCache
from .costmodel import CostModel, calibrate
from .backend.features import FeatureTap, FinalNormTap, make_feature_tap
from . import native
from .native import rows as native_rows
from .drafters import Drafter, DraftMemory, TargetHandle, make_drafter
from .errors import ContextOverflowError, DecodeError, InvalidRequestError
from .policy import SpeculationPolicy, TreeShape
from .request_state import RequestState
from .sampling import SamplingParams
from .stats import GenerationStats, count_sources
from .text import TextAssembler
from .tree import TokenSource, TokenTree
from .verify import verify

MIN_N_CTX = 16
"""Smallest context an engine accepts (tokens)."""
DEFAULT_N_CTX = 8192


@dataclass
class TokenLogprob:
    """Log-probability of an emitted token under the raw model distribution (softmax of the
    logits, no sampling transforms), with the ``top`` most likely alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class StreamChunk:
    """One emitted token and the text it released.

    ``text`` may be empty (a character or a possible stop string still incomplete) or hold
    text of earlier tokens; the concatenation of all chunks' text is the final text. The
    last chunk of a stream may carry only held-back text, with ``token == -1``.
    """

    text: str
    token: int
    source: TokenSource
    step: int
    logprob: TokenLogprob | None = None


@dataclass
class GenerationResult:
    """The outcome of a request.

    Attributes:
        text: generated text (cut before a stop string; no end-of-generation token).
        token_ids: generated token ids (the same cut).
        finish_reason: ``"stop"`` (end-of-generation token or stop string), ``"length"``
            (``max_tokens`` reached or the context is full), ``"time"`` (``max_time_ms``
            reached), ``"cancelled"``, or ``"error"`` (the generation raised; the exception went
            to the caller, e.g. ``WorkerLostError``, and this result holds what was emitted before).
        stop: the stop string matched, ``"<eog>"`` for an end-of-generation token, else None.
        sources: how each token was produced (``TokenSource``).
        logprobs: per-token log-probabilities when requested.
        stats: ``GenerationStats``.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    stop: str | None
    sources: list[TokenSource]
    logprobs: list[TokenLogprob] | None
    stats: GenerationStats

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stop": self.stop,
            "sources": [TokenSource(s).name.lower() for s in self.sources],
            "logprobs": None
            if self.logprobs is None
            else [{"token": lp.token, "logprob": lp.logprob, "top": lp.top} for lp in self.logprobs],
            "stats": self.stats.to_dict(),
        }


class GenerationStream:
    """Iterator of ``StreamChunk`` for one request; ``result`` is set when it ends.

    ``cancel()`` may be called from another thread: the generation stops after the current
    step (a running prefill is aborted) with ``finish_reason == "cancelled"``, and the engine
    stays consistent. ``close()`` (or leaving a ``with`` block) also ends it.
    """

    def __init__(self, engine: "Engine", gen: Iterator[StreamChunk]) -> None:
        self._engine = engine
        self._gen = gen
        self.result: GenerationResult | None = None
        self.cancelled = threading.Event()

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self) -> StreamChunk:
        return next(self._gen)

    def cancel(self) -> None:
        """Stop this generation (thread-safe); a no-op once it has ended."""
        self.cancelled.set()
        if self._engine._active_stream is self:
            self._engine.ctx.request_abort()

    def close(self) -> None:
        self._gen.close()

    def __enter__(self) -> "GenerationStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _EngineLock:
    """A re-entrant lock that the thread finishing a stream may release although another
    thread started it.

    A ``GenerationStream`` holds the engine's lock from its first chunk to its end, and its
    consumer may move between threads (a worker thread takes the first token, another reads
    the rest): ``threading.RLock`` then refuses the release (``RuntimeError: cannot release
    un-acquired lock``, replacing the stream's own result or error) unless the second thread
    happens to reuse the first one's ident. Like an RLock, the owning thread may acquire it
    again (counted); unlike one, the last release may come from any thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._count = 0

    def acquire(self) -> bool:
        me = threading.get_ident()
        if self._owner == me:
            self._count += 1
            return True
        self._lock.acquire()
        self._owner, self._count = me, 1
        return True

    def release(self) -> None:
        if self._count <= 0:
            raise RuntimeError("_EngineLock released more often than acquired")
        self._count -= 1
        if self._count == 0:
            self._owner = None
            self._lock.release()

    def __enter__(self) -> "_EngineLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _now_us() -> float:
    return time.perf_counter() * 1e6


def _feature_layers(drafter: Drafter | None) -> tuple[int, ...] | None:
    """The target layers whose inputs ``drafter`` reads (EAGLE-3), or None."""
    layers = getattr(drafter, "target_feature_layers", None)
    # layer ids, or (NEXTN_FEATURES,): the target's nextn hidden states (MTP drafters)
    return tuple(k if isinstance(k, str) else int(k) for k in layers) if layers else None


def _final_norm(drafter: Drafter | None) -> bool:
    """Whether ``drafter`` reads the target's final hidden states (Medusa heads)."""
    return bool(getattr(drafter, "target_final_norm", False))


@dataclass
class _Request:
    """Everything one generation needs, validated."""

    prompt: list[int]
    sampler: RequestState
    drafter: Drafter | None
    max_tokens: int
    stop: Sequence[str]
    max_time_ms: float | None
    draft_context: list[list[int]]
    t_start_us: float


class Engine:
    """A target model with an optional drafter, ready to generate.

    Args:
        model: a ``Model``, a GGUF path, or None for the embedded default model.
        drafter: a drafter name (``"none"``, ``"ngram"``, ``"draft"``, ``"eagle3"``,
            ``"auto"``, ``"mtp"``: the target's own MTP / NextN block), a ``Drafter`` object, or None.
        draft_model: the GGUF of a draft model sharing the target's tokenizer (drafters
            ``"draft"`` and ``"auto"``).
        draft_n_ctx: the draft model's context (default: the target's); a smaller one sees
            only the recent history.
        eagle: the GGUF of an EAGLE-3 head for the target (drafters ``"eagle3"`` and ``"auto"``);
            with no path (and, for ``"auto"``, no draft model), the head shipped for the target
            (default model), if any.
        medusa: the GGUF of Medusa heads for the target (drafters ``"medusa"`` and ``"auto"``);
            for ``"medusa"`` with no path, the heads shipped for the target (default model), if any.
        draft_shape: a fixed ``TreeShape`` for every step of the ``"eagle3"`` or ``"medusa"`` drafter (e.g.
            ``TreeShape(6, 1, 7)``: chains of 6); default: the policy chooses.
        n_ctx: context size in tokens (default: 8192, at most the model's training context).
        n_threads: CPU threads (default: all CPUs this process may use, at most 16).
        n_gpu_layers: layers offloaded to the GPU on CUDA / Metal builds (-1 = all); with
            ``rpc``, layers on the workers (0 = all).
        rpc: llama.cpp RPC workers (``["HOST:PORT", ...]`` or ``"H1:P1,H2:P2"``) holding the
            target's layers; drafters stay on this machine (docs/rpc.md).
        rpc_local_gpu: with ``rpc``, split the layers over this machine's GPUs too.
        tensor_split: with ``rpc``, the share of the layers per device (workers, then GPUs).
        max_tree_nodes: largest verified tree (root included), at most 255.
        cost_model: a ``CostModel``; by default measured (and cached) at start-up.
        adaptive: False verifies every proposed tree up to ``max_tree_nodes`` without asking
            the policy (for tests and experiments).
        accept_threshold_single / accept_threshold_acc: **LOSSY** below 1.0 (the default, lossless):
            SGLang's acceptance thresholds (``verify.verify_thresholds``), in (0, 1], for requests
            whose ``SamplingParams`` leave them None. They apply at temperature > 0 only; the
            results then say ``stats.lossy``.
        draft_memory: a ``drafters.DraftMemory`` the engine's drafters (and its batches) draft
            from and write finished requests to (docs/drafters.md#drafting-memory); None = none.

    Raises:
        ModelLoadError: the model (or draft model / EAGLE-3 head) cannot be loaded.
        VocabMismatchError: the draft model's vocabulary is not the target's.
        InvalidRequestError: bad parameters (e.g. a drafter option the drafter does not take).
    """

    def __init__(
        self,
        model: Model | str | os.PathLike | None = None,
        *,
        drafter: str | Drafter | None = "ngram",
        draft_model: Model | str | os.PathLike | None = None,
        draft_n_ctx: int | None = None,
        eagle: str | os.PathLike | None = None,
        medusa: str | os.PathLike | None = None,
        draft_shape: TreeShape | None = None,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        max_tree_nodes: int = 64,
        cost_model: CostModel | None = None,
        adaptive: bool = True,
        flash_attn: bool | None = None,
        rpc: str | list[str] | None = None,
        rpc_local_gpu: bool = False,
        tensor_split: list[float] | None = None,
        accept_threshold_single: float = 1.0,
        accept_threshold_acc: float = 1.0,
        draft_memory: "DraftMemory | None" = None,
    ) -> None:
        # validated like a request's (InvalidRequestError: 0 < t <= 1)
        SamplingParams(accept_threshold_single=accept_threshold_single, accept_threshold_acc=accept_threshold_acc)
        self.accept_threshold_single = float(accept_threshold_single)
        self.accept_threshold_acc = float(accept_threshold_acc)
        if not 1 <= max_tree_nodes <= 255:
            raise InvalidRequestError("max_tree_nodes must be in [1, 255]")
        if n_ctx is not None and n_ctx < MIN_N_CTX:
            raise InvalidRequestError(f"n_ctx must be at least {MIN_N_CTX} tokens (got {n_ctx})")
        if model is None:
            from .models import default_model_path

            model = default_model_path()
        self._owns_model = not isinstance(model, Model)
        if isinstance(model, Model):
            if rpc:
                raise InvalidRequestError("rpc= applies when the engine loads the model (give a path, not a Model)")
            self.model = model
        else:
            rpc_args = dict(rpc=rpc, rpc_local_gpu=rpc_local_gpu, tensor_split=tensor_split) if rpc else {}
            self.model = Model(model, n_gpu_layers=n_gpu_layers, **rpc_args)
        if n_ctx is None:
            n_ctx = min(DEFAULT_N_CTX, self.model.n_ctx_train or DEFAULT_N_CTX)
        # llama.cpp needs n_seq_max <= n_ctx (one sequence per tree leaf): a small context
        # gets smaller trees instead of an abort inside llama.cpp
        max_tree_nodes = min(max_tree_nodes, n_ctx // 2 - 1)
        self.max_tree_nodes = max_tree_nodes
        self._ctx_args = dict(n_ctx=n_ctx, n_batch=512, n_seq_max=max_tree_nodes + 1, n_threads=n_threads, flash_attn=flash_attn)
        self.drafter: Drafter | None = None
        self._tap: FeatureTap | None = None
        self._norm_tap: FinalNormTap | None = None
        self._lock = _EngineLock()  # held by a stream from its first chunk to its end
        self._active_stream: GenerationStream | None = None
        self.adaptive = adaptive
        self.draft_memory = draft_memory  # shared by this engine's drafters (and its batches)
        new = self._new_drafter(
            drafter, draft_model=draft_model, draft_n_ctx=draft_n_ctx, eagle=eagle, medusa=medusa, draft_shape=draft_shape
        )
        try:
            self._make_context(_feature_layers(new), _final_norm(new))
            self.cost_model = cost_model or calibrate(self.ctx, max_size=max_tree_nodes)
            if self._tap is not None:
                self._tap.clear()
            if self._norm_tap is not None:
                self._norm_tap.clear()
            self.policy = SpeculationPolicy(self.cost_model, max_nodes=max_tree_nodes)
            self._install_drafter(new)
        except BaseException:
            if new is not None and self.drafter is not new:
                new.close()  # idempotent: _install_drafter may have closed it already
            self.close()
            raise

    # -- configuration ------------------------------------------------------------------------

    def set_drafter(self, drafter: str | Drafter | None, **options) -> None:
        """Switch drafter (by name with its options, e.g. ``draft_model=PATH``, or an object).

        The conversation in the KV cache is kept, unless the new drafter reads target
        features the current context does not capture (or the reverse): then the target
        context is recreated with (without) the feature tap.

        Raises:
            InvalidRequestError / VocabMismatchError / ModelLoadError: the new drafter cannot be
                used; the engine keeps its current drafter.
        """
        with self._lock:
            new = self._new_drafter(drafter, **options)
            old = self.drafter
            if _feature_layers(new) != (self._tap.layers if self._tap else None) or _final_norm(new) != (
                self._norm_tap is not None
            ):
                self.drafter = None
                if old is not None and old is not new:
                    old.close()
                old = None
                self._make_context(_feature_layers(new), _final_norm(new))
            self._install_drafter(new)
            if old is not None and old is not new:
                old.close()

    def _new_drafter(self, drafter: str | Drafter | None, **options) -> Drafter | None:
        options = {k: v for k, v in options.items() if v is not None}
        # eagle3 and auto without a head (nor, for auto, a draft model): the head shipped for
        # this target, if any (auto without one drafts n-grams only)
        models = {"eagle", "draft_model", "medusa"}
        if (drafter == "eagle3" and "eagle" not in options) or (drafter == "auto" and not models & set(options)):
            from .models.eagle3_heads import shipped_head

            head = shipped_head(self.model.path)
            if head is not None:
                options["eagle"] = head
        if drafter == "auto" and not models & set(options):
            from .drafters.mtp import mtp_capable

            if mtp_capable(self.model):  # auto on a target with MTP blocks: n-gram + its MTP block
                options["mtp"] = True
        if drafter == "medusa" and "medusa" not in options:
            from .models.eagle3_heads import shipped_head

            heads = shipped_head(self.model.path, kind="medusa")
            if heads is not None:
                options["medusa"] = heads
        if isinstance(drafter, (str, type(None))):
            new = make_drafter(drafter, memory=self.draft_memory, **options)
        elif options:
            raise InvalidRequestError(f"options {', '.join(sorted(options))} apply to drafter names, not to a drafter object")
        else:
            new = drafter
        check = getattr(new, "check_target", None)  # e.g. MTP: refuse a target without MTP blocks
        if check is not None:  # before anything changes, so a refused drafter loses nothing
            try:
                check(self.model)
            except BaseException:
                if new is not drafter:
                    new.close()
                raise
        return new

    def _make_context(self, feature_layers: tuple[int, ...] | None, final_norm: bool = False) -> None:
        """(Re)create the target context, with a ``FeatureTap`` when ``feature_layers`` is set,
        or a ``FinalNormTap`` when ``final_norm`` (one ``cb_eval`` per context)."""
        old = getattr(self, "ctx", None)
        if old is not None:
            old.close()
        if feature_layers and final_norm:
            raise InvalidRequestError("a drafter reads either target layer features or final hidden states, not both")
        self._tap = make_feature_tap(feature_layers, self.model) if feature_layers else None
        self._norm_tap = FinalNormTap(self.model.n_embd) if final_norm else None
        tap = self._tap or self._norm_tap
        cb, ud = (tap.callback, tap.user_data) if tap is not None else (None, None)
        self.ctx = Context(self.model, cb_eval=cb, cb_eval_user_data=ud, **self._ctx_args)
        if hasattr(self._tap, "bind"):  # NextnTap: llama.cpp's nextn rows, read after each decode
            self._tap.bind(self.ctx)
        self._ctx_generation = self.model.generation
        self.cache = SequenceCache(self.ctx, max_tree_nodes=self.max_tree_nodes)

    def _install_drafter(self, drafter: Drafter | None) -> None:
        """Attach ``drafter`` to the target and make it current (on failure, close it)."""
        attach = getattr(drafter, "attach", None)
        if attach is not None:
            try:
                attach(
                    TargetHandle(
                        self.model,
                        n_ctx=self.ctx.n_ctx,
                        n_threads=self.ctx.n_threads,
                        tensor_source=self.ctx,
                        features=self._tap,
                    )
                )
            except BaseException:
                drafter.close()
                raise
        self.drafter = drafter
        self.cost_model.reset_draft()  # the draft levels measured were the old drafter's

    @property
    def drafter_name(self) -> str:
        return self.drafter.name if self.drafter is not None else "none"

    @property
    def n_ctx(self) -> int:
        return self.ctx.n_ctx

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self.reconnect_if_lost()
        return self.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.close()
            self.drafter = None
        if getattr(self, "ctx", None) is not None:
            self.ctx.close()
        if self._owns_model:
            self.model.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reconnect_if_lost(self) -> None:
        """After a lost RPC worker (``WorkerLostError``): load the target on its workers again,
        with a new context (the KV cache is gone) and the same drafter re-attached. Every request
        calls this first, so an engine (and a server on it) works again once the worker is back.
        A no-op when the workers are fine or the model is local.

        Raises:
            RPCError: a worker is still unreachable (the next request tries again).
        """
        def needed() -> bool:  # the worker lost, or the model reloaded by another user of it
            return self._ctx_generation != self.model.generation or (
                bool(self.model._rpc_guards) and self.model.lost_worker() is not None
            )

        if not needed():
            return
        with self._lock:
            if not needed():
                return
            lost = self.model.lost_worker() is not None
            if lost:
                self.model.probe_workers()  # still down: raises, and the engine stays as it is
            # drafter contexts may borrow the target context's tensors (EAGLE-3 heads): free them
            # before the target's; attach() below creates them again
            for d in (self.drafter, getattr(self.drafter, "model", None)):
                dctx = getattr(d, "ctx", None)
                if isinstance(dctx, Context):
                    dctx.close()
            self.ctx.close()
            if lost:
                self.model.reload_if_lost()  # a no-op when another user of the model did it
            self._make_context(self._tap.layers if self._tap else None, self._norm_tap is not None)
            if self.drafter is not None:
                self._install_drafter(self.drafter)

    def reset(self) -> None:
        """Forget the KV cache of earlier requests."""
        with self._lock:
            self.cache.reset()

    # -- generation ---------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
        """Generate a completion of ``prompt``; keyword arguments as ``stream``."""
        s = self.stream(prompt, **kwargs)
        for _ in s:
            pass
        assert s.result is not None
        return s.result

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        speculative: bool = True,
        parse_special: bool = False,
        add_special: bool = True,
        max_time_ms: float | None = None,
        draft_context: Sequence[str | Sequence[int]] = (),
    ) -> GenerationStream:
        """Start a generation; iterate the returned stream for ``StreamChunk``s.

        Args:
            prompt: text (tokenised with BOS where the model wants it) or token ids.
            max_tokens: most tokens to generate (never exceeded).
            sampling: ``SamplingParams`` (default: llama.cpp's defaults, random seed).
            stop: stop strings; the text is cut before the first one completed.
            speculative: False decodes without the drafter for this request.
            parse_special: tokenise special-token text (e.g. chat markup) as special tokens.
            add_special: add BOS (and EOS) as the model asks when tokenising text; with
                ``parse_special`` a text that already starts with the BOS token gets no second.
            max_time_ms: stop generating (``finish_reason == "time"``) once this much time
                has passed since the first generated token; prefill is not limited.
            draft_context: extra texts or token sequences the drafter may draft from (an
                editor's suffix and other files): the n-gram drafter indexes them too.
        Raises:
            InvalidRequestError: bad parameters or an empty prompt.
            ContextOverflowError: the prompt does not leave room for one generated token.
        """
        if max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be >= 0, got {max_tokens}")
        self.reconnect_if_lost()
        sampling = self.with_thresholds(sampling or SamplingParams())
        t_start = _now_us()
        if isinstance(prompt, str):
            tokens = self.model.tokenize(prompt, add_special=add_special, parse_special=parse_special)
            bos = self.model.bos
            if parse_special and add_special and self.model.add_bos and tokens[:2] == [bos, bos]:
                # the text already starts with the BOS token: do not add a second one (as the
                # chat app does; llama.cpp only warns)
                tokens = tokens[1:]
        else:
            tokens = [int(t) for t in prompt]
            bad = [t for t in tokens if not 0 <= t < self.model.n_vocab]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.model.n_vocab - 1})")
        if not tokens:
            raise InvalidRequestError("the prompt is empty (and the model adds no BOS token)")
        if len(tokens) >= self.ctx.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(tokens)} tokens but the context holds {self.ctx.n_ctx}; "
                f"shorten it or use a larger context (n_ctx / --n-ctx >= {len(tokens) + max_tokens})"
            )
        if max_time_ms is not None and max_time_ms <= 0:
            raise InvalidRequestError(f"max_time_ms must be > 0, got {max_time_ms}")
        extra = [
            self.model.tokenize(c, add_special=False) if isinstance(c, str) else [int(t) for t in c]
            for c in draft_context
        ]
        req = RequestState(sampling, self.model, tokens)
        request = _Request(
            prompt=tokens,
            sampler=req,
            drafter=self.drafter if speculative else None,
            max_tokens=max_tokens,
            stop=list(stop),
            max_time_ms=max_time_ms,
            draft_context=extra,
            t_start_us=t_start,
        )
        stream = GenerationStream(self, iter(()))
        stream._gen = self._run(stream, request)
        return stream

    def with_thresholds(self, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` with the engine's acceptance thresholds where it leaves them None (the
        same object when the engine's are 1.0)."""
        kw = {}
        if sampling.accept_threshold_single is None and self.accept_threshold_single != 1.0:
            kw["accept_threshold_single"] = self.accept_threshold_single
        if sampling.accept_threshold_acc is None and self.accept_threshold_acc != 1.0:
            kw["accept_threshold_acc"] = self.accept_threshold_acc
        return replace(sampling, **kw) if kw else sampling

    def generate_batch(self, prompts, **kwargs) -> list:
        """Generate every prompt, several at a time in one batched decode (``--parallel``).

        Keyword arguments and result: ``localspec.scheduler.generate_batch``. The batch runs
        on its own context over this engine's model; outputs equal ``generate`` one prompt at
        a time at temperature 0 and for a seed above it.
        """
        from .scheduler import generate_batch

        self.reconnect_if_lost()
        return generate_batch(self, prompts, **kwargs)

    def plain_tokens_per_s(self) -> float:
        """Estimated plain-decoding speed on this machine now (from the measured cost model)."""
        return 1e6 / self.cost_model.t_decode_us(1)

    def _run(self, stream: GenerationStream, request: _Request) -> Iterator[StreamChunk]:
        prompt, req, drafter = request.prompt, request.sampler, request.drafter
        max_tokens, stop, t_start = request.max_tokens, request.stop, request.t_start_us
        with self._lock:
            self._active_stream = stream
            cache = self.cache
            model = self.model
            stats = GenerationStats(drafter=drafter.name if drafter else "none", seed=req.seed)
            stats.set_thresholds(req.params, drafted=drafter is not None)
            stats.n_prompt_tokens = len(prompt)
            want_logprobs = req.params.logprobs
            assembler = TextAssembler(model.token_bytes, stop)
            out_tokens: list[int] = []
            out_sources: list[TokenSource] = []
            out_depths: list[int] = []
            out_logprobs: list[TokenLogprob] = []
            step_drafted: list[int] = []  # max depth of each step's tree
            finish_reason = "length"
            stop_name: str | None = None
            self.ctx.clear_abort()
            redecoded0 = cache.n_redecoded
            t_gen0 = t_prefill_end = _now_us()
            try:
                # -- prompt: reuse the common prefix, prefill the rest but the last token -----
                common = 0
                old = cache.tokens
                limit = min(len(old), len(prompt) - 1)
                while common < limit and old[common] == prompt[common]:
                    common += 1
                self.policy.begin_request()
                if drafter is not None:
                    if hasattr(drafter, "set_sampling"):
                        drafter.set_sampling(req)
                    if request.draft_context:
                        drafter.begin(prompt, context=request.draft_context)
                    else:
                        drafter.begin(prompt)
                features = self._tap if _feature_layers(drafter) else None
                if features is not None:  # re-prefill what the drafter has no target features for
                    common = min(common, drafter.n_target_features)
                stats.n_cached_tokens = common
                cache.truncate(common)
                if stream.cancelled.is_set():
                    raise _Cancelled
                if self._tap is not None:
                    self._tap.clear()
                norm_tap = self._norm_tap
                hidden_to = drafter if norm_tap is not None and _final_norm(drafter) else None
                if norm_tap is not None:
                    norm_tap.clear()

                def on_chunk(n_done: int, _n_total: int) -> None:
                    rows = self._tap.take()
                    if features is not None:
                        drafter.add_target_features(common + n_done - rows.shape[0], rows)

                try:
                    cache.prefill(prompt[common:-1], on_chunk=on_chunk if self._tap is not None else None)
                except DecodeError:
                    if stream.cancelled.is_set():
                        raise _Cancelled from None
                    raise
                if norm_tap is not None:
                    norm_tap.clear()  # the prefill asks for no logits: no rows
                t_prefill_end = _now_us()
                stats.t_prefill_us = t_prefill_end - t_start
                root = prompt[-1]
                t_gen0 = _now_us()
                step = 0
                while True:
                    remaining = max_tokens - len(out_tokens)
                    if remaining <= 0:
                        finish_reason = "length"
                        break
                    if cache.n_free < 1:
                        finish_reason = "length"
                        break
                    if stream.cancelled.is_set():
                        raise _Cancelled
                    if request.max_time_ms is not None and step and (_now_us() - t_gen0) >= 1e3 * request.max_time_ms:
                        finish_reason = "time"
                        break
                    t0 = _now_us()
                    prop = self._propose(drafter, root, remaining, cache.n_free)
                    cand, tree = prop.candidate, prop.tree
                    t1 = _now_us()
                    n_past0, n_pending0 = cache.n_past, len(cache.pending)
                    try:
                        lay, logits = cache.decode_tree(tree)
                    except DecodeError:
                        if self._tap is not None:
                            self._tap.clear()
                        if norm_tap is not None:
                            norm_tap.clear()
                        if stream.cancelled.is_set():
                            raise _Cancelled from None
                        raise
                    rows = self._tap.take() if self._tap is not None else None  # [pending + nodes, F]
                    h_rows = norm_tap.take() if norm_tap is not None else None  # [nodes, n_embd]
                    t2 = _now_us()
                    cursor = req.cursor(cache.root_pos + 1)
                    try:
                        res = verify(tree, logits, cursor)
                    except BaseException:  # e.g. a grammar with no way on: keep the history, drop the drafts
                        cache.commit(tree, lay, [])
                        raise
                    finally:
                        cursor.close()
                    lps = self._logprobs(logits, res, want_logprobs) if want_logprobs is not None else None
                    t3 = _now_us()
                    cache.commit(tree, lay, res.path)
                    if features is not None:  # the committed rows: pending tokens, root, accepted path
                        keep = list(range(n_pending0 + 1)) + [n_pending0 + int(p) for p in res.path]
                        drafter.add_target_features(n_past0, rows[keep])
                    if drafter is not None:
                        drafter.observe(cand, res.tokens)
                        drafter.accept(res.tokens)
                    if hidden_to is not None and h_rows is not None and h_rows.shape[0] == tree.n_nodes:
                        # the row that produced the last emitted token: it predicts the next root
                        hidden_to.set_final_hidden(cache.root_pos - 1, h_rows[res.rows[-1]])
                    req.commit(res.tokens)
                    stats.n_steps += 1
                    n_draft = tree.n_nodes - 1
                    if n_draft:
                        stats.n_spec_steps += 1
                        stats.num_draft_tokens += n_draft
                    step_drafted.append(tree.max_depth())
                    # -- emit, with stops -------------------------------------------------------
                    done = False
                    chunks: list[StreamChunk] = []
                    for i, tok in enumerate(res.tokens):
                        stats.n_step_tokens += 1
                        if model.is_eog(tok):
                            finish_reason, stop_name, done = "stop", "<eog>", True
                            break
                        text = assembler.push(tok)
                        out_tokens.append(tok)
                        out_sources.append(res.sources[i])
                        out_depths.append(res.depths[i] if i < len(res.depths) else 0)
                        lp = lps[i] if lps is not None else None
                        if lp is not None:
                            out_logprobs.append(lp)
                        chunks.append(StreamChunk(text, tok, res.sources[i], step, lp))
                        if assembler.stop_hit is not None:
                            finish_reason, stop_name, done = "stop", assembler.stop_hit.stop, True
                            break
                    t4 = _now_us()
                    stats.t_draft_us += t1 - t0
                    stats.t_decode_us += t2 - t1
                    stats.t_verify_us += t3 - t2
                    stats.t_other_us += t4 - t3
                    self.policy.observe_step(tree.n_nodes, t2 - t1, (t4 - t0) - (t2 - t1) - prop.t_draft_us)
                    self.policy.observe_outcome(tree, len(res.path))
                    root = res.tokens[-1]
                    step += 1
                    yield from chunks
                    if done:
                        break
            except _Cancelled:
                finish_reason = "cancelled"
            except GeneratorExit:  # the consumer closed the stream early
                finish_reason = "cancelled"
                raise
            except BaseException:  # the step failed (the exception goes on to the caller)
                finish_reason = "error"
                raise
            finally:
                t_end = _now_us()
                self._active_stream = None
                self.ctx.clear_abort()
                # -- cut everything at the same point ---------------------------------------------
                if assembler.stop_hit is not None:
                    n_keep = assembler.stop_hit.n_tokens
                    del out_tokens[n_keep:], out_sources[n_keep:], out_depths[n_keep:]
                    del out_logprobs[n_keep:]
                tail = assembler.finish()
                # KV: keep the prompt and the kept tokens that were decoded
                keep_kv = min(cache.n_past, len(prompt) + len(out_tokens))
                cache.truncate(keep_kv)
                stats.n_generated_tokens = len(out_tokens)
                stats.n_redecoded_tokens = cache.n_redecoded - redecoded0
                stats.token_sources = count_sources(out_sources)
                stats.num_accepted_tokens = sum(1 for s in out_sources if TokenSource(s).is_draft)
                max_d = max(step_drafted, default=0)
                stats.drafted_per_depth = [sum(1 for m in step_drafted if m >= d) for d in range(1, max_d + 1)]
                stats.accepted_per_depth = [sum(1 for d2 in out_depths if d2 == d) for d in range(1, max_d + 1)]
                stats.t_generate_us = t_end - t_gen0 if out_tokens or stats.n_steps else 0.0
                stats.t_total_us = t_end - t_start
                req.close()
                stream.result = GenerationResult(
                    text=assembler.text,
                    token_ids=out_tokens,
                    finish_reason=finish_reason,
                    stop=stop_name,
                    sources=out_sources,
                    logprobs=out_logprobs if want_logprobs is not None else None,
                    stats=stats,
                )
            if tail:
                yield StreamChunk(tail, -1, TokenSource.DECODE, stats.n_steps)

    def _propose(self, drafter: Drafter | None, root: int, remaining: int, n_free: int) -> "_Proposal":
        """The step's drafting, decided once: the cheap drafts (``propose``), the policy's
        plan (``SpeculationPolicy.plan``: whether a model drafts, in which shape, how much to
        verify), the model's drafts only if planned (``extend``), then the best nodes to
        verify, cut to what the remaining token budget and the free context allow."""
        max_depth = min(remaining - 1, n_free - 1)
        max_nodes = min(self.max_tree_nodes, n_free)
        if drafter is None or max_depth <= 0 or max_nodes <= 1:
            t = TokenTree.root_only(root)
            return _Proposal(t, t, 0.0)
        t0 = _now_us()
        cand = self._clip(drafter, drafter.propose(max_depth, max_nodes), root, max_depth)
        model = getattr(drafter, "model_stats", None)
        plan = self.policy.plan(
            cand,
            model,
            max_nodes=max_nodes,
            max_depth=max_depth,
            t_draft_us=_now_us() - t0,
            fixed_shape=getattr(drafter, "fixed_shape", None),
            adaptive=self.adaptive,
        )
        if plan.shape is not None:
            cand = self._clip(drafter, drafter.extend(plan.shape), root, max_depth)
            self.cost_model.observe_draft_levels(model.last_level_us)
        t_draft_us = _now_us() - t0
        n = min(plan.n_nodes, max_nodes)
        if n <= 1:  # a plain step (most steps where matches are weak): no tree surgery
            return _Proposal(cand, TokenTree.root_only(root), t_draft_us)
        tree = cand.best_subtree(n) if n < cand.n_nodes else cand
        return _Proposal(cand, tree.best_first_dfs(), t_draft_us)

    @staticmethod
    def _clip(drafter: Drafter, cand: TokenTree, root: int, max_depth: int) -> TokenTree:
        if cand.n_nodes > 1 and int(cand.token_ids[0]) != root:
            raise RuntimeError(f"drafter {drafter.name} proposed a tree rooted at {cand.token_ids[0]}, not {root}")
        if cand.max_depth() > max_depth:
            cand = cand.subtree(cand.depth <= max_depth)
        return cand

    @staticmethod
    def _logprobs(logits: np.ndarray, res, top_n: int) -> list[TokenLogprob]:
        """Log-probabilities of the emitted tokens under the target's raw distribution
        (``log_softmax`` of the raw logits row, as llama.cpp's ``n_probs``), each with the
        ``top_n`` most likely tokens (value desc, id asc).

        ``logits``: [n_rows, n_vocab] float32; ``res``: the verification result (its ``rows``
        and ``tokens``). The C kernels (``ls_rows_logsumexp``, ``ls_top_k``) do the work when
        they are built (about 1 ms per 262k-wide row instead of ~7 ms in numpy); the numpy
        code below is the reference, with logsumexp in float64 in both."""
        rows = [int(r) for r in res.rows]
        if not rows:
            return []
        if native.enabled():
            lse = native_rows.rows_logsumexp(logits, rows)
            out = []
            for row, tok, z in zip(rows, res.tokens, lse):
                x = logits[row]
                top = [(int(i), float(np.float64(x[i]) - z)) for i in native_rows.top_k(x, top_n)] if top_n else []
                out.append(TokenLogprob(int(tok), float(np.float64(x[tok]) - z), top))
            return out
        out = []
        for row, tok in zip(rows, res.tokens):
            x = logits[row].astype(np.float64)
            m = x.max()
            lse = m + np.log(np.exp(x - m).sum())
            top: list[tuple[int, float]] = []
            if top_n:
                idx = np.argpartition(-x, top_n - 1)[:top_n]
                idx = idx[np.lexsort((idx, -x[idx]))]
                top = [(int(i), float(x[i] - lse)) for i in idx]
            out.append(TokenLogprob(int(tok), float(x[tok] - lse), top))
        return out


@dataclass
class _Proposal:
    """One step's drafting: the drafter's tree (``candidate``), the part to verify (``tree``,
    renumbered best-first) and what drafting cost (µs)."""

    candidate: TokenTree
    tree: TokenTree
    t_draft_us: float


class _Cancelled(Exception):
    pass
