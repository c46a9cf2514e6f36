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

No authentication: whoever reaches a worker's port can run graphs on it and read its memory.
Bind workers to loopback or a trusted private network only (docs/rpc.md).
"""

from __future__ import annotations

import ctypes
import math
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..errors import LocalSpecError, ModelLoadError
from ._llama import _libggml, ensure_backend, lib

# RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION of ggml-rpc.h in the llama.cpp that llama-cpp-python
# 0.3.36 vendors (the pin in pyproject.toml); `make rpc-server` checks it against the header.
RPC_PROTO_VERSION = (7, 0, 0)
DEFAULT_PORT = 50052
_CMD_HELLO = 14
_CONN_CAPS_SIZE = 24


class RPCError(LocalSpecError):
    """An RPC worker is unreachable, speaks another protocol version, or was lost."""


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


@dataclass(frozen=True)
class RPCDevice:
    """One device a worker exposes: ``handle`` is the ``ggml_backend_dev_t``."""

    endpoint: str
    name: str
    description: str
    memory_total: int
    handle: int


def connect(endpoints: Iterable[str], *, timeout: float = 10.0) -> tuple[list[RPCDevice], list[WorkerInfo]]:
    """Probe every worker, then register it with ggml's RPC backend and list its devices.

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
    for ep in endpoints:
        if ep not in _connected:
            _connected.append(ep)
        wreg = add_server(ep.encode())
        n = _reg_dev_count(wreg) if wreg else 0
        if n == 0:
            raise RPCError(f"RPC worker {ep} reports no devices")
        for i in range(n):
            dev = _reg_dev_get(wreg, i)
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            _dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            devices.append(
                RPCDevice(ep, _dev_name(dev).decode(), (_dev_desc(dev) or b"").decode(), int(total.value), int(dev))
            )
    return devices, infos


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
