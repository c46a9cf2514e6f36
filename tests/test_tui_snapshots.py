"""Snapshot tests (SVG) of the chat app's main layouts, with a scripted engine so that text,
statistics and timings are the same on every run.

Update the committed snapshots after an intended change of the layout with
``pytest tests/test_tui_snapshots.py --snapshot-update`` and look at them
(tests/__snapshots__/test_tui_snapshots/*.svg).
"""

import time

import pytest

pytest.importorskip("textual")
pytest.importorskip("pytest_textual_snapshot")

from tui_fakes import FakeClock, FakeEngine  # noqa: E402

from localspec.sampling import SamplingParams  # noqa: E402
from localspec.tui import ChatApp  # noqa: E402

NARROW, WIDE = (80, 24), (120, 36)


def make_app(**kw) -> ChatApp:
    return ChatApp(engine=FakeEngine(), sampling=SamplingParams.greedy(), max_tokens=16, clock=FakeClock(), **kw)


async def two_turns(pilot) -> None:
    app = pilot.app
    for text in ("Count to four, please.", "What do the colours mean?"):
        app.query_one("#prompt").value = text
        await pilot.press("enter")
        t0 = time.monotonic()
        while app.state != "idle" or app.session.generating:
            assert time.monotonic() - t0 < 60, "the scripted answer did not finish"
            await pilot.pause(0.01)
    await pilot.pause()


def test_chat_80x24(snap_compare):
    """Two turns at 80x24: the statistics panel is hidden, the status line summarises."""
    assert snap_compare(make_app(), terminal_size=NARROW, run_before=two_turns)


def test_chat_wide_with_stats(snap_compare):
    """Two turns at 120x36: statistics panel with acceptance by depth, time split, chart."""
    assert snap_compare(make_app(), terminal_size=WIDE, run_before=two_turns)


def test_stats_panel_toggled_at_80x24(snap_compare):
    assert snap_compare(make_app(), terminal_size=NARROW, run_before=two_turns, press=["ctrl+b"])


def test_colours_off(snap_compare):
    assert snap_compare(make_app(), terminal_size=NARROW, run_before=two_turns, press=["ctrl+l"])


def test_sampling_dialog_80x24(snap_compare):
    assert snap_compare(make_app(), terminal_size=NARROW, press=["ctrl+t"])


def test_drafter_dialog(snap_compare):
    assert snap_compare(make_app(), terminal_size=NARROW, press=["ctrl+d"])


def test_no_color(snap_compare, monkeypatch):
    """NO_COLOR: monochrome; provenance shown by underline / italic / bold."""
    monkeypatch.setenv("NO_COLOR", "1")
    assert snap_compare(make_app(), terminal_size=WIDE, run_before=two_turns)
