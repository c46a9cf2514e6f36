"""Spec-Bench-format prompts (JSON lines: question_id, category, turns).

Spec-Bench (Xia et al. 2024) has five task categories (translation, summarization, qa,
math_reasoning, rag) and the eight MT-Bench labels (writing, roleplay, reasoning, math,
coding, extraction, stem, humanities), which are reported together as ``mt_bench``. The
first turn of each question is the prompt. For ``mt_bench`` the N questions are taken
round-robin over the eight labels (the first of each label, then the second, ...), so that
the category is not only "writing".

Datasets shipped in the package (``--dataset NAME``): ``code``, Python code-completion prompts
cut from permissively licensed third-party sources (``bench/data/README.md`` gives their
provenance; ``scripts/collect_code_prompts.py`` rebuilds them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_DATA = Path(__file__).parent / "data"
BUILTIN_DATASETS = {"code": _DATA / "code.jsonl"}

MT_BENCH_LABELS = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass
class BenchPrompt:
    category: str  # reported category (mt_bench for the eight MT-Bench labels)
    label: str  # the dataset's own category
    question_id: int | str
    text: str
    tokens: list[int] | None = None  # the prompt as given to the model (None: ``text`` tokenised as it is)

    @property
    def model_input(self) -> str | list[int]:
        """What ``Engine.generate`` is given: ``tokens`` when set, else ``text``."""
        return self.text if self.tokens is None else self.tokens


def as_chat(prompts: list[BenchPrompt], model) -> list[BenchPrompt]:
    """The prompts as one user turn of a conversation, as ``chat`` / ``serve`` give them to
    ``model`` (its chat template, or the plain transcript: ``tui.chat_format.chat_prompt_tokens``),
    the way Spec-Bench's own harness wraps each question in its model's conversation template.
    Without it a base model is given the bare question, which it continues as text."""
    from dataclasses import replace

    from localspec.tui.chat_format import chat_prompt_tokens

    return [replace(p, tokens=chat_prompt_tokens(model, p.text)) for p in prompts]


def resolve_dataset(name: str | Path) -> Path:
    """The path of a dataset: a shipped one by name (``BUILTIN_DATASETS``), else ``name`` as a
    path. Raises ``FileNotFoundError`` (one line, naming the shipped ones) when neither exists."""
    if str(name) in BUILTIN_DATASETS:
        return BUILTIN_DATASETS[str(name)]
    path = Path(name)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {str(name)!r} is not a file nor a shipped dataset ({', '.join(BUILTIN_DATASETS)})")
    return path


def load_questions(path: str | Path) -> list[dict]:
    """Read a Spec-Bench JSONL file (or a shipped dataset by name, see ``resolve_dataset``).
    Raises ``ValueError`` naming a malformed line, ``FileNotFoundError`` for a missing file."""
    path = resolve_dataset(path)
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                q = json.loads(line)
                turns = q["turns"]
                if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                    raise TypeError(f"'turns' must be a non-empty list of strings, got {turns!r:.60}")
                if not isinstance(q["category"], str):
                    raise TypeError(f"'category' must be a string, got {q['category']!r:.60}")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{i}: not a Spec-Bench question ({e})") from None
            out.append(q)
    return out


def category_of(label: str) -> str:
    return "mt_bench" if label in MT_BENCH_LABELS else label


def select_prompts(questions: list[dict], categories: list[str] | None, per_category: int) -> list[BenchPrompt]:
    """The first ``per_category`` questions of each category (mt_bench round-robin).

    Raises:
        ValueError: ``per_category`` below 1, a category not in ``questions``, or no question
            at all (an empty file).
    """
    if per_category < 1:
        raise ValueError(f"at least one prompt per category is needed, got {per_category}")
    if not questions:
        raise ValueError("the dataset has no questions")
    by_cat: dict[str, list[dict]] = {}
    for q in questions:
        by_cat.setdefault(category_of(q["category"]), []).append(q)
    cats = categories or [c for c in CATEGORIES if c in by_cat] + [c for c in by_cat if c not in CATEGORIES]
    out: list[BenchPrompt] = []
    for cat in cats:
        if cat not in by_cat:
            raise ValueError(f"category {cat!r} is not in the dataset (it has {', '.join(sorted(by_cat))})")
        qs = by_cat[cat]
        if cat == "mt_bench":
            lanes = [[q for q in qs if q["category"] == lab] for lab in MT_BENCH_LABELS]
            lanes = [lane for lane in lanes if lane]
            ordered = []
            i = 0
            while len(ordered) < len(qs):
                for lane in lanes:
                    if i < len(lane):
                        ordered.append(lane[i])
                i += 1
            qs = ordered
        for q in qs[:per_category]:
            out.append(BenchPrompt(cat, q["category"], q.get("question_id", len(out)), q["turns"][0]))
    return out


def interleave(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """Round-robin over categories, so slow drifts of the machine spread over all of them."""
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out = []
    i = 0
    while len(out) < len(prompts):
        for lst in by_cat.values():
            if i < len(lst):
                out.append(lst[i])
        i += 1
    return out
