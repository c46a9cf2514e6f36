"""Snapshot tests (SVG) of the chat app's main layouts, with a scripted engine so that text,
statistics and timings are the same on every run.

Nothing in a snapshot may depend on how fast the machine runs: the scripted engine's clock
advances by a fixed pattern per call (frozen tokens/s and times), text cursors do not blink
(a blinking cursor is drawn or not depending on when the screenshot is taken, which made
five snapshots fail on a loaded machine), and the tests wait on conditions, not on pauses.

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


async def wait_until(pilot, cond, what: str, timeout_s: float = 120.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"timed out waiting for {what}"
        await pilot.pause(0.01)


def steady_cursors(app) -> None:
    """Cursors that do not blink, in every text box of the current screen."""
    for w in app.screen.query("Input, TextArea"):
        w.cursor_blink = False


async def two_turns(pilot) -> None:
    app = pilot.app
    await wait_until(pilot, lambda: app.session.engine is not None and app.state == "idle", "the engine")
    steady_cursors(app)
    for text in ("Count to four, please.", "What do the colours mean?"):
        n = len(app.session.turns)
        app.query_one("#prompt").value = text
        await pilot.press("enter")
        await wait_until(
            pilot,
            lambda n=n: len(app.session.turns) == n + 1 and app.state == "idle" and not app.session.generating,
            "the scripted answer",
        )
    await pilot.pause()  # let the last messages be processed (waits for the app, not for a time)


def open_dialog(key: str, screen_name: str):
    async def run(pilot) -> None:
        app = pilot.app
        await wait_until(pilot, lambda: app.session.engine is not None and app.state == "idle", "the engine")
        await pilot.press(key)
        await wait_until(pilot, lambda: type(app.screen).__name__ == screen_name, screen_name)
        await pilot.pause()
        steady_cursors(app)

    return run


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
    assert snap_compare(make_app(), terminal_size=NARROW, run_before=open_dialog("ctrl+t", "SamplingScreen"))


def test_drafter_dialog(snap_compare):
    assert snap_compare(make_app(), terminal_size=NARROW, run_before=open_dialog("ctrl+d", "DrafterScreen"))


def test_no_color(snap_compare, monkeypatch):
    """NO_COLOR: monochrome; provenance shown by underline / italic / bold."""
    monkeypatch.setenv("NO_COLOR", "1")
    assert snap_compare(make_app(), terminal_size=WIDE, run_before=two_turns)
