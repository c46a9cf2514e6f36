"""``CompletionService``: one engine, one worker thread, a queue of jobs.

The HTTP app and the stdio loop both submit ``CompletionRequest``s here and receive
``Event``s through a callback (called on the worker thread). Requests run one at a time, in
arrival order, on a single worker thread that owns the engine; between requests the engine
keeps its KV cache, so the next request prefills only what differs from the last prompt.

Cancellation: ``Job.cancel()`` is thread-safe. A queued job is answered at once without
touching the engine; a running one stops after the current step (or aborts a running
prefill) and the engine stays consistent. A newer request with the same client key (see
``CompletionRequest.client_key``) cancels the older ones, except cache warm-ups
(``n_predict`` 0): a warm-up cancels nothing and is cancelled by nothing but its client
leaving (as llama.cpp queues them), so the cache it fills is there for the next completion.

A cancelled request is answered (HTTP 200, ``"stop": true``) with ``"cancelled"`` (the reason)
and *no* ``content`` field: llama.vim caches any response that has ``"content":"``, and
llama.vscode caches each ``content`` it reads, so an empty answer would be remembered as the
completion of that context. Both plugins ignore a response without ``content``. The
``"cancelled"`` field is there whatever ``response_fields`` selects: it says why the answer has
no ``content``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ..backend.rpc import RPCError
from ..errors import ContextOverflowError, InvalidRequestError, LocalSpecError
from ..sampling import SamplingParams
from ..stats import GenerationStats
from ..text import ReleaseTracker
from .fields import EXCEED_CONTEXT, SERVER_ERROR, UNAVAILABLE, RequestError, error_body
from .prompt import BuiltPrompt, build_completion_prompt, build_infill_prompt
from .protocol import CompletionRequest
from .response import (
    HEALTH_STALL_S,
    Outcome,
    final_response,
    generation_settings,
    partial_response,
    request_log_line,
    stall_error,
    stop_type_of,
)
from .sampling_fields import SamplingPlan, resolve_sampling
from .stops import EditorStops

log = logging.getLogger("localspec.server")

NO_FIM_NOTE = (
    "the model has no fill-in-the-middle tokens: completed from the text before the cursor "
    "(and the extra context); the text after the cursor was used only for drafting"
)


@dataclass
class Event:
    """What a job reports: ``partial`` (streamed piece), ``final`` (the response: an object, or
    a list of ``n_cmpl`` objects) or ``error`` (``data`` is an error body, ``status`` its HTTP
    status)."""

    kind: Literal["partial", "final", "error"]
    data: Any
    status: int = 200


@dataclass
class ServiceConfig:
    """Server-wide settings.

    Attributes:
        sampling: defaults for sampling fields a request leaves out (the command line's).
        window: tokens of prefix + suffix in an infill prompt (llama.cpp's ``n_batch``).
        spm: suffix-prefix-middle FIM order.
        max_queue: most requests waiting; more get HTTP 503.
        default_n_predict: ``n_predict`` of requests without one (-1: until the end).
        speculative: False serves every request with plain decoding.
        stall_s: ``/health`` is 503 once requests have waited this long (s) with no engine step.
    """

    sampling: SamplingParams = field(default_factory=SamplingParams)
    window: int = 4096
    spm: bool = False
    max_queue: int = 64
    default_n_predict: int = -1
    speculative: bool = True
    stall_s: float = HEALTH_STALL_S


class Job:
    """One submitted request. ``cancel()`` may be called from any thread."""

    _ids = itertools.count(1)

    def __init__(self, request: CompletionRequest, sink: Callable[[Event], None]) -> None:
        self.id = next(Job._ids)
        self.request = request
        self._sink = sink
        self._lock = threading.Lock()
        self._stream = None
        self.cancel_reason: str | None = None
        self.outcome: str | None = None  # "final", "cancelled" or "error" once answered
        self._answered = False  # the final event is being delivered: cancel() is a no-op
        self.done = threading.Event()
        self.t_submit = time.perf_counter()

    @property
    def cancelled(self) -> bool:
        return self.cancel_reason is not None

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop this job (a no-op once it has finished)."""
        with self._lock:
            if self.cancel_reason is not None or self._answered:
                return
            self.cancel_reason = reason
            stream = self._stream
        if stream is not None:
            stream.cancel()

    def _attach(self, stream) -> bool:
        with self._lock:
            if self.cancel_reason is not None:
                return False
            self._stream = stream
            return True

    def emit(self, event: Event) -> None:
        final = event.kind != "partial"
        if final:  # before the sink: a cancel() racing the delivery must not relabel the job
            with self._lock:
                self._answered = True
                self._stream = None
                cancelled = event.kind == "final" and isinstance(event.data, dict) and "cancelled" in event.data
                self.outcome = "cancelled" if cancelled else event.kind
        try:
            self._sink(event)
        except Exception:  # a client that went away must not stop the worker
            log.debug("job %d: the event sink failed", self.id, exc_info=True)
        if final:
            self.done.set()


class _Call:
    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self.future: concurrent.futures.Future = concurrent.futures.Future()


class CompletionService:
    """Serves completion requests with one ``Engine`` on one worker thread.

    Args:
        engine: the engine (its model decides whether prompts use FIM).
        config: ``ServiceConfig``.

    The engine must not be used by anything else while the service runs; use ``call()`` to
    run code on it between requests.
    """

    def __init__(self, engine, config: ServiceConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ServiceConfig()
        self.model = engine.model
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._live: set[Job] = set()
        self._by_client: dict[str, set[Job]] = {}
        self._n_waiting = 0
        self._running: Job | None = None  # the job on the worker (for /health)
        self._t_progress = time.perf_counter()  # when it started or last emitted a token
        self._closed = False
        self.counters = {"requests": 0, "cancelled": 0, "errors": 0}
        self._cut_anchor = None  # where the last truncated infill prefix was cut (worker thread)
        self._thread = threading.Thread(target=self._worker, name="localspec-engine", daemon=True)
        self._thread.start()

    # -- public -------------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.model.path.name

    def submit(self, request: CompletionRequest, sink: Callable[[Event], None]) -> Job:
        """Queue a request; ``sink`` receives its events on the worker thread.

        Raises:
            RequestError: 503 when the server is shutting down or the queue is full.
        """
        job = Job(request, sink)
        key = request.client_key
        with self._lock:
            if self._closed:
                raise RequestError("the server is shutting down", 503, UNAVAILABLE)
            if self._n_waiting >= self.config.max_queue:
                raise RequestError(
                    f"too many requests waiting ({self._n_waiting}); try again later", 503, UNAVAILABLE
                )
            older = (
                [j for j in self._by_client.get(key, ()) if not j.request.is_warmup]
                if key is not None and not request.is_warmup
                else []
            )
            if key is not None:
                self._by_client.setdefault(key, set()).add(job)
            self._live.add(job)
            self._n_waiting += 1
        for old in older:
            old.cancel("superseded by a newer request from the same client")
        self._queue.put(job)
        return job

    def call(self, fn: Callable[[Any], Any], timeout: float | None = None) -> Any:
        """Run ``fn(engine)`` on the worker thread between requests and return its result."""
        c = _Call(fn)
        self._queue.put(c)
        return c.future.result(timeout)

    def health(self) -> tuple[int, dict]:
        """``/health`` of the editor server: HTTP status and body. ``slots_processing`` (0 or 1:
        requests run one at a time), ``requests_waiting``, ``last_step_age_s`` (seconds since the
        running request last emitted a token or started; null when none runs). 503 with
        ``"status": "error"`` when requests are present and neither a token came nor a request
        arrived or started for ``config.stall_s`` seconds (a stuck worker); else 200 ``"ok"``."""
        with self._lock:
            running = self._running
            n_waiting = self._n_waiting
            t_submit = [j.t_submit for j in self._live if j.outcome is None]
            t_progress = self._t_progress
        now = time.perf_counter()
        age = None if running is None else round(now - t_progress, 3)
        body: dict[str, Any] = {"status": "ok", "slots_idle": 0 if running else 1,
                                "slots_processing": int(running is not None), "requests_waiting": n_waiting,
                                "last_step_age_s": age}  # fmt: skip
        error = stall_error(now, t_submit, t_progress, self.config.stall_s, "engine step")
        if error is not None:
            body.update(status="error", error=error)
            return 503, body
        return 200, body

    def stop_accepting(self, reason: str = "the server is shutting down") -> None:
        """Refuse new requests (503) and cancel every queued or running one; each is still
        answered (a cancelled response). Thread-safe; ``close()`` then stops the worker."""
        with self._lock:
            self._closed = True
            jobs = list(self._live)
        for j in jobs:
            j.cancel(reason)

    def close(self, timeout: float = 30.0) -> None:
        """Cancel every job and stop the worker (the engine is left to its owner)."""
        with self._lock:
            if self._thread is None:
                return
            thread, self._thread = self._thread, None
        self.stop_accepting()
        self._queue.put(None)
        thread.join(timeout)

    # -- worker -------------------------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, _Call):
                try:
                    item.future.set_result(item.fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    item.future.set_exception(e)
                continue
            with self._lock:
                self._n_waiting -= 1
                self._running = item
                self._t_progress = time.perf_counter()
            try:
                self._run(item)
            except Exception as e:  # never let one request stop the server
                log.exception("request %d failed", item.id)
                self._recover()
                item.emit(Event("error", error_body(500, f"internal error: {e}", SERVER_ERROR), 500))
            finally:
                if not item.done.is_set():
                    item.emit(Event("error", error_body(500, "internal error: no response", SERVER_ERROR), 500))
                self._forget(item)
                with self._lock:
                    self._running = None

    def _forget(self, job: Job) -> None:
        with self._lock:
            self.counters["requests"] += 1
            self.counters["cancelled"] += job.outcome == "cancelled"
            self.counters["errors"] += job.outcome == "error"
            self._live.discard(job)
            key = job.request.client_key
            group = self._by_client.get(key) if key is not None else None
            if group is not None:
                group.discard(job)
                if not group:
                    del self._by_client[key]

    def _recover(self) -> None:
        try:
            self.engine.reset()
        except Exception:  # pragma: no cover - nothing more we can do
            log.exception("engine reset failed")

    def _run(self, job: Job) -> None:
        req = job.request
        t_start = time.perf_counter()
        queue_ms = (t_start - job.t_submit) * 1e3
        if job.cancelled:  # before it started: its answer still reports the settings it asked for
            try:
                plan = resolve_sampling(req.sampler_fields, self.config.sampling, self.model)
            except (RequestError, InvalidRequestError):  # it would have failed: the server's defaults
                plan = None
            job.emit(self._final(job, plan=plan, built=None, result=None, content="", tokens=[], reason=None,
                                 queue_ms=queue_ms))  # fmt: skip
            return
        plan = None
        try:
            plan = resolve_sampling(req.sampler_fields, self.config.sampling, self.model)
            built = self._build(req)
            # n_cmpl > 1 (llama.vscode asks for 3): independent completions of the same prompt,
            # decoded one after another (each after the first reuses the prompt's KV cache),
            # answered as a list as llama.cpp's server does; a fixed seed s gives s, s+1, ...
            n = 1 if req.stream else req.n_cmpl
            answers: list[dict] = []
            for i in range(n):
                params = plan.params
                if i and params.seed is not None:
                    params = replace(params, seed=(params.seed + i) % 2**64)
                answers.append(self._generate(job, plan, built, queue_ms, params))
                if "cancelled" in answers[-1]:
                    break
            if n == 1 or "cancelled" in answers[-1]:
                job.emit(Event("final", answers[-1]))
            else:
                for i, d in enumerate(answers):
                    d["index"] = i
                job.emit(Event("final", answers))  # type: ignore[arg-type]
        except RequestError as e:
            job.emit(Event("error", e.body(), e.status))
        except ContextOverflowError as e:
            job.emit(Event("error", error_body(400, str(e), EXCEED_CONTEXT), 400))
        except InvalidRequestError as e:
            job.emit(Event("error", RequestError(str(e)).body(), 400))
        except RPCError as e:  # a lost or unreachable RPC worker: the next request reconnects
            log.warning("request %d: %s", job.id, e)
            self._recover()
            job.emit(Event("error", error_body(503, str(e), UNAVAILABLE), 503))
        except LocalSpecError as e:
            log.exception("request %d: engine error", job.id)
            self._recover()
            job.emit(Event("error", error_body(500, str(e), SERVER_ERROR), 500))
        finally:
            if plan is not None:
                plan.close()

    def _build(self, req: CompletionRequest) -> BuiltPrompt:
        if req.kind == "infill":
            built = build_infill_prompt(
                self.model,
                req.input_prefix,
                req.input_suffix,
                req.prompt if isinstance(req.prompt, str) else "",
                req.input_extra,
                n_ctx=self.engine.n_ctx,
                n_predict=min(req.n_predict, 1024),
                window=self.config.window,
                spm=self.config.spm,
                anchor=self._cut_anchor,
            )
            if built.anchor is not None:  # kept across uncut prompts (warm-ups, other files)
                self._cut_anchor = built.anchor
            return built
        built = build_completion_prompt(self.model, req.prompt, n_ctx=self.engine.n_ctx)
        if not built.tokens:
            raise RequestError('"prompt" is empty (and the model adds no BOS token)')
        return built

    def _generate(self, job: Job, plan: SamplingPlan, built: BuiltPrompt, queue_ms: float, params) -> dict:
        """Run one completion; returns its final response (``Event.data``); streams partials."""
        req, engine = job.request, self.engine
        spec = self.config.speculative and engine.drafter is not None and req.speculative is not False
        max_tokens = req.n_predict if req.n_predict >= 0 else max(0, engine.n_ctx - len(built.tokens))
        if not req.cache_prompt:
            engine.reset()
        stream = engine.stream(
            built.tokens,
            max_tokens=max_tokens,
            sampling=params,
            stop=req.stop,
            speculative=spec,
            draft_context=built.draft_context,
            draft_limits=req.draft_limits,
        )
        if not job._attach(stream):
            stream.close()
            return self._final(job, plan=plan, built=built, result=None, content="", tokens=[], reason=None,
                               queue_ms=queue_ms).data  # fmt: skip
        stops = EditorStops(req.n_indent, req.t_max_predict_ms)
        # a token goes out (streamed, and in the final tokens) once its text has: none for text
        # held back as a possible stop prefix, none for tokens a stop string cuts
        track = ReleaseTracker(self.model.token_bytes)
        parts: list[str] = []
        tokens: list[int] = []
        t_first: float | None = None
        reason: str | None = None
        n_prompt = len(built.tokens)

        def partial(piece: str, out: list[int]) -> None:
            job.emit(Event("partial", partial_response(piece, out if req.return_tokens else [], id_slot=req.id_slot,
                                                       n_predicted=len(tokens), n_prompt=n_prompt)))  # fmt: skip

        try:
            for chunk in stream:
                now = self._t_progress = time.perf_counter()
                t_first = now if t_first is None else t_first
                check = stops.push(chunk.text, (now - t_first) * 1e3)
                piece = chunk.text[: check.keep]
                if piece:
                    parts.append(piece)
                if chunk.token >= 0 and (piece or not check.stop):
                    track.add(chunk.token, chunk.token)
                out = [t for t, _o in track.release(piece)]
                tokens += out
                if req.stream and (piece or (req.return_tokens and out)):
                    partial(piece, out)
                if check.stop:
                    reason = check.reason
                    break
        finally:
            stream.close()
        result = stream.result
        if result is not None:
            log.info("%s", request_log_line(job.id, f"/{req.kind}", result.stats, reason or result.finish_reason,
                                            (time.perf_counter() - job.t_submit) * 1e3))  # fmt: skip
        out = [t for t, _o in track.flush(len(result.token_ids) if result is not None else 0)]
        tokens += out
        if req.stream and req.return_tokens and out:
            partial("", out)
        return self._final(job, plan=plan, built=built, result=stream.result, content="".join(parts),
                           tokens=tokens, reason=reason, queue_ms=queue_ms, params=params).data  # fmt: skip

    def _final(self, job: Job, *, plan: SamplingPlan | None, built: BuiltPrompt | None, result, content: str,
               tokens: list[int], reason: str | None, queue_ms: float, params=None) -> Event:  # fmt: skip
        """The final event of a job.

        Args:
            result: the engine's ``GenerationResult`` (None: cancelled before it started).
            content / tokens: the completion as the client gets it (after editor stops).
            reason: ``"indent"`` / ``"time"`` when an editor stop ended it.
            params: the ``SamplingParams`` it ran with (default: the plan's).

        A job cancelled before it finished gets ``"cancelled"`` (the reason) and no
        ``content`` / ``tokens`` (see the module docstring: plugins must not cache it).
        """
        req = job.request
        stats = result.stats if result is not None else GenerationStats()
        stop_type, word = stop_type_of(result, reason)
        ctx_full = stats.n_prompt_tokens + stats.n_generated_tokens >= self.engine.n_ctx - 1
        info = self._info(job, plan, built, stats, reason or (result.finish_reason if result else "cancelled"))
        info["queue_ms"] = queue_ms
        outcome = Outcome(
            content=content,
            tokens=tokens,
            stop_type=stop_type,
            stopping_word=word,
            truncated=bool(built is not None and built.n_extra_dropped) or ctx_full,
            stats=stats,
            localspec=info,
        )
        want_prompt = req.response_fields is None or any(f.split("/")[0] == "prompt" for f in req.response_fields)
        prompt_text = self.model.detokenize(built.tokens, special=True) if built is not None and want_prompt else ""
        if params is None:
            params = plan.params if plan is not None else self.config.sampling
        data = final_response(
            outcome,
            id_slot=req.id_slot,
            model=self.model_name,
            prompt_text=prompt_text,
            generation_settings=generation_settings(
                req, params, plan.applied if plan else [], stats.seed, info["speculative"]
            ),
            return_tokens=req.return_tokens,
            response_fields=req.response_fields,
        )
        if job.cancel_reason is not None and (result is None or result.finish_reason == "cancelled"):
            for k in ("content", "tokens", "has_new_line"):
                data.pop(k, None)
            data["cancelled"] = job.cancel_reason
        return Event("final", data)

    @staticmethod
    def _info(job: Job, plan: SamplingPlan | None, built: BuiltPrompt | None, stats, finish: str) -> dict:
        """The response's ``localspec`` object (speculation, FIM, samplers, notes)."""
        req = job.request
        notes = list(plan.notes) if plan is not None else []
        if built is not None and req.kind == "infill" and not built.fim:
            notes.insert(0, NO_FIM_NOTE)
        if req.n_cmpl > 1 and req.stream:
            notes.append(f"n_cmpl {req.n_cmpl} asked with streaming: localspec streams one completion")
        if req.not_implemented:
            notes.append(f"ignored (not implemented): {', '.join(req.not_implemented)}")
        notes.extend(req.speculation_notes)
        info: dict[str, Any] = {
            "fim": bool(built.fim) if built is not None else None,
            "speculative": stats.drafter != "none",
            "drafter": stats.drafter,
            "n_steps": stats.n_steps,
            "mean_acceptance_length": stats.mean_acceptance_length,
            "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "finish_reason": finish,
            "seed": stats.seed,
        }
        if stats.lossy:
            info["lossy"] = True
            info["accept_threshold_single"] = stats.accept_threshold_single
            info["accept_threshold_acc"] = stats.accept_threshold_acc
        if plan is not None:
            info["samplers"] = {"applied": plan.applied, "not_applied": plan.not_applied}
        if built is not None:
            info["prompt_tokens_dropped"] = {
                "prefix": built.n_prefix_dropped,
                "suffix": built.n_suffix_dropped,
                "extra": built.n_extra_dropped,
            }
        if job.cancel_reason is not None:
            info["cancelled"] = job.cancel_reason
        info["notes"] = notes
        return info
