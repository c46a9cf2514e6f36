"""Model registry: where the embedded default model lives, and model utilities.

Installed as ``localspec.models`` (the top-level ``models/`` folder of the repository).
"""

from .registry import DEFAULT_MODEL_NAME, default_model_path, model_info, resolve_model

__all__ = ["DEFAULT_MODEL_NAME", "default_model_path", "model_info", "resolve_model"]
