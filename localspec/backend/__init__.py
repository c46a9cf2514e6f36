"""Owned wrappers over llama.cpp (through llama-cpp-python's raw bindings).

``Model`` owns a ``llama_model``, ``Context`` a ``llama_context``, ``Batch`` the arrays of a
``llama_batch``, and ``SequenceCache`` the committed token sequence in KV seq 0 with checked
rollbacks and token-tree commits. Nothing above this package touches a C handle.
"""

from ._llama import cpu_amx, ensure_backend, exact_kernels, supports_gpu_offload, system_info
from .batch import Batch
from .context import Context, default_threads
from .kv import SequenceCache
from .model import Model, check_gguf_file

__all__ = [
    "Batch",
    "Context",
    "Model",
    "SequenceCache",
    "check_gguf_file",
    "cpu_amx",
    "default_threads",
    "ensure_backend",
    "exact_kernels",
    "supports_gpu_offload",
    "system_info",
]
