"""Read-only access to ``ggml_tensor`` structs seen in llama.cpp's eval callback (``cb_eval``).

The struct layout is ggml's (``ggml.h`` in the llama.cpp vendored by llama-cpp-python
0.3.36); ``GGML_MAX_DIMS = 4``, ``GGML_MAX_OP_PARAMS = 64``, ``GGML_MAX_SRC = 10``,
``GGML_MAX_NAME = 64``. Only tensors in host memory (the CPU backend, or a buffer the
scheduler copied to the host) can be read as numpy arrays.
"""

from __future__ import annotations

import ctypes

import numpy as np

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1


class GgmlTensor(ctypes.Structure):
    pass


GgmlTensor._fields_ = [
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * 4),
    ("nb", ctypes.c_size_t * 4),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * 16),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(GgmlTensor) * 10),
    ("view_src", ctypes.POINTER(GgmlTensor)),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * 64),
    ("extra", ctypes.c_void_p),
    ("padding", ctypes.c_char * 8),
]


def tensor_name(t: GgmlTensor) -> str:
    return t.name.decode("utf-8", errors="replace")


def tensor_f32(t: GgmlTensor) -> np.ndarray:
    """A copy of an F32 tensor as ``[ne3, ne2, ne1, ne0]`` (contiguous rows assumed).

    Raises:
        TypeError: the tensor is not F32 or has no host data.
    """
    if t.type != GGML_TYPE_F32 or not t.data:
        raise TypeError(f"tensor {tensor_name(t)} is not a host F32 tensor")
    ne = [int(x) for x in t.ne]
    nb = [int(x) for x in t.nb]
    n_bytes = (ne[3] - 1) * nb[3] + (ne[2] - 1) * nb[2] + (ne[1] - 1) * nb[1] + ne[0] * 4
    buf = (ctypes.c_char * n_bytes).from_address(t.data)
    arr = np.frombuffer(buf, dtype=np.uint8, count=n_bytes)
    view = np.lib.stride_tricks.as_strided(
        arr.view(np.float32) if nb[0] == 4 and n_bytes % 4 == 0 else arr.view(np.float32),
        shape=(ne[3], ne[2], ne[1], ne[0]),
        strides=(nb[3], nb[2], nb[1], nb[0]),
    )
    return np.array(view, copy=True)
