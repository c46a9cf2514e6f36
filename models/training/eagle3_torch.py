"""An EAGLE-3 head in torch that computes what llama.cpp's ``eagle3`` graph computes.

The graph (``src/models/eagle3.cpp`` in the llama.cpp that llama-cpp-python 0.3.36 vendors),
for one entry at position ``pos`` with token ``t`` and input row ``g`` (the ``fc`` output of
the target features, or the head's own pre-norm output of the entry before it)::

    x     = [ rmsnorm(E[t]) * attn_norm ; rmsnorm(g) * hidden_norm ]      (2 * n_embd)
    q,k,v = Wq x, Wk x, Wv x;  RoPE type NORM (adjacent pairs) on q, k at ``pos``
    a     = Wo softmax(q k^T / sqrt(head_dim), causal over the head's KV) v   (GQA)
    r     = a + g                       (norm_before_residual = False: the raw g)
    h     = r + Wdown(silu(Wgate n) * Wup n),   n = rmsnorm(r) * ffn_norm
    logits over the draft vocabulary = Wout (rmsnorm(h) * output_norm);  h is the pre-norm
    state the next drafting level reads

``E`` is the target's token embedding table, **unscaled**. ``Eagle3Head.forward`` runs
EAGLE-3's *training-time test*: the head is unrolled ``n_steps`` times on its own pre-norm
outputs, with the attention pattern the runtime produces (see ``forward``).

The encoder input is standardised per column (``feat_scale``) during training and the scale is
folded into ``fc`` at export (``to_weights``), so the GGUF needs no extra operation.
"""

from __future__ import annotations


import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..eagle3_gguf import Eagle3Config, Eagle3Weights


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """llama.cpp's ``ggml_rms_norm`` times ``w`` (no Gemma-style ``1 + w``)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_norm(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE type NORM (llama.cpp ``mode = 0``): adjacent pairs ``(x[2i], x[2i+1])`` rotated by
    ``pos * base^(-2i / d)``.

    Args:
        x: [..., T, d] float; pos: [T] or [B, 1, T] positions (broadcast against x's leading dims).
    """
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)  # [d/2]
    ang = pos.to(torch.float32)[..., None] * inv  # [..., T, d/2]
    cos, sin = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class Eagle3Head(nn.Module):
    """The head's trainable tensors plus the frozen target embedding table.

    Args:
        cfg: hyper-parameters (``models.eagle3_gguf.Eagle3Config``).
        tok_embd: [n_vocab, n_embd] float32 the target's (dequantised, unscaled) token embeddings.
        d2t: [n_draft] int64 absolute target ids of the draft vocabulary.
        feat_scale: [3 * n_embd_target] float32 per-column standard deviations of the features
            (the encoder sees ``features / feat_scale``).
    """

    def __init__(self, cfg: Eagle3Config, tok_embd: np.ndarray, d2t: np.ndarray, feat_scale: np.ndarray) -> None:
        super().__init__()
        self.cfg = cfg
        e, n_draft = cfg.n_embd, int(d2t.shape[0])
        q, kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        self.register_buffer("tok_embd", torch.as_tensor(tok_embd, dtype=torch.float32), persistent=False)
        self.register_buffer("d2t", torch.as_tensor(d2t, dtype=torch.int64))
        self.register_buffer("feat_scale", torch.as_tensor(feat_scale, dtype=torch.float32))
        self.fc = nn.Linear(3 * cfg.n_embd_target, e, bias=False)
        self.attn_norm = nn.Parameter(torch.ones(e))
        self.hidden_norm = nn.Parameter(torch.ones(e))
        self.wq = nn.Linear(2 * e, q, bias=False)
        self.wk = nn.Linear(2 * e, kv, bias=False)
        self.wv = nn.Linear(2 * e, kv, bias=False)
        self.wo = nn.Linear(q, e, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(e))
        self.w_gate = nn.Linear(e, cfg.n_ff, bias=False)
        self.w_up = nn.Linear(e, cfg.n_ff, bias=False)
        self.w_down = nn.Linear(cfg.n_ff, e, bias=False)
        self.output_norm = nn.Parameter(torch.ones(e))
        self.output = nn.Linear(e, n_draft, bias=False)
        for lin in (self.wq, self.wk, self.wv, self.wo, self.w_gate, self.w_up, self.w_down, self.output):
            nn.init.normal_(lin.weight, std=0.02)
        nn.init.normal_(self.fc.weight, std=(3 * cfg.n_embd_target) ** -0.5)

    # -- pieces of the graph -------------------------------------------------------------------

    def encode(self, feats: torch.Tensor) -> torch.Tensor:
        """``fc`` over raw target features: [..., 3 * n_embd_target] -> [..., n_embd]."""
        return self.fc(feats / self.feat_scale)

    def _qkv(self, tokens: torch.Tensor, g: torch.Tensor, pos: torch.Tensor):
        eps = self.cfg.rms_eps
        x = torch.cat([rms_norm(self.tok_embd[tokens], self.attn_norm, eps), rms_norm(g, self.hidden_norm, eps)], -1)
        b, t = tokens.shape
        hd, base = self.cfg.head_dim, self.cfg.rope_freq_base
        q = self.wq(x).view(b, t, self.cfg.n_head, hd).transpose(1, 2)  # [B, H, T, hd]
        k = self.wk(x).view(b, t, self.cfg.n_head_kv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
        v = self.wv(x).view(b, t, self.cfg.n_head_kv, hd).transpose(1, 2)
        return rope_norm(q, pos, base), rope_norm(k, pos, base), v

    def _finish(self, attn: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """attn [B, H, T, hd] -> pre-norm states [B, T, n_embd] (output projection, residual, FFN)."""
        b, _, t, _ = attn.shape
        r = self.wo(attn.transpose(1, 2).reshape(b, t, -1)) + g
        n = rms_norm(r, self.ffn_norm, self.cfg.rms_eps)
        return r + self.w_down(F.silu(self.w_gate(n)) * self.w_up(n))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of pre-norm states: [..., n_embd] -> [..., n_draft]."""
        return self.output(rms_norm(hidden, self.output_norm, self.cfg.rms_eps))

    def _expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, ...] -> [B, H, ...]: query head h reads key/value head h // (H / Hkv)."""
        return x.repeat_interleave(self.cfg.n_head // self.cfg.n_head_kv, dim=1)

    # -- training-time test --------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor, n_steps: int, pos0: int = 0) -> list[torch.Tensor]:
        """Unroll the head ``n_steps`` times over a window of ``T`` positions.

        Args:
            tokens: [B, T] int64 tokens ``t_0 .. t_{T-1}`` (right-padded with any id).
            feats: [B, T, 3 * n_embd_target] float32 target features at the same positions.
            n_steps: unroll depth (1 = plain next-next-token training).
            pos0: position of ``t_0`` (RoPE).
        Returns:
            The pre-norm states [B, T, n_embd] of each step (``logits`` turns them into
            draft-vocabulary logits). Step ``k``'s entry of origin ``P`` sits at position
            ``P + k``, reads token ``t_{P+k+1}`` and (step 0) ``fc(f_P)`` or (later steps) the
            step ``k - 1`` pre-norm state of the same origin, and attends, as in the runtime's
            head KV, to the step-0 entries at positions ``<= P`` and to its own chain's entries
            of steps ``1 .. k``. It predicts ``t_{P+k+2}``; entries whose token would lie past
            the window are padding (mask them out of the loss).
        """
        b, t = tokens.shape
        dev = tokens.device
        scale = self.cfg.head_dim**-0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        g = self.encode(feats)
        outs: list[torch.Tensor] = []
        k0 = v0 = None
        chain_k: list[torch.Tensor] = []
        chain_v: list[torch.Tensor] = []
        for step in range(n_steps):
            shifted = torch.zeros_like(tokens)
            shifted[:, : t - step - 1] = tokens[:, step + 1 :]
            pos = torch.arange(t, device=dev) + pos0 + step
            q, k, v = self._qkv(shifted, g, pos)
            k, v = self._expand_kv(k), self._expand_kv(v)
            if step == 0:
                k0, v0 = k, v
            else:
                chain_k.append(k)
                chain_v.append(v)
            s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, H, T, T]
            s0 = s0.masked_fill(~causal, float("-inf"))
            sd = [(q * kc).sum(-1, keepdim=True) * scale for kc in chain_k]  # each [B, H, T, 1]
            p = torch.softmax(torch.cat([s0, *sd], dim=-1), dim=-1)
            attn = p[..., :t] @ v0
            for i, vc in enumerate(chain_v):
                attn = attn + p[..., t + i : t + i + 1] * vc
            g = self._finish(attn, g)
            outs.append(g)
        return outs

    # -- export --------------------------------------------------------------------------------

    def to_weights(self) -> Eagle3Weights:
        """The tensors for ``write_eagle3_gguf`` (float32 numpy, ``feat_scale`` folded into fc)."""

        def a(t: torch.Tensor) -> np.ndarray:
            return t.detach().to("cpu", torch.float32).numpy().copy()

        return Eagle3Weights(
            fc=a(self.fc.weight / self.feat_scale[None, :]),
            attn_norm=a(self.attn_norm), hidden_norm=a(self.hidden_norm),
            wq=a(self.wq.weight), wk=a(self.wk.weight), wv=a(self.wv.weight), wo=a(self.wo.weight),
            ffn_norm=a(self.ffn_norm),
            w_gate=a(self.w_gate.weight), w_up=a(self.w_up.weight), w_down=a(self.w_down.weight),
            output_norm=a(self.output_norm), output=a(self.output.weight),
            d2t=self.d2t.cpu().numpy().astype(np.int64),
        )  # fmt: skip


def reference_decode(
    w: Eagle3Weights, cfg: Eagle3Config, tok_embd: np.ndarray, tokens: np.ndarray, g: np.ndarray, pos: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One causal pass of the decoder graph over entries ``(tokens[i], g[i], pos[i])`` in KV
    order (each attends to itself and every earlier entry), from exported weights: the torch
    reference of a llama.cpp decode for parity tests.

    Args:
        tokens: [n] int; g: [n, n_embd] float32; pos: [n] int.
    Returns:
        (logits [n, n_draft] float32, pre-norm states [n, n_embd] float32).
    """
    t = lambda x: torch.as_tensor(np.asarray(x), dtype=torch.float32)  # noqa: E731
    eps, hd = cfg.rms_eps, cfg.head_dim
    x = torch.cat([rms_norm(t(tok_embd[tokens]), t(w.attn_norm), eps), rms_norm(t(g), t(w.hidden_norm), eps)], -1)
    n = x.shape[0]
    q = (x @ t(w.wq).T).view(n, cfg.n_head, hd).transpose(0, 1)
    k = (x @ t(w.wk).T).view(n, cfg.n_head_kv, hd).transpose(0, 1)
    v = (x @ t(w.wv).T).view(n, cfg.n_head_kv, hd).transpose(0, 1)
    p = torch.as_tensor(pos)
    q, k = rope_norm(q, p, cfg.rope_freq_base), rope_norm(k, p, cfg.rope_freq_base)
    rep = cfg.n_head // cfg.n_head_kv
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    s = (q @ k.transpose(-1, -2)) * hd**-0.5
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    a = (torch.softmax(s, -1) @ v).transpose(0, 1).reshape(n, -1)
    r = a @ t(w.wo).T + t(g)
    nn_ = rms_norm(r, t(w.ffn_norm), eps)
    h = r + (F.silu(nn_ @ t(w.w_gate).T) * (nn_ @ t(w.w_up).T)) @ t(w.w_down).T
    logits = rms_norm(h, t(w.output_norm), eps) @ t(w.output).T
    return logits.numpy(), h.numpy()
