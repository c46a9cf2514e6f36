"""Medusa heads' cost per step against a target single-token decode, side by side.

    python scripts/measure_medusa_cost.py [--vocab 1024,2048,4096,8192] [--heads 4] [--rounds 40]

For each draft-vocabulary size: K heads with a shared readout (the shipped layout) and with
per-head readouts, random weights of the real shapes (E = the target's hidden size). Each
round times, interleaved: one target decode of one token with its logits (llama.cpp, the
engine's thread count) and the heads' whole drafting step (``MedusaDrafter.extend`` with a
K x 6 tree of at most 64 nodes: the C kernels plus the tree's top-k and bookkeeping). Prints medians and the ratio; then
the ``FinalNormTap``'s own cost (decodes with and without it, interleaved).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", default="1024,2048,4096,8192")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None, help="target decode threads (default: all)")
    a = ap.parse_args()

    from types import SimpleNamespace

    from localspec.backend import Batch, Context, Model
    from localspec.drafters.medusa import MedusaDrafter
    from localspec.models import default_model_path
    from localspec.models.medusa_gguf import MedusaWeights
    from localspec.policy import TreeShape

    m = Model(default_model_path())
    ctx = Context(m, n_ctx=2048, n_batch=512, n_seq_max=1, n_threads=a.threads)
    b = Batch(512, 1)
    toks = m.tokenize("The history of the printing press begins in the fifteenth century. " * 20)[:256]
    b.set_sequence(toks, 0, output="last")
    ctx.decode(b)
    pos = len(toks)
    rng = np.random.default_rng(0)
    e, k = m.n_embd, a.heads
    target = SimpleNamespace(model=SimpleNamespace(n_embd=e, n_vocab=m.n_vocab, suppress_tokens=m.suppress_tokens))
    print(f"target decode vs {k} Medusa heads (E={e}), {a.rounds} interleaved rounds, ctx threads {ctx.n_threads}")
    for v in [int(x) for x in a.vocab.split(",")]:
        for shared in (True, False):
            d2t = np.sort(rng.choice(m.n_vocab, v, replace=False))
            w = MedusaWeights(w=(rng.standard_normal((k, e, e)) * 0.02).astype(np.float32),
                              b=np.zeros((k, e), np.float32),
                              out=rng.standard_normal((1 if shared else k, v, e)).astype(np.float32), d2t=d2t)
            d = MedusaDrafter(w)
            d.attach(target)
            hist = list(toks)
            d.begin(hist)
            t_dec, t_heads = [], []
            for i in range(a.rounds):
                b.set_sequence([toks[i % len(toks)]], pos, output="last")
                t0 = time.perf_counter()
                ctx.decode(b)
                ctx.logits()
                t_dec.append(time.perf_counter() - t0)
                ctx.seq_rm(0, pos, -1)
                d.set_final_hidden(len(hist) - 2, rng.standard_normal(e).astype(np.float32) * 3)
                t0 = time.perf_counter()
                d.propose(8, 64)
                tree = d.extend(TreeShape(depth=k, width=6, max_nodes=64, min_score=0.0))
                t_heads.append(time.perf_counter() - t0)
            md, mh = np.median(t_dec) * 1e3, np.median(t_heads) * 1e3
            print(f"V={v:5d} readout={'shared' if shared else 'per-head'}: decode {md:6.1f} ms, heads+tree {mh:5.2f} ms "
                  f"({tree.n_nodes} nodes) = {100 * mh / md:4.1f}% of a decode")
    # the FinalNormTap's own cost: decodes with and without it, interleaved
    from localspec.backend.features import FinalNormTap

    tap = FinalNormTap(e, native=False)  # the Python callback: its time inside is measured
    ctx2 = Context(m, n_ctx=2048, n_batch=512, n_seq_max=1, n_threads=a.threads, cb_eval=tap.callback,
                   cb_eval_user_data=tap.user_data)
    b.set_sequence(toks, 0, output="last")
    ctx2.decode(b)
    tap.clear()
    t_plain, t_tap = [], []
    for i in range(a.rounds):
        for c, ts in ((ctx, t_plain), (ctx2, t_tap)):
            b.set_sequence([toks[i % len(toks)]], pos, output="last")
            t0 = time.perf_counter()
            c.decode(b)
            c.logits()
            ts.append(time.perf_counter() - t0)
            c.seq_rm(0, pos, -1)
        assert tap.take().shape == (1, e)
    mp, mt = np.median(t_plain) * 1e3, np.median(t_tap) * 1e3
    print(f"decode without tap {mp:.1f} ms, with FinalNormTap {mt:.1f} ms ({100 * (mt - mp) / mp:+.1f}%); "
          f"{tap.t_callback_us / 1e3 / a.rounds:.2f} ms per decode inside the callback")
    ctx2.close()
    ctx.close()
    m.close()


if __name__ == "__main__":
    main()
