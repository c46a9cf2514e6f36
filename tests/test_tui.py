"""The chat app driven headless with Textual's Pilot, on the real default model.

Answers are short (max_tokens 16) and greedy, so the whole module runs in seconds.
"""

import time

import pytest

pytest.importorskip("textual")

from conftest import fixed_cost_model, frozen_cost_model  # noqa: E402
from textual.widgets import Input, OptionList  # noqa: E402

from localspec import Engine, SamplingParams  # noqa: E402
from localspec.drafters import drafter_names  # noqa: E402
from localspec.tree import TokenSource  # noqa: E402
from localspec.tui import ChatApp  # noqa: E402
from localspec.tui.chat_format import display_text  # noqa: E402
from localspec.tui.messages import AnswerView, Notice, UserMessage  # noqa: E402
from localspec.tui.prompt_input import PromptInput  # noqa: E402
from localspec.tui.provenance import LABELS, source_style  # noqa: E402
from localspec.tui.screens import DrafterScreen, SamplingScreen  # noqa: E402

SIZE = (100, 30)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def chat_engine(model):
    e = Engine(model, drafter="ngram", n_ctx=2048, cost_model=frozen_cost_model())
    yield e
    e.close()


@pytest.fixture(scope="module")
def long_sampling(model):
    """Greedy, with every token that holds a newline and every end-of-generation token
    banned: the base model then writes on until max_tokens (for stopping half way)."""
    banned = {t: float("-inf") for t in range(model.n_vocab) if b"\n" in model.token_bytes(t)}
    banned.update({t: float("-inf") for t in model.eog_ids})
    return SamplingParams.greedy(logit_bias=banned)


async def wait_until(pilot, cond, timeout_s=600.0):  # a hang guard, not a speed limit
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "timed out waiting for the app"
        await pilot.pause(0.02)


async def send(pilot, text, *, wait=True):
    app = pilot.app
    app.query_one("#prompt", PromptInput).value = text
    await pilot.press("enter")
    if wait:
        await wait_until(pilot, lambda: app.state == "idle")
        await pilot.pause()


async def choose_drafter(pilot, name):
    app = pilot.app
    await pilot.press("ctrl+d")
    await wait_until(pilot, lambda: isinstance(app.screen, DrafterScreen))
    app.screen.query_one(OptionList).highlighted = drafter_names().index(name)
    await pilot.press("enter")
    await wait_until(pilot, lambda: app.state == "idle" and not isinstance(app.screen, DrafterScreen))
    await pilot.pause()


def notices(app, kind=None):
    return [n.text for n in app.query(Notice) if kind is None or n.kind == kind]


@pytest.mark.anyio
async def test_two_turns_stop_half_way_switch_drafter(chat_engine, long_sampling, tmp_path):
    """Send a turn, switch drafter, stop a long answer half way, send another turn: the
    transcript, the statistics and the KV reuse stay consistent."""
    chat_engine.reset()
    app = ChatApp(engine=chat_engine, sampling=SamplingParams.greedy(), max_tokens=16)
    async with app.run_test(size=SIZE) as pilot:
        assert any("no chat template" in t for t in notices(app, "warning"))

        # -- turn 1: n-gram drafter ------------------------------------------------------------
        await send(pilot, "What is the capital of France?")
        r1 = app.session.turns[-1]
        assert r1.drafter == "ngram" and 0 < r1.stats.n_generated_tokens <= 16
        answers = list(app.query(AnswerView))
        assert len(answers) == 1 and answers[0].record is r1
        assert answers[0].text == r1.answer  # streamed chunks spell the final text
        assert "tok/s" in str(app.query_one("#status").render())

        # -- switch drafter between turns --------------------------------------------------------
        await choose_drafter(pilot, "none")
        assert chat_engine.drafter_name == "none" and app.drafter_choice == "none"
        assert any("Drafter: none" in t for t in notices(app))

        # -- turn 2: long answer, stopped half way with esc --------------------------------------
        app.session.sampling, app.session.max_tokens = long_sampling, 400
        await send(pilot, "Tell me a long story about a lighthouse keeper.", wait=False)
        await wait_until(pilot, lambda: app._live is not None and app._live.n_tokens >= 3)
        await pilot.press("escape")
        await wait_until(pilot, lambda: app.state == "idle")
        await pilot.pause()
        r2 = app.session.turns[-1]
        assert r2.finish_reason == "cancelled" and r2.stopped
        assert 3 <= r2.stats.n_generated_tokens < 400
        assert r2.drafter == "none" and r2.stats.n_spec_steps == 0
        assert set(r2.stats.token_sources) <= {"decode"}
        # the KV cache of turn 1 survived the drafter switch: only the new text was prefilled
        assert r2.stats.n_cached_tokens >= r1.stats.n_prompt_tokens + len(r1.token_ids) - 1
        assert list(app.query(AnswerView))[-1].text == r2.answer
        assert "stopped" in str(list(app.query(AnswerView))[-1].render())
        # with the drafter off the answer *is* plain decoding: no "≈0.38× plain" from
        # dividing its rate by an estimate measured at another moment
        assert app._panel_state().vs_plain(r2.stats.tokens_per_s) is None
        assert "plain" not in str(app.query_one("#status").render())

        # -- turn 3: back to n-gram; the stopped answer is part of the conversation --------------
        await choose_drafter(pilot, "ngram")
        app.session.sampling, app.session.max_tokens = SamplingParams.greedy(), 16
        await send(pilot, "Thank you.")
        r3 = app.session.turns[-1]
        assert r3.drafter == "ngram" and r3.finish_reason in ("stop", "length")
        assert r3.stats.n_cached_tokens >= r2.stats.n_prompt_tokens + len(r2.token_ids) - 1
        # a speculative turn: the estimate when its drafts saved steps, else why there is none
        # (this short answer accepts nothing here; test_tui_stats.py checks each case)
        state = app._panel_state()
        want = "× plain" if state.no_speedup is None else state.no_speedup
        assert want in str(app.query_one("#status").render())

        # -- transcript and statistics -----------------------------------------------------------
        assert [m.role for m in app.session.messages] == ["user", "assistant"] * 3
        assert [m.text for m in app.query(UserMessage)] == [t.user for t in app.session.turns]
        md = app.session.to_markdown()
        assert md.count("## User") == 3 and md.count("## Assistant") == 3 and "finish cancelled" in md
        assert display_text(r2.answer)[:40] in md
        state = app._panel_state()
        assert state.stats is r3.stats and state.n_context == app.session.n_context_tokens > 0
        assert state.plain_tokens_per_s == pytest.approx(chat_engine.plain_tokens_per_s())
        # the tokens/s chart has one point per answer, the figure of the answer's own line
        rates = [t.stats.tokens_per_s for t in app.session.turns]
        assert list(app.rates) == rates
        panel = app.query_one("#stats")
        assert list(panel.sparkline.data) == rates
        lines = [str(a.render()) for a in app.query(AnswerView)]
        assert all(f"{r:.1f} tokens/s" in line for r, line in zip(rates, lines, strict=True))
        assert str(panel.chart_range.render()) == f"{min(rates):.1f}–{max(rates):.1f} · last {rates[-1]:.1f}"
        saved = app.save_transcript(str(tmp_path / "chat.md"))
        assert saved is not None and saved.read_text() .count("## User") == 3
        await pilot.press("ctrl+g")
        assert app.clipboard == app.session.last_answer == display_text(r3.answer)


@pytest.mark.anyio
async def test_errors_are_shown_and_keep_the_conversation(model, long_sampling, tmp_path):
    """A missing model, a message that does not fit, a context that fills up, and a bad
    grammar: each is a message in the app; nothing typed or said is lost."""
    app = ChatApp(model=str(tmp_path / "missing.gguf"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state == "idle" and any("not found" in t for t in notices(app, "error")))
        await send(pilot, "hello")
        assert any("no model is loaded" in t for t in notices(app, "error"))
        assert app.query_one("#prompt", PromptInput).value == "hello"

    small = Engine(model, drafter="ngram", n_ctx=256, cost_model=frozen_cost_model())
    try:
        app = ChatApp(engine=small, sampling=long_sampling, max_tokens=200)
        async with app.run_test(size=SIZE) as pilot:
            await send(pilot, "word " * 300)
            assert any("new chat" in t for t in notices(app, "error"))
            assert app.query_one("#prompt", PromptInput).value.strip() == ("word " * 300).strip()
            assert app.session.messages == [] and not app.query(UserMessage)

            await send(pilot, "Repeat: " + "tick tock " * 64)  # 215 tokens: fits, the answer fills the rest
            rec = app.session.turns[-1]
            assert rec.finish_reason == "length" and rec.stats.n_generated_tokens < 200
            assert any("context is full" in t for t in notices(app, "warning"))

            await pilot.press("ctrl+n")
            assert app.session.messages == []
            await pilot.press("ctrl+t")
            await wait_until(pilot, lambda: isinstance(app.screen, SamplingScreen))
            app.screen.query_one("#grammar", Input).value = "root ::= ("
            await pilot.press("enter")
            await wait_until(pilot, lambda: "grammar" in str(app.screen.query_one("#error").render()).lower())
            assert isinstance(app.screen, SamplingScreen)  # the dialog stays open with the error
            app.screen.query_one("#grammar", Input).value = 'root ::= "yes" | "no"'
            app.screen.query_one("#max_tokens", Input).value = "4"
            await pilot.press("enter")
            await wait_until(pilot, lambda: not isinstance(app.screen, SamplingScreen))
            assert app.session.sampling.grammar and app.session.max_tokens == 4
            # the grammar ends after "yes"/"no" but end-of-generation tokens are still banned
            # (logit bias of long_sampling): the step fails; the partial answer stays
            await send(pilot, "Is the sky blue?")
            rec = app.session.turns[-1]
            assert rec.answer in ("yes", "no") and rec.finish_reason == "error"
            assert any("Generation failed" in t and "grammar" in t for t in notices(app, "error"))
            await send(pilot, "And the grass?")  # the session goes on
            assert len(app.session.turns) == 2
    finally:
        small.close()


@pytest.mark.anyio
async def test_model_chat_template_is_used(chat_template_engine):
    """A GGUF with a chat template: the app says so and answers end at <end_of_turn>."""
    e = chat_template_engine
    e.reset()
    app = ChatApp(engine=e, sampling=SamplingParams.greedy(), max_tokens=16)
    async with app.run_test(size=SIZE) as pilot:
        assert any("own chat template" in t for t in notices(app))
        assert "chat template" in app.sub_title
        await send(pilot, "Say hello.")
        rec = app.session.turns[-1]
        assert rec.finish_reason in ("stop", "length") and "<end_of_turn>" not in rec.answer
        assert app.session.builder.tokens[:1] == [e.model.bos]


@pytest.mark.anyio
async def test_every_action_is_in_the_palette_and_the_footer(chat_engine):
    app = ChatApp(engine=chat_engine, sampling=SamplingParams.greedy())
    async with app.run_test(size=(80, 24)) as pilot:
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for t in ("Stop generating", "Drafter…", "Sampling settings…", "Toggle provenance colours",
                  "Toggle statistics panel", "Load a model…", "Save transcript…", "Copy last answer",
                  "New chat"):  # fmt: skip
            assert t in titles
        for name in drafter_names():
            assert f"Drafter: {name}" in titles
        shown = {b.action for b in app.BINDINGS if b.show}
        assert shown >= {"stop", "drafter", "sampling", "toggle_colour", "toggle_stats", "load_model", "save",
                         "copy_answer", "new_chat"}  # fmt: skip
        assert not app.show_stats  # 80 columns: the panel starts hidden, ctrl+b shows it
        await pilot.press("ctrl+b")
        assert app.show_stats
        await pilot.press("ctrl+l")
        assert not app.colour and not app.query_one("#legend").display


def test_every_token_source_has_a_label_and_a_style():
    for dark in (True, False):
        colours = [source_style(s, dark=dark).color for s in TokenSource if s != TokenSource.DECODE]
        assert len(set(colours)) == len(colours) and None not in colours
    for s in TokenSource:
        assert LABELS[s] and source_style(s, no_color=True).color is None
    assert all(source_style(s, no_color=True) for s in TokenSource if s != TokenSource.DECODE)


def test_cli_chat_has_the_generate_flags(capsys):
    from localspec.cli.main import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["chat", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--drafter", "--temperature", "--top-k", "--seed", "--grammar", "--n-ctx",
                 "--max-tokens", "--system", "--transcript"):  # fmt: skip
        assert flag in out


def test_cli_chat_without_a_terminal_is_a_one_line_error(tmp_path):
    # `localspec chat < questions.txt > answers.txt` ran the full-screen app anyway: escape codes
    # into the file, SIGINT ignored, until killed
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "localspec", "chat", "-m", str(tmp_path / "never-loaded.gguf")],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == ("localspec: error: localspec chat needs a terminal (its standard input and output); "
                        "for scripts use localspec generate, batch or serve\n")  # fmt: skip


def run_in_a_terminal(*args: str, timeout: float = 120) -> tuple[int, str]:
    """``localspec ARGS`` with a pseudo-terminal as its standard streams: (exit status, output)."""
    import os
    import pty
    import subprocess
    import sys
    import time

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "localspec", *args], stdin=slave, stdout=slave, stderr=slave,
                            close_fds=True)  # fmt: skip
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return proc.returncode, out.decode("utf-8", "replace").replace("\r\n", "\n")


@pytest.mark.parametrize("flags, says", [
    (["--draft-shape", "0,0,0"], "localspec: error: --draft-shape 0,0,0: depth 0, width 0, nodes 0; each must be at least 1 (e.g. 6,1,7)"),
    (["--draft-memory-mib", "0"], "localspec: error: --draft-memory-mib must be a finite number > 0, got 0.0"),
    (["--n-ctx", "8"], "localspec: error: n_ctx must be a whole number of at least 16, got 8"),
    (["--max-tree-nodes", "0"], "localspec: error: max_tree_nodes must be a whole number of at least 1, got 0"),
    (["-n", "0"], "argument -n/--max-tokens: must be >= 1, got 0"),
])  # fmt: skip
def test_cli_chat_refuses_a_bad_flag_in_one_line_before_its_app_starts(flags, says):
    """In a terminal, these flags were checked only when the app loaded its engine: a Textual
    worker's traceback ending in the SystemExit, an error screen inviting ctrl+o with the same
    flags, or (``-n 0``) every answer empty (a new user's report)."""
    status, out = run_in_a_terminal("chat", *flags)
    lines = out.strip().splitlines()
    assert lines[-1].endswith(says) and "Traceback" not in out, out
    assert (status, len(lines)) == (1, 1) if says.startswith("localspec: error:") else status == 2, out  # argparse: usage first


@pytest.mark.anyio
async def test_multiline_message_and_theme_switch():
    """ctrl+j adds a line, enter sends the whole message; a light theme redraws the colours."""
    from tui_fakes import FakeClock, FakeEngine

    app = ChatApp(engine=FakeEngine(), clock=FakeClock())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("a", "ctrl+j", "b")
        assert app.query_one("#prompt", PromptInput).value == "a\nb"
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.state == "idle" and app.session.turns)
        assert app.session.turns[-1].user == "a\nb" and app.query_one("#prompt", PromptInput).value == ""
        app.theme = "textual-light"
        await wait_until(pilot, lambda: not list(app.query(AnswerView))[-1].dark)
        assert not app.dark


@pytest.mark.anyio
async def test_a_paste_loses_terminal_escapes_and_control_characters():
    """Text copied from a terminal (colour codes) or with a BEL in it went to the model and into
    the saved transcript as it was (a new user's report); tabs and new lines stay."""
    from textual import events
    from tui_fakes import FakeClock, FakeEngine

    from localspec.tui.prompt_input import clean_paste

    app = ChatApp(engine=FakeEngine(), clock=FakeClock())
    async with app.run_test(size=(80, 24)) as pilot:
        box = app.query_one("#prompt", PromptInput)
        box.focus()
        await pilot.pause()
        app.post_message(events.Paste("one \x1b[31mred\x1b[0m two\x07\r\n\tsecond\x00 line\rthird"))
        await wait_until(pilot, lambda: box.value != "")
        assert box.value == "one red two\n\tsecond line\nthird"
    # a window title (OSC), a reset (ESC c), a character set (ESC ( B), an 8-bit CSI, a link
    for text, kept in (("t\tab\x1b]0;title\x07z", "t\tabz"), ("e\x1bcf", "ef"), ("a\x1b(Bb", "ab"), ("c\x9b31mX", "cX"),
                       ("x\x1b]8;;http://a\x1b\\link\x1b]8;;\x1b\\y", "xlinky"), ("é中文😀", "é中文😀")):  # fmt: skip
        assert clean_paste(text) == kept, text


def test_native_stderr_is_kept_off_the_screen(capfd):
    """While the app runs, what C code writes to descriptor 2 goes to a file the app reads
    (for error messages); Python's stderr (where Textual draws) still reaches the terminal."""
    import os
    import sys

    from localspec.tui.stderr import NativeStderr

    with NativeStderr() as native:
        os.write(2, b"parse: error parsing grammar\n")
        print("drawn by textual", file=sys.__stderr__, flush=True)
        assert native.take() == "parse: error parsing grammar\n"
        assert native.take() == ""
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert "drawn by textual" in err and "after" in err and "parse:" not in err


@pytest.mark.anyio
async def test_load_a_model_by_path_keeps_the_conversation(chat_engine, chat_template_model_path, tmp_path):
    """ctrl+o: a bad path is refused in the dialog; a GGUF with a chat template is loaded in
    a worker, and the conversation goes on in that model's own format."""
    from localspec.tui.screens import PathScreen

    loaded = []

    def factory(path, drafter):
        e = Engine(path, drafter=drafter, n_ctx=1024, cost_model=frozen_cost_model())
        loaded.append(e)
        return e

    chat_engine.reset()
    app = ChatApp(engine=chat_engine, engine_factory=factory, sampling=SamplingParams.greedy(), max_tokens=8)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "Hello!")
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: isinstance(app.screen, PathScreen))
        app.screen.query_one(Input).value = str(tmp_path / "nope.gguf")
        await pilot.press("enter")
        await wait_until(pilot, lambda: "not found" in str(app.screen.query_one("#error").render()))
        assert isinstance(app.screen, PathScreen)
        app.screen.query_one(Input).value = str(chat_template_model_path)
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.state == "idle" and any("own chat template" in t for t in notices(app)))
        assert app.session.engine is not chat_engine and app.session.format.uses_template
        assert [m.role for m in app.session.messages] == ["user", "assistant"]
        await send(pilot, "And now?")
        assert len(app.session.turns) == 2 and app.session.turns[-1].finish_reason in ("stop", "length")
        assert app.session.builder.tokens[0] == loaded[0].model.bos
    assert loaded[0].ctx._ctx is None  # the app owned the engine it loaded and closed it at exit


@pytest.mark.anyio
async def test_switch_to_a_draft_model_asks_for_its_path(model, tmp_path):
    """Choosing the draft-model drafter without a path asks for the GGUF (a bad path stays in
    the dialog), switches without losing the conversation, and the next answer has tokens
    from the draft model; the path is remembered for the next switch."""
    from localspec.tui.screens import PathScreen

    e = Engine(model, drafter="ngram", n_ctx=1024, cost_model=frozen_cost_model())
    app = ChatApp(engine=e, sampling=SamplingParams.greedy(), max_tokens=24)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await send(pilot, "Count: one, two, three")
            await pilot.press("ctrl+d")
            await wait_until(pilot, lambda: isinstance(app.screen, DrafterScreen))
            app.screen.query_one(OptionList).highlighted = drafter_names().index("draft")
            await pilot.press("enter")
            await wait_until(pilot, lambda: isinstance(app.screen, PathScreen))
            app.screen.query_one(Input).value = str(tmp_path / "missing.gguf")
            await pilot.press("enter")
            await wait_until(pilot, lambda: "not found" in str(app.screen.query_one("#error").render()))
            assert isinstance(app.screen, PathScreen)
            app.screen.query_one(Input).value = str(model.path)  # the target as its own draft
            await pilot.press("enter")
            await wait_until(pilot, lambda: app.state == "idle" and e.drafter_name == "draft")
            await pilot.pause()
            assert app.drafter_choice == "draft" and app.drafter_options["draft"]["draft_model"] == str(model.path)
            await send(pilot, "Again: one, two, three")
            rec = app.session.turns[-1]
            assert rec.drafter == "draft" and rec.stats.token_sources.get("draft_model", 0) > 0
            assert [m.role for m in app.session.messages] == ["user", "assistant"] * 2
            await choose_drafter(pilot, "none")
            await choose_drafter(pilot, "draft")  # no dialog the second time
            assert e.drafter_name == "draft"
    finally:
        e.close()


@pytest.mark.anyio
async def test_a_draft_model_that_fails_to_load_is_forgotten_and_asked_for_again(model, random_head_path):
    """A file that passes the dialog's check (a GGUF) but cannot be a draft model (an EAGLE-3
    head): the switch fails, the app says so, and choosing the drafter again asks again."""
    from localspec.tui.screens import PathScreen

    e = Engine(model, drafter="ngram", n_ctx=1024, cost_model=frozen_cost_model())
    app = ChatApp(engine=e, sampling=SamplingParams.greedy(), max_tokens=4)
    try:
        async with app.run_test(size=SIZE) as pilot:
            for attempt in range(2):
                await pilot.press("ctrl+d")
                await wait_until(pilot, lambda: isinstance(app.screen, DrafterScreen))
                app.screen.query_one(OptionList).highlighted = drafter_names().index("draft")
                await pilot.press("enter")
                await wait_until(pilot, lambda: isinstance(app.screen, PathScreen))  # asked, both times
                app.screen.query_one(Input).value = str(random_head_path)
                await pilot.press("enter")
                await wait_until(pilot, lambda n=attempt + 1: len(notices(app, "error")) == n and app.state == "idle")
                assert "Could not switch to drafter draft" in notices(app, "error")[-1]
                assert "forgotten" in notices(app, "error")[-1]
                assert e.drafter_name == "ngram" and "draft_model" not in app.drafter_options.get("draft", {})
    finally:
        e.close()


@pytest.mark.anyio
async def test_switching_to_and_from_eagle3_says_what_happens_to_the_kv_cache(model, random_head_path):
    """The EAGLE-3 feature tap needs a new target context: the app must not claim the KV
    cache is kept (the next answer does prefill the whole conversation); other switches keep it."""
    e = Engine(model, drafter="ngram", n_ctx=1024, cost_model=frozen_cost_model())
    app = ChatApp(engine=e, sampling=SamplingParams.greedy(), max_tokens=4,
                  drafter_options={"eagle3": {"eagle": str(random_head_path)}})  # fmt: skip
    try:
        async with app.run_test(size=SIZE) as pilot:
            await send(pilot, "Hello there.")
            await choose_drafter(pilot, "eagle3")
            assert e.drafter_name == "eagle3"
            said = notices(app)[-1]
            assert "not its KV cache" in said and "KV cache are kept" not in said
            assert "eagle3 reads the target's layer features (EAGLE-3 feature tap)" in said
            await send(pilot, "And again.")
            r = app.session.turns[-1]
            assert r.drafter == "eagle3" and r.stats.n_cached_tokens == 0  # as said: prefilled again
            await choose_drafter(pilot, "medusa")  # the shipped heads read the final-norm rows
            said = notices(app)[-1]
            assert "not its KV cache" in said and "medusa reads the target's final-norm rows" in said
            assert "EAGLE" not in said
            await choose_drafter(pilot, "none")  # the tap goes: a new context again
            said = notices(app)[-1]
            assert "not its KV cache" in said and "captured the target's final-norm rows is replaced" in said
            await send(pilot, "Once more.")
            await choose_drafter(pilot, "ngram")  # no tap either way: the cache is kept
            assert "the conversation and its KV cache are kept" in notices(app)[-1]
            before = app.session.turns[-1]
            await send(pilot, "Last one.")
            r = app.session.turns[-1]
            assert r.stats.n_cached_tokens >= before.stats.n_prompt_tokens + len(before.token_ids) - 1
    finally:
        e.close()


@pytest.mark.anyio
async def test_an_answer_with_nothing_drafted_shows_no_speed_against_plain(chat_engine):
    """One token: the step has no budget for drafts, so the answer ran as plain decoding and
    its rate over the plain estimate (measured at another moment) would be no speed-up."""
    chat_engine.reset()
    app = ChatApp(engine=chat_engine, sampling=SamplingParams.greedy(), max_tokens=1)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "Hello there, hello there, hello there, hello")
        r = app.session.turns[-1]
        assert r.drafter == "ngram" and r.stats.n_generated_tokens == 1 and r.stats.num_draft_tokens == 0
        status = str(app.query_one("#status").render())
        assert "no drafts" in status and "×" not in status
        assert app._panel_state().vs_plain(r.stats.tokens_per_s) is None


@pytest.mark.anyio
async def test_a_cost_table_measured_under_contention_is_a_warning():
    """An engine whose cost table was measured under contention: the app says so once, as a
    warning (what ``localspec`` commands print on stderr); a quiet table says nothing."""
    from tui_fakes import FakeClock, FakeEngine

    from localspec.costmodel import CostModel

    for contended in ("the process got 45% of its CPUs' time during the timed decodes", None):
        engine = FakeEngine()
        engine.cost_model = CostModel(dict(fixed_cost_model().table_us), contended=contended)
        app = ChatApp(engine=engine, clock=FakeClock())
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_until(pilot, lambda: app.session.engine is not None and app.state == "idle")
            await pilot.pause()
            said = [t for t in notices(app, "warning") if "cost table" in str(t)]
            if contended:
                assert len(said) == 1 and "45%" in str(said[0]) and "not cached" in str(said[0])
            else:
                assert said == []
