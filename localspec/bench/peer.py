"""llama.cpp's own server as a peer in ``localspec bench``.

``--peer-llama-server BIN`` starts ``llama-server`` (built from the same llama.cpp source that
llama-cpp-python vendors; docs/bench.md says how) once per mode - plain, and each of its
n-gram speculative modes - on a loopback port, sends the same prompt tokens to
``/completion`` with greedy sampling and no prompt cache, and reads the server's own timings
(``predicted_n`` / ``predicted_ms``: decode time, prefill excluded).

With ``exact=True`` (the default when localspec itself runs with exact kernels) the server
runs with the same numerics as localspec (``--no-repack``, ``GGML_CPU_TILED_MM=0``, K cache
BF16 / V cache F16), so its plain output is the same text as localspec's and acceptance is
compared on the same continuations; ``exact=False`` runs llama.cpp's defaults.
"""

from __future__ import annotations

import json
import os
import socket
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

NGRAM_MODES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def _die_with_parent() -> None:
    """In the child before exec: end the peer server when the bench process dies, also by
    SIGKILL (Linux ``PR_SET_PDEATHSIG``; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PeerRun:
    tokens: list[int]
    predicted_n: int
    predicted_ms: float
    prompt_ms: float
    draft_n: int
    draft_n_accepted: int


class PeerServer:
    """One ``llama-server`` process in one speculative mode (``"none"`` = plain); ``extra_args``
    are added to its command line (e.g. ``-lcs FILE``: ngram-cache's static cache)."""

    def __init__(
        self,
        binary: str | Path,
        model: str | Path,
        mode: str,
        *,
        n_ctx: int,
        threads: int,
        log_dir: Path,
        exact: bool = True,
        tag: str = "",
        extra_args: Sequence[str] = (),
    ) -> None:
        self.mode = mode
        self.exact = exact
        self.port = free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"llama-server-{mode}{'-' + tag if tag else ''}.log"
        args = [
            str(binary),
            "-m", str(model),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "-c", str(n_ctx),
            "-t", str(threads),
            "-tb", str(threads),
            "-np", "1",
            "--no-webui",
        ]  # fmt: skip
        if mode != "none":
            args += ["--spec-type", mode]
        args += list(extra_args)
        env = dict(os.environ)
        if exact:
            args += ["--no-repack", "-ctk", "bf16", "-ctv", "f16", "-fa", "on"]
            env["GGML_CPU_TILED_MM"] = "0"
        else:
            env.pop("GGML_CPU_TILED_MM", None)
            from ..backend import cpu_amx

            if cpu_amx():  # llama.cpp's AMX matmul segfaults on batches (backend.cpu_amx)
                args.append("--no-repack")
        self.args = args
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 120.0) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server ({self.mode}) exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.3)
        self.close()
        raise RuntimeError(f"llama-server ({self.mode}) did not become ready; see {self.log_path}")

    def complete(self, prompt_tokens: list[int], n_predict: int, *, stop: Sequence[str] = (), cache_prompt: bool = False) -> PeerRun:
        """One greedy ``/completion`` (``cache_prompt``: reuse the KV of the previous request's
        common prefix, as an editor's session does; only the prefill time changes)."""
        body = {
            "prompt": prompt_tokens,
            "n_predict": n_predict,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": cache_prompt,
            "return_tokens": True,
            "seed": 0,
        }
        if stop:
            body["stop"] = list(stop)
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            d = json.loads(r.read())
        t = d.get("timings", {})
        return PeerRun(
            tokens=list(d.get("tokens", [])),
            predicted_n=int(t.get("predicted_n", 0)),
            predicted_ms=float(t.get("predicted_ms", 0.0)),
            prompt_ms=float(t.get("prompt_ms", 0.0)),
            draft_n=int(t.get("draft_n", 0)),
            draft_n_accepted=int(t.get("draft_n_accepted", 0)),
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()
