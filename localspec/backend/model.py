"""``Model``: an owned llama.cpp model (weights + vocabulary).

Owns one ``llama_model *``; ``close()`` (or the context manager) frees it. Tokenisation,
detokenisation and special tokens all come from llama.cpp's vocabulary: no tokenizer of our
own.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ModelLoadError
from ._llama import cpu_amx, ensure_backend, exact_kernels, held_errors, lib, raise_if_interrupted, recent_errors

if TYPE_CHECKING:
    from ..models.gguf_index import GGUFIndex

GGUF_MAGIC = b"GGUF"

# llama_token_attr bits (llama.h)
TOKEN_ATTR_UNUSED = 1 << 1
TOKEN_ATTR_CONTROL = 1 << 3


_load_count = itertools.count(1)
_reload_lock = threading.Lock()  # one reload at a time (an engine and a scheduler may share a model)


def check_gguf_file(path: str | os.PathLike, what: str = "model file", flag: str | None = None) -> Path:
    """Check that ``path`` exists and starts with the GGUF magic.

    ``what`` names the file in messages (``"EAGLE-3 head file"``), ``flag`` the option that
    gave it. Returns the path as a ``Path``. Raises ``ModelLoadError`` with an actionable
    message.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"{what} not found: {p} (give the path of a .gguf file{' with ' + flag if flag else ''})")
    if p.is_dir():
        raise ModelLoadError(f"{p} is a directory; give the path of a .gguf file")
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read {p}: {e}") from e
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{p} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
            "convert the model with llama.cpp's convert_hf_to_gguf.py or download a .gguf"
        )
    return p


def refuse_head_file(path: str | os.PathLike, role: str) -> None:
    """A drafting head (an EAGLE-3 head, Medusa heads) given where a model is expected: one
    line saying what the file is and where it goes, before llama.cpp fails on it (it cannot
    make a context for an EAGLE-3 head without its target, and does not know Medusa files).
    Files that are not readable GGUFs are left to the loader, which names the problem.

    Args:
        path: the file given.
        role: what the file was given as (``"a model to generate with"``, ``"a draft model"``).
    Raises:
        ModelLoadError: ``path`` is a GGUF of architecture ``eagle3`` or ``medusa``.
    """
    from ..models.gguf_index import gguf_architecture

    arch = gguf_architecture(path)
    if arch == "eagle3":
        raise ModelLoadError(f"{path} is an EAGLE-3 head, not {role}: give the target model with -m "
                             f"and the head with --drafter eagle3 --eagle {path}")  # fmt: skip
    if arch == "medusa":
        raise ModelLoadError(f"{path} is a Medusa heads file, not {role}: give the target model with -m "
                             f"and the heads with --drafter medusa --medusa {path}")  # fmt: skip


class Model:
    """A GGUF model loaded by llama.cpp.

    Args:
        path: path of a ``.gguf`` file.
        n_gpu_layers: layers to offload to the GPU (``-1`` = all). Ignored by CPU-only builds
            of llama.cpp; on CUDA / Metal builds it moves the weights to the device.
        use_mmap: map the file instead of reading it.
        vocab_only: load only the vocabulary (fast; for tokenisation and compatibility checks).
        repack: let llama.cpp repack weights for its CPU GEMM kernels (``use_extra_bufts``).
            Default: off with exact kernels (the repacked 4-row GEMM rounds differently from
            the single-row kernel), on otherwise, except on a CPU with AMX (``cpu_amx()``:
            llama.cpp's AMX matmul segfaults there, and ``repack=True`` is refused). See
            ``backend.exact_kernels()``.
        rpc: llama.cpp RPC workers ``"HOST:PORT"`` (``localspec rpc-worker``) that hold the
            offloaded layers (docs/rpc.md). With ``rpc``, ``n_gpu_layers=0`` means all layers on
            the workers; a positive count keeps the first ``n_layer - n_gpu_layers`` layers on
            the local CPU.
        rpc_local_gpu: with ``rpc``, also split the layers over this machine's GPUs (after the
            workers' devices).
        tensor_split: proportions of the offloaded layers per device (RPC devices in
            ``rpc`` order, then local GPUs); default: by device memory (llama.cpp's rule).
        load_mtp: also load the model's MTP / NextN blocks (``*.nextn_predict_layers``),
            which llama.cpp skips by default; a context of type MTP (``Context(...,
            mtp=True)``) runs them (``drafters.mtp``).

    Raises:
        ModelLoadError: the file is missing, not GGUF, truncated/corrupt, or of an architecture
            this llama.cpp does not know. The message includes llama.cpp's own error lines.
        RPCError: a worker in ``rpc`` is unreachable or speaks another protocol version.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        n_gpu_layers: int = 0,
        use_mmap: bool = True,
        vocab_only: bool = False,
        repack: bool | None = None,
        rpc: str | list[str] | None = None,
        rpc_local_gpu: bool = False,
        tensor_split: list[float] | None = None,
        load_mtp: bool = False,
    ) -> None:
        self._model = None
        self._retired: list = []  # llama_model pointers replaced by reload_if_lost(), freed at close()
        self.generation = next(_load_count)  # changes at every load (reload), process-wide unique
        self._rpc_guards: list = []  # backend.rpc.Guard per worker (empty: no RPC, or unguarded)
        self._load_args = dict(
            n_gpu_layers=n_gpu_layers, use_mmap=use_mmap, vocab_only=vocab_only, repack=repack,
            rpc=rpc, rpc_local_gpu=rpc_local_gpu, tensor_split=tensor_split,
        )  # fmt: skip
        self.path = check_gguf_file(path)
        ensure_backend()
        params = lib.llama_model_default_params()
        self.rpc_workers: list = []  # backend.rpc.WorkerInfo per worker
        self.device_key = "local"  # the device set, for cost-model calibration keys
        # True when layers run on a GPU of this machine. Not `llama_supports_gpu_offload()`:
        # that is also true on every RPC-enabled build (it counts the RPC backend), and RPC
        # workers are, as far as the host can tell, CPU backends with the host's kernels.
        self.on_local_gpu = False
        if rpc:
            from . import rpc as _rpc

            devs, self.rpc_workers, self._rpc_guards = _rpc.connect(_rpc.parse_endpoints(rpc))
            handles = [d.handle for d in devs]
            names = [f"{d.name}@{d.endpoint}" for d in devs]
            if rpc_local_gpu:
                for name, h in _rpc.local_gpu_devices():
                    handles.append(h)
                    names.append(name)
                    self.on_local_gpu = True
            self._devices = _rpc.device_array(handles)  # keep alive: llama.cpp reads it at load
            self._split = _rpc.split_array(tensor_split, len(handles))
            params.devices = ctypes.cast(self._devices, ctypes.c_void_p).value
            if self._split is not None:
                params.tensor_split = ctypes.cast(self._split, ctypes.POINTER(ctypes.c_float))
            if n_gpu_layers == 0:
                n_gpu_layers = -1
            rtts = ",".join(str(_rpc.rtt_bucket(w.rtt_us)) for w in self.rpc_workers)
            self.device_key = f"{'+'.join(names)}|split={tensor_split}|rtt2^={rtts}"
        elif tensor_split is not None:
            raise ModelLoadError("tensor_split applies to models split over RPC workers (rpc=...)")
        elif n_gpu_layers != 0 and not vocab_only:
            from .rpc import local_gpu_devices

            self.on_local_gpu = bool(local_gpu_devices())
        params.n_gpu_layers = int(n_gpu_layers) if n_gpu_layers >= 0 else 0x7FFFFFFF
        params.use_mmap = bool(use_mmap)
        params.vocab_only = bool(vocab_only)
        if repack is None:
            repack = not exact_kernels() and (vocab_only or not cpu_amx())
        elif repack and not vocab_only and cpu_amx():
            raise ModelLoadError(
                "weight repacking would use llama.cpp's AMX kernels on this CPU, which crash on batched "
                "decodes (llama.cpp issue 20824); load with repack=False"
            )
        params.use_extra_bufts = bool(repack)
        self.repack = bool(repack)
        params.load_mtp = bool(load_mtp)
        self.load_mtp = bool(load_mtp)
        recent_errors(clear=True)
        with held_errors():  # a failed load's lines are in its one-line error, not printed before it
            model = lib.llama_model_load_from_file(str(self.path).encode("utf-8"), params)
            if self._rpc_guards and self.lost_worker() is not None:
                if model:
                    lib.llama_model_free(model)
                self.check_workers()  # raises WorkerLostError naming the worker
            if not model:
                why = "; ".join(recent_errors()) or "no reason logged"
                raise ModelLoadError(
                    f"llama.cpp could not load {self.path}: {why}. The file may be truncated or "
                    "corrupt (re-download it), or its architecture may be newer than the llama.cpp "
                    f"in llama-cpp-python {lib.__version__}."
                )
        self._model = model
        self.vocab = lib.llama_model_get_vocab(model)
        self.n_gpu_layers = n_gpu_layers
        self.vocab_only = vocab_only
        self.n_vocab: int = lib.llama_vocab_n_tokens(self.vocab)
        self.n_embd: int = lib.llama_model_n_embd(model)
        self.n_layer: int = lib.llama_model_n_layer(model)
        # MTP / NextN blocks after the trunk (``*.nextn_predict_layers``; 0 for most models)
        self.n_layer_nextn: int = int(lib.llama_model_n_layer_nextn(model))
        self.n_embd_out: int = int(lib.llama_model_n_embd_out(model))  # width of hidden-state outputs
        self.n_ctx_train: int = lib.llama_model_n_ctx_train(model)
        self.n_swa: int = lib.llama_model_n_swa(model)
        self.bos: int = lib.llama_vocab_bos(self.vocab)
        self.eos: int = lib.llama_vocab_eos(self.vocab)
        self.eot: int = lib.llama_vocab_eot(self.vocab)
        self.add_bos: bool = bool(lib.llama_vocab_get_add_bos(self.vocab))
        self._piece_buf = ctypes.create_string_buffer(256)
        self._pieces: dict[int, bytes] = {}  # token (or ~token for special=True) -> piece bytes
        raise_if_interrupted()  # Ctrl-C during the load (swallowed in llama.cpp's log callback)

    # -- lifetime -----------------------------------------------------------------------------

    def lost_worker(self) -> tuple[str, str] | None:
        """``(endpoint, why)`` of an RPC worker of this model whose connection failed, else None."""
        for g in self._rpc_guards:
            if g.lost is not None:
                return g.endpoint, g.lost
        return None

    def check_workers(self) -> None:
        """Raise if an RPC worker holding some of this model's layers was lost (a cheap check:
        ``Context.decode`` calls it after every decode, before the logits are read).

        Raises:
            WorkerLostError: names the worker; the model's layers on it are gone.
        """
        if self._rpc_guards:
            from .rpc import check_guards

            check_guards(self._rpc_guards)

    def probe_workers(self) -> None:
        """One HELLO to each RPC worker of this model (``backend.rpc.probe``); nothing else.

        Raises:
            RPCError: a worker is unreachable or speaks another protocol version.
        """
        if self._load_args["rpc"]:
            from . import rpc as _rpc

            for ep in _rpc.parse_endpoints(self._load_args["rpc"]):
                _rpc.probe(ep)

    def reload_if_lost(self) -> bool:
        """Load the model again with the same arguments when one of its RPC workers was lost
        (and is back: the workers are probed first). True when it loaded again; False when no
        worker was lost (e.g. another user of the model reloaded it already).

        The old ``llama_model`` is freed only at ``close()``, not here: contexts made on it stay
        valid memory until their owners, who see ``generation`` change, close them (their
        decodes keep raising ``WorkerLostError``: a context checks the guards it was made
        with), and a thread still tokenizing with its vocabulary never holds a freed one. Its
        weights on the lost worker are gone anyway, and its local layers are mapped from the
        same file. When the load fails (a worker still unreachable), nothing changes: the model
        stays as it was (its vocabulary usable, its decodes failing), and a later call tries
        again.

        Raises:
            RPCError: a worker is still unreachable; ModelLoadError as the constructor.
        """
        with _reload_lock:
            if not self._rpc_guards or self.lost_worker() is None:
                return False
            self.probe_workers()
            saved = dict(self.__dict__)
            try:
                self.__init__(self.path, **self._load_args)
            except BaseException:
                self.__dict__.clear()
                self.__dict__.update(saved)
                raise
            self._retired = saved["_retired"] + ([saved["_model"]] if saved["_model"] else [])
            return True

    @property
    def handle(self):
        """The raw ``llama_model *`` (valid until ``close()``)."""
        self._check_open()
        return self._model

    def _check_open(self) -> None:
        if self._model is None:
            raise ModelLoadError("model is closed")

    def close(self) -> None:
        """Free the model. Contexts made from it must be closed first."""
        if self._model is not None:
            lib.llama_model_free(self._model)
            self._model = None
        while getattr(self, "_retired", None):
            lib.llama_model_free(self._retired.pop())

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass

    # -- metadata -----------------------------------------------------------------------------

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None when the key is absent."""
        buf = ctypes.create_string_buffer(4096)
        n = lib.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            lib.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    @property
    def architecture(self) -> str:
        return self.meta("general.architecture") or "unknown"

    def describe(self) -> str:
        buf = ctypes.create_string_buffer(256)
        lib.llama_model_desc(self.handle, buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    @property
    def size_bytes(self) -> int:
        return int(lib.llama_model_size(self.handle))

    def chat_template(self, name: str | None = None) -> str | None:
        """The model's own chat template (Jinja source) or None when the GGUF has none.

        Never falls back to another family's template (llama.cpp's template applier would
        silently use ChatML, which is wrong for e.g. Gemma).
        """
        ptr = lib.llama_model_chat_template(self.handle, name.encode() if name else None)
        return ptr.decode("utf-8", errors="replace") if ptr else None

    def fim_tokens(self) -> dict[str, int]:
        """Fill-in-the-middle token ids reported by llama.cpp; absent ones are omitted."""
        out = {}
        for name in ("pre", "suf", "mid", "pad", "rep", "sep"):
            tok = getattr(lib, f"llama_vocab_fim_{name}")(self.vocab)
            if tok >= 0:
                out[name] = int(tok)
        return out

    # -- vocabulary ---------------------------------------------------------------------------

    def tokenize(self, text: str | bytes, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text -> token ids with llama.cpp's tokenizer.

        ``add_special`` adds BOS (and EOS) where the model asks for it; ``parse_special``
        turns special-token text such as ``<start_of_turn>`` into its id.

        Raises:
            ModelLoadError: the model is closed.
        """
        self._check_open()  # a closed model's vocabulary pointer dangles: llama.cpp would abort the process
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        n_max = len(data) + 16
        buf = (lib.llama_token * n_max)()
        n = lib.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (lib.llama_token * n_max)()
            n = lib.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token's piece (may be part of a UTF-8 character)."""
        return self._piece(int(token), bool(special))

    def _piece(self, token: int, special: bool) -> bytes:
        key = token if not special else ~token
        piece = self._pieces.get(key)
        if piece is None:
            self._check_open()
            buf = self._piece_buf
            n = lib.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = lib.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
            piece = buf.raw[:n]
            self._pieces[key] = piece
        return piece

    def detokenize(self, tokens, *, special: bool = False) -> str:
        """Token ids -> text (pieces concatenated, invalid UTF-8 replaced)."""
        return b"".join(self._piece(int(t), special) for t in tokens).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        """The vocabulary's stored text of a token (as in the GGUF, e.g. '▁the')."""
        ptr = lib.llama_vocab_get_text(self.vocab, int(token))
        return ptr.decode("utf-8", errors="replace") if ptr else ""

    def token_attr(self, token: int) -> int:
        return int(lib.llama_vocab_get_attr(self.vocab, int(token)))

    def is_eog(self, token: int) -> bool:
        """True for every end-of-generation token (EOS, EOT, <end_of_turn>, ...)."""
        return bool(lib.llama_vocab_is_eog(self.vocab, int(token)))

    @functools.cached_property
    def eog_ids(self) -> frozenset[int]:
        """All end-of-generation ids of the vocabulary (scanned once)."""
        is_eog = lib.llama_vocab_is_eog
        v = self.vocab
        return frozenset(t for t in range(self.n_vocab) if is_eog(v, t))

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound of the bytes one token stands for: the longest stored token text of the
        vocabulary (UTF-8 bytes). A stored text is never shorter than the piece it decodes to
        (SentencePiece's ``▁`` is 3 bytes for a space, ``<0x0A>`` 6 for one byte; byte-level
        BPE maps each byte to a character of 1-2 bytes; special tokens are their text), so a
        text of ``b`` bytes has at least ``b / max_token_bytes`` tokens. About 0.2 s for a
        262,144-token vocabulary, once."""
        longest = 1
        for t in range(self.n_vocab):
            p = lib.llama_vocab_get_text(self.vocab, t)
            if p and len(p) > longest:
                longest = len(p)
        return longest

    @functools.cached_property
    def suppress_tokens(self) -> np.ndarray:
        """Token ids the model asks never to sample (GGUF ``tokenizer.ggml.suppress_tokens``)."""
        n = ctypes.c_int32(0)
        ptr = lib.llama_vocab_get_suppress_tokens(self.vocab, ctypes.byref(n))
        if not ptr or n.value <= 0:
            return np.zeros(0, dtype=np.int32)
        return np.ctypeslib.as_array(ptr, shape=(n.value,)).astype(np.int32)

    def __repr__(self) -> str:
        return f"Model({str(self.path)!r}, {self.describe() if self._model else 'closed'})"


def gguf_tensor(path: str | os.PathLike | GGUFIndex, name: str, *, float_only: bool = False) -> np.ndarray | None:
    """One tensor of a GGUF file in numpy order (ggml's ``ne`` reversed: a ``[n_in, n_out]``
    ggml matrix comes back as ``[n_out, n_in]``).

    Reads through ``GGUFIndex`` (one ``struct`` walk of the header, a fraction of a second),
    not ``gguf.GGUFReader``, which builds numpy views of every tokenizer entry: 10-40 s on a
    head or model that carries a 262k-token vocabulary.

    Args:
        path: the file (str or path), or a ``GGUFIndex`` already open on it (a caller that
            reads several tensors walks the header once).
        float_only: return only F32 / F16 tensors (as float32); None for anything else.
    Returns:
        a copy of the tensor's data (integer and float tensors in their own dtype, F16 as
        float32 with ``float_only``; quantised ones dequantised to float32), or None when the
        file has no tensor ``name`` (or, with ``float_only``, when it is quantised).
    """
    from gguf import GGMLQuantizationType as Q

    from ..models.gguf_index import GGUFIndex

    ix = path if isinstance(path, GGUFIndex) else GGUFIndex(path)
    t = ix.tensors.get(name)
    if t is None:
        return None
    shape = tuple(reversed(t.shape))
    plain = {Q.F32: np.float32, Q.F16: np.float16, Q.I8: np.int8, Q.I16: np.int16, Q.I32: np.int32,
             Q.I64: np.int64, Q.F64: np.float64}  # fmt: skip
    qt = Q(t.qtype)
    if float_only and qt not in (Q.F32, Q.F16):
        return None
    if qt in plain:
        n = int(np.prod(shape))
        out = np.frombuffer(ix._mm, dtype=plain[qt], count=n, offset=t.offset).reshape(shape).copy()
        return out.astype(np.float32) if float_only else out
    return ix.rows(name).reshape(shape)
