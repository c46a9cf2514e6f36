"""Prompt building for editor completions: fill-in-the-middle, or prefix completion.

**With FIM tokens** (the model's vocabulary reports ``fim_pre``, ``fim_suf`` and ``fim_mid``;
``Model.fim_tokens()``) the prompt follows llama.cpp's server (``format_prompt_infill`` in
``tools/server/server-common.cpp``), the repo-level pattern of Qwen2.5-Coder
(arXiv:2409.12186)::

    [BOS] [FIM_REP]myproject\\n                    (when the vocabulary has FIM_REP)
          [FIM_SEP]{filename}\\n{extra chunk}       (per input_extra chunk; without FIM_SEP
          ...                                      a "--- snippet ---" separator)
          [FIM_SEP]filename\\n                      (when the vocabulary has FIM_SEP)
          [FIM_PRE]{prefix}{prompt}[FIM_SUF]{suffix}[FIM_MID]

(``spm`` order puts the suffix part first.) The prefix keeps its last 3/4 of ``window``
tokens, the suffix its first ``window/4 - 2 - len(prompt)``, the extra context the last
``n_ctx - window - 2 * n_predict`` tokens, as llama.cpp does with its ``n_batch`` as the window.
One departure: BOS comes first, not after the extra context.

**Without FIM tokens** (the default Gemma 3 270M) the model completes the text before the
cursor: ``[BOS] {extra chunks, each after a "--- snippet ---" line} {prefix}{prompt}``. The
suffix cannot be shown to such a model, so it only feeds the drafter (``draft_context``):
code after the cursor often repeats what is being typed.

**Stable truncation.** The prefix is cut from the front in blocks of ``window / 16``
tokens, so successive keystrokes keep the same first token and the engine reuses the KV
cache of the common prefix (cutting at exactly ``3/4 window`` would shift the start by a
token at a time and invalidate the whole cache on every keystroke). The blocks are anchored
to the text, not to its start: the caller passes the previous prompt's ``CutAnchor`` (the
tokens the kept part began with, and where), and when those tokens still occur the cut
points are that place plus or minus whole blocks. An edit above the cut then moves nothing
(counting blocks from the start of the text would shift every later cut point by the
tokens the edit added, and lose the whole cache on every request after it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import ContextOverflowError

# "\n\n--- snippet ---\n\n": llama.cpp's chunk separator for models without FIM_SEP
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
REPO_NAME = "myproject\n"  # llama.cpp's fixed project name after FIM_REP
CURRENT_FILE = "filename\n"  # llama.cpp's fixed name of the current file after the last FIM_SEP


@dataclass
class ExtraChunk:
    """A piece of context from another place in the project (llama.cpp's ``input_extra``)."""

    text: str
    filename: str = "tmp"


BYTES_PER_TOKEN_BOUND = 8
"""Bytes per token that a long text is clipped or pre-tokenized to (English prose and code are
~3-5 bytes per token here): llama.cpp's tokenizer takes time that grows faster than the
text on some texts (measured with Gemma 3's: ``"hi\\n" * n`` 0.37 s at 15 KB, 7.7 s at 60 KB,
32 s at 120 KB; 400 KB of Python 2.0 s), and editor and API requests are tokenized one after
another, so a huge request would stall every other."""


class PromptTooLongError(ContextOverflowError):
    """A text has at least ``at_least`` tokens, more than a context of ``n_ctx`` holds."""

    def __init__(self, at_least: int, n_ctx: int, hint: str = "") -> None:
        super().__init__(f"the prompt has at least {at_least} tokens but the context holds {n_ctx}"
                         f"{hint}; shorten it")  # fmt: skip
        self.at_least, self.n_ctx = at_least, n_ctx


def tokenize_bounded(model, text: str, n_ctx: int, *, add_special: bool, parse_special: bool = False,
                     hint: str = "") -> list[int]:  # fmt: skip
    """``text``'s token ids, refusing a text that surely has more than ``n_ctx`` tokens before it
    is tokenized whole: more bytes than ``n_ctx x model.max_token_bytes`` (a lower bound of its
    tokens) is refused without tokenizing; a text longer than ``BYTES_PER_TOKEN_BOUND`` bytes
    per context token is first tokenized up to there, and refused when that part alone does
    not fit.

    Raises:
        PromptTooLongError: the text cannot fit (``hint`` is added to the message, e.g. the
            option that sets ``n_ctx``).
    """
    data = text.encode("utf-8", errors="surrogatepass")
    if len(data) > n_ctx * model.max_token_bytes:
        raise PromptTooLongError(len(data) // model.max_token_bytes, n_ctx, hint)
    head = BYTES_PER_TOKEN_BOUND * n_ctx
    if len(data) > head:
        part = model.tokenize(data[:head].decode("utf-8", errors="ignore"), add_special=add_special,
                              parse_special=parse_special)  # fmt: skip
        if len(part) > n_ctx + 16:  # (tokens near the cut may merge differently in the whole text)
            raise PromptTooLongError(len(part) - 16, n_ctx, hint)
    return model.tokenize(text, add_special=add_special, parse_special=parse_special)


def clip_tail(text: str, max_bytes: int) -> str:
    """The end of ``text``: at most ``max_bytes`` UTF-8 bytes, starting after a newline when the
    clipped part has one in its first half (a line's start tokenizes as it does in the whole
    text). ``text`` itself when it is short enough."""
    data = text.encode("utf-8", errors="surrogatepass")
    if len(data) <= max_bytes:
        return text
    part = data[len(data) - max_bytes :]
    nl = part.find(b"\n", 0, max_bytes // 2)
    return part[nl + 1 if nl >= 0 else 0 :].decode("utf-8", errors="ignore")


def clip_head(text: str, max_bytes: int) -> str:
    """The start of ``text``: at most ``max_bytes`` UTF-8 bytes, ending after a newline when the
    clipped part has one in its second half. ``text`` itself when it is short enough."""
    data = text.encode("utf-8", errors="surrogatepass")
    if len(data) <= max_bytes:
        return text
    part = data[:max_bytes]
    nl = part.rfind(b"\n", max_bytes // 2)
    return part[: nl + 1 if nl >= 0 else max_bytes].decode("utf-8", errors="ignore")


def clip_chunks(chunks: Sequence["ExtraChunk"], max_bytes: int) -> list["ExtraChunk"]:
    """The last chunks whose texts together hold at most ``max_bytes`` bytes; the first one kept
    may be clipped to its end (``clip_tail``); ``[]`` for ``max_bytes <= 0``."""
    kept: list[ExtraChunk] = []
    left = max_bytes
    for c in reversed(chunks):
        if left <= 0:
            break
        n = len(c.text.encode("utf-8", errors="surrogatepass"))
        kept.append(c if n <= left else ExtraChunk(clip_tail(c.text, left), c.filename))
        left -= n
    return kept[::-1]


ANCHOR_TOKENS = 16  # tokens at a cut point that identify it in the next request's text


@dataclass(frozen=True)
class CutAnchor:
    """Where the last truncated prefix was cut: ``tokens`` (the first ``ANCHOR_TOKENS`` kept)
    at index ``at`` of the text's tokens."""

    tokens: tuple[int, ...]
    at: int


@dataclass
class BuiltPrompt:
    """A prompt ready for the engine.

    Attributes:
        tokens: the prompt token ids.
        fim: True when built with the model's FIM tokens; False for prefix completion.
        draft_context: token sequences the drafter may draft from that the prompt lacks
            (the suffix without FIM; the parts cut off by the window).
        n_prefix_dropped / n_suffix_dropped / n_extra_dropped: tokens left out to fit.
        anchor: where the prefix was cut (None: not cut), for the next request's cut.
    """

    tokens: list[int]
    fim: bool
    draft_context: list[list[int]] = field(default_factory=list)
    n_prefix_dropped: int = 0
    n_suffix_dropped: int = 0
    n_extra_dropped: int = 0
    anchor: CutAnchor | None = None


def has_fim(model) -> bool:
    """Whether the model's vocabulary has the three tokens fill-in-the-middle needs."""
    return {"pre", "suf", "mid"} <= set(model.fim_tokens())


def _occurrences(tokens: list[int], pattern: tuple[int, ...]) -> list[int]:
    """Indices where ``pattern`` (non-empty) starts in ``tokens``."""
    first, n = pattern[0], len(pattern)
    return [i for i, t in enumerate(tokens) if t == first and tuple(tokens[i : i + n]) == pattern]


def _block_cut(tokens: list[int], keep: int, block: int, anchor: CutAnchor | None = None) -> int:
    """How many tokens to drop from the front so at most ``keep`` remain: the smallest cut
    point that leaves at most ``keep``, where cut points are ``anchor.at`` in this text (where
    its tokens occur, nearest to where they were) plus or minus whole ``block``s, or multiples
    of ``block`` without an anchor; 0 when everything fits."""
    over = len(tokens) - keep
    if over <= 0:
        return 0
    base = 0
    if anchor is not None and anchor.tokens:
        found = _occurrences(tokens, anchor.tokens)
        if found:
            base = min(found, key=lambda i: (abs(i - anchor.at), i))
    cut = base + -(-(over - base) // block) * block  # smallest base + m*block >= over
    return min(len(tokens), cut)


def _anchor(tokens: list[int], cut: int) -> CutAnchor | None:
    return CutAnchor(tuple(tokens[cut : cut + ANCHOR_TOKENS]), cut) if 0 < cut < len(tokens) else None


def build_infill_prompt(
    model,
    prefix: str,
    suffix: str,
    prompt: str,
    extra: Sequence[ExtraChunk],
    *,
    n_ctx: int,
    n_predict: int,
    window: int = 4096,
    spm: bool = False,
    anchor: CutAnchor | None = None,
) -> BuiltPrompt:
    """The prompt of an ``/infill`` request (see the module docstring for the layout).

    Args:
        model: the target ``backend.Model``.
        prefix / suffix: text before / after the cursor (``input_prefix`` / ``input_suffix``).
        prompt: text typed after the prefix (llama.vim sends the current line's part before
            the cursor here); tokenised with special-token parsing, as llama.cpp does.
        extra: context chunks (``input_extra``).
        n_ctx: the engine's context size (tokens).
        n_predict: tokens to generate (-1: unknown; counted as 0 for the extra budget).
        window: tokens for prefix + suffix (llama.cpp's ``n_batch``), at most ``n_ctx / 2``.
        spm: suffix-prefix-middle order (llama.cpp's ``--spm-infill``).
        anchor: the previous prompt's ``BuiltPrompt.anchor`` (see "Stable truncation").
    """
    window = max(64, min(window, n_ctx // 2))
    block = max(1, window // 16)
    fim = model.fim_tokens()
    use_fim = {"pre", "suf", "mid"} <= set(fim)
    # Huge texts are clipped before tokenizing (BYTES_PER_TOKEN_BOUND): the prefix and the
    # typed prompt to their ends, the suffix to its start, the extra chunks to their last
    # bytes, each to 8 bytes per token it may keep in the prompt or in the draft context.
    clip = BYTES_PER_TOKEN_BOUND * window
    prefix, prompt, suffix = clip_tail(prefix, clip), clip_tail(prompt, clip), clip_head(suffix, clip)
    extra = clip_chunks(extra, BYTES_PER_TOKEN_BOUND * n_ctx)

    def tok(text: str) -> list[int]:
        return model.tokenize(text, add_special=False) if text else []

    prompt_toks = model.tokenize(prompt, add_special=False, parse_special=True) if prompt else []
    extra_toks: list[int] = []
    if use_fim and "rep" in fim:
        extra_toks += [fim["rep"], *tok(REPO_NAME)]
    for chunk in extra:
        if use_fim and "sep" in fim:
            extra_toks += [fim["sep"], *tok(chunk.filename + "\n")]
        else:
            extra_toks += tok(SNIPPET_SEPARATOR)
        extra_toks += tok(chunk.text)
    if use_fim and "sep" in fim:
        extra_toks += [fim["sep"], *tok(CURRENT_FILE)]
    elif extra and not use_fim:
        extra_toks += tok(SNIPPET_SEPARATOR)  # separates the last chunk from the file itself

    n_extra_take = min(max(0, n_ctx - window - 2 * max(n_predict, 0)), len(extra_toks))
    n_extra_dropped = len(extra_toks) - n_extra_take
    extra_kept = extra_toks[n_extra_dropped:]
    bos = [model.bos] if model.add_bos and model.bos >= 0 else []

    if not use_fim:
        body = model.tokenize(prefix + prompt, add_special=False, parse_special=True) if prefix + prompt else []
        cut = _block_cut(body, window, block, anchor)
        suffix_toks = tok(suffix)
        ctx = [t for t in (body[:cut], suffix_toks, extra_toks[:n_extra_dropped]) if t]
        tokens = bos + extra_kept + body[cut:]
        return BuiltPrompt(tokens, False, ctx, n_prefix_dropped=cut, n_extra_dropped=n_extra_dropped,
                           anchor=_anchor(body, cut))  # fmt: skip

    prefix_toks = tok(prefix)
    suffix_toks = tok(suffix)
    cut = _block_cut(prefix_toks, 3 * (window // 4), block, anchor)
    n_suffix_take = min(len(suffix_toks), max(0, window // 4 - (2 + len(prompt_toks))))
    pre_part = [fim["pre"], *prefix_toks[cut:], *prompt_toks]
    suf_part = [fim["suf"], *suffix_toks[:n_suffix_take]]
    first, second = (suf_part, pre_part) if spm else (pre_part, suf_part)
    tokens = bos + extra_kept + first + second + [fim["mid"]]
    ctx = [t for t in (prefix_toks[:cut], suffix_toks[n_suffix_take:], extra_toks[:n_extra_dropped]) if t]
    return BuiltPrompt(
        tokens,
        True,
        ctx,
        n_prefix_dropped=cut,
        n_suffix_dropped=len(suffix_toks) - n_suffix_take,
        n_extra_dropped=n_extra_dropped,
        anchor=_anchor(prefix_toks, cut),
    )


def build_completion_prompt(model, prompt: str | Sequence[int], *, n_ctx: int) -> BuiltPrompt:
    """The prompt of a ``/completion`` request: text (BOS added as the model asks, special
    tokens parsed, as llama.cpp's server does) or token ids as given.

    Raises:
        PromptTooLongError: a text that surely does not fit in ``n_ctx`` tokens (refused
            before it is tokenized whole: ``tokenize_bounded``).
    """
    if isinstance(prompt, str):
        return BuiltPrompt(tokenize_bounded(model, prompt, n_ctx, add_special=True, parse_special=True,
                                            hint=" (--n-ctx)"), False)  # fmt: skip
    return BuiltPrompt([int(t) for t in prompt], False)
