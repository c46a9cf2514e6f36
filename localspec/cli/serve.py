"""``localspec serve``: the OpenAI-compatible server (and the editor endpoints), with
concurrent requests decoded together (``--parallel``)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from .common import (_draft_shape, add_drafter_args, add_memory_args, add_model_args, add_sampling_args, add_usage_args,
                     check_listen_address, check_parallel, check_request_context, make_engine, sampling_from_args,
                     server_interrupt)


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models) and the editor endpoints",
        description="Serve an OpenAI-compatible API with lossless speculative decoding; up to --parallel "
        "requests are decoded together in one batch. The editor endpoints (/infill, /completion, /health) "
        "are served by the same process. Listens on 127.0.0.1 unless --host is given, which needs --api-key.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; others need --api-key)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = any free port)")
    p.add_argument("--parallel", type=int, default=4, help="requests decoded together (default 4)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (needed off loopback)")
    p.add_argument("--ctx-per-request", type=int, default=4096, help="tokens one request may hold (default 4096)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="largest request body (default 8 MiB)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="most requests waiting for a slot when every slot is busy (default 64; more get 503; 0 = none)")
    p.add_argument("--model-name", default=None, help="the model id /v1/models lists (default: the GGUF file name)")
    p.add_argument("--prompt-cache", type=int, default=None, metavar="N",
                   help="finished requests whose KV is kept for later prompts with the same start, e.g. the "
                   "next turn of a chat (default: --parallel; 0 = none; a request may send cache_prompt: false)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="most prompt tokens prefilled per step while other requests decode (default 64)")
    p.add_argument("--no-editor", action="store_true", help="do not serve /infill and /completion")
    add_drafter_args(p)
    add_sampling_args(p)
    add_model_args(p, n_ctx_help="context of the editor endpoints (/completion, /infill, llama-server's; default "
                   "8192); each request to the OpenAI endpoints (/v1/...) holds --ctx-per-request tokens")
    add_memory_args(p)
    add_usage_args(p)
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from ..scheduler import PREFILL_CHUNK, BatchScheduler
    from ..server import CompletionService, ServiceConfig
    from ..server.http import bind_socket, serve_while_loading
    from ..server.openai import OpenAIService, create_serve_app

    if not 0 <= a.port <= 65535:
        raise SystemExit(f"localspec: error: --port must be in 0..65535, got {a.port}")
    check_listen_address(a.host, a.api_key)
    check_parallel(a.parallel)
    if a.ctx_per_request < 16:
        raise SystemExit(f"localspec: error: --ctx-per-request must be at least 16 tokens, got {a.ctx_per_request}")
    check_request_context(a.model, a.ctx_per_request, "--ctx-per-request")
    if a.max_queue < 0:
        raise SystemExit(f"localspec: error: --max-queue must be >= 0, got {a.max_queue}")
    if a.max_body_bytes < 1024:
        raise SystemExit(f"localspec: error: --max-body-bytes must be at least 1024, got {a.max_body_bytes}")
    if a.prompt_cache is not None and a.prompt_cache < 0:
        raise SystemExit(f"localspec: error: --prompt-cache must be >= 0, got {a.prompt_cache}")
    if a.prefill_chunk is not None and a.prefill_chunk < 1:
        raise SystemExit(f"localspec: error: --prefill-chunk must be >= 1, got {a.prefill_chunk}")
    sampling = sampling_from_args(a)
    _draft_shape(a.draft_shape)  # a bad --draft-shape before the model loads
    try:
        sock = bind_socket(a.host, a.port)  # fail before loading the model when the port is taken
    except OSError as e:
        print(f"localspec: error: {e}", file=sys.stderr)
        return 1
    # one line per request (as llama-server logs each task), whatever --verbose says
    logging.getLogger("localspec.server").setLevel(logging.INFO)
    made: dict = {}  # what load() built, closed at the end in reverse order

    def load():
        """The model, the scheduler and the services (the socket answers 503 meanwhile)."""
        engine = made["engine"] = make_engine(a, None if a.drafter == "none" else a.drafter)
        defaults = engine.with_thresholds(sampling)  # --accept-threshold-*: the requests' default
        name, options = engine.drafter_spec or ("none", {})
        sched = made["sched"] = BatchScheduler(
            engine.model, parallel=a.parallel, n_ctx=a.ctx_per_request, drafter=name, drafter_options=options,
            max_tree_nodes=min(a.max_tree_nodes, 32), cost_model=engine.cost_model, n_threads=a.threads,
            adaptive=not a.no_adaptive, prompt_cache=a.prompt_cache,
            prefill_chunk=a.prefill_chunk or PREFILL_CHUNK, draft_memory=engine.draft_memory).start()  # fmt: skip
        sched.usage_log = engine.usage_log  # --record-usage: the API's requests too
        name = a.model_name or engine.model.path.name
        oai = OpenAIService(sched, model_name=name, sampling=defaults, max_queue=a.max_queue)
        editor = None
        if not a.no_editor:
            editor = made["editor"] = CompletionService(engine, ServiceConfig(sampling=defaults, max_queue=a.max_queue))
        app = create_serve_app(oai, editor, max_body_bytes=a.max_body_bytes, api_key=a.api_key)
        if not oai.chat_format().uses_template:
            print(f"localspec: {name} has no chat template: /v1/chat/completions uses the plain "
                  "'User:/Assistant:' transcript (docs/serve.md)", file=sys.stderr)  # fmt: skip
        def on_shutdown() -> None:  # before uvicorn waits for open connections: end the streams
            oai.stop_accepting()
            if editor is not None:
                editor.stop_accepting()

        return app, on_shutdown

    def on_ready(addr: str) -> None:
        made["serving"] = True
        print(f"localspec serve: listening on {addr} (OpenAI base URL {addr}/v1, --parallel {a.parallel})", flush=True)

    interrupt = server_interrupt(made)
    old_term = signal.signal(signal.SIGTERM, interrupt)
    old_int = signal.signal(signal.SIGINT, interrupt)
    try:
        serve_while_loading(sock, load, log_level="info" if a.verbose else "warning", on_ready=on_ready)
        print("localspec serve: stopped", file=sys.stderr)
        return 0
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
        for key in ("editor", "sched", "engine"):
            if key in made:
                made[key].close()
        if made.get("engine") is not None and made["engine"].usage_log is not None:
            made["engine"].usage_log.close()
        sock.close()
