"""Tiny Hugging Face checkpoints for the EAGLE-3 conversion tests, and llama.cpp's converter.

``write_target`` writes a random Llama-architecture model folder (config.json, safetensors
weights, a SentencePiece tokenizer trained on generated text); ``write_head`` a random EAGLE-3
head for it in one of the upstream checkpoint layouts; ``converter`` extracts
``convert_hf_to_gguf.py`` (with its ``conversion`` package and ``gguf-py``) from the
llama-cpp-python sdist that the Makefile downloads; ``convert`` runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def sdist_path() -> Path:
    """The llama-cpp-python sdist the Makefile downloads (``build/sdist``), for the installed version."""
    import llama_cpp

    return REPO / "build" / "sdist" / f"llama_cpp_python-{llama_cpp.__version__}.tar.gz"


def converter(dest: Path) -> Path:
    """Extract the vendored llama.cpp's ``convert_hf_to_gguf.py``, ``conversion/`` and
    ``gguf-py/`` from the sdist into ``dest``; returns the script's path.

    Raises:
        FileNotFoundError: no sdist (run ``make env``).
    """
    sdist = sdist_path()
    if not sdist.exists():
        raise FileNotFoundError(sdist)
    top = sdist.name[: -len(".tar.gz")] + "/vendor/llama.cpp/"
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(top) and m.name[len(top) :].startswith(wanted):
                m.name = m.name[len(top) :]
                members.append(m)
        tar.extractall(dest, members=members, filter="data")
    return dest / "convert_hf_to_gguf.py"


_DRIVER = """
import json, runpy, sys
script, jobs = sys.argv[1], json.loads(sys.argv[2])
main = runpy.run_path(script)["main"]  # the script's own main(), as `python SCRIPT ARGS...` runs it
for argv in jobs:
    sys.argv = [script, *argv]
    main()
"""


def convert(script: Path, *jobs: list[str]) -> None:
    """Run ``python convert_hf_to_gguf.py ARGS...`` for each argument list in ``jobs``
    (offline), in one interpreter: the script's ``main()`` once per job (importing torch and
    transformers once instead of once per file).

    Raises:
        RuntimeError: the converter failed (its last output lines in the message).
    """
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-c", _DRIVER, str(script), json.dumps([[str(a) for a in job] for job in jobs])]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=script.parent)
    if p.returncode != 0:
        tail = "\n".join((p.stdout + p.stderr).splitlines()[-20:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({p.returncode}) on {jobs}:\n{tail}")


WORDS = (
    "the a of to and in is it that for on with as was at by be this from or have an they which one you had not "
    "but what all were when we there can more if no out so said up time about than into them only some could new "
    "red green blue apple river stone cloud light night table garden window music paper story water"
).split()


def train_tokenizer(dest: Path, vocab_size: int, seed: int) -> Path:
    """Train a byte-fallback BPE SentencePiece model (Llama's kind) on generated text; returns
    ``dest / "tokenizer.model"``."""
    import sentencepiece as spm

    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 15)))).capitalize() + "." for _ in range(2000)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(dest / "tokenizer"),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )  # fmt: skip
    (dest / "tokenizer.vocab").unlink()
    return dest / "tokenizer.model"


@dataclass(frozen=True)
class TargetSpec:
    """A tiny Llama target: hidden size, layers, heads, SwiGLU width, vocabulary size."""

    hidden: int = 64
    layers: int = 8
    heads: int = 4
    kv_heads: int = 2
    ff: int = 128
    vocab: int = 320
    tokenizer_seed: int = 0


def _config(spec: TargetSpec, **extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ff,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "vocab_size": spec.vocab,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        **extra,
    }


def _save(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def _decoder_layer(rng, prefix: str, hidden: int, heads: int, kv_heads: int, ff: int, d_in: int) -> dict:
    hd = hidden // heads

    def mat(rows, cols, std=0.08):
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    return {
        f"{prefix}input_layernorm.weight": norm(hidden),
        f"{prefix}self_attn.q_proj.weight": mat(heads * hd, d_in),
        f"{prefix}self_attn.k_proj.weight": mat(kv_heads * hd, d_in),
        f"{prefix}self_attn.v_proj.weight": mat(kv_heads * hd, d_in),
        f"{prefix}self_attn.o_proj.weight": mat(hidden, heads * hd),
        f"{prefix}post_attention_layernorm.weight": norm(hidden),
        f"{prefix}mlp.gate_proj.weight": mat(ff, hidden),
        f"{prefix}mlp.up_proj.weight": mat(ff, hidden),
        f"{prefix}mlp.down_proj.weight": mat(hidden, ff),
    }


def write_target(dest: Path, spec: TargetSpec = TargetSpec(), *, weights: bool = True, seed: int = 0) -> Path:
    """A random Llama target folder (config.json, tokenizer.model, model.safetensors unless
    ``weights`` is False: a head's conversion reads only the config and the tokenizer)."""
    dest.mkdir(parents=True, exist_ok=True)
    train_tokenizer(dest, spec.vocab, spec.tokenizer_seed)
    (dest / "config.json").write_text(json.dumps(_config(spec), indent=1))
    if weights:
        rng = np.random.default_rng(seed)
        t = {"model.embed_tokens.weight": rng.standard_normal((spec.vocab, spec.hidden)).astype(np.float32)}
        for i in range(spec.layers):
            t |= _decoder_layer(rng, f"model.layers.{i}.", spec.hidden, spec.heads, spec.kv_heads, spec.ff, spec.hidden)
        t["model.norm.weight"] = np.ones(spec.hidden, dtype=np.float32)
        t["lm_head.weight"] = (rng.standard_normal((spec.vocab, spec.hidden)) * 0.5).astype(np.float32)
        _save(dest / "model.safetensors", t)
    return dest


LAYOUTS = ("eagle", "specforge")
"""Upstream EAGLE-3 checkpoint layouts: the EAGLE repo's (``midlayer.*``, no token embeddings,
feature layers implied) and SpecForge's (``model.layers.0.*``, its own copy of the target's
token embeddings, ``eagle_aux_hidden_state_layer_ids`` in its config)."""


@dataclass(frozen=True)
class HeadInfo:
    path: Path
    target_layers: tuple[int, int, int]
    d2t: np.ndarray  # absolute target ids of the draft vocabulary, [draft_vocab] int64


def write_head(
    dest: Path,
    target: Path,
    layout: str,
    *,
    draft_vocab: int = 96,
    aux_layers: tuple[int, int, int] | None = None,
    norm_before_fc: bool = False,
    norm_before_residual: bool = False,
    seed: int = 1,
) -> HeadInfo:
    """A random EAGLE-3 head for the target folder ``target`` in checkpoint ``layout`` (``LAYOUTS``).

    ``d2t`` holds offsets (target id - draft id) and ``t2d`` a boolean mask over the target
    vocabulary, as the upstream trainers save them. ``aux_layers`` goes into the config as
    ``eagle_aux_hidden_state_layer_ids`` (SpecForge's key); without it the converter uses
    ``(2, n_layer // 2, n_layer - 3)``. ``norm_before_fc`` (an RMSNorm ``input_norm`` over the
    fused features before ``fc``, as in NVIDIA's EAGLE-3.1 heads) and ``norm_before_residual``
    (the residual around attention is the normed feature row, as in speculators' heads) go
    into the config.
    """
    tcfg = json.loads((target / "config.json").read_text())
    hidden, vocab, n_layer = tcfg["hidden_size"], tcfg["vocab_size"], tcfg["num_hidden_layers"]
    heads, kv, ff = tcfg["num_attention_heads"], tcfg["num_key_value_heads"], tcfg["intermediate_size"]
    rng = np.random.default_rng(seed)
    dest.mkdir(parents=True, exist_ok=True)
    extra = {"draft_vocab_size": draft_vocab, "num_hidden_layers": 1}
    if aux_layers is not None:
        extra["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    if norm_before_fc:
        extra["norm_before_fc"] = True
    if norm_before_residual:
        extra["norm_before_residual"] = True
    cfg = _config(TargetSpec(hidden=hidden, layers=1, heads=heads, kv_heads=kv, ff=ff, vocab=vocab), **extra)
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    # the draft vocabulary: the end-of-sequence token and a random subset of the others
    ids = np.sort(np.concatenate([[2], rng.choice(np.arange(3, vocab), size=draft_vocab - 1, replace=False)]))
    t2d = np.zeros(vocab, dtype=bool)
    t2d[ids] = True
    prefix = {"eagle": "midlayer.", "specforge": "model.layers.0."}[layout]
    t = _decoder_layer(rng, prefix, hidden, heads, kv, ff, 2 * hidden)
    t[prefix + "hidden_norm.weight"] = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    t["fc.weight"] = (rng.standard_normal((hidden, 3 * hidden)) * 0.1).astype(np.float32)
    if norm_before_fc:
        t["input_norm.weight"] = (1.0 + 0.1 * rng.standard_normal(3 * hidden)).astype(np.float32)
    t["norm.weight" if layout == "eagle" else "model.norm.weight"] = np.ones(hidden, dtype=np.float32)
    t["lm_head.weight"] = (rng.standard_normal((draft_vocab, hidden)) * 0.5).astype(np.float32)
    t["d2t"] = (ids - np.arange(draft_vocab)).astype(np.int64)
    t["t2d"] = t2d
    if layout == "specforge" and (target / "model.safetensors").exists():
        from safetensors.numpy import load_file

        t["model.embed_tokens.weight"] = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    _save(dest / "model.safetensors", t)
    layers = aux_layers or (2, n_layer // 2, n_layer - 3)
    return HeadInfo(dest, tuple(layers), ids.astype(np.int64))


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def _rope_hf(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """Hugging Face Llama rotary embedding (``rotate_half``: the two halves of each head are
    the pairs) of ``x`` [n, heads, head_dim] at positions ``pos`` [n]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos[:, None].astype(np.float64) * inv[None, :]  # [n, hd / 2]
    cos = np.concatenate([np.cos(ang)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, axis=-1)[:, None, :]
    rot = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], axis=-1)
    return x * cos + rot * sin


def reference_head_logits(head_dir: Path, target_dir: Path, features: np.ndarray, tokens: list[int]) -> np.ndarray:
    """The EAGLE-3 head of the checkpoint ``head_dir`` as the upstream trainers define it, in
    float64 numpy, straight from its safetensors (no GGUF, no llama.cpp): entries at positions
    ``0 .. n - 1`` with ``g = fc(features)`` ([n, 3 * hidden]) and the tokens ``tokens`` ([n]:
    the token after each position), causal attention over all of them.

    Returns:
        [n, draft_vocab] float64 logits over the draft vocabulary.
    """
    from safetensors.numpy import load_file

    cfg = json.loads((head_dir / "config.json").read_text())
    raw = load_file(str(head_dir / "model.safetensors"))
    w = {k: v.astype(np.float64) for k, v in raw.items() if k not in ("d2t", "t2d")}
    p = "midlayer." if any(k.startswith("midlayer.") for k in w) else "model.layers.0."
    emb = w.get("model.embed_tokens.weight")
    if emb is None:
        emb = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"].astype(np.float64)
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // nh
    n = len(tokens)
    f = features.astype(np.float64)
    if cfg.get("norm_before_fc"):
        f = _rms(f, w["input_norm.weight"], eps)
    g = f @ w["fc.weight"].T
    g_norm = _rms(g, w[p + "hidden_norm.weight"], eps)
    x = np.concatenate([_rms(emb[tokens], w[p + "input_layernorm.weight"], eps), g_norm], axis=-1)
    pos = np.arange(n)
    q = _rope_hf((x @ w[p + "self_attn.q_proj.weight"].T).reshape(n, nh, hd), pos, theta)
    k = _rope_hf((x @ w[p + "self_attn.k_proj.weight"].T).reshape(n, nkv, hd), pos, theta)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(n, nkv, hd)
    rep = nh // nkv
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
    s = np.where(np.tril(np.ones((n, n), dtype=bool))[None], s, -np.inf)
    a = np.exp(s - s.max(axis=-1, keepdims=True))
    a /= a.sum(axis=-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", a, v).reshape(n, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
    h = o + (g_norm if cfg.get("norm_before_residual") else g)  # the residual around attention
    y = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
    gate = y @ w[p + "mlp.gate_proj.weight"].T
    h = h + ((gate / (1.0 + np.exp(-gate))) * (y @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    norm = w.get("norm.weight", w.get("model.norm.weight"))
    return _rms(h, norm, eps) @ w["lm_head.weight"].T
