"""The chat's statistics: pure functions of the streamed chunks, their times and a turn's stats."""

import pytest

from localspec.engine import StreamChunk
from localspec.tree import TokenSource as S
from localspec.stats import GenerationStats
from localspec.tui.live_stats import LiveTurn
from localspec.tui.stats_panel import PanelState, render_panel


def test_live_turn_counts_tokens_steps_sources_and_excludes_the_first_step_from_the_rate():
    live = LiveTurn()
    chunks = [  # (chunk, arrival time in s): step 0 after prefill, then 2 steps of 3 tokens
        (StreamChunk("a", 10, S.DECODE, 0), 5.0),
        (StreamChunk("b", 11, S.NGRAM, 1), 5.1), (StreamChunk("c", 12, S.NGRAM, 1), 5.1),
        (StreamChunk("d", 13, S.BONUS, 1), 5.1),
        (StreamChunk("e", 14, S.NGRAM, 2), 5.2), (StreamChunk("f", 15, S.RECOVERED, 2), 5.2),
        (StreamChunk("", 16, S.DECODE, 2), 5.2),
        (StreamChunk("tail", -1, S.DECODE, 3), 5.3),  # held-back text: not a token
    ]  # fmt: skip
    for c, t in chunks:
        live.add(c, t)
    assert live.n_tokens == 7 and live.n_steps == 3
    assert live.mean_acceptance_length == pytest.approx(7 / 3)
    assert live.num_accepted_tokens == 3
    assert live.sources[S.NGRAM] == 3 and live.sources[S.BONUS] == 1
    assert live.tokens_per_s == pytest.approx(6 / 0.2)  # tokens after step 0 over 5.0 -> 5.2 s


def _text(renderable) -> str:
    from rich.console import Console

    console = Console(width=40, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_vs_plain_only_for_answers_whose_drafts_saved_steps():
    """An answer with nothing drafted ran as plain decoding: its rate over the plain estimate
    measured at another moment is no speed-up (it read "≈0.36× (estimate)"); nor is one in
    which almost nothing was accepted (stats.no_speedup_reason)."""

    def state(drafted, accepted, steps, drafter="ngram"):
        stats = GenerationStats(drafter=drafter, n_generated_tokens=20, n_step_tokens=20, n_steps=steps,
                                num_draft_tokens=drafted, num_accepted_tokens=accepted, t_generate_us=1e6)  # fmt: skip
        return PanelState(drafter=drafter, stats=stats, plain_tokens_per_s=50.0)

    none = state(0, 0, 20)
    assert none.vs_plain(20.0) is None and none.no_speedup == "no drafts"
    text = _text(render_panel(none))
    assert "no drafts" in text and "×" not in text and "estimate" not in text
    few = state(9, 0, 20)
    assert few.vs_plain(20.0) is None and few.no_speedup == "too few accepted"
    assert "too few accepted" in _text(render_panel(few))
    good = state(9, 8, 12)
    assert good.no_speedup is None and good.vs_plain(20.0) == pytest.approx(0.4)
    assert "≈0.40× (estimate)" in _text(render_panel(good))
    plain = state(0, 0, 20, drafter="none")  # the drafter off: no row at all
    assert plain.no_speedup is None and plain.vs_plain(20.0) is None and "vs plain" not in _text(render_panel(plain))
    live = LiveTurn()
    for i in range(20):  # 20 tokens in 20 steps so far: nothing saved, no ratio (nor a verdict yet)
        live.add(StreamChunk("a", 10, S.DECODE, i), 1.0 + 0.1 * i)
    streaming = PanelState(drafter="ngram", live=live, plain_tokens_per_s=50.0)
    assert streaming.vs_plain(10.0) is None and streaming.no_speedup is None
    for j in range(5):  # then a step of 4 accepted drafts and its bonus token: 25 tokens in 21 steps
        live.add(StreamChunk("b", 11, S.NGRAM if j < 4 else S.BONUS, 20), 3.0)
    assert streaming.vs_plain(10.0) == pytest.approx(0.2)
