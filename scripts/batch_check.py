"""One-off check of `localspec batch` (issue 13): N Spec-Bench prompts, killed half-way and
restarted, then every output compared with a one-at-a-time `Engine.generate` at T=0.

    python scripts/batch_check.py /work/shared/data/spec_bench/question.jsonl --n 200 --max-tokens 16

Prints the counts and exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dataset")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--max-prompt-chars", type=int, default=300)
    ap.add_argument("--work", default=None)
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="batch-check-"))
    work.mkdir(parents=True, exist_ok=True)
    qs = [json.loads(x) for x in Path(a.dataset).read_text().splitlines() if x.strip()]
    items = [{"id": f"q{q['question_id']}-{i}", "prompt": q["turns"][0][: a.max_prompt_chars]} for i, q in enumerate(qs[: a.n])]
    inp, out = work / "in.jsonl", work / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in items))
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "localspec", "batch", str(inp), "--out", str(out), "-n", str(a.max_tokens),
           "--parallel", str(a.parallel), "--temperature", "0", "--no-progress"]

    def n_done() -> int:
        return len(out.read_text().splitlines()) if out.exists() else 0

    # run 1: killed (SIGKILL) once half the ids are written
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    while n_done() < a.n // 2 and p.poll() is None:
        time.sleep(0.5)
    p.send_signal(signal.SIGKILL)
    p.wait()
    first = n_done()
    # run 2: resumes
    r = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    print(r.stderr.strip().splitlines()[0] if r.stderr else "")
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    ids = [x["id"] for x in lines]
    ok = True
    print(f"killed after {first} results; after restart {len(lines)} lines, {len(set(ids))} distinct ids of {a.n}")
    ok &= len(ids) == len(set(ids)) == a.n
    errors = [x for x in lines if "error" in x]
    print(f"errors recorded: {len(errors)}")
    # one at a time
    from localspec import Engine, SamplingParams

    got = {x["id"]: x.get("text") for x in lines}
    e = Engine(drafter="ngram", n_ctx=2048)
    diff = 0
    for it in items:
        e.reset()
        ref = e.generate(it["prompt"], max_tokens=a.max_tokens, sampling=SamplingParams.greedy()).text
        diff += got.get(it["id"]) != ref
    e.close()
    print(f"outputs differing from one-at-a-time generate: {diff} of {a.n}; load {os.getloadavg()[0]:.1f}")
    ok &= diff == 0
    print("OK" if ok else "FAILED", "work dir", work)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
