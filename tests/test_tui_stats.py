"""The chat's live statistics: pure functions of the streamed chunks and their times."""

import pytest

from localspec.engine import StreamChunk
from localspec.tree import TokenSource as S
from localspec.tui.live_stats import LiveTurn, RateSeries


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


def test_rate_series_windows_are_timed_and_never_span_turns():
    r = RateSeries(interval_s=0.5)
    for i in range(9):  # turn 1: first chunk opens the window, then 8 tokens 0.125 s apart
        r.add(1, 1.0 + 0.125 * i)
    r.end_turn(2.0)
    assert list(r.points) == pytest.approx([8.0, 8.0])  # 4 tokens per 0.5 s
    r.add(1, 50.0)
    for _ in range(9):  # a step's 9 tokens arriving together make no point of their own
        r.add(1, 50.0 + 1e-6)
    r.add(1, 50.5)
    assert list(r.points) == pytest.approx([8.0, 8.0, 20.0])
    r.end_turn(50.5)
    r.add(1, 100.0)  # turn 3 starts much later: the pause is not counted
    r.add(1, 100.2)
    r.end_turn(100.2)
    assert list(r.points) == pytest.approx([8.0, 8.0, 20.0, 5.0])
    r.clear()
    assert not r.points
