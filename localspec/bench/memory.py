"""``localspec bench memory``: sequences of requests through one process, the n-gram drafter
with and without a drafting memory (``drafters.memory.DraftMemory``), in one run.

Each request of a workload runs twice, back to back, on two engines over one model with one
measured cost model: one with a plain n-gram drafter, one whose n-gram drafter shares the
run's memory (which has seen every earlier request of every workload so far, in order). Each
engine has its own speculation policy, so neither learns from the other's steps. Both runs
must emit the same tokens
(the memory only drafts); the report gives, per workload, the decode speed of each, the
speed-up, and the tokens per target call (the mean accepted length + 1: a property of the
drafts, not of the machine's load).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..drafters.memory import DraftMemory
from ..drafters.ngram import NgramDrafter
from ..sampling import SamplingParams


@dataclass
class Side:
    """Totals of one drafter over a workload."""

    tokens: int = 0
    steps: int = 0
    accepted: int = 0
    t_generate_us: float = 0.0

    def add(self, stats) -> None:
        self.tokens += stats.n_generated_tokens
        self.steps += stats.n_steps
        self.accepted += stats.num_accepted_tokens
        self.t_generate_us += stats.t_generate_us

    @property
    def tok_per_s(self) -> float:
        return self.tokens / (self.t_generate_us * 1e-6) if self.t_generate_us else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return dict(tokens=self.tokens, steps=self.steps, accepted=self.accepted, t_generate_s=self.t_generate_us * 1e-6,
                    tok_per_s=self.tok_per_s, tokens_per_step=self.tokens_per_step)  # fmt: skip


@dataclass
class WorkloadResult:
    name: str
    n_requests: int = 0
    off: Side = field(default_factory=Side)
    on: Side = field(default_factory=Side)
    mismatches: list[int] = field(default_factory=list)  # requests whose outputs differed (must stay empty)
    requests: list[dict] = field(default_factory=list)  # per request: prompt and output token ids, steps of each side

    def as_dict(self) -> dict:
        speedup = self.on.tok_per_s / self.off.tok_per_s if self.off.tok_per_s else None
        return dict(name=self.name, n_requests=self.n_requests, off=self.off.as_dict(), on=self.on.as_dict(),
                    speedup=speedup, identical=not self.mismatches, mismatches=self.mismatches,
                    requests=self.requests)  # fmt: skip


def code_workload(n: int | None = None) -> list[str]:
    """The shipped Python code-completion prompts (``bench/data/code.jsonl``), in file order."""
    from .dataset import load_questions

    qs = [q["turns"][0] for q in load_questions("code")]
    return qs[:n] if n else qs


_NAMES = ("Alice Moreau", "Bilal Haddad", "Chen Wei", "Dana Kowalski", "Emeka Obi", "Fatima Zahra", "Goran Petrovic",
          "Hana Sato", "Ivan Lindqvist", "Julia Costa", "Kofi Mensah", "Lea Fischer")  # fmt: skip
_CITIES = ("Lyon", "Beirut", "Chengdu", "Gdansk", "Enugu", "Fes", "Split", "Sendai", "Uppsala", "Porto", "Kumasi", "Graz")
_JOBS = ("a nurse", "a carpenter", "an engineer", "a teacher", "a pharmacist", "a pilot")


def extract_workload(n: int = 12) -> list[str]:
    """One instruction over different inputs (issue 29's batch workload, (b)): extract three
    fields as JSON from a generated sentence. Synthetic, made here (no evaluation data)."""
    out = []
    for i in range(n):
        name, city, job, age = _NAMES[i % len(_NAMES)], _CITIES[(5 * i + 3) % len(_CITIES)], _JOBS[i % len(_JOBS)], 23 + (7 * i) % 41
        text = f"{name} is {age} years old and works as {job} in {city}, where she moved {1 + i % 9} years ago."
        out.append("Extract the person's name, age, job and city from the text as a JSON object with the keys "
                   f'"name", "age", "job" and "city".\n\nText: {text}\nJSON:')  # fmt: skip
    return out


def specbench_workload(path: str | os.PathLike, per_category: int) -> list[tuple[str, list[str]]]:
    """Spec-Bench first turns, ``per_category`` per category, category after category."""
    from .dataset import load_questions, select_prompts

    prompts = select_prompts(load_questions(path), None, per_category)
    out: dict[str, list[str]] = {}
    for p in prompts:
        out.setdefault(p.category, []).append(p.text)
    return list(out.items())


def run_memory_bench(
    engine,
    workloads: Sequence[tuple[str, Sequence[str]]],
    *,
    max_tokens: int = 128,
    sampling: SamplingParams | None = None,
    budget_mib: float = 64.0,
    on_request: Callable[[str, int, object, object], None] | None = None,
) -> dict:
    """Run every workload's requests in order, each without and with the memory.

    Args:
        engine: the ``Engine`` without memory (its drafter is replaced by a plain n-gram
            drafter during the run and restored after); the engine with memory is made on
            its model with its cost model, context size, threads and tree size.
        workloads: (name, prompts) in the order they run.
        on_request: called ``(workload, index, result_off, result_on)`` after each request.
    Returns:
        ``{"workloads": [WorkloadResult.as_dict()...], "memory": MemoryInfo, "loadavg": ...}``.
    """
    from ..engine import Engine

    sampling = sampling or SamplingParams.greedy()
    mem = DraftMemory(budget_mib)
    saved = engine.drafter_name
    engine.set_drafter(NgramDrafter())
    with_mem = Engine(engine.model, drafter="ngram", draft_memory=mem, cost_model=engine.cost_model, n_ctx=engine.n_ctx,
                      n_threads=engine.ctx.n_threads, max_tree_nodes=engine.max_tree_nodes, adaptive=engine.adaptive)  # fmt: skip
    results = []
    load0 = os.getloadavg()
    t0 = time.time()
    try:
        for name, prompts in workloads:
            w = WorkloadResult(name)
            for i, prompt in enumerate(prompts):
                r_off = engine.generate(prompt, max_tokens=max_tokens, sampling=sampling)
                r_on = with_mem.generate(prompt, max_tokens=max_tokens, sampling=sampling)
                w.n_requests += 1
                w.off.add(r_off.stats)
                w.on.add(r_on.stats)
                if r_off.token_ids != r_on.token_ids:
                    w.mismatches.append(i)
                w.requests.append(dict(prompt=engine.tokenize(prompt), output=r_off.token_ids,
                                       finish=r_off.finish_reason, steps_off=r_off.stats.n_steps,
                                       steps_on=r_on.stats.n_steps))  # fmt: skip
                if on_request is not None:
                    on_request(name, i, r_off, r_on)
            results.append(w)
    finally:
        with_mem.close()  # its drafter writes the last request
        engine.set_drafter(saved)
    return dict(
        workloads=[w.as_dict() for w in results],
        memory=mem.info().as_dict(),
        max_tokens=max_tokens,
        wall_s=time.time() - t0,
        loadavg_start=load0,
        loadavg_end=os.getloadavg(),
        cpus=os.cpu_count(),
    )


def format_report(rep: dict) -> str:
    lines = [f"{'workload':<16}{'reqs':>5}{'tok/s off':>11}{'tok/s on':>10}{'speed-up':>10}"
             f"{'tok/step off':>14}{'on':>6}  identical"]  # fmt: skip
    for w in rep["workloads"]:
        sp = f"{w['speedup']:.2f}x" if w["speedup"] else "-"
        lines.append(f"{w['name']:<16}{w['n_requests']:>5}{w['off']['tok_per_s']:>11.1f}{w['on']['tok_per_s']:>10.1f}{sp:>10}"
                     f"{w['off']['tokens_per_step']:>14.2f}{w['on']['tokens_per_step']:>6.2f}  {'yes' if w['identical'] else 'NO'}")  # fmt: skip
    m = rep["memory"]
    lines.append(f"memory at the end: {m['documents']} documents, {m['tokens']} tokens ({m['bytes'] / 2**20:.1f} MiB)")
    la, lb = rep["loadavg_start"], rep["loadavg_end"]
    lines.append(f"load average {la[0]:.1f} -> {lb[0]:.1f} on {rep['cpus']} CPUs over {rep['wall_s']:.0f} s"
                 " (a loaded machine: compare tokens/step; speeds are of this run only)")  # fmt: skip
    return "\n".join(lines)


def replay(workloads: Sequence[dict], *, budget: int = 16, max_depth: int = 48, budget_mib: float = 64.0) -> list[dict]:
    """Tokens per target call of the n-gram drafter with and without a memory, replayed on
    recorded greedy outputs (the ``requests`` of a ``run_memory_bench`` report): at each step
    the drafter's tree is cut to its ``budget`` best nodes by score (``TokenTree.best_subtree``)
    and accepted along the recorded output, as greedy verification would. No model runs and
    no clock is read, so the numbers do not depend on the machine's load; they stand for a
    fixed verification budget, not for the adaptive policy's choices.

    Returns:
        per workload: ``{"name", "tokens", "calls_off", "calls_on", "tokens_per_call_off", "..._on"}``.
    """
    mem = DraftMemory(budget_mib)
    sides = {"off": NgramDrafter(), "on": NgramDrafter(memory=mem)}
    out = []
    for w in workloads:
        row = {"name": w["name"], "tokens": 0, "calls_off": 0, "calls_on": 0}
        for req in w["requests"]:
            output = list(req["output"])
            row["tokens"] += len(output)
            for side, d in sides.items():
                d.begin(req["prompt"])
                pos = 0
                while pos < len(output):
                    full = d.propose(max_depth, budget)
                    tree = full.best_subtree(budget) if full.n_nodes > budget else full
                    node, emitted = 0, []
                    for tok in output[pos:]:
                        nxt = next((c for c in tree.children(node) if int(tree.token_ids[c]) == tok), None)
                        emitted.append(tok)  # the accepted draft, or the target's own token
                        if nxt is None:
                            break
                        node = nxt
                    d.observe(full, emitted)  # as the engine does: the tree as proposed
                    d.accept(emitted)
                    pos += len(emitted)
                    row[f"calls_{side}"] += 1
        for side in sides:
            row[f"tokens_per_call_{side}"] = row["tokens"] / row[f"calls_{side}"] if row[f"calls_{side}"] else 0.0
        out.append(row)
    for d in sides.values():
        d.close()
    return out


def _rss_kib() -> tuple[int, int]:
    """(resident, peak resident) KiB of this process (Linux ``/proc/self/status``)."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                vals[key] = int(rest.split()[0])
    return vals["VmRSS"], vals["VmHWM"]


def rss_run(
    n_requests: int = 10_000,
    *,
    budget_mib: float = 64.0,
    prompt_tokens: int = 400,
    output_tokens: int = 200,
    step_tokens: int = 4,
    seed: int = 0,
    every: int = 1000,
    on_sample: Callable[[dict], None] | None = None,
) -> dict:
    """Resident memory of a process whose drafting memory serves ``n_requests`` requests (no
    model: each request's tokens go through an ``NgramDrafter`` sharing the memory as the
    engine drives it: ``begin(prompt)``, a ``propose`` every ``step_tokens`` output tokens, then
    ``accept``; ``close`` writes it to the memory).

    The requests are synthetic token ids (vocabulary 32,000): one of 20 instructions (40
    tokens) + random input + an output that copies parts of its input and of a few shared
    phrases, so the memory both fills with unread text and is read (eviction's two cases).

    Returns:
        ``{"budget_mib", "capacity", "samples": [{"requests", "rss_mib", "peak_mib",
        "growth_mib", "store_mib", "stored_tokens", "written"}...], ...}``; ``growth_mib`` is
        the resident memory over the process's before the memory was made (MiB = 2**20 bytes).
    Raises:
        OSError: not on Linux (no /proc/self/status).
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    rss0, _ = _rss_kib()
    mem = DraftMemory(budget_mib)
    drafter = NgramDrafter(memory=mem)
    instructions = rng.integers(0, 32000, (20, 40))
    phrases = rng.integers(0, 32000, (50, 12))
    samples = []
    t0 = time.time()

    def sample(i: int) -> None:
        rss, peak = _rss_kib()
        info = mem.info()
        s = dict(requests=i, rss_mib=rss / 1024, peak_mib=peak / 1024, growth_mib=(rss - rss0) / 1024,
                 store_mib=info.bytes / 2**20, stored_tokens=info.tokens, written=info.written,
                 elapsed_s=time.time() - t0)  # fmt: skip
        samples.append(s)
        if on_sample is not None:
            on_sample(s)

    sample(0)
    for i in range(1, n_requests + 1):
        inp = rng.integers(0, 32000, prompt_tokens - 40)
        prompt = np.concatenate([instructions[rng.integers(20)], inp])
        parts, n = [], 0
        while n < output_tokens:
            if rng.random() < 0.5:
                a = int(rng.integers(0, inp.size - 16))
                part = inp[a : a + int(rng.integers(4, 16))]
            else:
                part = phrases[rng.integers(50)]
            parts.append(part)
            n += part.size
        output = np.concatenate(parts)[:output_tokens].tolist()
        drafter.begin(prompt.tolist())
        for k in range(0, len(output), step_tokens):
            drafter.propose(16, 32)
            drafter.accept(output[k : k + step_tokens])
        if i % every == 0 or i == n_requests:
            drafter.close()  # the last request written before the sample
            sample(i)
    drafter.close()
    return dict(budget_mib=budget_mib, capacity=mem.capacity, n_requests=n_requests, prompt_tokens=prompt_tokens,
                output_tokens=output_tokens, baseline_rss_mib=rss0 / 1024, samples=samples)  # fmt: skip


def format_rss(rep: dict) -> str:
    lines = [f"drafting memory of {rep['budget_mib']:g} MiB ({rep['capacity']:,} tokens); requests of "
             f"{rep['prompt_tokens']} + {rep['output_tokens']} tokens; process RSS before it: {rep['baseline_rss_mib']:.1f} MiB",
             f"{'requests':>9}{'RSS MiB':>9}{'growth':>8}{'store':>7}{'stored tokens':>15}{'written':>12}"]  # fmt: skip
    for s in rep["samples"]:
        lines.append(f"{s['requests']:>9}{s['rss_mib']:>9.1f}{s['growth_mib']:>8.1f}{s['store_mib']:>7.1f}"
                     f"{s['stored_tokens']:>15,}{s['written']:>12,}")  # fmt: skip
    last = rep["samples"][-1]
    lines.append(f"growth over the run: {last['growth_mib']:.1f} MiB for a budget of {rep['budget_mib']:g} MiB "
                 f"(peak RSS {last['peak_mib']:.1f} MiB)")  # fmt: skip
    return "\n".join(lines)
