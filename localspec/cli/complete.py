"""``localspec complete``: the editor completion backend (HTTP or stdio)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from .common import (add_drafter_args, add_memory_args, add_model_args, add_sampling_args, check_listen_address,
                     make_engine, sampling_from_args, server_interrupt)


def register(sub) -> None:
    p = sub.add_parser(
        "complete",
        help="serve editor completions (llama.vim / llama.vscode compatible)",
        description="Serve code completions to editor plugins with speculative decoding: --serve "
        "speaks the llama.cpp server's /infill, /completion and /health over HTTP (point llama.vim "
        "or llama.vscode at it); --stdio speaks JSON lines on standard input/output.",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--serve", action="store_true", help="serve HTTP until stopped")
    mode.add_argument("--stdio", action="store_true", help="JSON lines on standard input / output")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; others need --api-key)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' but on /health (the plugins' api_key; needed off loopback)")
    p.add_argument("--port", type=int, default=8012, help="port (default 8012, the plugins' default; 0 = any free port)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="largest request body (default 8 MiB)")
    p.add_argument("--max-queue", type=int, default=64, help="most requests waiting (default 64; more get 503)")
    p.add_argument("-n", "--n-predict", type=int, default=-1, help="n_predict of requests without one (default -1: no limit)")
    p.add_argument(
        "--fim-window",
        type=int,
        default=4096,
        help="tokens of prefix + suffix in an infill prompt (llama.cpp's n_batch; default 4096)",
    )
    p.add_argument("--spm-infill", action="store_true", help="suffix/prefix/middle FIM order (as llama-server --spm-infill)")
    add_drafter_args(p)
    add_sampling_args(p)
    add_model_args(p)
    add_memory_args(p)
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from ..server import CompletionService, ServiceConfig
    from ..server.prompt import has_fim

    if not 0 <= a.port <= 65535:
        raise SystemExit(f"localspec: error: --port must be in 0..65535, got {a.port}")
    config = ServiceConfig(
        sampling=sampling_from_args(a),
        window=a.fim_window,
        spm=a.spm_infill,
        max_queue=a.max_queue,
        default_n_predict=a.n_predict,
    )
    sock = None
    if a.serve:  # fail before loading the model when the address needs a key or the port is taken
        from ..server.http import bind_socket

        check_listen_address(a.host, a.api_key)
        try:
            sock = bind_socket(a.host, a.port)
        except OSError as e:
            print(f"localspec: error: {e}", file=sys.stderr)
            return 1
    if a.serve:  # one line per request (as llama-server logs each task), whatever --verbose says
        logging.getLogger("localspec.server").setLevel(logging.INFO)
    made: dict = {}

    def load():
        engine = made["engine"] = make_engine(a, a.drafter)
        service = made["service"] = CompletionService(engine, config)
        if not has_fim(engine.model):
            print(
                f"localspec: {engine.model.path.name} has no fill-in-the-middle tokens: /infill completes "
                "from the text before the cursor (the suffix feeds the drafter)",
                file=sys.stderr,
            )
        return service

    try:
        if a.stdio:
            from ..server.stdio import StdioServer

            service = load()
            engine = made["engine"]
            ready = {"model": service.model_name, "fim": has_fim(engine.model), "drafter": engine.drafter_name,
                     "n_ctx": engine.n_ctx}  # fmt: skip
            if threading.current_thread() is threading.main_thread():
                # loaded: Ctrl-C no longer ends the process at once (main's handler) but raises
                # KeyboardInterrupt, on which StdioServer.run answers every outstanding request
                signal.signal(signal.SIGINT, signal.default_int_handler)
            return StdioServer(service, sys.stdin, sys.stdout).run(ready)
        from ..server.http import create_app, serve_while_loading

        def load_app():
            service = load()
            app = create_app(service, max_body_bytes=a.max_body_bytes)
            if a.api_key:
                from ..server.openai import APIKeyMiddleware

                app = APIKeyMiddleware(app, a.api_key)
            return app, service.stop_accepting

        def on_ready(addr: str) -> None:
            made["serving"] = True
            print(f"localspec complete: listening on {addr}", flush=True)

        # until the model is loaded /health answers 503 "loading model" (as llama-server);
        # a signal ends the load at once (server_interrupt), and once serving uvicorn handles
        # SIGINT / SIGTERM and re-raises them after a graceful shutdown
        interrupt = server_interrupt(made)
        old_term = signal.signal(signal.SIGTERM, interrupt)
        old_int = signal.signal(signal.SIGINT, interrupt)
        try:
            serve_while_loading(sock, load_app, log_level="info" if a.verbose else "warning", on_ready=on_ready)
        finally:
            signal.signal(signal.SIGTERM, old_term)
            signal.signal(signal.SIGINT, old_int)
        print("localspec complete: stopped", file=sys.stderr)
        return 0
    finally:
        if "service" in made:
            made["service"].close()
        if "engine" in made:
            made["engine"].close()
        if sock is not None:
            sock.close()
