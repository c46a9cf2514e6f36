"""``localspec batch IN.jsonl --out OUT.jsonl``: many prompts through the batched engine.

Each input line is a JSON object with ``"prompt"`` (text) and optionally ``"id"`` (a string or
an integer; default, or null: the line number), ``"max_tokens"`` and the sampling settings of
``LINE_SAMPLING`` and ``"seed"`` (-1: a random seed), each over the command line's (greedy by
default). A line that names a sampling setting it cannot set (``NOT_PER_LINE``) is that line's
error; other keys are ignored. Each request's context holds ``--n-ctx`` tokens (default 4096).
Each output line is ``{"id", "text", "finish_reason", "usage", "speculation"}`` or ``{"id",
"error"}``, written as soon as that prompt ends (any order). Ids already in OUT are skipped,
so a killed run continues where it stopped; a half-written last line (the kill) is cut off
first.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import threading
from collections import Counter
from pathlib import Path

from ..errors import LocalSpecError
from ..sampling import SamplingParams
from ..server.fields import lone_surrogate_error
from .common import (add_drafter_args, add_memory_args, add_model_args, add_sampling_args, check_parallel,
                     check_request_context, count, exit_now_on_sigint, make_engine, sampling_from_args)


def register(sub) -> None:
    p = sub.add_parser(
        "batch",
        help="run a JSONL file of prompts, several at a time in one batched decode",
        description="Generate a completion for every line of IN.jsonl into OUT.jsonl (resumable by id; "
        "per-prompt errors are recorded in OUT and do not stop the run).",
    )
    p.add_argument("input", help="JSONL file, one {\"id\", \"prompt\", ...} per line")
    p.add_argument("--out", required=True, help="JSONL output (appended; ids already there are skipped)")
    p.add_argument("--parallel", type=int, default=4, help="prompts decoded together (default 4)")
    p.add_argument("-n", "--max-tokens", type=count, default=256, help="most tokens per prompt (default 256)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-spec", action="store_true", help="plain batched decoding (no drafter)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_drafter_args(p)
    add_sampling_args(p, greedy_default=True)
    add_model_args(p, n_ctx_help="tokens each request may hold, prompt + generated (default 4096, or the model's "
                   "training context if smaller)")  # fmt: skip
    add_memory_args(p)
    p.set_defaults(func=run, n_ctx=None)


# The sampling settings a line may set: SamplingParams' fields, named as the command line's
# flags, read as the server reads its JSON fields (and "seed" by its rule: -1 = a random seed).
LINE_SAMPLING = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "repeat_penalty": float,
                 "frequency_penalty": float, "presence_penalty": float, "penalty_last_n": int}  # fmt: skip
LINE_KEYS = ("id", "prompt", "max_tokens", *LINE_SAMPLING, "seed")
# sampling settings that a line cannot set: SamplingParams' other fields, and --stop (one list for all lines)
NOT_PER_LINE = frozenset(f.name for f in dataclasses.fields(SamplingParams)).difference(LINE_KEYS) | {"stop"}


def read_jobs(path: str) -> list[dict]:
    """The input lines as dicts with an ``id``; a bad line (not UTF-8 text, not a JSON object,
    no usable prompt) becomes ``{"id", "_error"}``, where a line that cannot be read at all has
    the id ``"line N"`` (its own is unknown; the line number alone is the id of a line without
    one, and could be a real prompt's). Lines end at LF, CR LF or CR; a UTF-8 byte order mark
    at the start is skipped."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise SystemExit(f"localspec: error: cannot read {path}: {e.strerror or e}") from None
    out = []
    for n, data in enumerate(raw.removeprefix(b"\xef\xbb\xbf").splitlines(), start=1):
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as e:
            out.append({"id": f"line {n}", "_error": f"line {n} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})"})
            continue
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            out.append({"id": f"line {n}", "_error": f"line {n} is not a JSON object: {e}"})
            continue
        rid = obj.get("id")
        if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
            out.append({"id": f"line {n}", "_error": f'line {n}: "id" must be a string or an integer, got {json.dumps(rid)}'})
            continue
        surrogate = lone_surrogate_error(obj)
        if surrogate is not None and lone_surrogate_error(rid) is not None:  # the id cannot be written
            out.append({"id": f"line {n}", "_error": f"line {n}: {surrogate}"})
            continue
        obj["id"] = str(n if rid is None else rid)
        obj["_line"] = n
        if surrogate is not None:
            obj["_error"] = f"line {n}: {surrogate}"
        elif "prompt" not in obj and "messages" in obj:  # a chat-format line: batch completes text
            obj["_error"] = (f'line {n}: batch takes a "prompt" (text to continue), not chat "messages"; '
                             "for chat turns use localspec serve's /v1/chat/completions")  # fmt: skip
        elif not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            obj["_error"] = f'line {n}: "prompt" must be a non-empty string'
        out.append(obj)
    return out


def line_settings(x: dict, default_max_tokens: int, base: SamplingParams) -> tuple[int, SamplingParams]:
    """``(max_tokens, sampling)`` of one input line: its ``max_tokens`` and sampling settings
    (``LINE_SAMPLING``, ``"seed"``) over the command line's.

    Raises:
        ValueError: ``line N: ...`` naming the field that is not a count, a number in its range,
            a seed, or that a line cannot set (``NOT_PER_LINE``; the message lists what it can).
    """
    from ..server.fields import RequestError, get_float, get_int
    from ..server.sampling_fields import get_seed, seed_param

    n = x["_line"]
    bad = sorted(NOT_PER_LINE.intersection(x))
    if bad:
        takes = ", ".join(f'"{k}"' for k in LINE_KEYS)
        raise ValueError(f'line {n}: "{bad[0]}" cannot be set per line; a line takes {takes}')
    mt = x.get("max_tokens", default_max_tokens)
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 0:
        raise ValueError(f'line {n}: "max_tokens" must be an integer >= 0, got {json.dumps(mt)}')
    try:  # the line's settings (null: absent, as the server reads it)
        values = {k: (get_int if t is int else get_float)(x, k, getattr(base, k))
                  for k, t in LINE_SAMPLING.items() if k in x}  # fmt: skip
        if "seed" in x:
            values["seed"] = seed_param(get_seed(x), base.seed)
    except RequestError as e:  # the field's type, or a seed outside -1..2**64-1
        raise ValueError(f"line {n}: {e}") from None
    sampling = base
    for k, v in values.items():
        try:
            sampling = dataclasses.replace(sampling, **{k: v})
        except ValueError as e:  # SamplingParams' range checks (InvalidRequestError)
            raise ValueError(f'line {n}: "{k}": {e}') from None
    return mt, sampling


def done_ids(path: Path) -> set[str]:
    """Ids already in OUT; cuts a half-written last line (a killed run) off the file.

    Raises:
        SystemExit: one error line when OUT cannot be read (a directory, no permission) or cut.
    """
    if not path.exists():
        return set()
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise SystemExit(f"localspec: error: cannot read --out {path}: {e.strerror or e}") from None
    if raw and not raw.endswith(b"\n"):
        raw = raw[: raw.rfind(b"\n") + 1]
        try:
            path.write_bytes(raw)
        except OSError as e:
            raise SystemExit(f"localspec: error: cannot write --out {path}: {e.strerror or e}") from None
    ids = set()
    for line in raw.decode("utf-8", errors="replace").splitlines():
        try:
            ids.add(str(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError):
            continue
    return ids


def result_record(job_id: str, r) -> dict:
    if isinstance(r, BaseException):  # the project's errors say what to do; anything else names its type
        return {"id": job_id, "error": str(r) if isinstance(r, LocalSpecError) else f"{type(r).__name__}: {r}"}
    s = r.stats
    rec = {
        "id": job_id,
        "text": r.text,
        "finish_reason": r.finish_reason,
        "usage": {"prompt_tokens": s.n_prompt_tokens, "completion_tokens": s.n_generated_tokens,
                  "total_tokens": s.n_prompt_tokens + s.n_generated_tokens},  # fmt: skip
        "speculation": {"drafter": s.drafter, "draft_n": s.num_draft_tokens, "draft_n_accepted": s.num_accepted_tokens},
        "seed": s.seed,  # the seed the line's sampling used: "seed": -1 drew it, this reproduces it
    }
    if s.lossy:  # LOSSY acceptance thresholds were in effect
        rec["speculation"]["lossy"] = True
    return rec


def run(a) -> int:
    from tqdm import tqdm

    check_parallel(a.parallel)
    check_request_context(a.model, a.n_ctx, "--n-ctx")
    if not a.out:
        raise SystemExit("localspec: error: --out is empty; give the file to write the results to")
    out_path = Path(a.out)
    if not out_path.parent.is_dir():  # before anything is printed or read: nothing could be written
        why = "is not a directory" if out_path.parent.exists() else "does not exist"
        raise SystemExit(f"localspec: error: cannot write --out {out_path}: {out_path.parent} {why}")
    if out_path.exists() and Path(a.input).exists() and out_path.samefile(a.input):
        raise SystemExit(f"localspec: error: --out {a.out} is the input file; give another file for the results")
    items = read_jobs(a.input)
    seen = done_ids(out_path)
    todo = [x for x in items if x["id"] not in seen]
    counts = Counter(x["id"] for x in items)
    dup = len(items) - len(counts)
    if dup:
        some = ", ".join(repr(k) for k, c in counts.items() if c > 1)
        print(f"localspec: warning: {dup} duplicate ids in {a.input} ({some[:200]}); each id is generated once "
              "(a line without an id has its line number as id)", file=sys.stderr)  # fmt: skip
    n_todo = len({x["id"] for x in todo})  # what this run writes: one record per id
    print(f"localspec: {len(items)} prompts, {len(items) - len(todo)} already in {out_path}, {n_todo} to do",
          file=sys.stderr)  # fmt: skip
    if not todo:
        return 0
    base = sampling_from_args(a)
    existed = out_path.exists()
    try:  # before the model loads: an OUT that cannot be written fails at once
        f = out_path.open("a", encoding="utf-8")
    except OSError as e:
        raise SystemExit(f"localspec: error: cannot write --out {out_path}: {e.strerror or e}") from None
    def drop_empty_out() -> None:
        f.close()
        if not existed:  # leave no empty OUT behind
            out_path.unlink(missing_ok=True)

    def interrupt_load(signum, frame) -> None:  # a load runs native code nothing can cancel: stop now, as generate does
        drop_empty_out()
        exit_now_on_sigint(signum, frame)

    hard = threading.current_thread() is threading.main_thread()
    old_int = signal.signal(signal.SIGINT, interrupt_load) if hard else None
    try:
        engine = make_engine(a, None if a.no_spec or a.drafter == "none" else a.drafter)
    except BaseException:
        drop_empty_out()
        raise
    finally:
        if hard:  # from here a Ctrl-C stops the run between results (KeyboardInterrupt)
            signal.signal(signal.SIGINT, old_int)
    bar = tqdm(total=n_todo, unit="prompt", disable=a.no_progress, file=sys.stderr)
    written: set[str] = set()

    def write(rec: dict) -> None:
        if rec["id"] in written:
            return
        written.add(rec["id"])
        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        f.flush()
        bar.update(1)

    uniq: dict[str, dict] = {}
    for x in todo:
        if "_error" in x:
            write({"id": x["id"], "error": x["_error"]})
        else:
            uniq.setdefault(x["id"], x)
    good, prompts, max_tokens, samplings = [], [], [], []
    n_err = sum(1 for x in todo if "_error" in x)
    for x in uniq.values():
        if x["id"] in written:
            continue
        try:
            mt, sp = line_settings(x, a.max_tokens, base)
        except ValueError as e:
            write({"id": x["id"], "error": str(e)})
            n_err += 1
            continue
        good.append(x)
        prompts.append(x["prompt"])
        max_tokens.append(mt)
        samplings.append(sp)
    n_failed = 0

    def on_result(i: int, r) -> None:
        nonlocal n_failed
        n_failed += isinstance(r, BaseException)
        write(result_record(good[i]["id"], r))

    try:
        engine.generate_batch(
            prompts,
            parallel=a.parallel,
            max_tokens=max_tokens,
            sampling=samplings,
            stop=a.stop,
            speculative=not a.no_spec,
            n_ctx=a.n_ctx,
            return_exceptions=True,
            on_result=on_result,
        )
    finally:
        bar.close()
        f.close()
        engine.close()
    errors = f"{n_err} input error{'s' * (n_err != 1)}"
    if n_failed:  # e.g. a prompt longer than the context: an error record like the input's
        errors += f", {n_failed} failed to generate"
    print(f"localspec: wrote {len(written)} results to {out_path} ({errors})", file=sys.stderr)
    return 0
