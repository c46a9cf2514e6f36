"""``ChatApp``: the terminal chat, showing where every token came from.

Threads: the UI runs on Textual's event loop. Everything that may take long runs in a
thread worker - generating an answer (iterating a ``GenerationStream``), loading a model,
switching drafter - and reports back with a message (``post_message`` is thread-safe). At
most one such job runs at a time (``state`` says which); the engine is never used from two
threads at once. Esc cancels the stream (``GenerationStream.cancel`` is thread-safe): the
engine stops after the current step and the partial answer stays in the conversation.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.css.query import NoMatches
from textual.message import Message
from textual.reactive import reactive
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Header, Static

from localspec.drafters import drafter_names
from localspec.drafters.base import target_reads
from localspec.engine import Engine, GenerationResult, GenerationStream, StreamChunk
from localspec.errors import LocalSpecError
from localspec.sampling import SamplingParams

from .live_stats import LiveTurn
from .messages import AnswerView, Notice, UserMessage
from .prompt_input import PromptInput
from .provenance import legend
from .screens import DrafterScreen, PathScreen, SamplingChoice, SamplingScreen
from .session import ChatSession, TurnRecord
from .stderr import NativeStderr
from .stats_panel import PanelState, StatsPanel

EngineFactory = Callable[..., Engine]
"""``(model path or None for the default model, drafter name, **drafter options) -> Engine``
(options as ``Engine`` takes them: ``draft_model``, ``draft_n_ctx``, ``eagle``); may raise
``LocalSpecError`` (e.g. ``ModelLoadError``)."""

PATH_OPTION = {"draft": ("draft_model", "Draft model GGUF (it must share the target's tokenizer)"),
               "eagle3": ("eagle", "EAGLE-3 head GGUF trained for this model"),
               "medusa": ("medusa", "Medusa heads GGUF trained for this model")}  # fmt: skip
"""Drafters that need a file: the ``Engine`` option that names it, and the dialog's title."""

WIDE = 100  # columns from which the statistics panel is shown by default
DRAIN_HZ = 20  # how often streamed tokens are drawn


def default_engine_factory(path: str | None, drafter: str, **options) -> Engine:
    return Engine(path, drafter=drafter, **options)


# -- messages from the workers -------------------------------------------------------------------


class TurnEnded(Message):
    def __init__(self, turn: int, result: GenerationResult | None, error: BaseException | None, t_s: float) -> None:
        super().__init__()
        self.turn, self.result, self.error, self.t_s = turn, result, error, t_s


class EngineLoaded(Message):
    def __init__(self, engine: Engine | None, error: BaseException | None, path: str | None) -> None:
        super().__init__()
        self.engine, self.error, self.path = engine, error, path


class DrafterSwitched(Message):
    """``cache_rebuilt``: the switch replaced the target's context (a tap for what a drafter
    reads from the target, ``drafters.base.target_reads``, was added, changed or removed),
    so its KV cache is gone and the next answer prefills again; ``reads`` / ``read_before``:
    what the new / the previous drafter reads (None: nothing)."""

    def __init__(self, name: str, error: BaseException | None, cache_rebuilt: bool = False,
                 reads: str | None = None, read_before: str | None = None) -> None:  # fmt: skip
        super().__init__()
        self.name, self.error, self.cache_rebuilt = name, error, cache_rebuilt
        self.reads, self.read_before = reads, read_before


class ChatApp(App):
    """The chat app.

    Args:
        engine: an engine to use (the caller keeps ownership); or None to load ``model``
            with ``engine_factory`` when the app starts (the app then owns and closes it).
        model: the GGUF path to load (None = the embedded default model).
        engine_factory: how to load a model (also used by "load model").
        drafter: the drafter to use (a name from ``localspec.drafters.drafter_names()``).
        sampling / max_tokens / system / transcript: see ``ChatSession``.
        save_dir: where transcripts are saved by default.
        clock: seconds for the live rates (``time.perf_counter``; tests pass a fake one).
        native_stderr: where native output goes while the app runs (``NativeStderr``); its
            text is added to error messages.
    """

    TITLE = "localspec chat"
    CSS = """
    #main { height: 1fr; }
    #chat { width: 1fr; padding: 0 1 1 1; scrollbar-size-vertical: 1; }
    #legend { height: 1; padding: 0 1; color: $text-muted; }
    #prompt { margin: 0 1; }
    #status { height: 1; padding: 0 1; background: $panel; color: $text-muted; }
    """
    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+d", "drafter", "Drafter", priority=True),
        Binding("ctrl+t", "sampling", "Sampling", priority=True),
        Binding("ctrl+l", "toggle_colour", "Colour", priority=True),
        Binding("ctrl+b", "toggle_stats", "Stats", priority=True),
        Binding("ctrl+o", "load_model", "Model", priority=True),
        Binding("ctrl+s", "save", "Save", priority=True),
        Binding("ctrl+g", "copy_answer", "Copy", priority=True),
        Binding("ctrl+n", "new_chat", "New", priority=True),
        Binding("pageup", "scroll_chat(-1)", "Scroll up", show=False, priority=True),
        Binding("pagedown", "scroll_chat(1)", "Scroll down", show=False, priority=True),
    ]

    state: reactive[str] = reactive("loading")
    """``"loading"`` (a model), ``"idle"``, ``"generating"`` or ``"switching"`` (drafter)."""
    colour: reactive[bool] = reactive(True)
    show_stats: reactive[bool] = reactive(True)

    def __init__(
        self,
        *,
        engine: Engine | None = None,
        model: str | None = None,
        engine_factory: EngineFactory | None = None,
        drafter: str | None = None,
        drafter_options: dict[str, dict] | None = None,
        sampling: SamplingParams | None = None,
        max_tokens: int = 512,
        system: str | None = None,
        transcript: bool = False,
        save_dir: str | Path = ".",
        clock: Callable[[], float] = time.perf_counter,
        native_stderr: NativeStderr | None = None,
    ) -> None:
        super().__init__()
        self.clock = clock
        self.native_stderr = native_stderr
        self.engine_factory = engine_factory or default_engine_factory
        self.model_path = model
        self.drafter_choice = drafter or (engine.drafter_name if engine is not None else "ngram")
        # drafter name -> its options (e.g. {"draft": {"draft_model": PATH}}); paths asked for
        # in the app are remembered here for later switches and model loads
        self.drafter_options: dict[str, dict] = {k: dict(v) for k, v in (drafter_options or {}).items()}
        self.session = ChatSession(None, system=system, sampling=sampling, max_tokens=max_tokens, transcript=transcript)
        self.save_dir = Path(save_dir)
        self._initial_engine = engine
        self._owns_engine = False
        self._stream: GenerationStream | None = None
        self._turn = 0
        self._answer: AnswerView | None = None
        self._live: LiveTurn | None = None
        self._pending_drafter: str | None = None
        # (turn, chunk, arrival time in s): filled by the generation worker, drained by the UI
        # at most DRAIN_HZ times a second (one message per token would cost the UI thread
        # enough CPU to slow the decode threads down on a small machine).
        self._chunks: deque[tuple[int, StreamChunk, float]] = deque()
        self._job_done = threading.Event()
        self._job_done.set()
        self._stats_auto = True  # follow the terminal width until the user toggles the panel
        self._stats_dirty = False
        # tokens/s of each finished answer (GenerationStats.tokens_per_s, as on its own line)
        self.rates: deque[float] = deque(maxlen=120)

    # -- layout ---------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="◆")
        with Horizontal(id="main"):
            yield VerticalScroll(id="chat", can_focus=False)
            yield StatsPanel(id="stats")
        yield Static(id="legend")
        yield PromptInput(placeholder="Message · enter sends · ctrl+j new line · ctrl+p all commands", id="prompt")
        yield Static(id="status")
        # the prompt's placeholder names ctrl+p: the footer keeps its room for the bindings
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        self.query_one("#chat", VerticalScroll).anchor()
        self.query_one("#prompt", PromptInput).focus()
        self.theme_changed_signal.subscribe(self, lambda _theme: (self._redraw_colours(), self._refresh_stats()))
        self._apply_width(self.size.width)
        self._redraw_colours()
        self.set_interval(0.25, self._refresh_live)
        self._drain_timer = self.set_interval(1 / DRAIN_HZ, self._drain, pause=True)
        if self._initial_engine is not None:
            self._attach(self._initial_engine, owned=False)
            self.state = "idle"
            if self.drafter_choice != self._initial_engine.drafter_name:
                self._switch_drafter(self.drafter_choice)
        else:
            self.notice(f"Loading {self.model_path or 'the default model'}…")
            self._start_job(lambda: self._load_job(self.model_path), "loading")
        self._refresh_stats()

    def on_resize(self, event) -> None:
        if self._stats_auto:
            self._apply_width(event.size.width)

    def _apply_width(self, width: int) -> None:
        if self._stats_auto:
            self.show_stats = width >= WIDE

    def watch_show_stats(self, show: bool) -> None:
        self.query_one("#stats", StatsPanel).display = show

    def watch_state(self, _state: str) -> None:
        self.refresh_bindings()
        self._refresh_status()

    @property
    def dark(self) -> bool:
        return self.current_theme.dark

    # -- conversation widgets -------------------------------------------------------------------

    def notice(self, text: str, kind: str = "info") -> Notice:
        """Add a line from the app to the conversation (``kind``: info, warning, error)."""
        n = Notice(text, kind)
        self.query_one("#chat", VerticalScroll).mount(n)
        return n

    def _redraw_colours(self) -> None:
        leg = self.query_one("#legend", Static)
        leg.display = self.colour
        leg.update(Text("tokens: ", style="dim") + legend(dark=self.dark, no_color=self.no_color))
        for a in self.query(AnswerView):
            a.set_colour(self.colour, dark=self.dark)

    def watch_colour(self, _colour: bool) -> None:
        self._redraw_colours()

    def _native_mark(self) -> None:
        """Forget native stderr output so far (call before an operation ``_explain`` may follow)."""
        if self.native_stderr is not None:
            self.native_stderr.take()

    def _explain(self, error: BaseException) -> str:
        """``error``'s message, with what native code wrote to stderr since ``_native_mark``."""
        detail = " ".join(self.native_stderr.take().split()) if self.native_stderr is not None else ""
        return f"{error} ({detail})" if detail else str(error)

    # -- engine ---------------------------------------------------------------------------------

    def _start_job(self, fn: Callable[[], None], state: str) -> None:
        """Run ``fn`` in a thread worker; ``state`` says what it does until it reports."""
        self.state = state
        self._job_done.clear()

        def run() -> None:
            try:
                fn()
            finally:
                self._job_done.set()

        self.run_worker(run, thread=True, group="engine", exit_on_error=False)

    def _load_job(self, path: str | None) -> None:
        self._native_mark()
        try:
            engine = self.engine_factory(path, self.drafter_choice, **self._options_for(self.drafter_choice))
        except Exception as e:  # noqa: BLE001 - shown in the app, never a crash
            self.post_message(EngineLoaded(None, e, path))
        else:
            self.post_message(EngineLoaded(engine, None, path))

    def on_engine_loaded(self, msg: EngineLoaded) -> None:
        self.state = "idle"
        if msg.error is not None:
            what = msg.path or "the default model"
            self.notice(f"Could not load {what}: {self._explain(msg.error)}. Load a model with ctrl+o.", "error")
            self._refresh_stats()
            return
        assert msg.engine is not None
        old, old_owned = self.session.engine, self._owns_engine
        try:
            self._attach(msg.engine, owned=True)
        except LocalSpecError as e:
            msg.engine.close()
            self.notice(f"Cannot chat with {msg.path}: {e}", "error")
            return
        self.model_path = msg.path
        if old is not None and old_owned:
            old.close()

    def _attach(self, engine: Engine, *, owned: bool) -> None:
        self.session.attach(engine)
        self._owns_engine = owned
        fmt = self.session.format
        assert fmt is not None
        self.sub_title = f"{self.session.model_name} · {fmt.name}"
        self.notice(f"Model: {self.session.model_name} ({engine.model.describe()}), context {engine.n_ctx} tokens.")
        if fmt.uses_template:
            self.notice("Chat format: the model's own chat template (from its GGUF).")
        else:
            self.notice(
                "This model has no chat template (a base model): using a plain transcript, "
                "'User: …' / 'Assistant: …' (see docs/chat.md).",
                "warning",
            )
        cost = getattr(engine, "cost_model", None)
        if cost is not None and (note := cost.contention_note()) is not None:
            self.notice(note[0].upper() + note[1:] + ".", "warning")
        if self.session.messages:
            self.notice("The conversation is kept; the next answer prefills it with this model.")
        self._refresh_stats()

    def _switch_drafter(self, name: str) -> None:
        engine = self.session.engine
        if engine is None:
            self.drafter_choice = name
            return

        def job() -> None:
            ctx, before = engine.ctx, target_reads(getattr(engine, "drafter", None))
            try:
                engine.set_drafter(name, **self._options_for(name))
            except Exception as e:  # noqa: BLE001 - shown in the app
                self.post_message(DrafterSwitched(name, e))
            else:
                reads = target_reads(getattr(engine, "drafter", None))
                self.post_message(DrafterSwitched(name, None, engine.ctx is not ctx, reads, before))

        self._start_job(job, "switching")

    def on_drafter_switched(self, msg: DrafterSwitched) -> None:
        self.state = "idle"
        if msg.error is not None:
            forgotten = ""
            if msg.name in PATH_OPTION:  # ask again next time instead of retrying a bad file
                path = self.drafter_options.get(msg.name, {}).pop(PATH_OPTION[msg.name][0], None)
                forgotten = f" ({path} is forgotten: choosing {msg.name} again asks for a file)" if path else ""
            self.notice(f"Could not switch to drafter {msg.name}: {msg.error}{forgotten}", "error")
        else:
            self.drafter_choice = msg.name
            if msg.cache_rebuilt:
                why = (f"{msg.name} reads {msg.reads}, which needs a new target context" if msg.reads else
                       f"the target context that captured {msg.read_before} is replaced" if msg.read_before else
                       "the target context was replaced")  # fmt: skip
                self.notice(
                    f"Drafter: {msg.name}. The conversation is kept, but not its KV cache: {why}, "
                    "so the next answer prefills the conversation again."
                )
            else:
                self.notice(f"Drafter: {msg.name} (the conversation and its KV cache are kept).")
        self._refresh_stats()

    # -- turns ----------------------------------------------------------------------------------

    @on(PromptInput.Submitted, "#prompt")
    def send(self, event: PromptInput.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.state != "idle":
            self.notify("Wait for the model: " + {"loading": "loading a model", "switching": "switching drafter"}.get(
                self.state, "an answer is being generated (esc stops it)"), severity="warning")
            return
        self._native_mark()
        try:
            stream = self.session.begin_turn(text)
        except LocalSpecError as e:
            self.notice(self._explain(e), "error")  # the message stays in the input box
            return
        event.input.value = ""
        chat = self.query_one("#chat", VerticalScroll)
        self._answer = AnswerView(colour=self.colour, dark=self.dark, no_color=self.no_color)
        chat.mount(UserMessage(text), self._answer)
        chat.anchor()
        self._turn += 1
        self._stream = stream
        self._live = LiveTurn()
        turn = self._turn

        def job() -> None:
            error: BaseException | None = None
            try:
                for chunk in stream:
                    self._chunks.append((turn, chunk, self.clock()))
            except Exception as e:  # noqa: BLE001 - shown in the app, the turn keeps its text
                error = e
            self.post_message(TurnEnded(turn, stream.result, error, self.clock()))

        self._start_job(job, "generating")
        self._drain_timer.resume()
        self._refresh_stats()

    def _drain(self) -> None:
        """Draw the chunks that arrived since the last call."""
        if not self._chunks:
            return
        texts: list[tuple[str, int]] = []
        while self._chunks:
            turn, chunk, t_s = self._chunks.popleft()
            if turn != self._turn or self._live is None:
                continue
            texts.append((chunk.text, chunk.source))
            self._live.add(chunk, t_s)
        if self._answer is not None and texts:
            self._answer.extend(texts)
        self._stats_dirty = True

    def on_turn_ended(self, msg: TurnEnded) -> None:
        if msg.turn != self._turn:
            return
        self._drain()
        self._drain_timer.pause()
        self._stream = None
        self.state = "idle"
        rec = self.session.end_turn(msg.result, msg.error)
        if rec is not None and rec.stats.n_generated_tokens:
            self.rates.append(rec.stats.tokens_per_s)
        answer, self._answer, self._live = self._answer, None, None
        if rec is None:
            if answer is not None:
                answer.remove()
            users = list(self.query(UserMessage))
            if users:  # the turn is undone: its message goes back to the input box
                users[-1].remove()
                self.query_one("#prompt", PromptInput).value = users[-1].text
            self.notice(f"The answer could not start: {self._explain(msg.error)}", "error")
        else:
            if answer is not None:
                answer.finish(rec)
            if rec.finish_reason == "error":
                self.notice(f"Generation failed: {self._explain(msg.error)} (the partial answer is kept)", "error")
            elif rec.note:
                self.notice(rec.note, "warning")
        self._refresh_stats()
        if self._pending_drafter is not None:
            name, self._pending_drafter = self._pending_drafter, None
            self._switch_drafter(name)

    @property
    def last_record(self) -> TurnRecord | None:
        return self.session.turns[-1] if self.session.turns else None

    # -- statistics -----------------------------------------------------------------------------

    def _panel_state(self) -> PanelState:
        engine = self.session.engine
        live = self._live if self.state == "generating" else None
        rec = self.last_record
        n_context = self.session.n_context_tokens + (live.n_tokens if live else 0)
        return PanelState(
            drafter=self.drafter_choice,
            stats=None if live is not None or rec is None else rec.stats,
            live=live,
            # measured cost of a single-token decode, updated by the engine as it runs
            plain_tokens_per_s=engine.plain_tokens_per_s() if engine is not None else 0.0,
            n_context=n_context,
            n_ctx=engine.n_ctx if engine is not None else 0,
            dark=self.dark,
            no_color=self.no_color,
            lossy=self._lossy_label(),
        )

    def _lossy_label(self) -> str:
        """The LOSSY label of the next / current turn's settings ("" when lossless)."""
        engine = self.session.engine
        if engine is None or self.drafter_choice == "none":
            return ""
        from localspec.stats import GenerationStats

        st = GenerationStats()
        st.set_thresholds(engine.with_thresholds(self.session.sampling), drafted=True)
        return st.lossy_label

    def _refresh_stats(self) -> None:
        st = self._panel_state()
        panel = self.query_one("#stats", StatsPanel)
        panel.show(st)
        panel.chart(self.rates)
        self._refresh_status(st)

    def _refresh_live(self) -> None:
        """The 4 Hz timer: redraws the panel and status line when a turn changed them. A tick
        that comes while the screen's widgets are being removed (the app closing) draws
        nothing and leaves the redraw pending."""
        if self._stats_dirty:
            try:
                self._refresh_stats()
            except NoMatches:
                return
            self._stats_dirty = False

    def _refresh_status(self, st: PanelState | None = None) -> None:
        st = st or self._panel_state()
        if self.state == "loading":
            text = "loading the model (the first start measures its decode cost)…"
        elif self.session.engine is None:
            text = "no model loaded · ctrl+o loads one"
        else:
            s, live = st.stats, st.live
            parts = [("● " if self.state == "generating" else "") + st.drafter]
            if s is not None or live is not None:
                tps = s.tokens_per_s if s is not None else live.tokens_per_s
                mal = s.mean_acceptance_length if s is not None else live.mean_acceptance_length
                parts.append(f"{tps:.1f} tok/s")
                parts.append(f"{mal:.2f} tok/step")
                ratio = st.vs_plain(tps)
                if ratio is not None:
                    parts.append(f"≈{ratio:.2f}× plain")
                elif st.no_speedup is not None:
                    parts.append(st.no_speedup)
            t = self.session.sampling.temperature
            parts.append("greedy" if t <= 0 else f"temp {t:g}")
            if (s.lossy if s is not None else bool(st.lossy)):
                parts.append("LOSSY")
            parts.append(f"ctx {st.n_context}/{st.n_ctx}")
            if self.state == "switching":
                parts.append("switching drafter…")
            text = " · ".join(parts)
        self.query_one("#status", Static).update(Text(text))

    # -- actions --------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if isinstance(self.screen, ModalScreen) and action in {b.action for b in self.BINDINGS}:
            return False  # dialogs get their own keys (esc closes them)
        if action == "stop":
            return True if self.state == "generating" else False
        return True

    def action_stop(self) -> None:
        """Stop the answer being generated (it is kept as it is)."""
        if self._stream is not None:
            self._stream.cancel()

    def action_drafter(self) -> None:
        names = drafter_names()
        self.push_screen(DrafterScreen(names, self.drafter_choice), self._chose_drafter)

    def _options_for(self, name: str) -> dict:
        """The options of drafter ``name`` (``auto`` uses those of ``draft`` and ``eagle3``)."""
        if name == "auto":
            merged = {**self.drafter_options.get("draft", {}), **self.drafter_options.get("eagle3", {})}
            return {**merged, **self.drafter_options.get("auto", {})}
        return dict(self.drafter_options.get(name, {}))

    def _needs_path(self, name: str) -> bool:
        """True when drafter ``name`` needs a file the app does not know yet (an EAGLE-3 head
        ships for the default model, so ``eagle3`` needs none there)."""
        if name not in PATH_OPTION or self._options_for(name).get(PATH_OPTION[name][0]):
            return False
        if name in ("eagle3", "medusa"):
            from localspec.models.eagle3_heads import shipped_head

            engine = self.session.engine
            target = engine.model.path if engine is not None else None
            return target is None or shipped_head(target, kind=name) is None
        return True

    def _chose_drafter(self, name: str | None) -> None:
        if name is None or name == self.drafter_choice and self._pending_drafter is None:
            return
        if self._needs_path(name):
            key, title = PATH_OPTION[name]

            def chosen(path: str | None) -> None:
                if path:
                    self.drafter_options.setdefault(name, {})[key] = path
                    self._chose_drafter(name)

            self.push_screen(PathScreen(title, check=_check_model), chosen)
            return
        if self.state == "generating":
            self._pending_drafter = name
            self.notice(f"Drafter {name} takes over after this answer.")
        elif self.state == "idle":
            self._switch_drafter(name)
        else:
            self.notify("Busy: try again in a moment", severity="warning")

    def action_sampling(self) -> None:
        screen = SamplingScreen(self.session.sampling, self.session.max_tokens, self._check_grammar)
        self.push_screen(screen, self._chose_sampling)

    def _check_grammar(self, grammar: str) -> None:
        engine = self.session.engine
        if engine is None:
            return
        from localspec.errors import GrammarError
        from localspec.grammar import GrammarState

        self._native_mark()
        try:
            GrammarState(engine.model, grammar).close()
        except GrammarError as e:
            raise GrammarError(self._explain(e)) from e

    def _chose_sampling(self, choice: SamplingChoice | None) -> None:
        if choice is None:
            return
        self.session.sampling, self.session.max_tokens = choice.sampling, choice.max_tokens
        s = choice.sampling
        desc = "greedy" if s.is_greedy else f"temperature {s.temperature:g}, top-k {s.top_k}, top-p {s.top_p:g}"
        extra = ", with a grammar" if s.grammar else ""
        self.notice(f"Sampling: {desc}{extra}, up to {choice.max_tokens} tokens per answer.")
        self._refresh_status()

    def action_toggle_colour(self) -> None:
        """Show or hide the provenance colours."""
        self.colour = not self.colour

    def action_toggle_stats(self) -> None:
        self._stats_auto = False
        self.show_stats = not self.show_stats

    def action_scroll_chat(self, direction: int) -> None:
        chat = self.query_one("#chat", VerticalScroll)
        (chat.scroll_page_down if direction > 0 else chat.scroll_page_up)()

    def action_load_model(self) -> None:
        current = str(self.session.engine.model.path) if self.session.engine is not None else ""
        self.push_screen(PathScreen("Load a GGUF model (the conversation is kept)", current, _check_model), self._load)

    def _load(self, path: str | None) -> None:
        if path is None:
            return
        if self.state != "idle":
            self.notify("Busy: stop the answer first (esc)", severity="warning")
            return
        self.notice(f"Loading {path}…")
        self._start_job(lambda: self._load_job(path), "loading")

    def action_save(self) -> None:
        name = time.strftime("chat-%Y%m%d-%H%M%S.md")
        self.push_screen(PathScreen("Save the transcript (Markdown)", str(self.save_dir / name)), self.save_transcript)

    def save_transcript(self, path: str | None) -> Path | None:
        """Write the transcript to ``path`` (Markdown); errors are shown, not raised."""
        if path is None:
            return None
        p = Path(path).expanduser()
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(self.session.to_markdown(), encoding="utf-8")
        except OSError as e:
            self.notice(f"Could not save the transcript: {e}", "error")
            return None
        self.notify(f"Saved the transcript to {p}")
        return p

    def action_copy_answer(self) -> None:
        text = self.session.last_answer
        if not text:
            self.notify("No answer to copy yet", severity="warning")
            return
        self.copy_to_clipboard(text)
        self.notify(f"Copied the last answer ({len(text)} characters)")

    def action_new_chat(self) -> None:
        if self.state == "generating":
            self.notify("Stop the answer first (esc)", severity="warning")
            return
        self.session.new_chat()
        self.query_one("#chat", VerticalScroll).remove_children()
        self.rates.clear()
        self.notice("New chat.")
        self._refresh_stats()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Stop generating", "Stop the answer (esc)", self.action_stop)
        yield SystemCommand("Drafter…", "Choose how tokens are drafted (ctrl+d)", self.action_drafter)
        for name in drafter_names():
            yield SystemCommand(
                f"Drafter: {name}", "Switch drafter; the conversation is kept", lambda n=name: self._chose_drafter(n)
            )
        yield SystemCommand("Sampling settings…", "Temperature, top-k/p, seed, grammar, max tokens (ctrl+t)",
                            self.action_sampling)  # fmt: skip
        yield SystemCommand("Toggle provenance colours", "Colour tokens by how they were produced (ctrl+l)",
                            self.action_toggle_colour)  # fmt: skip
        yield SystemCommand("Toggle statistics panel", "Show or hide the statistics (ctrl+b)", self.action_toggle_stats)
        yield SystemCommand("Load a model…", "Open a GGUF file (ctrl+o)", self.action_load_model)
        yield SystemCommand("Save transcript…", "Write the conversation as Markdown (ctrl+s)", self.action_save)
        yield SystemCommand("Copy last answer", "Copy to the clipboard (ctrl+g)", self.action_copy_answer)
        yield SystemCommand("New chat", "Forget the conversation (ctrl+n)", self.action_new_chat)

    # -- shutdown -------------------------------------------------------------------------------

    def shutdown_engine(self, timeout_s: float = 30.0) -> None:
        """Stop any generation, wait for the worker, and close the engine if the app owns it."""
        if self._stream is not None:
            self._stream.cancel()
        self._job_done.wait(timeout_s)
        if self._owns_engine and self.session.engine is not None and self._job_done.is_set():
            self.session.engine.close()
            self.session.engine = None
            self._owns_engine = False

    def on_unmount(self) -> None:
        self.shutdown_engine()


def _check_model(path: str) -> str | None:
    """An error message for a path that is not a readable GGUF file, else None."""
    from localspec.backend.model import check_gguf_file

    try:
        check_gguf_file(path)
    except LocalSpecError as e:
        return str(e)
    return None
