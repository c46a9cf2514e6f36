"""Chat-like and code-like prompts that the target itself writes (``--self-prompts N``).

A head trained only on documents drafts poorly where users ask questions. The base model can
write such questions itself: given the beginning of a numbered list ("Questions people ask an
assistant:\\n1."), it continues the list. ``harvest_prompts`` does so for a few hand-written
list headers (``SEEDS``: general, advice and school questions, Python / shell / debugging
tasks, writing and editing, brainstorming, maths, translation, summarising) in rounds: each round continues every header with seeded sampling, splits the
continuation into its numbered items, keeps the new ones (dropping exact repeats, ignoring
case and whitespace, and near repeats of a prompt of the same kind: ``near_duplicate``,
word-set Jaccard similarity >= 0.6) and shows up to ``EXAMPLES`` items harvested for that
header so far as the list's first entries in the next round, so that later rounds vary. No evaluation set
(Spec-Bench, HumanEval) is read; the only fixed text is ``SEEDS``.

The prompts are then answered by the target (the self-distillation path of
``eagle3_data.extract``) in the form ``chat`` and ``serve`` give the model a conversation
(``tui.chat_format.chat_prompt_tokens``: the model's chat template, or the plain ``User:/Assistant:``
transcript for a base model), so the recorded data is the target's own answers to chat- and
code-like requests.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np



@dataclass(frozen=True)
class Seed:
    """A list header the target continues, and the kind of prompt it yields."""

    header: str
    kind: str


SEEDS: tuple[Seed, ...] = (
    Seed("Questions people often ask an AI assistant:\n", "question"),
    Seed("Python programming tasks for a coding assistant:\n", "code"),
    Seed("Requests for help with shell commands, git and SQL:\n", "code"),
    Seed("Writing requests (emails, stories, poems, cover letters):\n", "writing"),
    Seed("Maths word problems for students:\n", "maths"),
    Seed("Sentences people ask to have translated:\n", "translation"),
    Seed("Requests people send to an assistant to summarise or explain something:\n", "summary"),
    Seed("Everyday advice questions (health, cooking, travel, money):\n", "question"),
    Seed("Questions students ask about science, history and geography:\n", "question"),
    Seed("Questions programmers ask about bugs, error messages and libraries:\n", "code"),
    Seed("Things people ask an assistant to do with their text (rewrite, shorten, fix the grammar):\n", "writing"),
    Seed("Ideas people ask an assistant to brainstorm (names, gifts, plans, recipes):\n", "writing"),
)
EXAMPLES = 3  # harvested items shown as a header's first entries in later rounds
ROUND_PROMPT_TOKENS = 1024  # room for a list's header and examples in a round's request context
_ITEM = re.compile(r"(?:^|\n)\s*(\d{1,3})[.)]\s+")


def split_items(text: str) -> list[str]:
    """The entries of a numbered list (``"1. a\\n2. b"`` -> ``["a", "b"]``), each stripped, its
    continuation lines joined with spaces; text before the first number is dropped."""
    marks = list(_ITEM.finditer(text))
    out = []
    for m, nxt in zip(marks, marks[1:] + [None]):
        body = text[m.end() : nxt.start() if nxt is not None else len(text)]
        out.append(" ".join(body.split()))
    return out


def item_key(item: str) -> str:
    """What two prompts must differ in to count as different: case, whitespace and trailing
    punctuation ignored."""
    return " ".join(item.casefold().split()).rstrip(" .?!:;")


_WORD = re.compile(r"\w+")
NEAR_DUPLICATE = 0.6  # word-set Jaccard similarity at which a prompt repeats an earlier one


def word_set(item: str) -> frozenset[str]:
    """The case-folded words of a prompt (what ``near_duplicate`` compares)."""
    return frozenset(_WORD.findall(item.casefold()))


def near_duplicate(words: frozenset[str], earlier: Sequence[frozenset[str]], threshold: float = NEAR_DUPLICATE) -> bool:
    """Whether a prompt's ``words`` share at least ``threshold`` of their union with those of
    an earlier prompt (Jaccard): "How do I run a shell script?" repeats "How to run a shell
    script?" (5 of 8 words), "What is your favorite type of music?" repeats "... kind of
    music?" (6 of 8)."""
    for w in earlier:
        inter = len(words & w)
        if inter and inter >= threshold * (len(words) + len(w) - inter):
            return True
    return False


def usable(item: str, min_chars: int = 12, max_chars: int = 300) -> bool:
    """A prompt worth answering: ``min_chars .. max_chars`` characters, at least four words
    and mostly letters (not a stray number, URL or code fragment of the list)."""
    if not min_chars <= len(item) <= max_chars or len(item.split()) < 4:
        return False
    letters = sum(c.isalpha() for c in item)
    return letters >= 0.5 * len(item) and "http" not in item


def _list_text(seed: Seed, examples: Sequence[str]) -> str:
    lines = [f"{i + 1}. {e}\n" for i, e in enumerate(examples)]
    return seed.header + "".join(lines) + f"{len(examples) + 1}."


@dataclass
class Harvest:
    """Prompts harvested from the target.

    Attributes:
        prompts: the deduplicated prompts, in the order found.
        kinds: the ``Seed.kind`` of each prompt.
        rounds: rounds run; generated_tokens: tokens the target wrote for them.
    """

    prompts: list[str]
    kinds: list[str]
    rounds: int
    generated_tokens: int


def harvest_prompts(
    engine,
    n: int,
    *,
    seed: int = 0,
    max_tokens: int = 160,
    temperature: float = 0.9,
    seeds: Sequence[Seed] = SEEDS,
    max_rounds: int | None = None,
    deadline: float | None = None,
) -> Harvest:
    """Have the target write ``n`` distinct prompts by continuing numbered lists.

    Args:
        engine: a ``localspec.Engine`` on the target: its model, tokenizer and cost model.
            Each round decodes every header's continuation together (a ``BatchScheduler``
            with a slot per header, plain decoding; one continuation at a time, the recipe's
            chat stage of 2026-12-03 harvested only 142 prompts, on a shared machine).
        n: prompts wanted (fewer when ``max_rounds`` ends the harvest first).
        seed: the sampling seed of the first continuation; every continuation has its own
            seed derived from it, so the same ``seed`` gives the same prompts on the same
            target and machine.
        max_tokens: tokens per continuation; its last, possibly cut, item is dropped when the
            continuation stops at this length.
        temperature: sampling temperature (0 = greedy; then only the examples vary a round).
        max_rounds: stop after this many rounds over ``seeds`` (default: ``4 * n`` continuations).
        deadline: ``time.time()`` after which no further round starts (fewer prompts).
    Raises:
        ValueError: ``n`` < 1 or no seeds.
    """
    from localspec import SamplingParams
    from localspec.scheduler import BatchScheduler

    if n < 1 or not seeds:
        raise ValueError("harvest_prompts needs n >= 1 and at least one seed")
    rng = np.random.default_rng(seed)
    seen = {item_key(s.header) for s in seeds}
    by_seed: list[list[str]] = [[] for _ in seeds]
    words_by_kind: dict[str, list[frozenset[str]]] = {}
    prompts: list[str] = []
    kinds: list[str] = []
    n_tok = 0
    rounds = 0
    limit = max_rounds if max_rounds is not None else max(1, -(-4 * n // len(seeds)))
    sched = None
    try:
        while len(prompts) < n and rounds < limit and (deadline is None or time.time() < deadline):
            # a round: every header's continuation decoded together (one batched decode per
            # token for all of them), its examples and sampling seed drawn in header order
            asks = []
            for j, s in enumerate(seeds):
                pool = by_seed[j]
                k = min(EXAMPLES, len(pool))
                examples = [pool[int(i)] for i in rng.choice(len(pool), size=k, replace=False)] if k else []
                sp = SamplingParams(temperature=temperature, seed=int(rng.integers(0, 2**31 - 1)), draft_memory=False)
                asks.append((examples, engine.tokenize(_list_text(s, examples)), sp))
            if sched is None:
                sched = BatchScheduler(engine.model, parallel=len(seeds), n_ctx=ROUND_PROMPT_TOKENS + max_tokens,
                                       drafter="none", cost_model=engine.cost_model, prompt_cache=0)  # fmt: skip
            jobs = [sched.submit(t, max_tokens=max_tokens, sampling=sp, speculative=False) for _, t, sp in asks]
            sched.run_until_idle()
            n_tok += _take_round(seeds, asks, [job.wait() for job in jobs], n, prompts, kinds, by_seed, seen, words_by_kind)
            rounds += 1
    finally:
        if sched is not None:
            sched.close()
    return Harvest(prompts, kinds, rounds, n_tok)


def _take_round(seeds, asks, results, n, prompts, kinds, by_seed, seen, words_by_kind) -> int:
    """The items of one round's continuations (``results``, in header order) appended to
    ``prompts``/``kinds`` and the headers' pools until there are ``n``: an item cut by the
    token limit, an unusable one and a (near) repeat are dropped. Returns the tokens the round
    generated."""
    n_tok = 0
    for j, (s, (examples, _, _), res) in enumerate(zip(seeds, asks, results)):
        n_tok += len(res.token_ids)
        if len(prompts) >= n:
            continue
        items = split_items(f"{len(examples) + 1}. " + res.text)
        if res.finish_reason == "length" and items:
            items = items[:-1]
        near = words_by_kind.setdefault(s.kind, [])
        for item in items:
            key = item_key(item)
            if key in seen or not usable(item) or near_duplicate(words := word_set(item), near):
                continue
            seen.add(key)
            near.append(words)
            by_seed[j].append(item)
            prompts.append(item)
            kinds.append(s.kind)
            if len(prompts) >= n:
                break
    return n_tok
