"""Statistics while an answer streams in.

The engine's exact ``GenerationStats`` arrive with the stream's result at the end of a turn;
until then the panel shows what the chunks tell: tokens, steps, sources, and a rate
measured from the chunks' arrival times (seconds from ``time.perf_counter``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from localspec.engine import StreamChunk
from localspec.tree import TokenSource


@dataclass
class LiveTurn:
    """What the chunks of the answer being generated say so far.

    ``tokens_per_s`` counts the tokens after the first step over the time since the first
    chunk, so the prefill of the prompt is not in it (as in ``GenerationStats.tokens_per_s``).
    """

    n_tokens: int = 0
    n_steps: int = 0
    sources: Counter = field(default_factory=Counter)
    t_first_s: float | None = None
    t_last_s: float = 0.0
    n_first_step: int = 0

    def add(self, chunk: StreamChunk, t_s: float) -> None:
        if chunk.token < 0:  # held-back text released at the end: no new token
            return
        self.n_tokens += 1
        self.sources[TokenSource(chunk.source)] += 1
        self.n_steps = max(self.n_steps, chunk.step + 1)
        if self.t_first_s is None:
            self.t_first_s = t_s
        if chunk.step == 0:
            self.n_first_step = self.n_tokens
        self.t_last_s = t_s

    @property
    def tokens_per_s(self) -> float:
        if self.t_first_s is None or self.t_last_s <= self.t_first_s:
            return 0.0
        return (self.n_tokens - self.n_first_step) / (self.t_last_s - self.t_first_s)

    @property
    def mean_acceptance_length(self) -> float:
        return self.n_tokens / self.n_steps if self.n_steps else 0.0

    @property
    def num_accepted_tokens(self) -> int:
        return sum(n for s, n in self.sources.items() if s.is_draft)
