"""What junk cells cost a batched step (docs/serve.md, "Junk cells").

The scheduler keeps rejected tree nodes and finished requests' cells in the KV cache as junk
(cells stay in position order), and every row's attention walks every used cell. This times
a step of 8 decode rows (one per sequence) and a 64-token prompt piece, with 8 sequences of
300 tokens after 0, 4,096 and 12,288 junk cells, in two rounds.

    python scripts/junk_cost.py
"""

import time

import numpy as np

from localspec.backend import Batch, Context, Model
from localspec.models import default_model_path

P = 300  # tokens per live sequence


def main() -> None:
    m = Model(default_model_path())
    rng = np.random.default_rng(0)
    res: dict = {}
    for _round in range(2):
        for junk in (0, 4096, 12288):
            ctx = Context(m, n_ctx=16384 + 512, n_batch=512, n_seq_max=10)
            b = Batch(512, 10)
            for i in range(0, junk, 512):  # junk first: the live cells come after it
                b.set_sequence(rng.integers(100, 5000, 512).astype(np.int32), i, seq_id=9, output="none")
                ctx.decode(b)
            for s in range(8):
                b.set_sequence(rng.integers(100, 5000, P).astype(np.int32), 0, seq_id=s, output="none")
                ctx.decode(b)
            for name, n in (("8 decode rows", 8), ("64-token prompt piece", 64)):
                ts = []
                for _ in range(8):
                    toks = rng.integers(100, 5000, n).astype(np.int32)
                    if n == 8:  # one row per sequence, with logits
                        b.set_tree(toks, np.full(n, P, np.int32), np.arange(n, dtype=np.int32)[:, None],
                                   np.ones(n, np.int32))  # fmt: skip
                    else:  # a prompt piece of sequence 0, no logits
                        b.set_tree(toks, np.arange(P, P + n, dtype=np.int32), np.zeros((n, 1), np.int32),
                                   np.ones(n, np.int32), np.zeros(n, np.int8))  # fmt: skip
                    t0 = time.perf_counter()
                    ctx.decode(b)
                    ts.append(time.perf_counter() - t0)
                    for s in range(8):
                        ctx.seq_rm(s, P, -1)
                res.setdefault((name, junk), []).append(round(1e3 * float(np.median(ts)), 1))
            ctx.close()
    for (name, junk), ms in res.items():
        print(f"{name}, {junk} junk cells: {ms} ms (median of 8, per round)")
    m.close()


if __name__ == "__main__":
    main()
