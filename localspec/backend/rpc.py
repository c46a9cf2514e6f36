"""llama.cpp RPC workers as devices for the target model (ggml-rpc).

A worker is llama.cpp's ``rpc-server`` (``localspec rpc-worker``) on another machine (or on
this one); the host drives it through ggml's RPC backend as one more device, and
``llama_model_params.devices`` / ``tensor_split`` put some or all of the target's layers on it.
Drafters keep loading on the local devices: the RPC devices are handed to the target model
only and are never added to ggml's global device registry.

Before llama.cpp connects (it aborts the process on a refused connection or a failed
handshake), :func:`probe` makes its own HELLO round trip to every worker: it names the worker
that does not answer and checks that the worker speaks exactly this build's protocol version.

Wire format of the HELLO exchange (ggml/src/ggml-rpc/ggml-rpc.cpp, protocol v7):
request ``u8 cmd=14 | u64 size=24 | u8 conn_caps[24]``; response
``u64 size=28 | u8 major | u8 minor | u8 patch | u8 pad | u8 conn_caps[24]`` (little endian).
An all-zero ``conn_caps`` asks for no transport upgrade (plain TCP).

A worker lost mid-request would end the host process: ggml's RPC client calls ``GGML_ABORT``
on any failed exchange (``RPC_STATUS_ASSERT`` in ``rpc_dispatcher::work``, ggml-rpc.cpp), and
an abort cannot be caught. So ggml never talks to a worker directly: it connects to a
:class:`Guard`, a relay on 127.0.0.1 in this process that forwards every exchange to the worker
unchanged. When the worker's connection fails, the guard marks it lost and answers the
exchanges still to come itself, with well-formed zero-filled responses of the sizes ggml expects
(the responses of protocol v7 have fixed sizes, except ``GET_TENSOR``'s, which the request
gives). ggml returns normally, and :meth:`Model.check_workers` (called after every decode)
raises :class:`WorkerLostError` naming the worker before those zeros are read as logits.

No authentication: whoever reaches a worker's port can run graphs on it and read its memory.
Bind workers to loopback or a trusted private network only (docs/rpc.md).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import select
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..errors import DecodeError, LocalSpecError, ModelLoadError
from ._llama import _libggml, ensure_backend, lib

# RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION of ggml-rpc.h in the llama.cpp that llama-cpp-python
# 0.3.36 vendors (the pin in pyproject.toml); `make rpc-server` checks it against the header.
RPC_PROTO_VERSION = (7, 0, 0)
DEFAULT_PORT = 50052
_CMD_HELLO = 14
_CONN_CAPS_SIZE = 24


class RPCError(LocalSpecError):
    """An RPC worker is unreachable, speaks another protocol version, or was lost."""


class WorkerLostError(RPCError, DecodeError):
    """A worker holding some of the model's layers dropped its connection (it died, or the
    network failed): its part of the model is gone. An ``Engine`` loads the model again at its
    next request (once the worker answers again); a bare ``Model`` must be loaded again."""


@dataclass(frozen=True)
class WorkerInfo:
    """What one worker answered to HELLO.

    Attributes:
        endpoint: ``"HOST:PORT"``.
        version: the worker's protocol version ``(major, minor, patch)``.
        rtt_us: the HELLO round trip in microseconds (connect excluded).
    """

    endpoint: str
    version: tuple[int, int, int]
    rtt_us: float


def parse_endpoints(spec: str | Sequence[str] | None) -> list[str]:
    """``"h1:p1,h2:p2"`` (or a list of such strings) -> ``["h1:p1", "h2:p2"]``.

    Raises:
        RPCError: an entry is not ``HOST:PORT`` with a port in 1..65535, or one repeats.
    """
    if spec is None:
        return []
    items = [spec] if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            host, sep, port = part.rpartition(":")
            if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise RPCError(f"RPC worker {part!r} is not HOST:PORT (e.g. 192.168.1.20:{DEFAULT_PORT})")
            ep = f"{host}:{int(port)}"
            if ep in out:
                raise RPCError(f"RPC worker {ep} is listed twice")
            out.append(ep)
    if isinstance(spec, str) and not out:
        raise RPCError("--rpc needs at least one HOST:PORT")
    return out


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by the worker")
        buf += chunk
    return bytes(buf)


def probe(endpoint: str, *, timeout: float = 10.0) -> WorkerInfo:
    """One HELLO round trip to ``endpoint``; the worker must speak ``RPC_PROTO_VERSION`` exactly.

    A worker serves one host at a time: while another host is connected, the HELLO waits in
    its accept queue and this raises after ``timeout`` seconds.

    Raises:
        RPCError: unreachable, busy past ``timeout``, not an RPC worker, or another version.
    """
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.perf_counter()
            s.sendall(struct.pack("<BQ", _CMD_HELLO, _CONN_CAPS_SIZE) + bytes(_CONN_CAPS_SIZE))
            (size,) = struct.unpack("<Q", _recv_exact(s, 8))
            if size != 4 + _CONN_CAPS_SIZE:
                raise RPCError(
                    f"RPC worker {endpoint} answered HELLO with {size} bytes, not {4 + _CONN_CAPS_SIZE}: it is not a "
                    f"llama.cpp rpc-server of protocol v{RPC_PROTO_VERSION[0]}"
                )
            rsp = _recv_exact(s, size)
            rtt_us = (time.perf_counter() - t0) * 1e6
    except socket.timeout:
        raise RPCError(
            f"RPC worker {endpoint} did not answer within {timeout:g} s (is another host connected to it? "
            "a worker serves one host at a time)"
        ) from None
    except (ConnectionError, OSError) as e:
        if isinstance(e, RPCError):
            raise
        raise RPCError(f"RPC worker {endpoint} is unreachable: {e.strerror or e} (start it with `localspec rpc-worker`)") from None
    version = (rsp[0], rsp[1], rsp[2])
    if version != RPC_PROTO_VERSION:
        want = ".".join(map(str, RPC_PROTO_VERSION))
        raise RPCError(
            f"RPC worker {endpoint} speaks protocol v{'.'.join(map(str, version))}, this host v{want} "
            f"(llama-cpp-python {lib.__version__}): build the worker from the same llama.cpp (`make rpc-server`)"
        )
    return WorkerInfo(endpoint, version, rtt_us)


def supported() -> bool:
    """True when this llama.cpp build has the RPC backend (built with ``GGML_RPC=ON``)."""
    ensure_backend()
    return bool(lib.llama_supports_rpc())


def _fn(name: str, argtypes, restype):
    f = getattr(_libggml, name)
    f.argtypes, f.restype = argtypes, restype
    return f


_reg_by_name = _fn("ggml_backend_reg_by_name", [ctypes.c_char_p], ctypes.c_void_p)
_reg_proc = _fn("ggml_backend_reg_get_proc_address", [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p)
_reg_dev_count = _fn("ggml_backend_reg_dev_count", [ctypes.c_void_p], ctypes.c_size_t)
_reg_dev_get = _fn("ggml_backend_reg_dev_get", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p)
_dev_name = _fn("ggml_backend_dev_name", [ctypes.c_void_p], ctypes.c_char_p)
_dev_desc = _fn("ggml_backend_dev_description", [ctypes.c_void_p], ctypes.c_char_p)
_dev_memory = _fn(
    "ggml_backend_dev_memory", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)], None
)
_ABORT_CB = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_set_abort = _fn("ggml_set_abort_callback", [_ABORT_CB], ctypes.c_void_p)
_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)

_connected: list[str] = []  # endpoints whose devices this process holds (for the abort message)


def _on_abort(message: bytes | None) -> None:
    """ggml is about to abort the process (e.g. a worker died mid-request): say which workers
    were in use, since ggml's own message does not name them."""
    text = (message or b"").decode("utf-8", errors="replace").strip()
    if _connected and ("RPC" in text or "connect" in text or "handshake" in text):
        sys.stderr.write(
            f"localspec: error: lost RPC worker(s) {', '.join(_connected)} ({text}); the process "
            "cannot continue (llama.cpp's RPC backend aborts). Restart the worker, or run without --rpc.\n"
        )
    elif text:
        sys.stderr.write(f"localspec: error: llama.cpp aborted: {text}\n")
    sys.stderr.flush()


_abort_cb = _ABORT_CB(_on_abort)  # keep a reference: C holds the pointer
_abort_installed = False


# -- the guard: a relay that keeps a lost worker from aborting this process --------------------

_log = logging.getLogger("localspec.rpc")

# rpc_cmd of ggml-rpc.cpp (protocol v7) -> the size of its response, for the commands that have
# one (GET_TENSOR's is the request's last u64, handled apart); the others have no response.
_CMD_GET_TENSOR = 8
_CMD_COUNT = 19
_RESPONSE_SIZE = {
    0: 16,  # ALLOC_BUFFER: remote_ptr, remote_size (0 = allocation failed: llama.cpp fails cleanly)
    1: 8,  # GET_ALIGNMENT
    2: 8,  # GET_MAX_SIZE
    3: 8,  # BUFFER_GET_BASE
    7: 1,  # SET_TENSOR_HASH: 0 = "not cached" (the client then sends the data)
    9: 1,  # COPY_TENSOR: 0 = "not copied" (ggml falls back to get + set)
    11: 16,  # GET_DEVICE_MEMORY: free, total
    13: 8,  # GET_ALLOC_SIZE (ggml takes at least ggml_nbytes)
    _CMD_HELLO: 4 + _CONN_CAPS_SIZE,
    15: 4,  # DEVICE_COUNT
}
_SMALL = 1 << 20  # requests up to this size are read whole; larger ones (weights) are streamed
_CHUNK = 1 << 22
_ZEROS = bytes(_CHUNK)


def _tune(sock: socket.socket, upstream: bool) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if upstream:
        # a worker machine that vanishes (power, network) sends no FIN: keepalive probes, which
        # the worker's kernel answers even while it computes, find it in ~11 s instead of never;
        # TCP_USER_TIMEOUT bounds unacknowledged sends the same way
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 15000)):
            opt = getattr(socket, name, None)
            if opt is not None:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)


class _ClientGone(Exception):
    """ggml's end of a relayed connection failed (not the worker's)."""


def _recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("connection closed")
        view = view[n:]


class Guard:
    """A relay on 127.0.0.1 between ggml's RPC client (this process) and one worker.

    Every connection ggml opens to ``local_endpoint`` gets its own connection to the worker,
    and the relay forwards each exchange (``u8 cmd | u64 size | request``, then ``u64 size |
    response`` for the commands that have one) unchanged, except that HELLO's transport
    capabilities are zeroed (plain TCP; no RDMA upgrade through the relay). Once a worker
    connection fails, ``lost`` holds the reason, for good: the guard answers every later
    exchange on any of its connections itself, with zero-filled responses of the expected
    size, so that ggml's client never sees a broken connection (it would abort the process).
    A new model load gets a new guard.

    Attributes:
        endpoint: the worker, ``"HOST:PORT"``.
        local_endpoint: where ggml connects, ``"127.0.0.1:PORT"``.
        lost: None while the worker's connections are healthy, else why one failed.
    """

    def __init__(self, endpoint: str, *, connect_timeout: float = 10.0) -> None:
        self.endpoint = endpoint
        host, _, port = endpoint.rpartition(":")
        self._target = (host.strip("[]"), int(port))
        self._connect_timeout = connect_timeout
        self.lost: str | None = None
        self._known: dict[tuple[int, bytes], bytes] = {}  # answers to ALIGNMENT / MAX_SIZE, reused when lost
        self._srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(16)
        self.local_endpoint = f"127.0.0.1:{self._srv.getsockname()[1]}"
        threading.Thread(target=self._accept, name=f"rpc-guard {endpoint}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), name=f"rpc-relay {self.endpoint}", daemon=True).start()

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            _log.info("RPC worker %s lost: %s", self.endpoint, why)

    def _serve(self, client: socket.socket) -> None:
        up: socket.socket | None = None
        if self.lost is None:
            try:
                up = socket.create_connection(self._target, timeout=self._connect_timeout)
                up.settimeout(None)
                _tune(up, upstream=True)
            except OSError as e:
                self._lose(f"cannot connect: {e.strerror or e}")
                up = None
        _tune(client, upstream=False)
        view = memoryview(bytearray(_CHUNK))
        zeros = _ZEROS

        def drop(e: BaseException) -> None:
            nonlocal up
            self._lose(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            if up is not None:
                up.close()
                up = None

        def to_client(data) -> None:
            try:
                client.sendall(data)
            except OSError:
                raise _ClientGone from None

        def from_client(v: memoryview) -> None:
            try:
                _recv_into_exact(client, v)
            except OSError:
                raise _ClientGone from None

        try:
            while True:
                # idle between exchanges: a worker that goes away now is noticed now (EOF), so
                # that the next request can reconnect instead of failing on its first decode
                while up is not None:
                    ready, _, _ = select.select([client, up], [], [])
                    if up in ready:
                        try:
                            extra = up.recv(1)
                            drop(ConnectionError("connection closed by the worker" if not extra else "unexpected data"))
                        except OSError as e:
                            drop(e)
                    if client in ready:
                        break
                head = bytearray(9)
                try:
                    n = client.recv_into(head)
                except OSError:
                    return
                if n == 0:
                    return  # ggml closed the connection (its dispatcher was freed)
                from_client(memoryview(head)[n:])
                cmd, size = struct.unpack("<BQ", head)
                if cmd >= _CMD_COUNT:
                    return
                body = bytearray()
                if size <= _SMALL:
                    body = bytearray(size)
                    from_client(memoryview(body))
                    if cmd == _CMD_HELLO:
                        body = bytearray(size)  # no transport upgrade: the relay speaks TCP
                    if up is not None:
                        try:
                            up.sendall(head + body)
                        except OSError as e:
                            drop(e)
                else:  # stream a large request (weights, graphs) through in chunks
                    if up is not None:
                        try:
                            up.sendall(head)
                        except OSError as e:
                            drop(e)
                    left = size
                    while left:
                        k = min(left, _CHUNK)
                        from_client(view[:k])
                        left -= k
                        if up is not None:
                            try:
                                up.sendall(view[:k])
                            except OSError as e:
                                drop(e)
                if cmd == _CMD_GET_TENSOR:
                    want = struct.unpack_from("<Q", body, len(body) - 8)[0]
                else:
                    want = _RESPONSE_SIZE.get(cmd)
                if want is None:
                    continue
                sent = -1  # bytes of the response body passed to ggml; -1: not even its size
                if up is not None:
                    try:
                        rsize = bytearray(8)
                        _recv_into_exact(up, memoryview(rsize))
                        (n_rsp,) = struct.unpack("<Q", rsize)
                        if n_rsp != want:
                            raise ConnectionError(f"command {cmd}: a {n_rsp}-byte response, {want} expected")
                        if want <= 64:
                            rsp = bytearray(want)
                            _recv_into_exact(up, memoryview(rsp))
                            if cmd == _CMD_HELLO:
                                rsp[4:] = bytes(want - 4)
                            elif cmd in (1, 2):
                                self._known[(cmd, bytes(body))] = bytes(rsp)
                            to_client(rsize + rsp)
                            continue
                        to_client(rsize)
                        sent = 0
                        while sent < want:
                            k = up.recv_into(view[: min(want - sent, _CHUNK)])
                            if k == 0:
                                raise ConnectionError("connection closed by the worker")
                            to_client(view[:k])
                            sent += k
                        continue
                    except OSError as e:
                        drop(e)
                # the worker is gone: answer in its place, so that ggml does not abort
                if sent < 0:
                    to_client(struct.pack("<Q", want) + self._fake(cmd, bytes(body), want, zeros))
                    continue
                while sent < want:
                    k = min(want - sent, _CHUNK)
                    to_client(zeros[:k])
                    sent += k
        except _ClientGone:
            return  # ggml's side failed (the process is ending)
        finally:
            client.close()
            if up is not None:
                up.close()

    def _fake(self, cmd: int, body: bytes, want: int, zeros: bytes) -> bytes:
        if (cmd, body) in self._known:
            return self._known[(cmd, body)]
        if cmd == _CMD_HELLO:
            return bytes(RPC_PROTO_VERSION) + bytes(want - 3)
        if cmd == 1:  # GET_ALIGNMENT must stay a power of two
            return struct.pack("<Q", 32)
        if cmd == 2:  # GET_MAX_SIZE
            return struct.pack("<Q", (1 << 62))
        if cmd == 3:  # BUFFER_GET_BASE must not be NULL (ggml asserts); never dereferenced here
            return struct.pack("<Q", 1 << 12)
        if want <= len(zeros):
            return zeros[:want]
        return bytes(want)


_guards: dict[str, Guard] = {}  # endpoint -> its current guard (a lost one is replaced)
_guards_lock = threading.Lock()


def guard_for(endpoint: str) -> Guard:
    """The guard ggml reaches ``endpoint`` through: one per worker and process, shared by every
    model on it (a worker serves one connection at a time, like ggml's own dispatcher), and a
    new one once the previous was lost."""
    with _guards_lock:
        g = _guards.get(endpoint)
        if g is None or g.lost is not None:
            g = _guards[endpoint] = Guard(endpoint)
        return g


def check_guards(guards: Sequence[Guard]) -> None:
    """Raise if one of ``guards`` lost its worker.

    Raises:
        WorkerLostError: names the worker.
    """
    for g in guards:
        if g.lost is not None:
            raise WorkerLostError(
                f"lost RPC worker {g.endpoint} ({g.lost}): the model's layers on it are gone; an Engine loads "
                "them again at its next request once the worker is back (or run without --rpc)"
            )


def guarded() -> bool:
    """False when ``LOCALSPEC_RPC_GUARD=0``: ggml then connects to the workers directly, and a
    worker lost mid-request ends the process (llama.cpp's own behaviour)."""
    return os.environ.get("LOCALSPEC_RPC_GUARD", "1") != "0"


@dataclass(frozen=True)
class RPCDevice:
    """One device a worker exposes: ``handle`` is the ``ggml_backend_dev_t``."""

    endpoint: str
    name: str
    description: str
    memory_total: int
    handle: int


def connect(
    endpoints: Iterable[str], *, timeout: float = 10.0
) -> tuple[list[RPCDevice], list[WorkerInfo], list[Guard]]:
    """Probe every worker, then register it with ggml's RPC backend (through its
    :class:`Guard`, unless :func:`guarded` is off) and list its devices.

    Returns:
        the devices (in ``endpoints`` order), what each worker answered to HELLO, and the
        guards (empty when unguarded): a model on these devices is broken once one is lost.

    Raises:
        RPCError: this build has no RPC backend, or a worker fails :func:`probe`.
    """
    global _abort_installed
    endpoints = list(endpoints)
    if not supported():
        raise RPCError(
            "this llama-cpp-python was built without the RPC backend; rebuild it with "
            'CMAKE_ARGS="-DGGML_RPC=ON" (`make env` does; see docs/rpc.md)'
        )
    infos = [probe(ep, timeout=timeout) for ep in endpoints]
    reg = _reg_by_name(b"RPC")
    add = _reg_proc(reg, b"ggml_backend_rpc_add_server") if reg else None
    if not add:
        raise RPCError("llama.cpp's RPC backend has no ggml_backend_rpc_add_server")
    add_server = _ADD_SERVER(add)
    if not _abort_installed:
        _set_abort(_abort_cb)
        _abort_installed = True
    devices: list[RPCDevice] = []
    guards: list[Guard] = []
    for ep in endpoints:
        if ep not in _connected:
            _connected.append(ep)
        guard = guard_for(ep) if guarded() else None
        wreg = add_server((guard.local_endpoint if guard else ep).encode())
        n = _reg_dev_count(wreg) if wreg else 0
        if guard is not None:
            guards.append(guard)
            if guard.lost is not None:
                raise RPCError(f"RPC worker {ep} was lost while connecting ({guard.lost})")
        if n == 0:
            raise RPCError(f"RPC worker {ep} reports no devices")
        for i in range(n):
            dev = _reg_dev_get(wreg, i)
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            _dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            # ggml names RPC devices by a process-wide counter ("RPC3"); the name here is the
            # device's index on its worker, so that it is the same in every process (cost keys)
            # (ggml's description of an RPC device is the address it connects to: the guard's)
            devices.append(RPCDevice(ep, f"RPC{i}", ep, int(total.value), int(dev)))
    return devices, infos, guards


_dev_count = _fn("ggml_backend_dev_count", [], ctypes.c_size_t)
_dev_get = _fn("ggml_backend_dev_get", [ctypes.c_size_t], ctypes.c_void_p)
_dev_type = _fn("ggml_backend_dev_type", [ctypes.c_void_p], ctypes.c_int)
_DEV_GPU, _DEV_IGPU = 1, 2  # enum ggml_backend_dev_type: CPU=0, GPU=1, IGPU=2, ACCEL=3


def local_gpu_devices() -> list[tuple[str, int]]:
    """``(name, ggml_backend_dev_t)`` of this machine's GPUs (empty on CPU-only builds)."""
    ensure_backend()
    out = []
    for i in range(_dev_count()):
        dev = _dev_get(i)
        if _dev_type(dev) in (_DEV_GPU, _DEV_IGPU):
            out.append((_dev_name(dev).decode(), int(dev)))
    return out


def device_array(handles: Sequence[int]):
    """A NULL-terminated ``ggml_backend_dev_t[]`` for ``llama_model_params.devices``."""
    arr = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)
    return arr


def split_array(split: Sequence[float] | None, n_devices: int):
    """``tensor_split`` proportions -> the ``float[llama_max_devices()]`` llama.cpp reads, or None.

    Raises:
        ModelLoadError: wrong length, a negative or non-finite value, or all zero.
    """
    if split is None:
        return None
    vals = [float(x) for x in split]
    if len(vals) != n_devices:
        raise ModelLoadError(f"tensor split has {len(vals)} values for {n_devices} devices")
    if any(not math.isfinite(v) or v < 0 for v in vals) or sum(vals) <= 0:
        raise ModelLoadError(f"tensor split must be non-negative and not all zero, got {vals}")
    n_max = int(lib.llama_max_devices())
    if n_devices > n_max:
        raise ModelLoadError(f"{n_devices} devices, this llama.cpp takes at most {n_max}")
    return (ctypes.c_float * n_max)(*vals)


def rtt_bucket(rtt_us: float) -> int:
    """The round trip rounded to a power of two of microseconds (a cost-model cache key part:
    a link twice as slow gets its own calibration)."""
    return int(round(math.log2(max(rtt_us, 1.0))))
