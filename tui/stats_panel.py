"""The statistics panel: how speculation is doing, live and for the last answer.

Shows tokens/s, the speed against plain decoding (estimated from the engine's measured
decode cost, ``Engine.plain_tokens_per_s()``), the mean acceptance length (bonus included),
accepted / drafted tokens, acceptance by depth, the tokens by source, the time split of the
generation loop (draft / verify / other), the prompt and context use, and a chart of the
answers' tokens/s. A turn that ran the opt-in LOSSY acceptance thresholds says so
under its acceptance figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Sparkline, Static

from localspec.stats import MIN_STEPS_SAVED, GenerationStats, no_speedup_reason
from localspec.tree import TokenSource

from .live_stats import LiveTurn
from .provenance import LABELS, source_style

BAR_WIDTH = 8
MAX_DEPTHS = 5


@dataclass
class PanelState:
    """Everything the panel draws. ``stats`` (exact, after a turn) wins over ``live``."""

    drafter: str = "none"
    stats: GenerationStats | None = None
    live: LiveTurn | None = None
    plain_tokens_per_s: float = 0.0
    n_context: int = 0
    n_ctx: int = 0
    dark: bool = True
    no_color: bool = False
    lossy: str = ""  # the LOSSY label of the turn being generated ("" = lossless); a finished turn's is in stats

    @property
    def lossy_label(self) -> str:
        """``"LOSSY (accept thresholds: ...)"`` when the turn shown ran the lossy thresholds."""
        return self.stats.lossy_label if self.stats is not None else (self.lossy if self.live is not None else "")

    @property
    def speculative(self) -> bool:
        """Whether the turn shown was drafted for (the last turn's drafter, else the current one)."""
        return (self.stats.drafter if self.stats is not None else self.drafter) != "none"

    @property
    def no_speedup(self) -> str | None:
        """Why the finished speculative turn shown has no speed against plain decoding to show:
        ``"no drafts"`` (nothing was drafted: the turn ran as plain decoding) or ``"too few
        accepted"`` (the drafts saved under ``MIN_STEPS_SAVED`` of the steps, the rule of
        ``stats.no_speedup_reason``); None otherwise, and while a turn streams."""
        if not self.speculative or self.stats is None:
            return None
        if self.stats.num_draft_tokens == 0:
            return "no drafts"
        return "too few accepted" if no_speedup_reason(self.stats) else None

    def vs_plain(self, tokens_per_s: float) -> float | None:
        """``tokens_per_s`` over the engine's plain-decoding estimate, for a speculative turn
        whose drafts saved steps (for a finished turn ``no_speedup`` is None; while a turn
        streams, its accepted drafts so far saved ``MIN_STEPS_SAVED`` of its steps).

        None with the drafter off: that turn *is* plain decoding, and dividing its end-to-end
        rate by an estimate measured at another moment (and load) would only show the
        difference between the two moments (it read "≈0.38× plain"); None too for a turn in
        which nothing, or almost nothing, was accepted, for the same reason (it read "≈0.36×
        (estimate)" for an answer with nothing drafted).
        """
        if not self.speculative or self.plain_tokens_per_s <= 0 or tokens_per_s <= 0:
            return None
        if self.stats is not None:
            if self.no_speedup is not None:
                return None
        elif self.live is None or not self.live.n_tokens:
            return None
        elif (self.live.n_tokens - self.live.n_steps) / self.live.n_tokens < MIN_STEPS_SAVED:
            return None
        return tokens_per_s / self.plain_tokens_per_s


def _bar(frac: float, width: int = BAR_WIDTH) -> str:
    frac = min(max(frac, 0.0), 1.0)
    full = round(frac * width)
    return "█" * full + "░" * (width - full)


def _num(x: float) -> str:
    """A rate with the digits that matter: 0.42, 8.5, 64."""
    return f"{x:.2f}" if x < 1 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _title(text: str) -> Text:
    return Text(text, style="bold")


def _grid() -> Table:
    t = Table.grid(padding=(0, 1))
    t.add_column(style="dim", no_wrap=True)
    t.add_column(no_wrap=True)
    return t


def render_panel(st: PanelState) -> RenderableType:
    """The panel's text (without the chart) for ``st``."""
    s, live = st.stats, st.live
    parts: list[RenderableType] = [_title("Speculation")]
    g = _grid()
    g.add_row("drafter", st.drafter)
    if s is None and live is None:
        g.add_row("tokens/s", "–")
        parts.append(g)
        parts.append(Text("Send a message to see how each token is produced.", style="dim"))
        return Group(*parts)
    if s is not None:
        tps, mal, acc, drafted = s.tokens_per_s, s.mean_acceptance_length, s.num_accepted_tokens, s.num_draft_tokens
        sources = {TokenSource[k.upper()]: v for k, v in s.token_sources.items()}
        label = ""
    else:
        assert live is not None
        tps, mal, acc, drafted = live.tokens_per_s, live.mean_acceptance_length, live.num_accepted_tokens, None
        sources = dict(live.sources)
        label = " (live)"
    g.add_row("tokens/s", f"{_num(tps)}{label}")
    ratio = st.vs_plain(tps)
    if ratio is not None:
        g.add_row("vs plain", f"≈{ratio:.2f}× (estimate)")
        g.add_row("plain", f"≈{_num(st.plain_tokens_per_s)} tokens/s")
    elif st.no_speedup is not None:
        g.add_row("vs plain", st.no_speedup)
    g.add_row("accept len", f"{mal:.2f} tokens/step")
    g.add_row("accepted", f"{acc}/{drafted} drafted" if drafted is not None else f"{acc}")
    parts.append(g)
    if st.lossy_label:  # opt-in lossy acceptance: say it where the acceptance is shown
        parts.append(Text(st.lossy_label + ": not exactly the model's distribution", style="bold red"))
    parts.append(_sources_bar(sources, st))
    if s is not None:
        parts.extend(_depths(s))
        parts.extend(_time_split(s))
        g2 = _grid()
        g2.add_row("prompt", f"{s.n_prompt_tokens} tok ({s.n_cached_tokens} cached)")
        g2.add_row("prefill", f"{s.t_prefill_us / 1e3:.0f} ms")
        parts.append(g2)
    if st.n_ctx:
        g3 = _grid()
        g3.add_row("context", f"{st.n_context}/{st.n_ctx} tok")
        parts.append(g3)
    return Group(*parts)


def _sources_bar(sources: dict[TokenSource, int], st: PanelState) -> RenderableType:
    """A bar split by token source, then the counts."""
    total = sum(sources.values())
    bar = Text()
    counts = Text()
    if total:
        width = 24
        for src in TokenSource:
            n = sources.get(src, 0)
            if not n:
                continue
            style = source_style(src, dark=st.dark, no_color=st.no_color)
            bar.append("█" * max(1, round(width * n / total)), style=style)
            if counts:
                counts.append(" ")
            counts.append(f"{LABELS[src]} {n}", style=style)
    return Group(bar, counts) if total else Text("")


def _depths(s: GenerationStats) -> list[RenderableType]:
    rates = s.acceptance_per_depth
    if not rates:
        return []
    g = _grid()
    for d, (r, n) in enumerate(zip(rates[:MAX_DEPTHS], s.drafted_per_depth[:MAX_DEPTHS], strict=True), start=1):
        g.add_row(f"depth {d}", f"{_bar(r)} {100 * r:3.0f}% of {n}")
    out: list[RenderableType] = [_title("Acceptance by depth"), g]
    if len(rates) > MAX_DEPTHS:
        out.append(Text(f"… {len(rates) - MAX_DEPTHS} deeper", style="dim"))
    return out


def _time_split(s: GenerationStats) -> list[RenderableType]:
    draft = s.t_draft_us
    verify = s.t_decode_us + s.t_verify_us  # target decode of the tree + acceptance
    other = s.t_other_us
    total = draft + verify + other
    if total <= 0:
        return []
    g = _grid()
    for name, t in (("draft", draft), ("verify", verify), ("other", other)):
        g.add_row(name, f"{_bar(t / total)} {100 * t / total:3.0f}% {t / 1e3:.0f} ms")
    return [_title("Time split"), g]


class StatsPanel(VerticalScroll):
    """The panel widget: ``show(state)`` redraws it; ``chart(points)`` the tokens/s chart."""

    DEFAULT_CSS = """
    StatsPanel { width: 34; padding: 0 1; border-left: vkey $foreground 20%; }
    StatsPanel > #stats-body { height: auto; }
    StatsPanel > #chart-title { height: 1; margin-top: 1; text-style: bold; }
    StatsPanel > Sparkline { height: 3; }
    StatsPanel > #chart-range { height: 1; color: $text-muted; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.body = Static(id="stats-body")
        self.sparkline = Sparkline([], id="rate-chart")
        self.chart_range = Static("", id="chart-range")

    def compose(self) -> ComposeResult:
        yield self.body
        yield Static("Tokens/s per answer", id="chart-title")
        yield self.sparkline
        yield self.chart_range

    def show(self, state: PanelState) -> None:
        self.body.update(render_panel(state))

    def chart(self, points) -> None:
        """Draw the answers' tokens/s, one point per answer: each is the ``tokens_per_s`` of its
        ``GenerationStats``, the figure of the answer's own line (the chart is scaled from
        its minimum to its maximum)."""
        data = list(points)
        self.sparkline.data = data
        self.chart_range.update(
            f"{min(data):.1f}–{max(data):.1f} · last {data[-1]:.1f}" if data else "no answers yet"
        )
