"""``localspec models``: where the default model is, and model utilities (derived drafts,
EAGLE-3 heads)."""

from __future__ import annotations

import argparse
import json


def register(sub) -> None:
    p = sub.add_parser("models", help="show the default model and model utilities")
    msub = p.add_subparsers(dest="models_command", metavar="ACTION")
    w = msub.add_parser("where", help="print the default model's path (assembling it if needed)")
    w.set_defaults(func=run_where)
    i = msub.add_parser("info", help="describe a GGUF (default: the embedded model)")
    i.add_argument("path", nargs="?", default=None)
    i.set_defaults(func=run_info)
    for sp in (w, i):  # `models info --json` as `models --json info` (SUPPRESS: it keeps the latter's value)
        sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    d = msub.add_parser(
        "derive-draft",
        help="write a draft model: the target's first N layers (+ final norm and output)",
        description="Writes a layer-truncated copy of TARGET: a real draft model with the target's "
        "vocabulary, for --drafter draft --draft-model OUT.",
    )
    d.add_argument("target", help="target GGUF ('default' = the embedded model)")
    d.add_argument("--layers", type=int, required=True, help="blocks to keep")
    d.add_argument("--out", required=True, help="draft GGUF to write")
    d.set_defaults(func=run_derive_draft)
    r = msub.add_parser(
        "random-eagle3",
        help="write an untrained EAGLE-3 head for TARGET (for tests: lossless, rarely accepted)",
        description="Writes a randomly initialised EAGLE-3 head (llama.cpp architecture eagle3) for "
        "TARGET: fc over 3 target-layer features, one decoder layer, a reduced draft vocabulary with "
        "its own output matrix and d2t. Use it with --drafter eagle3 --eagle OUT.",
    )
    r.add_argument("target", help="target GGUF ('default' = the embedded model)")
    r.add_argument("--out", required=True, help="head GGUF to write")
    r.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (default 8192)")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=run_random_eagle3)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_default)


def run_default(a: argparse.Namespace) -> int:
    from ..models import default_model_path, model_info

    path = default_model_path()
    info = model_info()
    info["path"] = str(path)
    if a.json:
        print(json.dumps(info))
    else:
        print(f"default model: {info['default_model']} (from package {info['package']})")
        print(f"path:          {info['path']}")
        print(f"size:          {info['size_bytes'] / 2**20:.1f} MiB, sha256 {info['sha256']}")
        print(f"cache dir:     {info['cache_dir']}")
    return 0


def run_where(a: argparse.Namespace) -> int:
    from ..models import default_model_path

    path = str(default_model_path())
    print(json.dumps({"path": path}) if a.json else path)
    return 0


def run_info(a: argparse.Namespace) -> int:
    from ..backend import Model
    from ..models import resolve_model

    m = Model(resolve_model(a.path), vocab_only=False)
    try:
        info = {
            "path": str(m.path),
            "description": m.describe(),
            "architecture": m.architecture,
            "n_vocab": m.n_vocab,
            "n_embd": m.n_embd,
            "n_layer": m.n_layer,
            "n_ctx_train": m.n_ctx_train,
            "n_swa": m.n_swa,
            "size_bytes": m.size_bytes,
            "chat_template": m.chat_template() is not None,
            "fim_tokens": m.fim_tokens(),
            "bos": m.bos,
            "eos": m.eos,
        }
    finally:
        m.close()
    print(json.dumps(info, indent=None if a.json else 2))
    return 0


def _write_gguf(write, out, *args, **kwargs):
    """``write(*args, **kwargs)`` (a GGUF writer returning the path it wrote), with its
    errors as one-line CLI errors: bad parameters, or an ``out`` that cannot be written."""
    try:
        return write(*args, **kwargs)
    except ValueError as e:
        raise SystemExit(f"localspec: error: {e}") from None
    except OSError as e:
        raise SystemExit(f"localspec: error: cannot write {out}: {e.strerror or e}") from None


def run_derive_draft(a: argparse.Namespace) -> int:
    from ..backend import check_gguf_file
    from ..models import resolve_model
    from ..models.derive import derive_draft

    target = check_gguf_file(resolve_model(a.target))
    out = _write_gguf(derive_draft, a.out, target, a.out, a.layers)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): the first {a.layers} layers of {target.name}")
    return 0


def run_random_eagle3(a: argparse.Namespace) -> int:
    from ..backend import check_gguf_file
    from ..models import resolve_model
    from ..models.eagle3_gguf import random_eagle3

    if a.draft_vocab is not None and a.draft_vocab < 1:
        raise SystemExit(f"localspec: error: --draft-vocab must be >= 1, got {a.draft_vocab}")
    target = check_gguf_file(resolve_model(a.target))
    out = _write_gguf(random_eagle3, a.out, target, a.out, draft_vocab=a.draft_vocab, seed=a.seed)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): an untrained EAGLE-3 head for {target.name}")
    return 0
