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

import httpx
import numpy as np
import pytest

from conftest import frozen_cost_model
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
        Engine(rpc=[f"127.0.0.1:{port}"], drafter=None, cost_model=frozen_cost_model())


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
    with Engine(rpc=[worker.endpoint], drafter="ngram", n_ctx=2048, cost_model=frozen_cost_model()) as eng:
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
def test_layers_on_the_worker_greedy_equals_local_plain(engine, remote):
    """Bit-identity needs the exact kernels on the worker too: the K cache in BF16 like a local
    context (it was F16 while ``llama_supports_gpu_offload()``, true on any RPC build, was read
    as "layers on a GPU"; then greedy output left the local one at token 31 of this prompt)."""
    engine.reset()
    local = engine.generate(PROMPT, max_tokens=48, sampling=GREEDY, speculative=False)
    assert remote[0].token_ids == local.token_ids


@needs_worker
def test_logits_on_the_worker_are_bit_identical_to_local(model_path, worker):
    """The cause of the old mismatch, checked directly: with the layers on the worker the
    context has the exact-kernel K type (BF16) like a local one, and logit rows of a 520-token
    batch (positions 0 to 519), then of a single-token decode over those 520 cells (where an
    F16/F16 cache would take flash attention's split-KV path), equal the local ones bit for bit."""
    from localspec.backend import Batch, Context, Model

    def run(m):
        with Context(m, n_ctx=1024, n_batch=1024) as c:
            toks = (m.tokenize(PROMPT) * 40)[:520]
            b = Batch(1024)
            b.set_sequence(toks, 0, output="none")
            b.output[[0, 1, 2, 255, 511, 519]] = 1  # a few rows (a logits row is 1 MB on the wire)
            c.decode(b)
            rows = np.array(c.logits())
            b.set_sequence([toks[-1]], 520, output="all")
            c.decode(b)
            return c.type_k, rows, np.array(c.logits())

    with Model(model_path) as lm:
        local = run(lm)
    with Model(model_path, rpc=[worker.endpoint]) as rm:
        assert not rm.on_local_gpu
        remote = run(rm)
    assert local[0] == remote[0] == 30  # GGML_TYPE_BF16
    assert np.array_equal(local[1], remote[1]) and np.array_equal(local[2], remote[2])


@needs_worker
def test_part_of_the_layers_local_part_on_the_worker(engine, worker):
    engine.reset()
    local = engine.generate(PROMPT, max_tokens=24, sampling=GREEDY, speculative=False)
    with Engine(rpc=worker.endpoint, n_gpu_layers=9, drafter="ngram", n_ctx=2048, cost_model=frozen_cost_model()) as eng:
        assert eng.generate(PROMPT, max_tokens=24, sampling=GREEDY).token_ids == local.token_ids


@needs_worker
def test_cost_calibration_is_keyed_by_the_device_set(model_path, worker):
    from localspec.backend import Context, Model
    from localspec.costmodel import _cache_key

    with Model(model_path) as local_m, Model(model_path, rpc=[worker.endpoint]) as remote_m:
        with Context(local_m, n_ctx=64) as c1, Context(remote_m, n_ctx=64) as c2:
            assert _cache_key(c1) != _cache_key(c2)
            assert "devices=" not in local_m.device_key and remote_m.device_key.startswith("RPC")


def bounded(fn, timeout: float = 300.0):
    """``fn()`` on a daemon thread: its result or exception, or a failure if it has not returned
    within ``timeout`` seconds (a hang must fail the test, not stall it; returns at once when
    ``fn`` does)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"no answer within {timeout:g} s: hung"
    if "error" in box:
        raise box["error"]
    return box["value"]


@needs_worker
def test_a_worker_killed_mid_generation_python_api(engine):
    """The Python API: a worker killed mid-stream is a WorkerLostError naming it (the process
    lives: ggml's client talks to the guard relay, not to the worker); while it is down the next
    request is a clear RPCError; once it is back on its port the same engine reconnects and
    generates exactly the local plain output; a local engine in this process works throughout."""
    engine.reset()
    local = engine.generate(PROMPT, max_tokens=24, sampling=GREEDY, speculative=False)
    w = Worker()
    try:
        eng = Engine(rpc=[w.endpoint], drafter="ngram", n_ctx=4096, cost_model=frozen_cost_model())
        stream = eng.stream(PROMPT, max_tokens=3000, sampling=GREEDY)
        first = bounded(lambda: next(stream))  # the first token came through the worker
        assert first.text
        w.kill()

        def rest():
            for _ in stream:
                pass

        with pytest.raises(rpc.WorkerLostError, match=rf"lost RPC worker {w.endpoint} "):
            bounded(rest)
        # retried locally, in this very process
        engine.reset()
        assert engine.generate(PROMPT, max_tokens=24, sampling=GREEDY, speculative=False).token_ids == local.token_ids
        # the worker still down: a clear error, and the engine stays as it is
        with pytest.raises(rpc.RPCError, match=rf"RPC worker {w.endpoint} is unreachable"):
            bounded(lambda: eng.generate(PROMPT, max_tokens=4, sampling=GREEDY))
        w = Worker(w.port)  # back on the same port
        out = bounded(lambda: eng.generate(PROMPT, max_tokens=24, sampling=GREEDY, speculative=False))
        assert out.token_ids == local.token_ids
        eng.reset()
        assert bounded(lambda: eng.generate(PROMPT, max_tokens=24, sampling=GREEDY)).token_ids == local.token_ids
        eng.close()
    finally:
        w.kill()


@needs_worker
def test_a_worker_lost_between_requests_is_seen_before_the_next_one(engine):
    """Killed while the engine is idle: the guard sees the worker's connection close (no
    request running), so once the worker is back the next request reconnects first and
    succeeds, instead of failing on its first decode."""
    engine.reset()
    local = engine.generate(PROMPT, max_tokens=8, sampling=GREEDY, speculative=False)
    w = Worker()
    try:
        with Engine(rpc=[w.endpoint], drafter="none", n_ctx=1024, cost_model=frozen_cost_model()) as eng:
            assert bounded(lambda: eng.generate(PROMPT, max_tokens=8, sampling=GREEDY)).token_ids == local.token_ids
            w.kill()
            deadline = time.monotonic() + 60  # a bound: the loop ends as soon as the guard sees it
            while eng.model.lost_worker() is None:
                assert time.monotonic() < deadline, "the guard did not notice the idle worker's end"
                time.sleep(0.02)
            assert eng.model.lost_worker()[0] == w.endpoint
            w = Worker(w.port)
            assert bounded(lambda: eng.generate(PROMPT, max_tokens=8, sampling=GREEDY)).token_ids == local.token_ids
    finally:
        w.kill()


@needs_worker
def test_a_worker_killed_mid_generation_cli(tmp_path, model_path):
    """The CLI: ``localspec generate --rpc`` ends with exit status 1 and a one-line error naming
    the worker (before the guard, the process aborted), promptly; a new run works once the
    worker is back."""
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
    assert host.returncode == 1, err.decode()
    assert err.decode().strip().splitlines()[-1].startswith(f"localspec: error: lost RPC worker {w.endpoint} (")
    w2 = Worker(w.port)
    try:
        r = subprocess.run(cmd[:5] + ["-n", "8"] + cmd[7:], capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr
    finally:
        w2.kill()


@needs_worker
def test_a_worker_killed_mid_request_server(engine):
    """``localspec serve``'s app (OpenAI API over a BatchScheduler, editor endpoints over an
    Engine, both on the RPC model), driven by the official client: a worker killed mid-stream
    ends that stream with an error naming it; requests while it is down get 503 naming it; once
    it is back, the same server answers again, with the local greedy output."""
    openai = pytest.importorskip("openai")
    from localspec.scheduler import BatchScheduler
    from localspec.server import CompletionService, ServiceConfig
    from localspec.server.http import AppThread
    from localspec.server.openai import OpenAIService, create_serve_app

    engine.reset()
    local = engine.generate(PROMPT, max_tokens=16, sampling=GREEDY, speculative=False)
    w = Worker()
    eng = Engine(rpc=[w.endpoint], drafter="ngram", n_ctx=2048, cost_model=frozen_cost_model())
    sched = BatchScheduler(eng.model, parallel=2, n_ctx=2048, cost_model=frozen_cost_model()).start()
    oai = OpenAIService(sched, model_name="gemma-rpc", sampling=GREEDY)
    editor = CompletionService(eng, ServiceConfig(sampling=GREEDY))
    try:
        with AppThread(create_serve_app(oai, editor, max_body_bytes=1 << 20)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)

            def complete():
                return client.completions.create(model="gemma-rpc", prompt=PROMPT, max_tokens=16, temperature=0)

            assert bounded(complete).choices[0].text == local.text

            def stream_and_kill():
                with client.completions.create(model="gemma-rpc", prompt=PROMPT, max_tokens=1500, temperature=0,
                                               stream=True) as s:  # fmt: skip
                    for i, _ in enumerate(s):
                        if i == 0:
                            w.kill()

            with pytest.raises(openai.APIError, match=rf"lost RPC worker {w.endpoint}"):
                bounded(stream_and_kill)
            with pytest.raises(openai.InternalServerError, match=rf"RPC worker {w.endpoint} is unreachable") as ei:
                bounded(complete)
            assert ei.value.status_code == 503
            w = Worker(w.port)
            assert bounded(complete).choices[0].text == local.text
            # the editor endpoint's engine shares the reloaded model: it follows
            r = bounded(lambda: httpx.post(srv.url + "/completion", json={"prompt": PROMPT, "n_predict": 16,
                                                                           "temperature": 0}, timeout=300))  # fmt: skip
            assert r.status_code == 200 and r.json()["content"] == local.text
    finally:
        editor.close()
        sched.close()
        eng.close()
        w.kill()


# -- the guard's framing, against stand-in workers (every branch, deterministically) ------------


def _stand_in(script):
    """A listening socket whose first connection runs ``script(conn)`` (a worker stand-in)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        with conn:
            script(conn)
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{srv.getsockname()[1]}"


def _recv(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, f"connection closed after {len(buf)} of {n} bytes"
        buf += chunk
    return buf


def _hello(sock):
    sock.sendall(struct.pack("<BQ", 14, 24) + bytes(range(1, 25)))  # non-zero caps: the guard zeroes them


def test_guard_forwards_then_pads_a_response_cut_by_a_dying_worker():
    seen = {}

    def worker(conn):
        cmd, size = struct.unpack("<BQ", _recv(conn, 9))
        seen["hello_caps"] = _recv(conn, size)
        conn.sendall(struct.pack("<Q", 28) + bytes(rpc.RPC_PROTO_VERSION) + bytes([0]) + bytes(range(1, 25)))
        cmd, size = struct.unpack("<BQ", _recv(conn, 9))  # SET_TENSOR (no response): forwarded
        seen["set"] = (cmd, _recv(conn, size))
        cmd, size = struct.unpack("<BQ", _recv(conn, 9))  # GET_TENSOR of 1000 bytes: answer 300, die
        _recv(conn, size)
        conn.sendall(struct.pack("<Q", 1000) + b"\x07" * 300)

    g = rpc.Guard(_stand_in(worker))
    host, port = g.local_endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as c:
        _hello(c)
        size, = struct.unpack("<Q", _recv(c, 8))
        rsp = _recv(c, size)
        assert size == 28 and tuple(rsp[:3]) == rpc.RPC_PROTO_VERSION and rsp[4:] == bytes(24)
        c.sendall(struct.pack("<BQ", 6, 5) + b"abcde")
        req = bytes(100) + struct.pack("<QQ", 0, 1000)  # rpc_tensor stand-in | offset | size
        c.sendall(struct.pack("<BQ", 8, len(req)) + req)
        size, = struct.unpack("<Q", _recv(c, 8))
        data = _recv(c, size)
    assert seen["hello_caps"] == bytes(24)  # no transport upgrade through the relay
    assert seen["set"] == (6, b"abcde")
    assert size == 1000 and data == b"\x07" * 300 + bytes(700)
    assert g.lost is not None


def test_guard_answers_in_place_of_an_unreachable_worker():
    g = rpc.Guard(f"127.0.0.1:{free_port()}")  # nothing listens there
    host, port = g.local_endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as c:
        _hello(c)
        size, = struct.unpack("<Q", _recv(c, 8))
        assert size == 28 and tuple(_recv(c, 28)[:3]) == rpc.RPC_PROTO_VERSION
        c.sendall(struct.pack("<BQ", 1, 4) + bytes(4))  # GET_ALIGNMENT: a power of two
        assert struct.unpack("<QQ", _recv(c, 16)) == (8, 32)
        c.sendall(struct.pack("<BQ", 0, 12) + bytes(12))  # ALLOC_BUFFER: NULL, so llama.cpp fails cleanly
        assert struct.unpack("<QQQ", _recv(c, 24)) == (16, 0, 0)
        c.sendall(struct.pack("<BQ", 10, 3) + b"xyz")  # GRAPH_COMPUTE: no response
        c.sendall(struct.pack("<BQ", 15, 0))  # DEVICE_COUNT: 0 devices
        assert struct.unpack("<QI", _recv(c, 12)) == (4, 0)
    assert "cannot connect" in g.lost
