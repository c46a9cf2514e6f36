"""A scripted engine for the TUI's layout (snapshot) tests: same answers, same statistics,
same timings on every run, no model. The behaviour tests use the real engine."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

from localspec.engine import GenerationResult, StreamChunk
from localspec.stats import GenerationStats, count_sources
from localspec.tree import TokenSource

D, N, DM, E, R, B = (TokenSource.DECODE, TokenSource.NGRAM, TokenSource.DRAFT_MODEL, TokenSource.EAGLE3,
                     TokenSource.RECOVERED, TokenSource.BONUS)  # fmt: skip

# Answers as (text, source, step) per token.
ANSWERS = [
    [(" Sure", D, 0), ("!", D, 1), (" Here", R, 2), (" is", N, 3), (" a", N, 3), (" list", N, 3), (":", B, 3),
     (" one", D, 4), (",", N, 5), (" two", N, 5), (",", N, 5), (" three", B, 5), (",", R, 6), (" four", D, 7),
     (".", B, 8)],
    [(" The", D, 0), (" draft", DM, 1), (" model", DM, 1), (" and", DM, 1), (" the", B, 1), (" EAGLE", E, 2),
     ("-3", E, 2), (" head", E, 2), (" get", R, 2), (" their", D, 3), (" own", DM, 4), (" colours", B, 4),
     (".", D, 5)],
]  # fmt: skip


class FakeClock:
    """A clock that advances by a repeating pattern of steps (seconds) on every call."""

    def __init__(self) -> None:
        self.t = 100.0
        self._steps = itertools.cycle([0.010, 0.030, 0.020, 0.012, 0.025])

    def __call__(self) -> float:
        self.t += next(self._steps)
        return self.t


class FakeModel:
    """Byte-level tokenizer (id = byte + 3), no chat template."""

    bos, eos, add_bos, n_vocab = 1, 2, True, 259
    path = Path("fake-270m.gguf")

    def chat_template(self, name=None):
        return None

    def meta(self, key):
        return "Fake 270M" if key == "general.name" else None

    def describe(self):
        return "fake 270M Q4_K - Medium"

    def tokenize(self, text, *, add_special=True, parse_special=False):
        ids = [b + 3 for b in text.encode()]
        return [self.bos, *ids] if add_special else ids

    def detokenize(self, ids, *, special=False):
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")


class FakeStream:
    def __init__(self, answer, n_prompt: int, n_cached: int, drafter: str) -> None:
        self.answer, self.n_prompt, self.n_cached, self.drafter = answer, n_prompt, n_cached, drafter
        self.result: GenerationResult | None = None
        self.cancelled = threading.Event()
        self._it = self._run()

    def __iter__(self):
        return self

    def __next__(self) -> StreamChunk:
        return next(self._it)

    def cancel(self) -> None:
        self.cancelled.set()

    def _run(self):
        emitted: list[tuple[str, TokenSource, int]] = []
        finish = "stop"
        try:
            for text, src, step in self.answer:
                if self.cancelled.is_set():
                    finish = "cancelled"
                    break
                emitted.append((text, src, step))
                yield StreamChunk(text, 3, src, step)
        finally:
            self.result = _result(emitted, finish, self.n_prompt, self.n_cached, self.drafter)


def _result(emitted, finish, n_prompt, n_cached, drafter) -> GenerationResult:
    sources = [s for _, s, _ in emitted]
    n_steps = len({step for _, _, step in emitted})
    n_acc = sum(1 for s in sources if s.is_draft)
    stats = GenerationStats(
        drafter=drafter,
        seed=7,
        n_prompt_tokens=n_prompt,
        n_cached_tokens=n_cached,
        n_generated_tokens=len(emitted),
        n_step_tokens=len(emitted),  # no end-of-generation step in these scripts
        n_steps=n_steps,
        n_spec_steps=n_steps - 2,
        num_draft_tokens=n_acc + 4,
        num_accepted_tokens=n_acc,
        drafted_per_depth=[6, 4, 3, 1],
        accepted_per_depth=[5, 3, 2, 0],
        token_sources=count_sources(sources),
        t_prefill_us=35_000.0,
        t_draft_us=4_000.0,
        t_decode_us=150_000.0,
        t_verify_us=12_000.0,
        t_other_us=9_000.0,
        t_generate_us=175_000.0,
        t_total_us=210_000.0,
    )
    text = "".join(t for t, _, _ in emitted)
    return GenerationResult(text, [3] * len(emitted), finish, None, sources, None, stats)


class FakeEngine:
    """Just enough of ``Engine`` for ``ChatApp``: scripted answers, in turn."""

    n_ctx = 4096

    def __init__(self, drafter: str = "ngram") -> None:
        self.model = FakeModel()
        self._drafter = drafter
        self._answers = itertools.cycle(ANSWERS)
        self._n_cached = 0

    @property
    def drafter_name(self) -> str:
        return self._drafter

    def set_drafter(self, name) -> None:
        self._drafter = name

    def with_thresholds(self, sampling):
        """As ``Engine.with_thresholds`` with the default (lossless) thresholds."""
        return sampling

    def plain_tokens_per_s(self) -> float:
        return 64.0

    def stream(self, prompt, *, max_tokens, sampling, stop=()):
        s = FakeStream(next(self._answers), len(prompt), self._n_cached, self._drafter)
        self._n_cached = len(prompt)
        return s

    def close(self) -> None:
        pass
