"""JSON lines over standard input / output, for plugins that spawn a process.

Each input line is one JSON object::

    {"id": 1, "method": "infill", "params": {...the /infill body...}}
    {"id": 2, "method": "completion", "params": {...the /completion body...}}
    {"id": 3, "method": "cancel", "params": {"id": 1}}
    {"id": 4, "method": "health"}
    {"id": 5, "method": "shutdown"}

Each output line is one JSON object carrying the request's ``id``: ``{"id": 1, "result":
{...}}`` (the same object the HTTP server returns), ``{"id": 1, "partial": {...}}`` for every
streamed piece when ``params.stream`` is true, or ``{"id": 1, "error": {"code", "message",
"type"}}``. The first line is ``{"ready": {...}}`` once the model is loaded. Requests run in
arrival order; ``cancel`` stops one (queued or running; its ``result`` still comes, with
``localspec.cancelled`` set), and a newer request with the same ``client_id`` / ``id_slot``
cancels the older one, as over HTTP. At the end of input, outstanding requests finish and
the process exits; ``shutdown`` cancels them and exits at once, and so does Ctrl-C (exit status
130), each cancelled request still answered.
"""

from __future__ import annotations

import json
import threading
from typing import IO, Any

from .fields import INVALID_REQUEST, NOT_FOUND, RequestError, decode_json, error_body, lone_surrogate_error
from .protocol import parse_request
from .response import dumps
from .service import CompletionService, Event, Job


class StdioServer:
    """Runs the JSON-lines protocol over two text streams."""

    def __init__(self, service: CompletionService, inp: IO[str], out: IO[str]) -> None:
        self.service = service
        self.inp = inp
        self.out = out
        self._write_lock = threading.Lock()
        self._jobs: dict[Any, Job] = {}  # request id -> running or queued job
        self._live: set[Job] = set()
        self._jobs_lock = threading.Lock()
        self.broken = False

    def write(self, obj: dict) -> None:
        line = dumps(obj) + "\n"
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (e.g. in a text echoed back): JSON's \\u escapes
            line = json.dumps(obj, ensure_ascii=True, separators=(",", ":")) + "\n"
        with self._write_lock:
            if self.broken:
                return
            try:
                self.out.write(line)
                self.out.flush()
            except (BrokenPipeError, OSError, ValueError):
                self.broken = True  # the client is gone; finish quietly

    def run(self, ready: dict | None = None) -> int:
        """Serve until end of input or ``shutdown``; returns the exit status.

        Raises:
            KeyboardInterrupt: Ctrl-C (SIGINT), after every request still queued or running
                was cancelled and answered (its ``result`` with ``cancelled``), so that a
                client waiting on an id gets its answer; a second Ctrl-C stops the waiting.
        """
        self.write({"ready": ready or {"model": self.service.model_name}})
        shutdown = False
        try:
            for line in self.inp:
                if self.broken:
                    break
                line = line.strip()
                if not line:
                    continue
                if self.handle(line) == "shutdown":
                    shutdown = True
                    break
            self._finish("the client shut the server down" if shutdown or self.broken else None)
        except KeyboardInterrupt:
            self._finish("the server was interrupted (Ctrl-C)")
            raise
        return 0

    def _finish(self, cancel: str | None) -> None:
        """Wait until every outstanding request is answered, cancelling each first with the
        reason ``cancel`` (None: let them run to their end)."""
        with self._jobs_lock:
            jobs = list(self._live)
        if cancel is not None:  # all before any wait: a queued job answers only after the running one
            for job in jobs:
                job.cancel(cancel)
        for job in jobs:
            job.done.wait()

    def handle(self, line: str) -> str | None:
        """Handle one input line; returns ``"shutdown"`` when asked to stop."""
        try:
            msg = decode_json(line, "the line")
        except RequestError as e:
            self.write({"id": None, "error": e.body()["error"]})
            return None
        if not isinstance(msg, dict):
            self.write({"id": None, "error": error_body(400, "each line must be a JSON object", INVALID_REQUEST)["error"]})
            return None
        rid = msg.get("id")
        method = msg.get("method")
        params = msg.get("params", {})
        try:
            _check_id(rid, '"id"')
        except RequestError as e:  # an id that cannot be echoed (a lone surrogate, 1e400 = Infinity): null
            self.write({"id": None, "error": e.body()["error"]})
            return None
        try:
            if method in ("infill", "completion"):
                self._submit(rid, method, params)
            elif method == "cancel":
                target = params.get("id") if isinstance(params, dict) else None
                _check_id(target, '"params.id"')
                with self._jobs_lock:
                    job = self._jobs.get(target)
                if job is not None:
                    job.cancel("cancelled by the client")
                self.write({"id": rid, "result": {"cancelled": job is not None}})
            elif method == "health":
                self.write({"id": rid, "result": self.service.health()[1]})
            elif method in ("shutdown", "exit"):
                self.write({"id": rid, "result": {"shutdown": True}})
                return "shutdown"
            else:
                raise RequestError(
                    f"unknown method {method!r}; use infill, completion, cancel, health or shutdown", 404, NOT_FOUND
                )
        except RequestError as e:
            self.write({"id": rid, "error": e.body()["error"]})
        return None

    def _submit(self, rid: Any, method: str, params: Any) -> None:
        req = parse_request(method, params, default_n_predict=self.service.config.default_n_predict)
        job: Job | None = None

        def sink(ev: Event) -> None:
            if ev.kind == "partial":
                self.write({"id": rid, "partial": ev.data})
                return
            if ev.kind == "final":
                self.write({"id": rid, "result": ev.data})
            else:
                self.write({"id": rid, "error": ev.data["error"]})
            with self._jobs_lock:  # waits until _submit has registered the job
                self._live.discard(job)
                if rid is not None and self._jobs.get(rid) is job:
                    del self._jobs[rid]

        with self._jobs_lock:
            if rid is not None and rid in self._jobs:
                raise RequestError(f"request id {rid!r} is still in use")
            job = self.service.submit(req, sink)
            self._live.add(job)
            if rid is not None:
                self._jobs[rid] = job


def _check_id(v: Any, name: str) -> None:
    """Raises:
    RequestError: 400 when ``v`` (a request id) is not a string, an integer or null, or is a
        string with a lone surrogate (it could not be written back as UTF-8)."""
    if v is not None and (not isinstance(v, (str, int)) or isinstance(v, bool)):
        raise RequestError(f"{name} must be a string, an integer or null")
    if isinstance(v, str) and (why := lone_surrogate_error(v)) is not None:  # " holds a lone ..." (path "")
        raise RequestError(f"{name}{why}")
