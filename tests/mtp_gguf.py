"""Tiny GGUFs of an MTP-capable architecture for the MTP tests (``write_tiny_glm4moe``).

No model with MTP / NextN blocks is on the package registries, so the tests write their own:
a GLM-4.5-style (llama.cpp architecture ``glm4moe``) target with random weights, a tiny
byte-level SentencePiece vocabulary and, unless ``nextn=False``, one NextN block appended
after the trunk (``blk.{n_layer}.nextn.*``, ``glm4moe.nextn_predict_layers = 1``), laid out as
llama.cpp's ``convert_hf_to_gguf.py`` writes GLM-4.5 (tensor names from ``gguf.TENSOR_NAMES``).

The weights are random but shaped so that the MTP block drafts something the target accepts
often enough to exercise rollbacks and accepted paths:

* the trunk's layers are scaled down (``trunk_scale``), so the residual stream after token
  ``x`` is mostly ``embed(x)``: the target's next-token distribution depends mostly on the
  current token, with a small dependence on the context (attention, FFN);
* the NextN block's ``eh_proj`` maps ``concat(enorm(embed(x)), hnorm(h))`` to roughly
  ``enorm(embed(x))`` plus ``mtp_h_scale`` times a random projection of the hidden state, so
  the block predicts the token after ``x`` (as the target would) and really reads ``h``.

Tokenizer: ``tokenizer.ggml.model = "llama"`` with ``<unk>``, ``<s>``, ``</s>`` and the 256 byte
tokens ``<0x00> .. <0xFF>`` (type BYTE): llama.cpp tokenises any text by byte fallback and
detokenises every id. ``n_vocab = 259``.

A file of the default size (n_embd 64, 2 trunk layers + 1 NextN, 4 experts) is ~0.6 MB
and loads in milliseconds.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

N_SPECIAL = 3  # <unk>, <s>, </s>
N_VOCAB = N_SPECIAL + 256


def _add_tokenizer(w) -> None:
    """The tiny test vocabulary (``_vocab``) as a llama-style tokenizer: UNK 0, BOS 1, EOS 2."""
    tokens, scores, types = _vocab()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _vocab():
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0] * len(tokens)
    # llama_token_type: NORMAL=1, UNKNOWN=2, CONTROL=3, BYTE=6
    types = [2, 3, 3] + [6] * 256
    return tokens, scores, types


def write_tiny_glm4moe(
    path: str | os.PathLike,
    *,
    nextn: bool = True,
    nextn_tensors: bool = True,
    seed: int = 0,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_layer: int = 2,
    n_ff: int = 128,
    n_expert: int = 4,
    n_expert_used: int = 2,
    n_ff_exp: int = 32,
    n_ctx_train: int = 4096,
    trunk_scale: float = 0.5,
    mtp_h_scale: float = 0.1,
    logit_scale: float = 5.0,
) -> Path:
    """Write a tiny random ``glm4moe`` GGUF (F32 weights) and return its path.

    Args:
        path: the file to write.
        nextn: append one NextN / MTP block (``nextn_predict_layers = 1``); False writes the
            same trunk without one (``nextn_predict_layers`` absent): the "no MTP" case.
        nextn_tensors: with ``nextn``, write the block's tensors; False keeps only the
            metadata (a GGUF converted without its MTP layers).
        seed: weights' RNG seed (same seed, same trunk with and without ``nextn``).
        n_embd, n_head, n_head_kv, n_layer, n_ff, n_expert, n_expert_used, n_ff_exp: shapes
            (``n_layer`` trunk layers: layer 0 dense, the rest MoE with one shared expert).
        trunk_scale: scale of the trunk layers' output projections (small: the next token
            depends mostly on the current one, see the module docstring).
        mtp_h_scale: weight of the hidden state in the NextN block's input projection.
        logit_scale: norm of the lm_head rows (larger: peakier distributions).
    Returns:
        ``Path(path)``.
    """
    import gguf

    rng = np.random.default_rng(seed)
    arch = gguf.MODEL_ARCH.GLM4_MOE
    names = gguf.TENSOR_NAMES
    T = gguf.MODEL_TENSOR
    head_dim = n_embd // n_head
    n_blocks = n_layer + (1 if nextn else 0)

    path = Path(path)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name("tiny-glm4moe-mtp" if nextn else "tiny-glm4moe")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_blocks)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_expert_shared_count(1)
    w.add_expert_feed_forward_length(n_ff_exp)
    w.add_leading_dense_block_count(1)
    w.add_expert_weights_scale(1.0)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if nextn:
        w.add_nextn_predict_layers(1)
    _add_tokenizer(w)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    def t(kind, bid, suffix, arr):
        name = names[kind].format(bid=bid) + suffix
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))

    def rand(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)

    emb = rng.standard_normal((N_VOCAB, n_embd)).astype(np.float32)
    out = rng.standard_normal((N_VOCAB, n_embd)).astype(np.float32)
    out *= logit_scale / np.linalg.norm(out, axis=1, keepdims=True)
    out[:N_SPECIAL] = 0.0  # <unk>, <s>, </s>: logit 0, never the greedy choice (generations run long)
    t(T.TOKEN_EMBD, 0, ".weight", emb)
    t(T.OUTPUT_NORM, 0, ".weight", np.ones(n_embd))
    t(T.OUTPUT, 0, ".weight", out)
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    for b in range(n_blocks if nextn_tensors else n_layer):
        # numpy arrays are [rows = out, cols = in]: ggml's {in, out}
        t(T.ATTN_NORM, b, ".weight", np.ones(n_embd))
        t(T.ATTN_POST_NORM, b, ".weight", np.ones(n_embd))
        t(T.ATTN_Q, b, ".weight", rand(q_dim, n_embd))
        t(T.ATTN_K, b, ".weight", rand(kv_dim, n_embd))
        t(T.ATTN_V, b, ".weight", rand(kv_dim, n_embd))
        t(T.ATTN_Q, b, ".bias", rand(q_dim, scale=0.1))
        t(T.ATTN_K, b, ".bias", rand(kv_dim, scale=0.1))
        t(T.ATTN_V, b, ".bias", rand(kv_dim, scale=0.1))
        t(T.ATTN_OUT, b, ".weight", rand(n_embd, q_dim, scale=trunk_scale))
        if b == 0:
            t(T.FFN_GATE, b, ".weight", rand(n_ff, n_embd))
            t(T.FFN_UP, b, ".weight", rand(n_ff, n_embd))
            t(T.FFN_DOWN, b, ".weight", rand(n_embd, n_ff, scale=trunk_scale))
        else:
            t(T.FFN_GATE_INP, b, ".weight", rand(n_expert, n_embd))
            t(T.FFN_EXP_PROBS_B, b, ".bias", np.zeros(n_expert))
            t(T.FFN_GATE_EXP, b, ".weight", rand(n_expert, n_ff_exp, n_embd))
            t(T.FFN_UP_EXP, b, ".weight", rand(n_expert, n_ff_exp, n_embd))
            t(T.FFN_DOWN_EXP, b, ".weight", rand(n_expert, n_embd, n_ff_exp, scale=trunk_scale))
            t(T.FFN_GATE_SHEXP, b, ".weight", rand(n_ff_exp, n_embd))
            t(T.FFN_UP_SHEXP, b, ".weight", rand(n_ff_exp, n_embd))
            t(T.FFN_DOWN_SHEXP, b, ".weight", rand(n_embd, n_ff_exp, scale=trunk_scale))
        if b >= n_layer:  # the NextN block
            eh = np.concatenate([np.eye(n_embd), rand(n_embd, n_embd, scale=mtp_h_scale)], axis=1)
            t(T.NEXTN_EH_PROJ, b, ".weight", eh)
            t(T.NEXTN_ENORM, b, ".weight", np.ones(n_embd))
            t(T.NEXTN_HNORM, b, ".weight", np.ones(n_embd))
            t(T.NEXTN_SHARED_HEAD_NORM, b, ".weight", np.ones(n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_mamba(path: str | os.PathLike, *, seed: int = 0, n_embd: int = 32, n_layer: int = 1) -> Path:
    """Write a tiny random Mamba (llama.cpp architecture ``mamba``, recurrent) GGUF whose
    metadata declares one NextN block (``mamba.nextn_predict_layers = 1``, ``block_count =
    n_layer + 1``) without its tensors: a recurrent target that *claims* MTP blocks, to test
    that ``--drafter mtp`` refuses recurrent / hybrid targets (no real Mamba has MTP blocks;
    Qwen3-Next / Qwen3.5 hybrids do, and are refused by the same check). Same byte vocabulary
    as ``write_tiny_glm4moe``."""
    import gguf

    rng = np.random.default_rng(seed)
    arch = gguf.MODEL_ARCH.MAMBA
    names = gguf.TENSOR_NAMES
    T = gguf.MODEL_TENSOR
    d_inner, d_state, d_conv, dt_rank = 2 * n_embd, 4, 4, 4
    path = Path(path)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name("tiny-mamba")
    w.add_context_length(1024)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer + 1)
    w.add_nextn_predict_layers(1)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_layer_norm_rms_eps(1e-5)
    _add_tokenizer(w)

    def t(kind, bid, suffix, arr):
        w.add_tensor(names[kind].format(bid=bid) + suffix, np.ascontiguousarray(arr, dtype=np.float32))

    def rand(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    t(T.TOKEN_EMBD, 0, ".weight", rng.standard_normal((N_VOCAB, n_embd)))
    t(T.OUTPUT_NORM, 0, ".weight", np.ones(n_embd))
    t(T.OUTPUT, 0, ".weight", rand(N_VOCAB, n_embd))
    for b in range(n_layer):
        t(T.ATTN_NORM, b, ".weight", np.ones(n_embd))
        t(T.SSM_IN, b, ".weight", rand(2 * d_inner, n_embd))
        t(T.SSM_CONV1D, b, ".weight", rand(d_inner, d_conv))
        t(T.SSM_CONV1D, b, ".bias", np.zeros(d_inner))
        t(T.SSM_X, b, ".weight", rand(dt_rank + 2 * d_state, d_inner))
        t(T.SSM_DT, b, ".weight", rand(d_inner, dt_rank))
        t(T.SSM_DT, b, ".bias", np.zeros(d_inner))
        t(T.SSM_A, b, "", -np.ones((d_inner, d_state)))
        t(T.SSM_D, b, "", np.ones(d_inner))
        t(T.SSM_OUT, b, ".weight", rand(n_embd, d_inner))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
