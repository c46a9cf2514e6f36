"""Per-request statistics of a generation (speculative or not).

Counts are of *emitted* tokens, so a generation cut by a stop string or an end-of-generation
token counts only what it kept. ``mean_acceptance_length`` is tokens produced per verification
step, the recovered/bonus token included (1.0 for plain decoding), counting also the
end-of-generation token and tokens a stop string cut (so it is never below 1); ``accept_length``
of a step excludes the recovered/bonus token. Times carry their unit (µs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .tree import TokenSource


@dataclass
class GenerationStats:
    """Statistics of one request.

    Attributes:
        drafter: name of the drafter used ("none" for plain decoding).
        seed: the seed of the random streams (reproduces a sampled generation).
        n_prompt_tokens: tokens in the prompt.
        n_cached_tokens: prompt tokens whose KV was reused from the previous request.
        n_generated_tokens: tokens emitted (after any stop cut; EOG not counted).
        n_steps: target verification calls (decode steps) of the generation loop.
        n_step_tokens: tokens those steps produced: the emitted ones, plus the
            end-of-generation token and tokens cut by a stop string (>= n_steps).
        n_spec_steps: steps that verified at least one draft token.
        num_draft_tokens: draft tokens verified, over all steps.
        num_accepted_tokens: emitted tokens that were accepted drafts.
        n_redecoded_tokens: accepted tokens decoded a second time (without logits) because an
            earlier tree branch sat between them and the root in the KV cache (cells are kept
            in position order so that results stay bit-identical to plain decoding).
        drafted_per_depth: [d] steps whose verified tree reached depth d+1.
        accepted_per_depth: [d] steps that accepted a draft at depth d+1.
        token_sources: count of emitted tokens per ``TokenSource`` name.
        t_prefill_us: prompt processing (KV reuse + prefill decodes).
        t_draft_us / t_decode_us / t_verify_us / t_other_us: the generation loop split into
            drafting, target decodes, verification (sampling, logprobs) and the rest.
        t_generate_us: wall time of the generation loop (first step to last).
        t_total_us: whole request, tokenisation and prefill included.
        lossy: True when the request ran the LOSSY acceptance thresholds (a threshold < 1 at
            temperature > 0, with a drafter): the output is not exactly the target's
            distribution. False for every lossless generation.
        accept_threshold_single / accept_threshold_acc: the thresholds it ran with (1.0 =
            lossless).
    """

    drafter: str = "none"
    seed: int | None = None
    n_prompt_tokens: int = 0
    n_cached_tokens: int = 0
    n_generated_tokens: int = 0
    n_steps: int = 0
    n_step_tokens: int = 0
    n_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    n_redecoded_tokens: int = 0
    drafted_per_depth: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)
    token_sources: dict[str, int] = field(default_factory=dict)
    t_prefill_us: float = 0.0
    t_draft_us: float = 0.0
    t_decode_us: float = 0.0
    t_verify_us: float = 0.0
    t_other_us: float = 0.0
    t_generate_us: float = 0.0
    t_total_us: float = 0.0
    lossy: bool = False
    accept_threshold_single: float = 1.0
    accept_threshold_acc: float = 1.0

    def set_thresholds(self, params, *, drafted: bool) -> None:
        """Record a request's acceptance thresholds (``SamplingParams``); ``lossy`` when they are
        in effect (``params.lossy``) and a drafter proposed the trees."""
        self.accept_threshold_single, self.accept_threshold_acc = (float(x) for x in params.acceptance_thresholds)
        self.lossy = bool(params.lossy and drafted)

    @property
    def lossy_label(self) -> str:
        """``"LOSSY (accept thresholds: single S, acc A)"`` for a lossy generation, else ``""``."""
        if not self.lossy:
            return ""
        return f"LOSSY (accept thresholds: single {self.accept_threshold_single:g}, acc {self.accept_threshold_acc:g})"

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per step, bonus/recovered token included (``n_step_tokens /
        n_steps``; >= 1 whenever a step ran, 0.0 when none did)."""
        return self.n_step_tokens / self.n_steps if self.n_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_per_depth(self) -> list[float]:
        """P(accepted at depth d | drafted to depth d), d = 1, 2, ..."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_depth, self.drafted_per_depth)]

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: generated tokens / generation-loop time (prefill excluded)."""
        return self.n_generated_tokens / (self.t_generate_us * 1e-6) if self.t_generate_us > 0 else 0.0

    @property
    def end_to_end_tokens_per_s(self) -> float:
        return self.n_generated_tokens / (self.t_total_us * 1e-6) if self.t_total_us > 0 else 0.0

    @property
    def t_host_us(self) -> float:
        """Everything in the generation loop except target decodes."""
        return self.t_draft_us + self.t_verify_us + self.t_other_us

    def finalise(self, sources, depths, step_drafted, *, t_gen0_us: float, t_end_us: float, t_start_us: float) -> None:
        """Fill the per-request totals at the end of a generation.

        Args:
            sources: ``TokenSource`` of each emitted token (after any stop cut).
            depths: depth of each emitted token (0 unless an accepted draft).
            step_drafted: the depth of each step's verified tree.
            t_gen0_us / t_end_us / t_start_us: first step, end, arrival (µs; ``t_gen0_us``
                0 when no step ran).
        """
        self.n_generated_tokens = len(sources)
        self.token_sources = count_sources(sources)
        self.num_accepted_tokens = sum(1 for s in sources if TokenSource(s).is_draft)
        max_d = max(step_drafted, default=0)
        self.drafted_per_depth = [sum(1 for m in step_drafted if m >= d) for d in range(1, max_d + 1)]
        self.accepted_per_depth = [sum(1 for x in depths if x == d) for d in range(1, max_d + 1)]
        self.t_generate_us = t_end_us - t_gen0_us if t_gen0_us and (sources or self.n_steps) else 0.0
        self.t_total_us = t_end_us - t_start_us

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            mean_acceptance_length=self.mean_acceptance_length,
            acceptance_rate=self.acceptance_rate,
            acceptance_per_depth=self.acceptance_per_depth,
            tokens_per_s=self.tokens_per_s,
            end_to_end_tokens_per_s=self.end_to_end_tokens_per_s,
            t_host_us=self.t_host_us,
            t_host_us_per_step=self.t_host_us / self.n_steps if self.n_steps else 0.0,
            t_decode_us_per_step=self.t_decode_us / self.n_steps if self.n_steps else 0.0,
        )
        return d


# Below this share of decode steps saved by accepted drafts, a speed ratio measures the
# machine's noise, not speculation: the drafts could make at most 1 / (1 - 0.05) = 1.05x of the
# steps' time, within the spread of repeated runs (``generate --compare`` on a quiet machine
# measured 0.96-0.99x for a prompt with no speculation gain).
MIN_STEPS_SAVED = 0.05


def no_speedup_reason(*stats: GenerationStats) -> str | None:
    """Why the speculative generations ``stats`` cannot show a speed-up, or None when they can.

    The accepted drafts saved ``n_step_tokens - n_steps`` decode steps of ``n_step_tokens``
    (summed over ``stats``); below ``MIN_STEPS_SAVED`` of them no ratio of speeds means
    anything. Returns ``"nothing was drafted"`` or ``"A of D drafted tokens accepted"``.
    """
    drafted = sum(s.num_draft_tokens for s in stats)
    if drafted == 0:
        return "nothing was drafted"
    saved = sum(s.n_step_tokens - s.n_steps for s in stats)
    produced = sum(s.n_step_tokens for s in stats)
    if produced and saved / produced >= MIN_STEPS_SAVED:
        return None
    return f"{sum(s.num_accepted_tokens for s in stats)} of {drafted} drafted tokens accepted"


def count_sources(sources) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in sources:
        name = TokenSource(s).name.lower()
        out[name] = out.get(name, 0) + 1
    return out
