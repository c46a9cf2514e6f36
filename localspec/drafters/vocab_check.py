"""Is a draft model's vocabulary the target's? Checked once, when a draft model is loaded.

A draft proposes token *ids*; the target verifies them as its own ids. That is only
meaningful when both vocabularies agree id by id:

* every id present in both has the same stored text and the same attributes (normal,
  control, byte, unused, ...; llama.cpp derives them from the GGUF token types);
* the special tokens are the same ids: BOS, EOS, EOT, SEP, newline, padding, mask, the FIM
  tokens, and every ``tokenizer.ggml.*_token_id`` key of either GGUF (e.g. UNK);
* one vocabulary may be longer than the other only by a **padded tail**: extra ids whose
  attribute is UNUSED (token type 5), as left by training with a vocabulary rounded up to
  a multiple of 64 or 128. The drafter never proposes such ids.

Anything else raises ``VocabMismatchError`` naming the first differing token (id and both
texts) and what to do. Loading both models with ``vocab_only=True`` makes the check cheap.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ..backend._llama import lib
from ..backend.model import Model
from ..errors import ModelLoadError, VocabMismatchError

TOKEN_ATTR_UNUSED = 1 << 1
_SPECIAL_GETTERS = ("bos", "eos", "eot", "sep", "nl", "pad", "mask", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")
_ADVICE = (
    "The draft model must use the target's tokenizer: use a draft from the same model family "
    "and release (for example `localspec models derive-draft TARGET --layers N`), or retrain "
    "the draft with the target's tokenizer."
)


@dataclass
class VocabCheck:
    """Result of a successful check.

    Attributes:
        n_common: ids ``0 .. n_common - 1`` exist in both vocabularies (the ids a draft may
            propose).
        n_padded_target: unused ids the target has beyond ``n_common``.
        n_padded_draft: unused ids the draft has beyond ``n_common``.
    """

    n_common: int
    n_padded_target: int = 0
    n_padded_draft: int = 0


def _texts(model: Model, n: int) -> list[bytes]:
    get = lib.llama_vocab_get_text
    v = model.vocab
    return [get(v, i) or b"" for i in range(n)]


def _attrs(model: Model, n: int) -> list[int]:
    get = lib.llama_vocab_get_attr
    v = model.vocab
    return [int(get(v, i)) for i in range(n)]


def _first_difference(a: list, b: list) -> int:
    """Index of the first differing entry of two equally long lists, or -1."""
    if a == b:
        return -1
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _special_id_keys(model: Model) -> dict[str, str]:
    """``tokenizer.ggml.*_token_id`` metadata of ``model`` (key -> value as text)."""
    out = {}
    handle = model.handle
    buf = ctypes.create_string_buffer(256)
    for i in range(lib.llama_model_meta_count(handle)):
        if lib.llama_model_meta_key_by_index(handle, i, buf, len(buf)) < 0:
            continue
        key = buf.value.decode("utf-8", errors="replace")
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            out[key] = model.meta(key) or ""
    return out


def _describe(model: Model, token: int) -> str:
    if token < 0:
        return "none"
    if token >= model.n_vocab:
        return f"{token} (outside its vocabulary)"
    return f"{token} ({model.token_text(token)!r})"


def _check_tail(model: Model, start: int, which: str, advice: str) -> int:
    attrs = _attrs(model, model.n_vocab)
    for i in range(start, model.n_vocab):
        if not attrs[i] & TOKEN_ATTR_UNUSED:
            raise VocabMismatchError(
                f"the {which} vocabulary has {model.n_vocab} tokens, the other {start}; its extra "
                f"token {i} ({model.token_text(i)!r}) is not an unused padding token. {advice}"
            )
    return model.n_vocab - start


def check_vocab(target: Model, draft: Model, advice: str = _ADVICE) -> VocabCheck:
    """Check that ``draft`` can propose ids for ``target`` (see the module docstring).

    Args:
        target: the target model (``vocab_only`` loads suffice).
        draft: the draft model (or an EAGLE-3 head, which carries a tokenizer too).
        advice: what to do, the end of the error message (default: for draft models).
    Returns:
        a ``VocabCheck`` with the number of common ids.
    Raises:
        VocabMismatchError: the first difference found, with both texts, and what to do.
    """
    n_common = min(target.n_vocab, draft.n_vocab)
    for name in _SPECIAL_GETTERS:
        getter = getattr(lib, f"llama_vocab_{name}")
        a, b = int(getter(target.vocab)), int(getter(draft.vocab))
        if a != b:
            raise VocabMismatchError(
                f"special token {name.upper()} differs: target id {_describe(target, a)}, draft id "
                f"{_describe(draft, b)}. {advice}"
            )
    ka, kb = _special_id_keys(target), _special_id_keys(draft)
    for key in sorted(set(ka) | set(kb)):
        if ka.get(key) != kb.get(key):
            raise VocabMismatchError(
                f"{key} differs: target {ka.get(key, 'unset')}, draft {kb.get(key, 'unset')}. {advice}"
            )
    ta, da = _texts(target, n_common), _texts(draft, n_common)
    i = _first_difference(ta, da)
    if i >= 0:
        raise VocabMismatchError(f"token {i} differs: target {_text(ta[i])!r}, draft {_text(da[i])!r}. {advice}")
    tt, dt = _attrs(target, n_common), _attrs(draft, n_common)
    i = _first_difference(tt, dt)
    if i >= 0:
        raise VocabMismatchError(
            f"token {i} ({_text(ta[i])!r}) has attributes {tt[i]:#x} in the target but {dt[i]:#x} in "
            f"the draft (token types differ). {advice}"
        )
    res = VocabCheck(n_common)
    if target.n_vocab > n_common:
        res.n_padded_target = _check_tail(target, n_common, "target", advice)
    if draft.n_vocab > n_common:
        res.n_padded_draft = _check_tail(draft, n_common, "draft", advice)
    return res


def check_draft_map(d2t, where: str, advice: str = "") -> None:
    """Check a head's draft-vocabulary map as it loads (``models.eagle3_gguf.d2t_problem``:
    distinct non-negative target ids).

    Raises:
        ModelLoadError: one line naming the file (``where``), what is wrong, and ``advice``.
    """
    from ..models.eagle3_gguf import d2t_problem  # the writers' module: loaded only when a head loads

    bad = d2t_problem(d2t)
    if bad is not None:
        raise ModelLoadError(f"{where}: its draft vocabulary map (d2t) {bad}; it must hold distinct non-negative target ids. {advice}".rstrip())
