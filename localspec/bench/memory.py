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
from pathlib import Path
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..drafters.memory import DraftMemory
from ..drafters.ngram import NgramDrafter
from ..sampling import SamplingParams


@dataclass
class Side:
    """Totals of one drafter over a workload."""

    tokens: int = 0
    steps: int = 0
    accepted: int = 0
    drafted: int = 0  # draft tokens verified (tree nodes: siblings included)
    t_generate_us: float = 0.0

    def add(self, stats) -> None:
        self.tokens += stats.n_generated_tokens
        self.steps += stats.n_steps
        self.accepted += stats.num_accepted_tokens
        self.drafted += stats.num_draft_tokens
        self.t_generate_us += stats.t_generate_us

    @property
    def tok_per_s(self) -> float:
        return self.tokens / (self.t_generate_us * 1e-6) if self.t_generate_us else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return dict(tokens=self.tokens, steps=self.steps, accepted=self.accepted, drafted=self.drafted,
                    acceptance=self.accepted / self.drafted if self.drafted else None,
                    t_generate_s=self.t_generate_us * 1e-6, tok_per_s=self.tok_per_s,
                    tokens_per_step=self.tokens_per_step)  # fmt: skip


@dataclass
class PeerSide:
    """Totals of one llama-server mode over a workload (its own timings: decode only)."""

    tokens: int = 0
    predicted_ms: float = 0.0
    draft_n: int = 0
    draft_accepted: int = 0
    same: int = 0  # requests whose tokens are localspec's
    requests: int = 0

    def add(self, run, reference: list[int]) -> None:
        self.tokens += run.predicted_n
        self.predicted_ms += run.predicted_ms
        self.draft_n += run.draft_n
        self.draft_accepted += run.draft_n_accepted
        self.same += run.tokens == reference
        self.requests += 1

    @property
    def tok_per_s(self) -> float:
        return self.tokens / (self.predicted_ms * 1e-3) if self.predicted_ms else 0.0

    def as_dict(self) -> dict:
        return dict(tokens=self.tokens, t_generate_s=self.predicted_ms * 1e-3, tok_per_s=self.tok_per_s,
                    draft_n=self.draft_n, draft_accepted=self.draft_accepted,
                    acceptance=self.draft_accepted / self.draft_n if self.draft_n else None,
                    same_output=self.same, requests=self.requests)  # fmt: skip


@dataclass
class WorkloadResult:
    name: str
    n_requests: int = 0
    off: Side = field(default_factory=Side)
    on: Side = field(default_factory=Side)
    peers: dict[str, PeerSide] = field(default_factory=dict)  # llama-server mode -> totals
    mismatches: list[int] = field(default_factory=list)  # requests whose outputs differed (must stay empty)
    requests: list[dict] = field(default_factory=list)  # per request: prompt and output token ids, steps of each side
    corpus: list[list[int]] = field(default_factory=list)  # documents written to the memory before the requests
    corpus_files: int = 0
    wall_s: float = 0.0  # the workload's wall time, every side and peer included

    def as_dict(self) -> dict:
        speedup = self.on.tok_per_s / self.off.tok_per_s if self.off.tok_per_s else None
        return dict(name=self.name, n_requests=self.n_requests, off=self.off.as_dict(), on=self.on.as_dict(),
                    speedup=speedup, identical=not self.mismatches, mismatches=self.mismatches,
                    peers={m: p.as_dict() for m, p in self.peers.items()},
                    corpus_files=self.corpus_files, corpus_tokens=sum(len(d) for d in self.corpus), wall_s=self.wall_s,
                    requests=self.requests, corpus=self.corpus)  # fmt: skip


@dataclass
class Request:
    """One request of a workload.

    Attributes:
        prompt: text (tokenized with BOS) or token ids.
        draft_context: token sequences the drafter may also draft from (an infill request's
            suffix and what its window cut off).
        parse_special: tokenize special-token text (chat markup) as special tokens.
        add_special: add BOS when tokenizing text.
        measured: False for a request that runs (and is written to the memory, as in the
            session it stands for) but is not counted (a conversation's first turn).
        stop: stop strings (a chat format's end of turn).
    """

    prompt: str | list[int]
    draft_context: list[list[int]] = field(default_factory=list)
    parse_special: bool = False
    add_special: bool = True
    measured: bool = True
    stop: list[str] = field(default_factory=list)


# an item of a workload: a text, a Request, or a function of the previous request's result
# (memory off) that makes the next one (a conversation's next turn)
Item = str | Request | Callable[[object], Request]


@dataclass
class Workload:
    """Requests run in order; ``corpus``: documents (token ids) written to the memory before
    the first request (a static memory built from a project's files)."""

    name: str
    items: Sequence[Item]
    corpus: Sequence[list[int]] = ()
    corpus_files: int = 0


def code_workload(n: int | None = None) -> list[str]:
    """The shipped Python code-completion prompts (``bench/data/code.jsonl``), in file order."""
    from .dataset import load_questions

    qs = [q["turns"][0] for q in load_questions("code")]
    return qs[:n] if n else qs


def humaneval_workload(path: str | os.PathLike, n: int | None = None, *, leave_out_tasks: int = 40) -> list[str]:
    """Code completions of a sequence of Python problems (issue 29's code workload, (a)): the
    problem prompts (signature and docstring) of a HumanEval file, in problem order.

    ``path`` is HumanEval's ``HumanEval.jsonl(.gz)`` (``prompt`` per problem) or its
    single-line infilling file (the first task of each problem, ``.../L0``, whose prefix is the
    problem's prompt). The problems of the tasks that ``localspec bench complete --humaneval``
    evaluates by default (``leave_out_tasks`` spread over the file) are left out.

    Raises:
        OSError: the file cannot be read.
        ValueError: it holds no HumanEval problems.
    """
    from .complete import load_humaneval_infilling, spread

    rows = load_humaneval_infilling(path)

    def problem(task_id: str) -> str:
        parts = str(task_id).split("/")
        return parts[2] if parts[0] == "SingleLineInfilling" and len(parts) > 2 else parts[-1]

    infilling = any(str(r.get("task_id", "")).startswith("SingleLineInfilling/") for r in rows)
    skip = {problem(r["task_id"]) for r in spread(rows, leave_out_tasks)} if infilling and leave_out_tasks else set()
    out, seen = [], set()
    for r in rows:
        pid = problem(r.get("task_id", ""))
        if pid in seen or pid in skip or not r.get("prompt"):
            continue
        seen.add(pid)
        out.append(r["prompt"])
    if not out:
        raise ValueError(f"{os.fspath(path)}: no HumanEval problems in it")
    return out[:n] if n else out


_FIRST = ("Alice", "Bilal", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Julia", "Kofi", "Lea", "Mateo",
          "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Sven", "Tariq")  # fmt: skip
_LAST = ("Moreau", "Haddad", "Wei", "Kowalski", "Obi", "Zahra", "Petrovic", "Sato", "Lindqvist", "Costa", "Mensah",
         "Fischer", "Alvarez", "Rahman", "Berg")  # fmt: skip
_CITIES = ("Lyon", "Beirut", "Chengdu", "Gdansk", "Enugu", "Fes", "Split", "Sendai", "Uppsala", "Porto", "Kumasi", "Graz",
           "Cusco", "Tartu", "Hobart", "Da Nang", "Tromso")  # fmt: skip
_JOBS = ("a nurse", "a carpenter", "an engineer", "a teacher", "a pharmacist", "a pilot", "a baker", "an architect",
         "a librarian", "a plumber", "a translator")  # fmt: skip
_VERBS = ("moved there {y} years ago", "has lived there for {y} years", "grew up there and returned {y} years ago",
          "arrived there {y} years ago")  # fmt: skip


def batch_workload(n: int = 200) -> list[str]:
    """One instruction over different inputs (issue 29's batch workload, (b)): extract four
    fields as JSON from a generated sentence. Synthetic, made here (no evaluation data); the
    ``n`` inputs are distinct for ``n`` up to 20 * 15."""
    out = []
    for i in range(n):
        name = f"{_FIRST[i % len(_FIRST)]} {_LAST[(i // len(_FIRST) + 7 * i) % len(_LAST)]}"
        city, job, age = _CITIES[(5 * i + 3) % len(_CITIES)], _JOBS[(3 * i + 1) % len(_JOBS)], 23 + (7 * i) % 41
        verb = _VERBS[i % len(_VERBS)].format(y=1 + i % 9)
        text = f"{name} is {age} years old and works as {job} in {city}; {name.split()[0]} {verb}."
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


def second_turn_workload(model, path: str | os.PathLike, n: int) -> list[Item]:
    """Second turns of ``n`` two-turn conversations (Spec-Bench's MT-Bench items, in file
    order), in the model's chat format: each conversation's first turn runs first (not
    measured; its answer is the model's own, from the run without memory), then the second
    turn, whose prompt holds the first turn, its answer and the second question (issue 29 (d)).

    Raises:
        ValueError: the dataset has no two-turn items.
    """
    from ..tui.chat_format import Message, chat_format_for
    from .dataset import load_questions

    convs = [q["turns"][:2] for q in load_questions(path) if len(q["turns"]) >= 2][:n]
    if not convs:
        raise ValueError(f"{path} has no two-turn conversations (MT-Bench items)")
    fmt = chat_format_for(model)

    def request(messages: list) -> Request:
        text = fmt.render(messages)
        return Request(text, parse_special=fmt.uses_template, add_special=not fmt.uses_template, stop=list(fmt.stop))

    items: list[Item] = []
    for t1, t2 in convs:
        first = request([Message("user", t1)])
        first.measured = False
        items.append(first)
        items.append(lambda r, t1=t1, t2=t2: request([Message("user", t1), Message("assistant", r.text.strip()),
                                                      Message("user", t2)]))  # fmt: skip
    return items


def editor_workload(model, path: str | os.PathLike, n: int, *, n_ctx: int, n_predict: int, every: int = 3) -> list[Request]:
    """An editor session (issue 29 (e)): the middle of a source file typed line by line, with
    an ``/infill`` request (built as the server builds it: ``server.prompt.build_infill_prompt``)
    every ``every`` lines at the middle of the line, as llama.vim sends it: the lines above in
    ``input_prefix``, the line's typed part in ``prompt``, the rest of the file below the typed
    part in ``input_suffix``. ``n`` requests.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file has too few lines for ``n`` requests.
    """
    from ..server.prompt import build_infill_prompt

    lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    span = n * every
    if len(lines) < span + 10:
        raise ValueError(f"{path} has {len(lines)} lines; {n} requests every {every} lines need {span + 10}")
    start = max(1, (len(lines) - span) // 2)
    end = start + span
    out = []
    for k in range(n):
        i = start + k * every
        line = lines[i].rstrip("\n")
        typed = line[: max(1, len(line) // 2)] if line.strip() else line
        built = build_infill_prompt(model, "".join(lines[:i]), "".join(lines[end:]), typed, [], n_ctx=n_ctx,
                                    n_predict=n_predict)  # fmt: skip
        out.append(Request(list(built.tokens), draft_context=[list(c) for c in built.draft_context]))
    return out


def default_project() -> Path | None:
    """The folder of an installed package to complete code in, for (f): ``starlette``
    (a web framework of ~70k tokens of Python; not part of any benchmark here), or None."""
    import importlib.util

    spec = importlib.util.find_spec("starlette")
    return Path(spec.origin).parent if spec and spec.origin else None


def project_workload(model, root: str | os.PathLike, n: int, *, max_prompt_tokens: int = 1024,
                     held_every: int = 5) -> Workload:  # fmt: skip
    """Code completion inside a real Python project (issue 29 (f)): every ``held_every``-th
    ``.py`` file (sorted by path) is held out; the others are the corpus of a static memory
    (as ``localspec memory build`` makes it: one document per file). The prompts are the held-out
    files up to a function's signature and docstring (the last ``max_prompt_tokens`` tokens,
    cut at a line), for functions spanning 4 or more lines, round robin over the files: the
    model writes the body. ``n`` prompts.

    Raises:
        ValueError: no Python files, or no such functions in the held-out ones.
    """
    import ast

    from ..cli.memory import corpus_documents, iter_files

    files = [f for f in iter_files([os.fspath(root)]) if f.suffix == ".py"]
    if not files:
        raise ValueError(f"{root} has no Python files")
    held = set(files[::held_every])
    docs, n_files, *_ = corpus_documents(model, [f for f in files if f not in held])
    per_file: list[list[str]] = []
    for f in sorted(held):
        text = f.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        prompts = []
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno - node.lineno < 3:
                continue
            body = node.body
            first = body[1] if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else body[0]
            upto = first.lineno - 1  # lines before the first statement of the body (docstring kept)
            keep, size = upto, 0
            while keep > 0 and size < max_prompt_tokens * 3:  # ~3 bytes per token of code; cut below
                keep -= 1
                size += len(lines[keep])
            prompt = "".join(lines[keep:upto])
            toks = model.tokenize(prompt, add_special=False)
            while len(toks) > max_prompt_tokens and "\n" in prompt:
                prompt = prompt.split("\n", 1)[1]
                toks = model.tokenize(prompt, add_special=False)
            prompts.append((node.lineno, prompt))
        per_file.append([p for _, p in sorted(prompts)])
    items: list[str] = []
    while len(items) < n and any(per_file):  # round robin over the held-out files
        for ps in per_file:
            if ps and len(items) < n:
                items.append(ps.pop(0))
    if not items:
        raise ValueError(f"{root}: no functions of 3 or more lines in the held-out files")
    return Workload(f"project:{Path(root).name}", items, corpus=docs, corpus_files=n_files)


def _as_workload(w) -> Workload:
    return w if isinstance(w, Workload) else Workload(w[0], list(w[1]))


def run_memory_bench(
    engine,
    workloads: Sequence[Workload | tuple[str, Sequence[Item]]],
    *,
    max_tokens: int = 128,
    sampling: SamplingParams | None = None,
    budget_mib: float = 64.0,
    on_request: Callable[[str, int, object, object], None] | None = None,
    peers: Sequence = (),
) -> dict:
    """Run every workload's requests in order, each without and with the memory.

    Args:
        engine: the ``Engine`` without memory (its drafter is replaced by a plain n-gram
            drafter during the run and restored after); the engine with memory is made on
            its model with its cost model, context size, threads and tree size.
        workloads: ``Workload``s or (name, items) in the order they run.
        on_request: called ``(workload, index, result_off, result_on)`` after each request.
        peers: ``PeerServer``s (llama-server, one per mode) that get the same requests, in the
            same order, as token ids (greedy); each keeps its own state across the run.
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
        for wl in map(_as_workload, workloads):
            w = WorkloadResult(wl.name)
            t_w = time.time()
            for doc in wl.corpus:
                mem.write(doc)
            w.corpus, w.corpus_files = [list(d) for d in wl.corpus], wl.corpus_files
            prev = None
            for i, item in enumerate(wl.items):
                req = item if isinstance(item, Request) else Request(item) if isinstance(item, str) else item(prev)
                kw = dict(max_tokens=max_tokens, sampling=sampling, parse_special=req.parse_special,
                          add_special=req.add_special, draft_context=req.draft_context, stop=req.stop)  # fmt: skip
                r_off = engine.generate(req.prompt, **kw)
                r_on = with_mem.generate(req.prompt, **kw)
                prev = r_off
                prompt = req.prompt if isinstance(req.prompt, list) else engine.model.tokenize(
                    req.prompt, add_special=req.add_special, parse_special=req.parse_special)  # fmt: skip
                # the engines reuse their previous request's KV; so do the servers
                peer_runs = {p.mode: p.complete(prompt, max_tokens, stop=req.stop, cache_prompt=True) for p in peers}
                w.requests.append(dict(prompt=prompt, context=req.draft_context, output=r_off.token_ids,
                                       finish=r_off.finish_reason, steps_off=r_off.stats.n_steps,
                                       steps_on=r_on.stats.n_steps, measured=req.measured))  # fmt: skip
                if r_off.token_ids != r_on.token_ids:
                    w.mismatches.append(i)
                if not req.measured:
                    continue
                w.n_requests += 1
                w.off.add(r_off.stats)
                w.on.add(r_on.stats)
                for mode, run in peer_runs.items():
                    w.peers.setdefault(mode, PeerSide()).add(run, r_off.token_ids)
                if on_request is not None:
                    on_request(wl.name, i, r_off, r_on)
            w.wall_s = time.time() - t_w
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


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def format_report(rep: dict) -> str:
    """The report as text: per workload, decode speed off / on, the speed-up, tokens per target
    call and acceptance (accepted / verified draft tokens), then each llama-server mode's decode
    speed, acceptance and speed relative to localspec with memory."""
    lines = [f"{'workload':<22}{'reqs':>5}{'tok/s off':>10}{'on':>7}{'on/off':>8}{'tok/step off':>13}{'on':>6}"
             f"{'accept off':>11}{'on':>6}  identical"]  # fmt: skip
    peer_lines = []
    for w in rep["workloads"]:
        off, on = w["off"], w["on"]
        acc = [f"{x['acceptance']:.2f}" if x["acceptance"] is not None else "-" for x in (off, on)]
        lines.append(f"{w['name']:<22}{w['n_requests']:>5}{off['tok_per_s']:>10.1f}{on['tok_per_s']:>7.1f}"
                     f"{_ratio(on['tok_per_s'], off['tok_per_s']):>8}{off['tokens_per_step']:>13.2f}"
                     f"{on['tokens_per_step']:>6.2f}{acc[0]:>11}{acc[1]:>6}  {'yes' if w['identical'] else 'NO'}")  # fmt: skip
        for mode, p in w.get("peers", {}).items():
            pa = f"{p['acceptance']:.2f}" if p["acceptance"] is not None else "-"
            peer_lines.append(f"{w['name']:<22}{mode:<13}{p['tok_per_s']:>8.1f}{pa:>8}"
                              f"{_ratio(on['tok_per_s'], p['tok_per_s']):>14}{p['same_output']:>6}/{p['requests']}")  # fmt: skip
    if peer_lines:
        lines.append("\nllama-server (one per mode, the same requests in the same order; its own decode timings; "
                     "on/it: localspec with memory over it)")  # fmt: skip
        lines.append(f"{'workload':<22}{'mode':<13}{'tok/s':>8}{'accept':>8}{'on/it':>14}  same output")
        lines += peer_lines
    m = rep["memory"]
    lines.append(f"memory at the end: {m['documents']} documents, {m['tokens']} tokens ({m['bytes'] / 2**20:.1f} MiB)")
    la, lb = rep["loadavg_start"], rep["loadavg_end"]
    lines.append(f"load average {la[0]:.1f} -> {lb[0]:.1f} on {rep['cpus']} CPUs over {rep['wall_s']:.0f} s"
                 " (on a loaded machine compare tokens/step; speeds are of this run only)")  # fmt: skip
    return "\n".join(lines)


def _accept_along(tree, output: Sequence[int], pos: int) -> tuple[list[int], int]:
    """Greedy verification of ``tree`` against the recorded ``output[pos:]``: the emitted
    tokens (the accepted drafts, then the target's own token) and the accepted path's length."""
    node, emitted = 0, []
    for tok in output[pos:]:
        nxt = next((c for c in tree.children(node) if int(tree.token_ids[c]) == tok), None)
        emitted.append(tok)
        if nxt is None:
            break
        node = nxt
    return emitted, int(tree.depth[node])


class _FixedBudget:
    """``replay``'s side: the drafter's tree cut to its ``budget`` best nodes, no clock."""

    def __init__(self, budget: int, max_depth: int) -> None:
        self.budget, self.max_depth = budget, max_depth

    def begin(self) -> None:
        pass

    def step(self, d: NgramDrafter):
        full = d.propose(self.max_depth, self.budget)
        return full, full.best_subtree(self.budget) if full.n_nodes > self.budget else full

    def verified(self, tree, path: int) -> float:
        return 0.0

    def end(self) -> None:
        pass


class _PolicySide:
    """``replay_policy``'s side: the engine's policy on a cost table, with the request's
    score calibration; ``verified`` returns the policy's estimate of the step's time (µs)."""

    def __init__(self, cost_table_us: dict, max_nodes: int, max_depth: int) -> None:
        from ..costmodel import CostModel
        from ..policy import SpeculationPolicy

        self.pol = SpeculationPolicy(CostModel({int(b): float(t) for b, t in cost_table_us.items()}), max_nodes=max_nodes)
        self.max_nodes, self.max_depth, self.cal = max_nodes, max_depth, None

    def begin(self) -> None:
        self.pol.begin_request()
        self.cal = self.pol.calibration.for_request()

    def step(self, d: NgramDrafter):
        from ..step import propose_one

        root = int(d.index.last()) if hasattr(d.index, "last") else int(d.index.tokens[-1])
        prop = propose_one(self.pol, d, root, self.max_depth, self.max_nodes, calibration=self.cal)
        return prop.candidate, prop.tree

    def verified(self, tree, path: int) -> float:
        self.cal.observe(np.asarray(tree.score[1:], dtype=np.float64), path)
        return self.pol.step_us(tree.n_nodes)

    def end(self) -> None:
        self.pol.calibration.end_request(self.cal)


def _replay(workloads: Sequence[dict], make_side: Callable[[], object], budget_mib: float) -> list[dict]:
    """Each recorded request through an n-gram drafter without (``off``) and with (``on``) a
    memory of ``budget_mib`` (the workloads' corpora written to it first), each side choosing
    its trees as ``make_side()`` says; per workload the target calls and estimated µs."""
    mem = DraftMemory(budget_mib)
    sides = {"off": (NgramDrafter(), make_side()), "on": (NgramDrafter(memory=mem), make_side())}
    out = []
    for w in workloads:
        row = {"name": w["name"], "tokens": 0, "calls_off": 0, "calls_on": 0, "est_us_off": 0.0, "est_us_on": 0.0}
        for doc in w.get("corpus", ()):
            mem.write(doc)
        for req in w["requests"]:
            output = list(req["output"])
            measured = req.get("measured", True)
            row["tokens"] += len(output) * measured
            for side, (d, chooser) in sides.items():
                chooser.begin()
                d.begin(req["prompt"], req.get("context", ()))
                pos = 0
                while pos < len(output):
                    cand, tree = chooser.step(d)
                    emitted, path = _accept_along(tree, output, pos)
                    d.observe(cand, emitted)  # as the engine does: the tree as proposed
                    d.accept(emitted)
                    row[f"est_us_{side}"] += chooser.verified(tree, path) * measured
                    pos += len(emitted)
                    row[f"calls_{side}"] += measured
                chooser.end()
        out.append(row)
    for d, _ in sides.values():
        d.close()
    return out


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
    rows = _replay(workloads, lambda: _FixedBudget(budget, max_depth), budget_mib)
    for row in rows:
        del row["est_us_off"], row["est_us_on"]
        for side in ("off", "on"):
            row[f"tokens_per_call_{side}"] = row["tokens"] / row[f"calls_{side}"] if row[f"calls_{side}"] else 0.0
    return rows


def replay_policy(workloads: Sequence[dict], cost_table_us: dict, *, max_nodes: int = 64, max_depth: int = 48,
                  budget_mib: float = 64.0) -> list[dict]:  # fmt: skip
    """``replay`` with the engine's policy instead of fixed budgets: each side has its own
    ``SpeculationPolicy`` on a ``CostModel`` of ``cost_table_us`` (batch size -> µs of one
    decode, e.g. a quiet table from the cost cache), and each step verifies what
    ``propose_one`` chooses (the memory's nodes after the n-grams' plan, the request's score
    calibration), accepted along the recorded greedy output. The step's time is the policy's
    own estimate (``step_us``: the table's decode plus its host-time prior), so the result is
    an estimate of decode time that does not depend on the machine's load, not a measurement.

    Returns:
        per workload: ``{"name", "tokens", "calls_off", "calls_on", "est_us_off", "est_us_on"}``.
    """
    return _replay(workloads, lambda: _PolicySide(cost_table_us, max_nodes, max_depth), budget_mib)


class _SuffixAutomaton:
    """The suffix automaton of a growing token sequence (Blumer et al. 1985): ``extend``
    appends a token in amortised O(1), ``longest_prefix`` finds how much of a pattern
    occurs somewhere in the sequence in O(len(pattern))."""

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]
        self.link, self.len, self.last = [-1], [0], 0

    def extend(self, c: int) -> None:
        cur = len(self.len)
        self.next.append({})
        self.len.append(self.len[self.last] + 1)
        self.link.append(0)
        p = self.last
        while p != -1 and c not in self.next[p]:
            self.next[p][c] = cur
            p = self.link[p]
        if p != -1:
            q = self.next[p][c]
            if self.len[p] + 1 == self.len[q]:
                self.link[cur] = q
            else:
                clone = len(self.len)
                self.next.append(dict(self.next[q]))
                self.len.append(self.len[p] + 1)
                self.link.append(self.link[q])
                while p != -1 and self.next[p].get(c) == q:
                    self.next[p][c] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur

    def longest_prefix(self, pattern: Sequence[int]) -> int:
        state, n = 0, 0
        for c in pattern:
            state = self.next[state].get(c)
            if state is None:
                break
            n += 1
        return n


def replay_bound(workloads: Sequence[dict], cost_table_us: dict, *, min_match: int = 1, max_depth: int = 63) -> list[dict]:
    """The most any drafter that copies from earlier text can gain, on a cost table: an
    upper bound to compare ``replay_policy`` against.

    At each step of each recorded greedy output, the bound finds, among every earlier place
    where the request's last ``min_match`` tokens occur, the one whose continuation agrees
    longest with the output (``k`` tokens, at most ``max_depth``), and verifies exactly those
    ``k`` tokens: a chain accepted whole, costing ``step_us(k + 1)`` of the engine's policy on
    ``cost_table_us`` (decode plus host prior). A drafter that copies after a match of at
    least ``min_match`` tokens accepts no more per step than ``k`` and verifies at least as
    many tokens, so on a cost table that grows with the batch its estimated time is no
    shorter (the n-gram drafter matches from one token: ``min_match`` 1). ``own`` copies only
    from the request's own context, prompt and output (the n-gram drafter's sources); ``mem``
    also from everything before it in the run (the workloads' corpora and earlier requests: a
    drafting memory that never evicts). Found with suffix automata of both texts.

    Returns:
        per workload: ``{"name", "tokens", "calls_own", "calls_mem", "est_us_own", "est_us_mem"}``.
    Raises:
        ValueError: ``min_match`` < 1 or ``max_depth`` < 1.
    """
    from ..costmodel import CostModel
    from ..policy import SpeculationPolicy

    if min_match < 1 or max_depth < 1:
        raise ValueError(f"need min_match >= 1 and max_depth >= 1, got {min_match}, {max_depth}")
    pol = SpeculationPolicy(CostModel({int(b): float(t) for b, t in cost_table_us.items()}))
    run = _SuffixAutomaton()  # every document of the run so far, each ended by its own separator
    n_docs = 0

    def end_document() -> None:
        nonlocal n_docs
        n_docs += 1
        run.extend(-n_docs)  # a separator no other document has: no match runs across it

    out = []
    for w in workloads:
        row = {"name": w["name"], "tokens": 0, "calls_own": 0, "calls_mem": 0, "est_us_own": 0.0, "est_us_mem": 0.0}
        for doc in w.get("corpus", ()):
            for t in doc:
                run.extend(int(t))
            end_document()
        for req in w["requests"]:
            measured = req.get("measured", True)
            output = [int(t) for t in req["output"]]
            history = [int(t) for c in req.get("context", ()) for t in c] + [int(t) for t in req["prompt"]]
            own = _SuffixAutomaton()
            for t in history:
                own.extend(t)
                run.extend(t)
            for side, sam in (("own", own), ("mem", run)):
                text, pos = list(history), 0
                while pos < len(output):
                    k = 0
                    if len(text) >= min_match:
                        want = min(max_depth, len(output) - pos - 1)
                        k = max(0, sam.longest_prefix(text[len(text) - min_match :] + output[pos : pos + want]) - min_match)
                    for t in output[pos : pos + k + 1]:
                        sam.extend(t)
                        text.append(t)
                    pos += k + 1
                    row[f"calls_{side}"] += measured
                    row[f"est_us_{side}"] += pol.step_us(k + 1) * measured
            end_document()
            row["tokens"] += len(output) * measured
        out.append(row)
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
        "growth_mib", "store_mib", "stored_tokens" (separators included), "written"}...], ...}``; ``growth_mib`` is
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
        u = mem.usage()  # (info() would copy the store)
        s = dict(requests=i, rss_mib=rss / 1024, peak_mib=peak / 1024, growth_mib=(rss - rss0) / 1024,
                 store_mib=u["bytes"] / 2**20, stored_tokens=u["stored"], written=u["written"],
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


def plot_report(rep: dict, path: str | os.PathLike) -> None:
    """A PNG of the report: per workload, the decode speed-up of the memory (on / off, and of
    localspec with memory over each llama-server mode) and the tokens per target call off and
    on (the mean accepted length + 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ws = rep["workloads"]
    names = [w["name"] for w in ws]
    x = np.arange(len(ws))
    modes = sorted({m for w in ws for m in w.get("peers", {})})
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(7, 0.9 * len(ws) + 3), 7), sharex=True)
    series = [("memory on / off", [w["speedup"] or 0 for w in ws])]
    for m in modes:
        series.append((f"on / llama-server {m}", [w["on"]["tok_per_s"] / w["peers"][m]["tok_per_s"]
                                                  if m in w.get("peers", {}) and w["peers"][m]["tok_per_s"] else 0
                                                  for w in ws]))  # fmt: skip
    width = 0.8 / len(series)
    for k, (label, vals) in enumerate(series):
        ax1.bar(x + (k - (len(series) - 1) / 2) * width, vals, width, label=label)
    for y, style in ((1.0, "-"), (0.97, ":"), (1.2, "--")):
        ax1.axhline(y, color="grey", lw=0.8, ls=style)
    ax1.set_ylabel("decode speed ratio")
    ax1.legend(fontsize=8)
    la = rep["loadavg_start"][0], rep["loadavg_end"][0]
    ax1.set_title(f"localspec bench memory: {rep['max_tokens']} tokens per request, load {la[0]:.1f} -> {la[1]:.1f} "
                  f"on {rep['cpus']} CPUs", fontsize=10)  # fmt: skip
    for k, side in enumerate(("off", "on")):
        ax2.bar(x + (k - 0.5) * 0.4, [w[side]["tokens_per_step"] for w in ws], 0.4, label=f"memory {side}")
    ax2.set_ylabel("tokens per target call")
    ax2.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
