"""The HTTP server: llama.cpp-compatible endpoints over a ``CompletionService`` (Starlette).

Endpoints: ``POST /infill``, ``POST /completion`` (and ``/completions``), ``GET /health``
(and ``/v1/health``), ``GET /props``, ``GET /v1/models`` (and ``/models``). Responses and
errors have llama.cpp's shapes; streaming (``"stream": true``) sends server-sent events
``data: {...}\\n\\n``, the last one with ``"stop": true``.

Every request body is read with a size bound (413 beyond it) and parsed strictly (400 with a
message for malformed JSON, a missing field or a wrong type); unknown paths get 404 and
wrong methods 405, all as JSON. A client that disconnects - before or during generation,
streaming or not - cancels its job, and the engine goes on with the next one.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from .fields import INVALID_REQUEST, NOT_FOUND, SERVER_ERROR, UNAVAILABLE, RequestError, decode_json, error_body
from .protocol import parse_request
from .response import dumps, sse
from .service import CompletionService, Event, Job
from .sockets import bind_socket  # noqa: F401 - where the commands and tests take it from

log = logging.getLogger("localspec.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


def json_response(obj, status: int = 200) -> Response:
    return Response(dumps(obj).encode("utf-8"), status_code=status, media_type="application/json")


async def read_json(request: Request, max_bytes: int):
    """The decoded JSON body.

    Raises:
        RequestError: 413 when larger than ``max_bytes``; 400 when not UTF-8 JSON, or nested too
            deeply for Python's parser, or when the client went away before the body ended (the
            answer reaches no one; it was an "Exception in ASGI application" traceback in the log).
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(f"the request body has {declared} bytes; the limit is {max_bytes}", 413)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise RequestError(f"the request body is larger than the limit of {max_bytes} bytes", 413)
            chunks.append(chunk)
    except ClientDisconnect:
        message = f"the client disconnected after {size} bytes of the request body"
        log.info("%s %s: %s", request.method, request.url.path, message)  # one line, not a traceback
        raise RequestError(message) from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise RequestError("the request body is empty; send a JSON object")
    return decode_json(raw, "the request body")


class JobResponse:
    """ASGI response that waits for a job's events and cancels the job if the client leaves.

    Non-streaming: one JSON body (the final response, or the error with its status).
    Streaming: the first event decides - an error is sent as a plain JSON error (as
    llama.cpp does); otherwise ``text/event-stream`` with one event per partial and the final.
    """

    def __init__(self, job: Job, events: asyncio.Queue, stream: bool) -> None:
        self.job = job
        self.events = events
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        self.job.cancel("the client disconnected")
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_disconnect)
            try:
                if self.stream:
                    await self._send_stream(send)
                else:
                    await self._send_one(send)
            finally:
                if not self.job.done.is_set():
                    self.job.cancel("the response ended early")
                tg.cancel_scope.cancel()

    async def _next_final(self) -> Event:
        while True:
            ev = await self.events.get()
            if ev.kind != "partial":
                return ev

    async def _send_one(self, send) -> None:
        ev = await self._next_final()
        await _send_body(send, ev.status, dumps(ev.data).encode("utf-8"), b"application/json")

    async def _send_stream(self, send) -> None:
        ev = await self.events.get()
        if ev.kind == "error":
            await _send_body(send, ev.status, dumps(ev.data).encode("utf-8"), b"application/json")
            return
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        while True:
            await send({"type": "http.response.body", "body": sse(ev.data), "more_body": True})
            if ev.kind != "partial":
                break
            ev = await self.events.get()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_body(send, status: int, body: bytes, media_type: bytes) -> None:
    headers = [(b"content-type", media_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def create_app(service: CompletionService, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """The Starlette app serving ``service``."""

    async def complete(request: Request, kind: str):
        try:
            body = await read_json(request, max_body_bytes)
            req = parse_request(kind, body, default_n_predict=service.config.default_n_predict)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()

            def sink(ev: Event) -> None:
                try:
                    loop.call_soon_threadsafe(events.put_nowait, ev)
                except RuntimeError:  # the event loop is gone (server shutting down)
                    pass

            job = service.submit(req, sink)
        except RequestError as e:
            return json_response(e.body(), e.status)
        return JobResponse(job, events, req.stream)

    async def infill(request: Request):
        return await complete(request, "infill")

    async def completion(request: Request):
        return await complete(request, "completion")

    async def health(_request: Request):
        status, body = service.health()
        return json_response(body, status)

    async def props(_request: Request):
        e = service.engine
        return json_response(
            {
                "default_generation_settings": {"n_ctx": e.n_ctx, "params": {"n_predict": service.config.default_n_predict}},
                "total_slots": 1,
                "model_path": str(service.model.path),
                "fim": {"supported": bool(service.model.fim_tokens()), "tokens": service.model.fim_tokens()},
                "speculative": {
                    "drafter": e.drafter_name,
                    "enabled": bool(service.config.speculative and e.drafter is not None),
                },
                "build_info": "localspec",
                "localspec": {"requests": dict(service.counters)},
            }
        )

    async def models(_request: Request):
        return json_response(
            {
                "object": "list",
                "data": [{"id": service.model_name, "object": "model", "created": 0, "owned_by": "localspec"}],
            }
        )

    async def http_error(_request: Request, exc: HTTPException):
        kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
        return json_response(error_body(exc.status_code, str(exc.detail), kind), exc.status_code)

    async def server_error(_request: Request, exc: Exception):
        log.exception("unhandled error", exc_info=exc)
        return json_response(error_body(500, f"internal error: {exc}", SERVER_ERROR), 500)

    routes = [
        Route("/infill", infill, methods=["POST"]),
        Route("/completion", completion, methods=["POST"]),
        Route("/completions", completion, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/props", props, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})


def address_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _uvicorn_server(app, *, log_level: str, on_ready=None, on_shutdown=None):
    """A uvicorn server; ``on_ready()`` once listening, ``on_shutdown()`` when a shutdown
    begins (SIGINT / SIGTERM), before uvicorn waits for open connections."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started and on_ready is not None:
                on_ready()

        async def shutdown(self, sockets=None) -> None:
            if on_shutdown is not None:
                on_shutdown()
            await super().shutdown(sockets=sockets)

    config = uvicorn.Config(
        app, log_level=log_level, access_log=log_level in ("info", "debug"), lifespan="off", timeout_graceful_shutdown=3
    )
    return _Server(config)


class LoadingGate:
    """ASGI app that answers while the model loads, as llama-server does: ``/health`` (and
    ``/v1/health``) 503 ``{"status": "loading model"}``, every other path 503 with an
    ``unavailable_error`` body; once ``open(app)`` is called, every request goes to ``app``."""

    def __init__(self) -> None:
        self.app = None

    def open(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        app = self.app
        if app is not None:
            await app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] in ("/health", "/v1/health"):
            body = {"status": "loading model"}
        else:
            body = error_body(503, "Loading model", UNAVAILABLE)
        await _send_body(send, 503, dumps(body).encode("utf-8"), b"application/json")


def serve_while_loading(sock: socket.socket, load, *, log_level: str = "warning", on_ready=None,
                        stop: threading.Event | None = None) -> None:  # fmt: skip
    """Serve on ``sock`` (see ``bind_socket``) at once, ``LoadingGate`` answering until
    ``load()`` (run on another thread) returns ``(app, on_shutdown)``; then ``app`` serves and
    ``on_ready(address)`` is called. Runs until interrupted (SIGINT / SIGTERM: uvicorn's
    graceful shutdown, ``on_shutdown()`` first when loaded), then returns. Closes the socket.

    Raises:
        whatever ``load()`` raised (the server stops at once); KeyboardInterrupt when
        interrupted before ``app`` served (``on_ready`` is then not called; what ``load()``
        built is the caller's to close). ``stop``: setting it ends serving as a signal does (tests).
    """
    addr = address_of(sock)
    gate = LoadingGate()
    state: dict = {}
    opening = threading.Lock()  # the loader opens the gate, or not, wholly before or after the check below

    def shutdown() -> None:
        if state.get("on_shutdown") is not None:
            state["on_shutdown"]()

    server = _uvicorn_server(gate, log_level=log_level, on_shutdown=shutdown)

    def loader() -> None:
        try:
            app, state["on_shutdown"] = load()
        except BaseException as e:  # noqa: BLE001 - re-raised on the serving thread
            state["error"] = e
            server.should_exit = True
            return
        with opening:
            if server.should_exit:  # interrupted while loading: nothing is served, no "listening" line
                return
            gate.open(app)
            state["served"] = True
            if on_ready is not None:
                on_ready(addr)

    t = threading.Thread(target=loader, name="localspec-load", daemon=True)
    t.start()
    if stop is not None:
        threading.Thread(target=lambda: (stop.wait(), setattr(server, "should_exit", True)), daemon=True).start()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the signal that stopped it
        pass
    finally:
        sock.close()
    with opening:
        served = state.get("served", False)
    if not served:  # stopped while loading: let the load end, so its owner can close it
        t.join()
        if "error" in state:
            raise state["error"]
        raise KeyboardInterrupt


class AppThread:
    """An in-process server for an ASGI ``app`` on a free loopback port, in a background
    thread (tests, benchmarks). Use as a context manager; ``url`` is its base address.

    Raises:
        RuntimeError: on entering, when the server thread died or did not start in 60 s.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = bind_socket(host, port)
        self.url = address_of(self._sock)
        self._server = _uvicorn_server(app, log_level="warning")
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self):
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()


class ServerThread(AppThread):
    """The editor server (``create_app(service)``) as an ``AppThread``."""

    def __init__(self, service: CompletionService, host: str = "127.0.0.1", port: int = 0, **app_kw) -> None:
        self.service = service
        super().__init__(create_app(service, **app_kw), host, port)
