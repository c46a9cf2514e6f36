"""The learning-rate schedule both head trainers use (EAGLE-3 and Medusa)."""

from __future__ import annotations

import math


def warmup_cosine(step: int, *, lr: float, warmup: int, steps: int, min_lr_frac: float) -> float:
    """Learning rate at optimiser ``step`` (0-based): a linear warm-up over ``warmup`` steps
    to ``lr``, then a half cosine down to ``lr * min_lr_frac`` at ``steps`` (held there after).
    The schedule of Loshchilov & Hutter 2017 (SGDR) without restarts, with Goyal et al. 2017's
    warm-up."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))
