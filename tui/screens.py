"""Dialogs: choose the drafter, edit sampling settings, enter a path."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Select, Static
from textual.widgets.option_list import Option

from localspec.errors import LocalSpecError
from localspec.sampling import SamplingParams

DRAFTER_HELP = {
    "none": "plain decoding, no speculation",
    "ngram": "n-gram lookup in the conversation",
    "draft": "a small draft model",
    "eagle3": "an EAGLE-3 head on the target",
    "medusa": "Medusa heads on the target's hidden state",
    "auto": "the fastest drafter, chosen as it goes",
    "mtp": "the model's own MTP block",
}

def _dialog_css(screen: str) -> str:
    """Centred box styles for the dialog screen ``screen`` (DEFAULT_CSS is scoped to it)."""
    return f"""
    {screen} {{ align: center middle; }}
    {screen} > Vertical {{
        width: 64; max-width: 100%; height: auto; max-height: 100%;
        padding: 0 1; border: round $accent; background: $surface;
    }}
    {screen} .title {{ text-style: bold; margin-bottom: 1; }}
    {screen} .error {{ color: $text-error; height: auto; }}
    {screen} .hint {{ color: $text-muted; }}
    {screen} Horizontal.buttons {{ height: auto; align: right middle; margin-top: 1; }}
    {screen} Horizontal.buttons Button {{ margin-left: 1; }}
    """


class DrafterScreen(ModalScreen[str | None]):
    """Pick a drafter by name; dismisses with the name, or None when cancelled."""

    DEFAULT_CSS = _dialog_css("DrafterScreen") + "DrafterScreen OptionList { height: auto; max-height: 12; }"
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, names: Sequence[str], current: str) -> None:
        super().__init__()
        self.names = list(names)
        self.current = current

    def compose(self) -> ComposeResult:
        options = [
            Option(f"{'●' if n == self.current else ' '} {n:<7} {DRAFTER_HELP.get(n, '')}", id=n) for n in self.names
        ]
        with Vertical():
            yield Label("Drafter (the conversation is kept)", classes="title")
            yield OptionList(*options, id="drafters")
            yield Label("enter: switch · esc: cancel", classes="hint")

    def on_mount(self) -> None:
        ol = self.query_one(OptionList)
        if self.current in self.names:
            ol.highlighted = self.names.index(self.current)
        ol.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)


@dataclass
class SamplingChoice:
    """What the sampling dialog returns."""

    sampling: SamplingParams
    max_tokens: int


_FIELDS = (
    # (id, label, hint)
    ("temperature", "temperature", "0 = greedy"),
    ("top_k", "top-k", "0 = off"),
    ("top_p", "top-p", "1 = off"),
    ("min_p", "min-p", "0 = off"),
    ("repeat_penalty", "repeat penalty", "1 = off"),
    ("seed", "seed", "empty = random"),
    ("max_tokens", "max tokens", "per answer"),
    ("grammar", "grammar", "GBNF, empty = none"),
)


class SamplingScreen(ModalScreen[SamplingChoice | None]):
    """Edit the sampling settings of the next turns.

    Args:
        sampling / max_tokens: the current settings.
        check_grammar: raises ``LocalSpecError`` when a GBNF grammar does not parse.
    """

    DEFAULT_CSS = (
        _dialog_css("SamplingScreen")
        + """
    SamplingScreen Grid { grid-size: 3; grid-columns: 16 1fr 20; grid-rows: 1; height: auto; grid-gutter: 0 1; }
    SamplingScreen Grid Label { height: 1; }
    """
    )
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(
        self, sampling: SamplingParams, max_tokens: int, check_grammar: Callable[[str], None] | None = None
    ) -> None:
        super().__init__()
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.check_grammar = check_grammar

    def _value(self, key: str) -> str:
        if key == "max_tokens":
            return str(self.max_tokens)
        v = getattr(self.sampling, key)
        return "" if v is None else str(v)

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Sampling (applies from the next answer)", classes="title")
            with Grid():
                for key, label, hint in _FIELDS:
                    yield Label(label)
                    yield Input(self._value(key), id=key, compact=True)
                    yield Label(hint, classes="hint")
                yield Label("verification")
                yield Select(
                    [("seeded Gumbel", "gumbel"), ("rejection", "rejection")],
                    value=self.sampling.verify,
                    allow_blank=False,
                    id="verify",
                    compact=True,
                )
                yield Label("at temperature > 0", classes="hint")
            yield Static("", id="error", classes="error")
            with Horizontal(classes="buttons"):
                yield Button("Cancel", id="cancel", compact=True)
                yield Button("Apply", id="apply", variant="primary", compact=True)

    def on_mount(self) -> None:
        self.query_one("#temperature", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self._apply()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "apply":
            self._apply()
        else:
            self.dismiss(None)

    def _apply(self) -> None:
        try:
            choice = self.parse()
        except (ValueError, LocalSpecError) as e:
            self.query_one("#error", Static).update(str(e))
            return
        self.dismiss(choice)

    def parse(self) -> SamplingChoice:
        """The settings typed in, checked.

        Raises:
            ValueError: a field is not a number or is out of range (``InvalidRequestError``),
                or the grammar does not parse (``GrammarError``).
        """
        raw = {key: self.query_one(f"#{key}", Input).value.strip() for key, _, _ in _FIELDS}

        def num(key: str, kind):
            try:
                return kind(raw[key])
            except ValueError:
                label = next(lbl for k, lbl, _ in _FIELDS if k == key)
                raise ValueError(f"{label}: expected a number, got {raw[key]!r}") from None

        max_tokens = num("max_tokens", int)
        if max_tokens < 1:
            raise ValueError("max tokens must be at least 1")
        grammar = raw["grammar"] or None
        sampling = SamplingParams(
            temperature=num("temperature", float),
            top_k=num("top_k", int),
            top_p=num("top_p", float),
            min_p=num("min_p", float),
            repeat_penalty=num("repeat_penalty", float),
            frequency_penalty=self.sampling.frequency_penalty,
            presence_penalty=self.sampling.presence_penalty,
            penalty_last_n=self.sampling.penalty_last_n,
            logit_bias=self.sampling.logit_bias,
            seed=num("seed", int) if raw["seed"] else None,
            grammar=grammar,
            verify=self.query_one("#verify", Select).value,
        )
        if grammar and self.check_grammar is not None:
            self.check_grammar(grammar)
        return SamplingChoice(sampling, max_tokens)


class PathScreen(ModalScreen[str | None]):
    """Ask for a file path; dismisses with it, or None when cancelled.

    Args:
        title: the dialog's title.
        value: the initial text.
        check: returns an error message for a path that cannot be used, or None.
    """

    DEFAULT_CSS = _dialog_css("PathScreen")
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, title: str, value: str = "", check: Callable[[str], str | None] | None = None) -> None:
        super().__init__()
        self.title_text = title
        self.value = value
        self.check = check

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.title_text, classes="title")
            yield Input(self.value, id="path", compact=True)
            yield Static("", id="error", classes="error")
            yield Label("enter: confirm · esc: cancel", classes="hint")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        path = event.value.strip()
        why = "enter a path" if not path else (self.check(path) if self.check else None)
        if why:
            self.query_one("#error", Static).update(why)
            return
        self.dismiss(path)
