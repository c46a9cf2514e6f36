"""``localspec rpc-worker``: run llama.cpp's ``rpc-server`` so another host can put layers here.

The binary is ``rpc-server.cpp`` from the llama.cpp that llama-cpp-python vendors, linked
against this environment's own ggml libraries (``make rpc-server``), so its protocol version and
its CPU kernels are the host's. The command checks the version the binary announces against
this host's (``backend.rpc.RPC_PROTO_VERSION``) and stops with a one-line error on a mismatch.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from ..errors import LocalSpecError

BINARY = "localspec-rpc-server"
_BANNER = re.compile(r"Starting RPC server v(\d+)\.(\d+)\.(\d+)")


def find_rpc_server() -> Path | None:
    """``$LOCALSPEC_RPC_SERVER``, else ``localspec-rpc-server`` next to this Python (where
    ``make rpc-server`` puts it), else on ``PATH``; None when not built."""
    env = os.environ.get("LOCALSPEC_RPC_SERVER")
    if env:
        return Path(env) if Path(env).is_file() else None
    here = Path(sys.prefix) / "bin" / BINARY
    if here.is_file():
        return here
    found = shutil.which(BINARY)
    return Path(found) if found else None


def worker_command(host: str, port: int, threads: int | None, device: str | None, cache: bool) -> list[str]:
    exe = find_rpc_server()
    if exe is None:
        raise LocalSpecError(
            f"{BINARY} is not built: run `make rpc-server` (it builds llama.cpp's rpc-server from the vendored "
            "source against this environment's ggml), or set LOCALSPEC_RPC_SERVER"
        )
    cmd = [str(exe), "--host", host, "--port", str(port)]
    if threads:
        cmd += ["--threads", str(threads)]
    if device:
        cmd += ["--device", device]
    if cache:
        cmd.append("--cache")
    return cmd


def worker_env() -> dict[str, str]:
    """The worker's environment: the host's exact-kernel setting (docs/architecture.md), so a
    layer computes the same bits on the worker as it would locally."""
    env = dict(os.environ)
    if os.environ.get("LOCALSPEC_KERNELS", "exact") == "exact":
        env.setdefault("GGML_CPU_TILED_MM", "0")
    return env


def check_banner(line: str) -> tuple[int, int, int] | None:
    """The version in rpc-server's ``Starting RPC server vX.Y.Z`` line, or None for other lines.

    Raises:
        LocalSpecError: the version is not this host's protocol version.
    """
    from ..backend.rpc import RPC_PROTO_VERSION

    m = _BANNER.search(line)
    if not m:
        return None
    version = tuple(int(x) for x in m.groups())
    if version != RPC_PROTO_VERSION:
        raise LocalSpecError(
            f"rpc-server speaks protocol v{'.'.join(map(str, version))}, this localspec v"
            f"{'.'.join(map(str, RPC_PROTO_VERSION))}: rebuild it with `make rpc-server`"
        )
    return version  # type: ignore[return-value]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the worker gets SIGKILL when this wrapper dies, however it dies (no orphans)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_worker(a: argparse.Namespace) -> int:
    if a.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"localspec: warning: RPC workers have no authentication; {a.host}:{a.port} must be reachable from "
            "trusted machines only (docs/rpc.md)",
            file=sys.stderr,
        )
    if not 1 <= a.port <= 65535:
        raise SystemExit(f"localspec: error: --port must be in 1..65535, got {a.port}")
    if a.threads is not None and a.threads < 1:
        raise SystemExit(f"localspec: error: -t/--threads must be >= 1, got {a.threads} (default: half the CPUs)")
    check_port_free(a.host, a.port)
    cmd = worker_command(a.host, a.port, a.threads, a.device, a.cache)
    proc = subprocess.Popen(
        cmd, env=worker_env(), stdout=subprocess.PIPE, text=True, bufsize=1, preexec_fn=_die_with_parent
    )
    stopped = []  # a SIGTERM asked for the stop: the worker's end is not a failure

    def terminate(*_) -> None:
        stopped.append(True)
        proc.terminate()

    # forward SIGTERM to the worker; Ctrl-C reaches it directly (same process group)
    signal.signal(signal.SIGTERM, terminate)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            try:
                check_banner(line)
            except LocalSpecError:
                proc.terminate()
                proc.wait()
                raise
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        return 130
    if stopped:
        return 0
    # rpc-server runs until it is stopped: ending on its own (a socket it could not open, a bad
    # --device, a kill) is a failure, whatever its exit status
    how = f"was killed by signal {-rc}" if rc < 0 else f"stopped with exit status {rc}"
    print(f"localspec: error: the rpc-server {how}; its own messages are above", file=sys.stderr)
    return rc if rc > 0 else 1


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another process listens on, before the worker starts (rpc-server says
    only "Failed to create server socket" and exits 0): ``serve``'s own check, the socket
    closed again for rpc-server to bind.

    Raises:
        SystemExit: one line naming the address."""
    from ..server.sockets import bind_socket

    try:
        bind_socket(host, port).close()
    except OSError as e:
        raise SystemExit(f"localspec: error: {e}") from None


def register(sub) -> None:
    from ..backend.rpc import DEFAULT_PORT

    p = sub.add_parser(
        "rpc-worker",
        help="serve this machine's devices to a localspec host (llama.cpp rpc-server)",
        description="Runs llama.cpp's rpc-server (built by `make rpc-server` from the same llama.cpp as this "
        "localspec) so that a host started with --rpc HOST:PORT puts target layers here. It has NO "
        "authentication: bind it to 127.0.0.1 (default) or to a trusted private network only.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads of the worker (default: half the CPUs)")
    p.add_argument("--device", default=None, help="devices to serve, e.g. CUDA0,CUDA1 (default: GPUs, else the CPU)")
    p.add_argument("--cache", action="store_true", help="cache received tensors on disk (llama.cpp's -c)")
    p.set_defaults(func=run_worker)


def _check_header(path: str) -> int:
    """``python -m localspec.cli.rpc HEADER``: exit 1 unless ggml-rpc.h's version is ours."""
    from ..backend.rpc import RPC_PROTO_VERSION

    text = Path(path).read_text()
    got = tuple(int(re.search(rf"RPC_PROTO_{k}_VERSION\s+(\d+)", text).group(1)) for k in ("MAJOR", "MINOR", "PATCH"))
    if got != RPC_PROTO_VERSION:
        print(f"error: {path} declares RPC protocol {got}, localspec.backend.rpc expects {RPC_PROTO_VERSION}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover - used by the Makefile
    sys.exit(_check_header(sys.argv[1]))
