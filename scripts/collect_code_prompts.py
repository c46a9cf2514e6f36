"""Collect the code-completion prompts of ``localspec bench --dataset code``.

Cuts Python code-completion prompts from the sources of permissively licensed third-party
packages installed with localspec's dependencies (not the Python standard library, whose
docstrings and sources calibrated the n-gram priors, and not HumanEval / Spec-Bench). Each
prompt is the text of one module from the start of a top-level or method ``def`` back to
about ``--context`` characters before it (cut at a line start), up to and including the
function's signature, its docstring if it has one, and its first body line: the model is
asked to go on writing the function, as an editor completion would.

Writes Spec-Bench-format JSON lines (``question_id``, ``category`` = ``"code"``, ``turns``)
with the provenance of each prompt (``source``: package, version, licence, path inside the
package, line of the ``def``). Functions are chosen by a seeded sample, at most
``--per-file`` per file and ``--per-package`` per package, so the set is reproducible from the
same package versions::

    python scripts/collect_code_prompts.py --out localspec/bench/data/code.jsonl

The held-out code set of the "never slower" table (``docs/results/heldout-code.jsonl``), from
eight other packages, none of which the benchmarks, the tests or the heads' training data use::

    python scripts/collect_code_prompts.py --packages heldout --per-package 2 --id-prefix heldout-code \\
        --out docs/results/heldout-code.jsonl
"""

from __future__ import annotations

import argparse
import ast
import json
import random
from importlib import metadata
from pathlib import Path

# (distribution, import package): pure-Python packages with permissive licences
PACKAGES = [
    ("click", "click"),
    ("Jinja2", "jinja2"),
    ("httpx", "httpx"),
    ("anyio", "anyio"),
    ("h11", "h11"),
    ("markdown-it-py", "markdown_it"),
    ("networkx", "networkx"),
    ("filelock", "filelock"),
    ("diskcache", "diskcache"),
    ("idna", "idna"),
]
# (distribution, import package): held out from every benchmark, test and training set here
HELDOUT_PACKAGES = [
    ("rich", "rich"),
    ("starlette", "starlette"),
    ("uvicorn", "uvicorn"),
    ("platformdirs", "platformdirs"),
    ("Pygments", "pygments"),
    ("packaging", "packaging"),
    ("pyparsing", "pyparsing"),
    ("urllib3", "urllib3"),
]
PACKAGE_SETS = {"default": PACKAGES, "heldout": HELDOUT_PACKAGES}


def _licence(dist: metadata.Distribution) -> str:
    md = dist.metadata
    for key in ("License-Expression", "License"):
        v = md.get(key)
        if v and len(v) < 40:
            return v
    for c in md.get_all("Classifier") or []:
        if c.startswith("License ::"):
            return c.split("::")[-1].strip()
    return "see the package's licence file"


def _candidates(text: str) -> list[tuple[int, int]]:
    """(first line of the def, last prompt line) of every function worth completing: a body
    of at least 6 lines after what the prompt shows, outside test code."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        body = node.body
        first = body[0]
        show = first
        if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) and isinstance(first.value.value, str):
            if len(body) < 2:
                continue
            show = body[1]
        if show.end_lineno is None or node.end_lineno is None:
            continue
        # the prompt ends with the first body statement's first line (a one-line statement)
        if show.end_lineno != show.lineno or node.end_lineno - show.lineno < 6:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        out.append((start, show.lineno))
    return sorted(out)


def collect(*, context: int, per_file: int, per_package: int, seed: int, packages=PACKAGES,
            id_prefix: str = "code") -> list[dict]:  # fmt: skip
    rng = random.Random(seed)
    rows = []
    for dist_name, pkg in packages:
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            continue
        root = Path(str(dist.locate_file(pkg)))
        files = sorted(p for p in root.rglob("*.py") if "test" not in p.name and "tests" not in p.parts)
        picked = []
        for path in files:
            text = path.read_text(encoding="utf-8", errors="replace")
            cands = _candidates(text)
            if cands:
                lines = text.splitlines(keepends=True)
                for c in rng.sample(cands, min(per_file, len(cands))):
                    picked.append((path, lines, c))
        rng.shuffle(picked)
        for path, lines, (start, end) in sorted(picked[:per_package], key=lambda x: (str(x[0]), x[2])):
            head = "".join(lines[start - 1 : end])
            # context before the def, cut at a line start
            before, n = [], 0
            for line in reversed(lines[: start - 1]):
                if n + len(line) > context:
                    break
                before.append(line)
                n += len(line)
            prompt = "".join(reversed(before)) + head
            rel = path.relative_to(root.parent).as_posix()
            rows.append(
                {
                    "question_id": f"{id_prefix}-{len(rows) + 1:03d}",
                    "category": "code",
                    "turns": [prompt],
                    "source": {
                        "package": dist.metadata["Name"],
                        "version": dist.version,
                        "license": _licence(dist),
                        "path": rel,
                        "def_line": start,
                    },
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=1500, help="characters of the module before the def (default 1500)")
    ap.add_argument("--per-file", type=int, default=1)
    ap.add_argument("--per-package", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--packages", choices=sorted(PACKAGE_SETS), default="default",
                    help="default: the shipped 'code' dataset's packages; heldout: the held-out set's")  # fmt: skip
    ap.add_argument("--id-prefix", default="code", help="question_id prefix (default code)")
    a = ap.parse_args()
    rows = collect(context=a.context, per_file=a.per_file, per_package=a.per_package, seed=a.seed,
                   packages=PACKAGE_SETS[a.packages], id_prefix=a.id_prefix)  # fmt: skip
    with open(a.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} prompts to {a.out}")


if __name__ == "__main__":
    main()
