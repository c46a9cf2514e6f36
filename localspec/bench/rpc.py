"""Plain vs speculative decoding with the target's layers on an RPC worker, at added round-trip
times, in one run (``python -m localspec.bench.rpc``; results in docs/rpc.md).

The worker runs on 127.0.0.1. The round trip is lengthened by :class:`LatencyRelay`, a TCP
relay on 127.0.0.1 that holds every chunk ``rtt/2`` before passing it on, in each direction
(the ggml RPC protocol is request/response, so each exchange pays the whole ``rtt``). This
stands in for ``tc netem``, which the kernel of the machine the numbers come from lacks
(``CONFIG_NET_SCH_NETEM`` is not set). Every case, 0 ms included, goes through the relay.
Each engine calibrates its own cost table on its link (no cost cache), so the policy sizes
its trees for that link. Every case runs through the guard relay (``backend.rpc.Guard``, the
default); ``--unguarded-baseline`` adds a case without it at the first round-trip time, to
measure what the guard costs.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path


class LatencyRelay:
    """Forward TCP connections from ``127.0.0.1:port`` to ``upstream``, each direction delayed
    by ``one_way_s`` (bytes keep their order). ``close()`` stops it and drops its connections.

    Thread-per-direction: a reader stamps each chunk with its due time, a writer sends it then.
    """

    def __init__(self, upstream: tuple[str, int], one_way_s: float) -> None:
        self.upstream = upstream
        self.one_way_s = float(one_way_s)
        self._srv = socket.socket()
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(4)
        self.port = self._srv.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self._socks: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                down, _ = self._srv.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            for s in (down, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._socks.append(s)
            for a, b in ((down, up), (up, down)):
                self._pump(a, b)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        cond = threading.Condition()
        queue: list[tuple[float, int, bytes | None]] = []
        seq = [0]

        def reader() -> None:
            while True:
                try:
                    data = src.recv(1 << 20)
                except OSError:
                    data = b""
                with cond:
                    seq[0] += 1
                    heapq.heappush(queue, (time.monotonic() + self.one_way_s, seq[0], data or None))
                    cond.notify()
                if not data:
                    return

        def writer() -> None:
            while True:
                with cond:
                    while not queue:
                        cond.wait()
                    due, _, data = queue[0]
                    now = time.monotonic()
                    if due > now:
                        cond.wait(due - now)
                        continue
                    heapq.heappop(queue)
                try:
                    if data is None:
                        dst.shutdown(socket.SHUT_WR)
                        return
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=reader, daemon=True).start()
        threading.Thread(target=writer, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        for s in [self._srv, *self._socks]:
            try:
                s.close()
            except OSError:
                pass


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def guard_overhead(endpoint: str, prompt: str, *, repeats: int, max_tokens: int) -> list[dict]:
    """Plain greedy decoding of ``prompt`` straight to the worker (no latency relay), with the
    guard and without it (``LOCALSPEC_RPC_GUARD``), alternating, ``repeats`` times each; one
    engine at a time (a worker serves one connection). Returns one record per run."""
    from ..engine import Engine
    from ..sampling import SamplingParams

    out, cost = [], None
    for i in range(repeats):
        for guard in ((True, False) if i % 2 == 0 else (False, True)):
            os.environ["LOCALSPEC_RPC_GUARD"] = "1" if guard else "0"
            with Engine(rpc=[endpoint], drafter="none", n_ctx=1024, cost_model=cost) as eng:
                cost = eng.cost_model
                r = eng.generate(prompt, max_tokens=max_tokens, sampling=SamplingParams.greedy(), speculative=False)
            n, t_us = len(r.token_ids), r.stats.t_generate_us
            out.append({"guard": guard, "n_tokens": n, "t_decode_us": t_us, "tokens_per_s": n / (t_us * 1e-6), "load": _loadavg()})
            print(f"guard {'on ' if guard else 'off'}: {out[-1]['tokens_per_s']:.2f} tok/s ({n} tokens), load {out[-1]['load']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from ..bench.dataset import load_questions, select_prompts
    from ..bench.specbench import run_bench, summarize
    from ..cli.rpc import find_rpc_server
    from ..engine import Engine
    from ..sampling import SamplingParams

    p = argparse.ArgumentParser(prog="python -m localspec.bench.rpc", description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", default="/work/shared/data/spec_bench/question.jsonl")
    p.add_argument("--categories", default="mt_bench,summarization,rag")
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--rtt-ms", default="0,2,10", help="added round-trip times in ms")
    p.add_argument("-n", "--max-tokens", type=int, default=64)
    p.add_argument("--max-tree-nodes", type=int, default=32)
    p.add_argument("--worker-threads", type=int, default=1)
    p.add_argument("--unguarded-baseline", action="store_true",
                   help="also run the first round-trip time with LOCALSPEC_RPC_GUARD=0 (ggml straight to the relay)")
    p.add_argument("--guard-overhead", type=int, default=0, metavar="N",
                   help="instead: plain decoding with and without the guard, alternating, N times each")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    if find_rpc_server() is None:
        print("rpc-server not built: make rpc-server", file=sys.stderr)
        return 1
    import tempfile

    os.environ["LOCALSPEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="localspec-bench-rpc-")  # keep the user's cost cache clean
    prompts = select_prompts(load_questions(a.questions), a.categories.split(","), a.per_category)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import subprocess

    from ..backend.rpc import RPCError, probe

    worker = subprocess.Popen(
        [sys.executable, "-m", "localspec", "rpc-worker", "--port", str(port), "--threads", str(a.worker_threads)],
        stdout=subprocess.DEVNULL,
    )
    results = {"load_before": _loadavg(), "cases": []}
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                probe(f"127.0.0.1:{port}", timeout=5)
                break
            except RPCError:
                if time.monotonic() > deadline or worker.poll() is not None:
                    raise
                time.sleep(0.05)
        if a.guard_overhead:
            runs = guard_overhead(f"127.0.0.1:{port}", prompts[0].text,
                                  repeats=a.guard_overhead, max_tokens=a.max_tokens)  # fmt: skip
            results["guard_overhead"] = runs
            for g in (True, False):
                n = sum(r["n_tokens"] for r in runs if r["guard"] is g)
                t = sum(r["t_decode_us"] for r in runs if r["guard"] is g)
                print(f"guard {'on' if g else 'off'}: {n / (t * 1e-6):.2f} tok/s over {n} tokens")
            rtts = []
        else:
            rtts = [float(x) for x in a.rtt_ms.split(",")]
        cases = [(rtts[0], False)] if a.unguarded_baseline else []
        cases += [(rtt, True) for rtt in rtts]
        for rtt, guard in cases:
            os.environ["LOCALSPEC_RPC_GUARD"] = "1" if guard else "0"
            relay = LatencyRelay(("127.0.0.1", port), rtt / 2e3)
            try:
                # calibrates t(b) on this link (the relay's new port is a new device set: no cached table)
                eng = Engine(rpc=[relay.endpoint], drafter="ngram", n_ctx=4096, max_tree_nodes=a.max_tree_nodes)
                try:
                    cost = eng.cost_model
                    rtt_us = eng.model.rpc_workers[0].rtt_us
                    t0 = time.monotonic()
                    recs = run_bench(eng, prompts, max_tokens=a.max_tokens, sampling=SamplingParams.greedy())
                    summ = summarize(recs)
                finally:
                    eng.close()
            finally:
                relay.close()
            pn = sum(r.plain.n_tokens for r in recs)
            sn = sum(r.spec.n_tokens for r in recs)
            pt = sum(r.plain.t_decode_us for r in recs)
            st = sum(r.spec.t_decode_us for r in recs)
            steps = sum(r.spec.n_steps for r in recs)
            case = {
                "added_rtt_ms": rtt,
                "guard": guard,
                "hello_rtt_us": rtt_us,
                "t_decode_us_b1": cost.t_decode_us(1),
                "t_decode_us_b16": cost.t_decode_us(16),
                "plain_tokens_per_s": pn / (pt * 1e-6),
                "spec_tokens_per_s": sn / (st * 1e-6),
                "speedup": (sn / st) / (pn / pt),
                "mean_acceptance_length": sn / steps if steps else 0.0,
                "identical": all(r.identical for r in recs),
                "n_prompts": len(recs),
                "wall_s": time.monotonic() - t0,
                "per_category": summ,
                "load": _loadavg(),
            }
            results["cases"].append(case)
            print(
                f"rtt +{rtt:g} ms{'' if guard else ' unguarded'} (hello {rtt_us / 1e3:.2f} ms): plain {case['plain_tokens_per_s']:.1f} tok/s, "
                f"spec {case['spec_tokens_per_s']:.1f} tok/s, x{case['speedup']:.2f}, "
                f"accept len {case['mean_acceptance_length']:.2f}, identical {case['identical']}, "
                f"t(1)={case['t_decode_us_b1'] / 1e3:.1f} ms t(16)={case['t_decode_us_b16'] / 1e3:.1f} ms, load {case['load']}",
                flush=True,
            )
    finally:
        worker.terminate()
        worker.wait()
    results["load_after"] = _loadavg()
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
