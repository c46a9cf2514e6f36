"""The ``localspec complete`` backend for editor plugins: an HTTP server compatible with the
llama.cpp server endpoints that llama.vim and llama.vscode call, and a JSON-lines stdio mode.

Modules, one idea each:

    fields.py    typed reads of JSON fields; llama.cpp-style error bodies
    protocol.py  /infill and /completion requests, validated (CompletionRequest)
    sampling_fields.py  llama.cpp's sampler-chain fields -> SamplingParams, and what is not applied
    prompt.py    fill-in-the-middle prompts (or prefix completion without FIM tokens)
    stops.py     the editor stopping rules (n_indent, t_max_predict_ms)
    response.py  llama.cpp's response JSON, server-sent events
    service.py   one engine, one worker thread, a job queue, per-client cancellation
    http.py      the Starlette app, uvicorn serving, an in-process server for tests
    sockets.py   listening sockets (bind_socket), without the HTTP stack
    stdio.py     the JSON-lines protocol
"""

from .protocol import CompletionRequest, parse_request
from .service import CompletionService, Event, Job, ServiceConfig

__all__ = ["CompletionRequest", "CompletionService", "Event", "Job", "ServiceConfig", "parse_request"]
