"""``localspec memory``: build a drafting memory from files, and say what is in one
(docs/drafters.md#drafting-memory)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

# files read by `memory build` from a folder: text and source files, not binaries
_SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", "node_modules", ".venv", "venv", ".tox", ".mypy_cache"}


def register(sub) -> None:
    p = sub.add_parser("memory", help="build or inspect a drafting memory file (--draft-memory PATH)")
    msub = p.add_subparsers(dest="memory_command", metavar="ACTION")
    b = msub.add_parser(
        "build",
        help="build a drafting memory from text files or folders",
        description="Tokenizes every UTF-8 text file given (folders: every such file below them, "
        "skipping hidden and build folders) with the model's tokenizer and stores each as one document "
        "of a drafting memory; the commands draft from it with --draft-memory OUT.",
    )
    b.add_argument("inputs", nargs="+", metavar="FILE_OR_DIR")
    b.add_argument("--out", required=True, help="memory file to write")
    b.add_argument("-m", "--model", default=None, help="the model whose tokenizer to use (default: the embedded one)")
    b.add_argument("--mib", type=float, default=None, help="memory budget in MiB (default 64); the last files win")
    b.set_defaults(func=run_build)
    i = msub.add_parser("info", help="say what is in a drafting memory file")
    i.add_argument("path")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(func=run_info)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def iter_files(inputs: list[str]) -> list[Path]:
    """Files given and, for folders, the files below them (sorted; hidden and build folders skipped).

    Raises:
        SystemExit: an input that does not exist.
    """
    out: list[Path] = []
    for x in inputs:
        path = Path(x)
        if path.is_file():
            out.append(path)
        elif path.is_dir():
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
                out.extend(Path(root) / f for f in sorted(files) if not f.startswith("."))
        else:
            raise SystemExit(f"localspec: error: {x}: no such file or folder")
    return out


def _read_text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:4096]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def corpus_documents(model, files: list[Path]) -> tuple[list[list[int]], int, int, int]:
    """The documents of a static memory: each UTF-8 text file's token ids (no BOS).

    Returns:
        (documents, files used, tokens, files skipped as unreadable or not UTF-8 text, empty
        files skipped).
    """
    docs: list[list[int]] = []
    n_unreadable = n_empty = 0
    for f in files:
        text = _read_text(f)
        if text is None:
            n_unreadable += 1
        elif not text:
            n_empty += 1
        else:
            docs.append(model.tokenize(text, add_special=False))
    return docs, len(docs), sum(len(d) for d in docs), n_unreadable, n_empty


def run_build(a: argparse.Namespace) -> int:
    from ..backend import Model
    from ..drafters.memory import DEFAULT_BUDGET_MIB, DraftMemory, vocab_fingerprint
    from ..models import resolve_model

    if a.mib is not None and not (a.mib > 0 and math.isfinite(a.mib)):
        raise SystemExit(f"localspec: error: --mib must be a finite number > 0, got {a.mib}")
    files = iter_files(a.inputs)
    model = Model(resolve_model(a.model), vocab_only=True)
    try:
        mem = DraftMemory(DEFAULT_BUDGET_MIB if a.mib is None else a.mib, vocab=vocab_fingerprint(model))
        docs, n_files, n_tokens, n_unreadable, n_empty = corpus_documents(model, files)
        for doc in docs:
            mem.write(doc)
    finally:
        model.close()
    try:
        mem.save(a.out)
    except OSError as e:
        raise SystemExit(f"localspec: error: cannot write {a.out}: {e.strerror or e}") from None
    info = mem.info()
    skipped = ", ".join(f"{n} {why}" for n, why in ((n_unreadable, "unreadable or not UTF-8 text"), (n_empty, "empty")) if n)
    print(f"localspec: {n_files} files ({n_tokens} tokens; skipped: {skipped or 'none'}) -> {a.out}: "
          f"{info.tokens} tokens kept of {info.capacity} ({info.bytes / 2**20:.1f} MiB)", file=sys.stderr)  # fmt: skip
    return 0


def run_info(a: argparse.Namespace) -> int:
    from ..drafters.memory import DraftMemory, MemoryFileError

    try:
        mem = DraftMemory.load(a.path)
    except MemoryFileError as e:
        raise SystemExit(f"localspec: error: {e}") from None
    info = mem.info().as_dict()
    info["path"] = a.path
    info["file_bytes"] = os.path.getsize(a.path)
    if a.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"{a.path}: {info['documents']} documents, {info['tokens']} tokens "
              f"(capacity {info['capacity']}, {info['bytes'] / 2**20:.1f} MiB in memory, "
              f"{info['file_bytes'] / 2**20:.1f} MiB on disk)")  # fmt: skip
        print(f"  n-gram orders {info['min_n']}..{info['max_n']}; {info['observations']} verification outcomes learned")
        print(f"  vocabulary {info['vocab']}")
    return 0
