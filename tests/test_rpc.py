"""The target's layers on a real llama.cpp RPC worker (``localspec rpc-worker`` on 127.0.0.1).

The worker tests skip only when the worker binary is not built (``make rpc-server``; ``make
test`` builds it). Unit tests of endpoint parsing and of the protocol-version check run always.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from conftest import fixed_cost_model
from localspec import Engine, SamplingParams
from localspec.backend import rpc
from localspec.cli.rpc import check_banner, find_rpc_server
from localspec.errors import LocalSpecError

GREEDY = SamplingParams.greedy()
PROMPT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def fibonacci_memo(n, memo={}):\n"
)

needs_worker = pytest.mark.skipif(find_rpc_server() is None, reason="rpc-server not built (make rpc-server)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """``localspec rpc-worker`` on 127.0.0.1:port, in its own process, ready when started."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "localspec", "rpc-worker", "--port", str(self.port), "--threads", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120  # bound only: the loop ends as soon as HELLO answers
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rpc-worker exited with {self.proc.returncode}")
            try:
                rpc.probe(self.endpoint, timeout=5)
                return
            except rpc.RPCError:
                if time.monotonic() > deadline:
                    self.kill()
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def worker():
    if find_rpc_server() is None:
        pytest.skip("rpc-server not built (make rpc-server)")
    w = Worker()
    yield w
    w.kill()


# -- always run ------------------------------------------------------------------------------


def test_endpoints_parse_and_bad_ones_are_clear():
    assert rpc.parse_endpoints("10.0.0.2:50052, 10.0.0.3:50053") == ["10.0.0.2:50052", "10.0.0.3:50053"]
    assert rpc.parse_endpoints(["a:1", "b:2"]) == ["a:1", "b:2"]
    for bad in ("10.0.0.2", "host:", ":50052", "host:0", "host:70000", "host:port"):
        with pytest.raises(rpc.RPCError, match="HOST:PORT"):
            rpc.parse_endpoints(bad)
    with pytest.raises(rpc.RPCError, match="twice"):
        rpc.parse_endpoints("a:1,a:1")


def test_unreachable_worker_is_a_clear_error_naming_it():
    port = free_port()  # nothing listens there
    with pytest.raises(rpc.RPCError, match=f"127.0.0.1:{port} is unreachable"):
        rpc.probe(f"127.0.0.1:{port}", timeout=5)
    with pytest.raises(rpc.RPCError, match=f"127.0.0.1:{port}"):
        Engine(rpc=[f"127.0.0.1:{port}"], drafter=None, cost_model=fixed_cost_model())


def _hello_server(version: tuple[int, int, int]):
    """A socket that answers one HELLO like an rpc-server of ``version`` (the real worker can
    only announce this build's version, so a mismatch needs a stand-in)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        with conn:
            conn.recv(1 + 8 + 24, socket.MSG_WAITALL)
            conn.sendall(struct.pack("<Q", 28) + bytes(version) + bytes(25))
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{srv.getsockname()[1]}"


@pytest.mark.parametrize("version", [(6, 0, 0), (7, 1, 0), (7, 0, 1)])
def test_a_worker_of_another_protocol_version_is_refused(version):
    ep = _hello_server(version)
    with pytest.raises(rpc.RPCError, match=rf"{ep} speaks protocol v{version[0]}\.{version[1]}\.{version[2]}"):
        rpc.probe(ep, timeout=10)


def test_the_same_version_passes_the_check():
    ep = _hello_server(rpc.RPC_PROTO_VERSION)
    assert rpc.probe(ep, timeout=10).version == rpc.RPC_PROTO_VERSION


def test_worker_banner_version_is_checked():
    assert check_banner("Starting RPC server v%d.%d.%d" % rpc.RPC_PROTO_VERSION) == rpc.RPC_PROTO_VERSION
    assert check_banner("  endpoint       : 127.0.0.1:50052") is None
    with pytest.raises(LocalSpecError, match="v6.0.0"):
        check_banner("Starting RPC server v6.0.0")


def test_cli_rejects_a_bad_rpc_flag_in_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "localspec", "generate", "x", "-n", "1", "--rpc", "nohost"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("localspec: error: RPC worker 'nohost' is not HOST:PORT")


# -- with a real worker -------------------------------------------------------------------------


@needs_worker
def test_rpc_build_is_present():
    assert rpc.supported(), "llama-cpp-python was built without GGML_RPC=ON (make env rebuilds it)"


@pytest.fixture(scope="module")
def remote(worker):
    """Plain and speculative greedy outputs with all the target's layers on the worker."""
    with Engine(rpc=[worker.endpoint], drafter="ngram", n_ctx=2048, cost_model=fixed_cost_model()) as eng:
        assert eng.model.n_gpu_layers == -1 and eng.model.device_key.startswith("RPC")
        assert eng.model.rpc_workers[0].endpoint == worker.endpoint
        plain = eng.generate(PROMPT, max_tokens=48, sampling=GREEDY, speculative=False)
        eng.reset()
        spec = eng.generate(PROMPT, max_tokens=48, sampling=GREEDY)
    return plain, spec


@needs_worker
def test_layers_on_the_worker_speculative_equals_plain(remote):
    plain, spec = remote
    assert spec.token_ids == plain.token_ids
    # the n-gram drafter really speculated (this prompt repeats itself), so the check means something
    assert spec.stats.n_steps < len(spec.token_ids)


@needs_worker
@pytest.mark.xfail(
    strict=True,
    reason="measured: logits with the layers on the worker differ from local ones at every position > 0 "
    "(up to ~1.4; position 0 is bit-identical; independent of worker threads and flash attention), so "
    "greedy output leaves the local one at token 31 of this prompt; cause not found yet (docs/rpc.md)",
)
def test_layers_on_the_worker_greedy_equals_local_plain(engine, remote):
    engine.reset()
    local = engine.generate(PROMPT, max_tokens=48, sampling=GREEDY, speculative=False)
    assert remote[0].token_ids == local.token_ids


@needs_worker
def test_part_of_the_layers_local_part_on_the_worker(engine, worker):
    engine.reset()
    local = engine.generate(PROMPT, max_tokens=24, sampling=GREEDY, speculative=False)
    with Engine(rpc=worker.endpoint, n_gpu_layers=9, drafter="ngram", n_ctx=2048, cost_model=fixed_cost_model()) as eng:
        assert eng.generate(PROMPT, max_tokens=24, sampling=GREEDY).token_ids == local.token_ids


@needs_worker
def test_cost_calibration_is_keyed_by_the_device_set(model_path, worker):
    from localspec.backend import Context, Model
    from localspec.costmodel import _cache_key

    with Model(model_path) as local_m, Model(model_path, rpc=[worker.endpoint]) as remote_m:
        with Context(local_m, n_ctx=64) as c1, Context(remote_m, n_ctx=64) as c2:
            assert _cache_key(c1) != _cache_key(c2)
            assert "devices=" not in local_m.device_key and remote_m.device_key.startswith("RPC")


@needs_worker
def test_a_worker_killed_mid_generation_is_a_clear_error_then_usable_again(engine, model_path, tmp_path):
    """llama.cpp's RPC client aborts its process when a worker drops (ggml-rpc's
    RPC_STATUS_ASSERT), so the host is a separate process: it must end promptly (no hang) with a
    message naming the worker; a new run once the worker is back, and a local run, both work."""
    w = Worker()
    # the model by path: the cache directory below holds only cost tables (of random ports),
    # so the host does not assemble a second copy of the default model there
    cmd = [sys.executable, "-m", "localspec", "generate", PROMPT, "-n", "4000", "--temperature", "0",
           "--n-ctx", "4096", "--max-tree-nodes", "4", "--drafter", "none", "--rpc", w.endpoint,
           "-m", str(model_path)]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LOCALSPEC_CACHE_DIR": str(tmp_path)}  # cost tables of random ports
    host = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert host.stdout is not None
        first = host.stdout.read(1)  # blocks until the host streams its first generated text
        assert first, host.stderr.read().decode()
        w.kill()
        _, err = host.communicate(timeout=300)  # a bound, not a pause: returns as soon as it exits
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
    assert host.returncode != 0
    assert f"lost RPC worker(s) {w.endpoint}" in err.decode()
    # the worker back on the same port: a new host process runs
    w2 = Worker(w.port)
    try:
        r = subprocess.run(cmd[:5] + ["-n", "8"] + cmd[7:], capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr
    finally:
        w2.kill()
    # retried locally (in this process, no RPC): fine
    engine.reset()
    assert len(engine.generate(PROMPT, max_tokens=8, sampling=GREEDY).token_ids) == 8
