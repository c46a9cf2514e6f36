"""Recording rates of the three ways `eagle3_data` records training data, side by side in one run.

    python scripts/measure_recording.py [--rounds 3] [--chunk 512] [--n-seq 64] [--gen 32]

Each round records, on the same machine state: one text chunk of ``--chunk`` tokens through
``FeatureRecorder.record_text`` (full 262k-wide logits rows from llama.cpp, top-k in torch),
the same chunk through ``TeacherForcedRecorder`` (graph stopped before the lm_head, logits over
an 8,192-token draft vocabulary), and ``--n-seq`` self-distilled sequences (64-token prompts,
``--gen`` greedy tokens each, one batched decode per step). Prints recorded tokens per second
per mode (median over rounds) and the ratios; the machine load (``/proc/loadavg``) before and
after. Text comes from the Python standard library; nothing here reads the Spec-Bench questions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def main() -> None:
    from localspec.backend import Model
    from localspec.models import default_model_path
    from localspec.models.training.eagle3_data import FeatureRecorder, TeacherForcedRecorder, iter_text_files, stdlib_sources

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--n-seq", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    a = ap.parse_args()
    layers = (2, 9, 15)
    target = default_model_path()
    load0 = os.getloadavg()
    m = Model(target, vocab_only=True)
    ids: list[int] = []
    for _, text in iter_text_files([p for p in stdlib_sources() if p.suffix == ".py"][:200]):
        ids += m.tokenize(text, add_special=False)
        if len(ids) > (a.rounds + 1) * a.chunk + a.n_seq * 64 * (a.rounds + 1):
            break
    bos = [m.bos]
    m.close()
    d2t = np.sort(np.argsort(-np.bincount(ids, minlength=262144), kind="stable")[:8192]).astype(np.int64)
    full = FeatureRecorder(target, layers, topk=8, n_seq=a.n_seq, n_ctx=a.n_seq * (64 + a.gen + 8) + 1024,
                           n_batch=a.chunk)  # fmt: skip
    tf = TeacherForcedRecorder(target, layers, d2t, topk=8, n_batch=a.chunk)
    rates: dict[str, list[float]] = {"text_full_rows": [], "text_teacher_forced": [], "self_distill": []}
    off = 0
    try:
        for r in range(a.rounds + 1):  # round 0 warms up (graph allocation, output buffers)
            chunk = bos + ids[off : off + a.chunk - 1]
            off += a.chunk
            t = time.perf_counter()
            full.record_text(chunk)
            t_full = time.perf_counter() - t
            t = time.perf_counter()
            tf.record_text(chunk)
            t_tf = time.perf_counter() - t
            prompts = [bos + ids[off + 64 * j : off + 64 * j + 63] for j in range(a.n_seq)]
            off += 64 * a.n_seq
            t = time.perf_counter()
            recs = full.record_generated(prompts, a.gen)
            t_gen = time.perf_counter() - t
            if r:
                rates["text_full_rows"].append(len(chunk) / t_full)
                rates["text_teacher_forced"].append(len(chunk) / t_tf)
                rates["self_distill"].append(sum(x.tokens.size for x in recs) / t_gen)
                print(json.dumps(dict(round=r, **{k: round(v[-1], 1) for k, v in rates.items()},
                                      loadavg=os.getloadavg())), flush=True)  # fmt: skip
    finally:
        full.close()
        tf.close()
    med = {k: round(statistics.median(v), 1) for k, v in rates.items()}
    print(json.dumps(dict(
        tokens_per_s=med, teacher_forced_over_full_rows=round(med["text_teacher_forced"] / med["text_full_rows"], 2),
        teacher_forced_over_self_distill=round(med["text_teacher_forced"] / med["self_distill"], 2),
        all_rounds={k: [round(x, 1) for x in v] for k, v in rates.items()}, chunk=a.chunk, n_seq=a.n_seq,
        gen_tokens=a.gen, loadavg_before=load0, loadavg_after=os.getloadavg(), n_cpu=os.cpu_count(),
    )))  # fmt: skip


if __name__ == "__main__":
    main()
