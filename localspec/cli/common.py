"""Arguments shared by the subcommands: model / runtime, drafter, sampling."""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import sys
from pathlib import Path

from ..sampling import SamplingParams


N_CTX_HELP = "context size in tokens (default 8192); held to exactly this size, although llama.cpp allocates a multiple of 256"


def add_model_args(p: argparse.ArgumentParser, *, n_ctx_help: str = N_CTX_HELP) -> None:
    g = p.add_argument_group("model and runtime")
    g.add_argument("-m", "--model", default=None, help="target GGUF path (default: the embedded Gemma 3 270M)")
    g.add_argument("--n-ctx", type=int, default=None, help=n_ctx_help)
    g.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all available)")
    g.add_argument(
        "-ngl", "--n-gpu-layers", type=int, default=0, help="layers to offload on CUDA/Metal builds (-1 = all)"
    )
    g.add_argument(
        "--rpc", default=None, metavar="HOST:PORT[,HOST:PORT...]",
        help="put the target's layers on llama.cpp RPC workers (`localspec rpc-worker`); drafters stay local. "
        "Workers have no authentication: trusted networks only (docs/rpc.md)",
    )  # fmt: skip
    g.add_argument("--tensor-split", default=None, metavar="F,F,...",
                   help="with --rpc: share of the layers per device (workers in order, then local GPUs)")  # fmt: skip
    g.add_argument("--rpc-local-gpu", action="store_true", help="with --rpc: split the layers over local GPUs too")
    g.add_argument("--max-tree-nodes", type=int, default=64, help="largest verified token tree (root included)")
    g.add_argument("--no-adaptive", action="store_true", help="verify whole drafted trees (no speculation policy)")
    add_threshold_args(p)


def add_threshold_args(p: argparse.ArgumentParser) -> None:
    """``--accept-threshold-single`` / ``--accept-threshold-acc`` (LOSSY below 1; every command
    that builds an engine gets them through ``add_model_args``)."""
    g = p.add_argument_group(
        "LOSSY acceptance thresholds (opt-in; SGLang's rule, docs/sampling.md)",
        "Below 1.0 they accept more drafts at temperature > 0 and the output is no longer exactly "
        "the target's distribution; results are marked lossy. At temperature 0 greedy "
        "verification is used and they do not apply. Default 1.0 = lossless, unchanged.",
    )
    g.add_argument("--accept-threshold-single", type=float, default=None, metavar="T",
                   help="accept a draft whose target probability is >= T; 0 < T <= 1 (default 1 = lossless)")  # fmt: skip
    g.add_argument("--accept-threshold-acc", type=float, default=None, metavar="T",
                   help="accept a draft when the node's coin <= (target probability of the siblings tried so far) / T; "
                   "0 < T <= 1 (default 1 = lossless)")  # fmt: skip


def thresholds_from_args(a: argparse.Namespace) -> dict:
    """``{"accept_threshold_single": ..., "accept_threshold_acc": ...}`` from the flags (None when
    not given), or a one-line ``localspec: error:`` for a value outside (0, 1]."""
    out = {}
    for name in ("accept_threshold_single", "accept_threshold_acc"):
        v = getattr(a, name, None)
        if v is not None and not 0.0 < v <= 1.0:  # NaN fails too
            flag = "--" + name.replace("_", "-")
            raise SystemExit(f"localspec: error: {flag} must be in (0, 1] (1 = lossless), got {v}")
        out[name] = v
    return out


def add_drafter_args(p: argparse.ArgumentParser, default: str = "ngram") -> None:
    from ..drafters import drafter_names

    g = p.add_argument_group("drafter")
    g.add_argument("--drafter", default=default, choices=drafter_names(), help=f"drafter (default {default})")
    _add_drafter_option_args(g)


def add_drafter_option_args(p: argparse.ArgumentParser) -> None:
    """The drafters' option flags without ``--drafter`` (for commands that take several
    drafters; ``drafter_options`` gives each drafter those it takes)."""
    _add_drafter_option_args(p.add_argument_group("drafter options"))


def _add_drafter_option_args(g) -> None:
    g.add_argument(
        "--draft-model", default=None, metavar="PATH", help="draft model GGUF sharing the target's tokenizer (--drafter draft|auto)"
    )
    g.add_argument("--draft-n-ctx", type=int, default=None, help="draft model context (default: the target's)")
    g.add_argument("--eagle", default=None, metavar="PATH",
                   help="EAGLE-3 head GGUF for the target (--drafter eagle3|auto; default for both: the head shipped "
                   "for the default model; auto without one, elsewhere, drafts n-grams only)")  # fmt: skip
    g.add_argument("--medusa", default=None, metavar="PATH",
                   help="Medusa heads GGUF for the target (--drafter medusa|auto; default for medusa: the heads "
                   "shipped for the default model; auto uses them only when given)")  # fmt: skip
    g.add_argument("--draft-shape", default=None, metavar="D,W,N",
                   help="fixed EAGLE-3 / Medusa / MTP tree shape: depth, width, node budget (e.g. 6,1,7 = chains of 6)")  # fmt: skip


_OPTION_FLAGS = {"draft_model": "--draft-model", "draft_n_ctx": "--draft-n-ctx", "eagle": "--eagle",
                 "medusa": "--medusa", "draft_shape": "--draft-shape"}  # fmt: skip


def drafter_options(a: argparse.Namespace, names: list[str]) -> dict[str, dict]:
    """Per drafter name, the drafter option flags given (``add_drafter_option_args``) that it
    takes (``drafters.drafter_option_names``), e.g. ``--eagle H`` for ``ngram,auto`` ->
    ``{"ngram": {}, "auto": {"eagle": "H"}}``; ``--draft-shape`` parsed to a ``TreeShape``.
    A flag that none of ``names`` takes is a one-line ``localspec: error:``."""
    from ..drafters import drafter_option_names

    given = {k: getattr(a, k, None) for k in _OPTION_FLAGS}
    given = {k: (_draft_shape(v) if k == "draft_shape" else v) for k, v in given.items() if v is not None}
    takes = {n: drafter_option_names(n) for n in names}
    for k in given:
        if not any(k in t for t in takes.values()):
            raise SystemExit(f"localspec: error: {_OPTION_FLAGS[k]} applies to none of the drafters {','.join(names)}")
    return {n: {k: v for k, v in given.items() if k in takes[n]} for n in names}


# Whether commands keep an in-process drafting memory without --draft-memory (measured:
# docs/results.md#drafting-memory; --no-draft-memory turns it off).
DRAFT_MEMORY_BY_DEFAULT = True


def add_memory_args(p: argparse.ArgumentParser) -> None:
    """``--draft-memory [PATH]``, ``--draft-memory-mib``, ``--no-draft-memory``."""
    from ..drafters.memory import DEFAULT_BUDGET_MIB

    g = p.add_argument_group("drafting memory (earlier requests' text to draft from; outputs do not change)")
    g.add_argument("--draft-memory", nargs="?", const="", default=None, metavar="PATH",
                   help="keep a drafting memory of this process's requests; with PATH, load it from PATH at start "
                   "(if the file exists) and save it there at exit (`localspec memory build` makes one from files)"
                   + (" (default: on, in memory only)" if DRAFT_MEMORY_BY_DEFAULT else " (default: off)"))  # fmt: skip
    g.add_argument("--draft-memory-mib", type=float, default=DEFAULT_BUDGET_MIB, metavar="MIB",
                   help=f"the drafting memory's budget (default {DEFAULT_BUDGET_MIB:g} MiB)")
    g.add_argument("--no-draft-memory", action="store_true",
                   help="no drafting memory: requests neither draft from one nor are written to one")


def add_usage_args(p: argparse.ArgumentParser) -> None:
    """``--record-usage DIR``, ``--record-usage-mib`` (learning from use, ``localspec.usage``)."""
    g = p.add_argument_group("learning from use (opt-in; docs/eagle3-training.md)")
    g.add_argument("--record-usage", default=None, metavar="DIR",
                   help="append each finished request's tokens to a bounded local dataset in DIR for "
                   "`localspec train-eagle3 --from-usage DIR`; requests that opt out of the drafting memory "
                   "(draft_memory: false, --no-draft-memory) are not recorded")  # fmt: skip
    g.add_argument("--record-usage-mib", type=float, default=64.0, metavar="MIB",
                   help="most MiB the recorded shards may take; the oldest go first (default 64)")


_USAGE_LOGS: dict[str, object] = {}  # one log per folder in a process (chat makes an engine per model switch)


def usage_log_from_args(a: argparse.Namespace):
    """The ``UsageLog`` ``--record-usage`` asks for (one per folder and process), or None."""
    folder = getattr(a, "record_usage", None)
    if not folder:
        return None
    from ..usage import UsageLog

    if getattr(a, "no_draft_memory", False):
        raise SystemExit("localspec: error: --record-usage records requests, --no-draft-memory keeps them out of "
                         "every memory: choose one")  # fmt: skip
    key = str(Path(folder).expanduser().resolve())
    if Path(key).exists() and not Path(key).is_dir():
        raise SystemExit(f"localspec: error: --record-usage {folder} is a file; give a folder (it is made if missing)")
    if key not in _USAGE_LOGS:
        try:
            _USAGE_LOGS[key] = UsageLog(folder, a.record_usage_mib)
        except (ValueError, OSError) as e:
            raise SystemExit(f"localspec: error: --record-usage: {e}") from None
    return _USAGE_LOGS[key]


# the memories to save at exit, by path (the last engine made for a path wins)
_SAVE_AT_EXIT: dict[str, object] = {}


def _save_memories() -> None:
    for path, mem in _SAVE_AT_EXIT.items():
        try:
            mem.save(path)
        except OSError as e:  # its message names the temporary file written first
            print(f"localspec: the drafting memory was not saved to {path}: {e.strerror or e}", file=sys.stderr)
        except ValueError as e:
            print(f"localspec: the drafting memory was not saved to {path}: {e}", file=sys.stderr)


def _wants_memory(a: argparse.Namespace) -> bool:
    """Whether the arguments ask for a drafting memory; SystemExit (one line) for a bad
    ``--draft-memory-mib``."""
    if getattr(a, "no_draft_memory", False) or not hasattr(a, "draft_memory_mib"):
        return False
    if a.draft_memory is None and not DRAFT_MEMORY_BY_DEFAULT:
        return False
    if not (a.draft_memory_mib > 0 and math.isfinite(a.draft_memory_mib)):
        raise SystemExit(f"localspec: error: --draft-memory-mib must be a finite number > 0, got {a.draft_memory_mib}")
    return True


def memory_from_args(a: argparse.Namespace):
    """A new empty ``DraftMemory`` when the arguments ask for one, else None (one line on
    stderr and None when the native library is missing)."""
    from ..errors import LocalSpecError

    if not _wants_memory(a):
        return None
    from ..drafters.memory import DraftMemory

    try:
        return DraftMemory(a.draft_memory_mib)
    except LocalSpecError as e:
        print(f"localspec: no drafting memory: {e}", file=sys.stderr)
        return None


def attach_memory_file(mem, path: str, model) -> None:
    """Tie ``mem`` to ``model``'s vocabulary, fill it from ``path`` when the file exists and
    save it there at exit. A file that cannot be loaded (not a memory, damaged, another model's
    or version's) is one line on stderr: the memory starts empty and is not saved over it. A
    file holding more than ``mem``'s budget: one line, its newest tokens drafted from, and the
    file not saved over (a save would drop the rest)."""
    import atexit

    from ..drafters.memory import DraftMemory, MemoryFileError, vocab_fingerprint

    mem.vocab = vocab_fingerprint(model)
    if os.path.exists(path):
        try:
            loaded = DraftMemory.load(path, vocab=mem.vocab, budget_mib=mem.budget_mib)
        except MemoryFileError as e:
            print(f"localspec: {e}; starting with an empty drafting memory, which is not saved over it "
                  "(give another path, or delete the file)", file=sys.stderr)  # fmt: skip
            return
        mem.absorb(loaded)
        if loaded.dropped_on_load:
            print(f"localspec: {path} holds more than --draft-memory-mib {mem.budget_mib:g} keeps: drafting from its "
                  f"newest tokens ({loaded.dropped_on_load} older ones left out), and not saving over it (give "
                  f"--draft-memory-mib {loaded.saved_budget_mib:g} to use and keep it whole)", file=sys.stderr)  # fmt: skip
            return
    if not _SAVE_AT_EXIT:
        atexit.register(_save_memories)
    _SAVE_AT_EXIT[path] = mem


def add_sampling_args(p: argparse.ArgumentParser, *, greedy_default: bool = False) -> None:
    """The sampling flags, with llama.cpp's defaults; ``greedy_default``: temperature 0 by
    default (bench, batch), with the same truncation defaults as every other command, so that
    ``--temperature 0.8`` alone samples as ``generate --temperature 0.8`` does (truncation
    changes nothing at temperature 0)."""
    d = SamplingParams(temperature=0.0) if greedy_default else SamplingParams()
    g = p.add_argument_group("sampling (llama.cpp defaults)")
    g.add_argument("--temperature", "--temp", type=float, default=d.temperature, help=f"0 = greedy (default {d.temperature})")
    g.add_argument("--top-k", type=int, default=d.top_k, help=f"0 = off (default {d.top_k})")
    g.add_argument("--top-p", type=float, default=d.top_p, help=f"1 = off, 0 = only the most likely token (default {d.top_p})")
    g.add_argument("--min-p", type=float, default=d.min_p, help=f"0 = off (default {d.min_p})")
    g.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty, help="1 = off")
    g.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty)
    g.add_argument("--presence-penalty", type=float, default=d.presence_penalty)
    g.add_argument("--penalty-last-n", type=int, default=d.penalty_last_n, help="window of penalties (-1 = all)")
    g.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="TOKEN=BIAS",
        help="add BIAS to TOKEN's logit ('-inf' bans it, 'inf' forces it); repeatable",
    )
    g.add_argument(
        "--seed", type=int, default=None, help="seed of the per-position random streams (-1 = random, as in llama.cpp; "
        "the seed used is in the statistics)"
    )
    g.add_argument("--grammar", default=None, help="GBNF grammar text constraining the output")
    g.add_argument("--grammar-file", default=None, help="file with a GBNF grammar")
    g.add_argument(
        "--verify",
        choices=("gumbel", "rejection"),
        default="gumbel",
        help="speculative sampling at temperature > 0: seeded Gumbel (same text as plain "
        "decoding for a seed) or classic rejection sampling",
    )


def sampling_from_args(a: argparse.Namespace, logprobs: int | None = None) -> SamplingParams:
    bias = {}
    for item in a.logit_bias:
        try:
            tok, val = item.split("=", 1)
            bias[int(tok)] = float(val)  # "inf" / "-inf" too: +inf forces the token, -inf bans it
        except ValueError:
            raise SystemExit(f"localspec: error: --logit-bias expects TOKEN=BIAS, got {item!r}") from None
        if math.isnan(bias[int(tok)]):
            raise SystemExit(f"localspec: error: --logit-bias expects a number, got {item!r}")
    grammar = a.grammar
    if a.grammar_file:
        grammar = read_text_file(a.grammar_file, "--grammar-file")
    seed = a.seed
    if seed is not None and (seed < -1 or seed >= 1 << 64):
        raise SystemExit(f"localspec: error: --seed must be in 0..{(1 << 64) - 1}, or -1 for a random seed; got {seed}")
    if seed == -1:
        seed = None
    return SamplingParams(
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        min_p=a.min_p,
        repeat_penalty=a.repeat_penalty,
        frequency_penalty=a.frequency_penalty,
        presence_penalty=a.presence_penalty,
        penalty_last_n=a.penalty_last_n,
        logit_bias=bias,
        seed=seed,
        grammar=grammar,
        verify=a.verify,
        logprobs=logprobs,
        **thresholds_from_args(a),
    )


def read_text_file(path: str, what: str) -> str:
    """The UTF-8 text of ``path``, or a one-line ``localspec: error:`` naming ``what``."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SystemExit(f"localspec: error: cannot read {what} {path!r}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SystemExit(
            f"localspec: error: {what} {path!r} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})"
        ) from None


def _draft_shape(text: str | None):
    """``"D,W,N"`` -> ``TreeShape(D, W, N, min_score=0)`` (every level drafted), or None."""
    if not text:
        return None
    from ..policy import TreeShape

    try:
        d, w, n = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"localspec: error: --draft-shape takes DEPTH,WIDTH,NODES (e.g. 6,1,7), not {text!r}") from None
    low = [f"{k} {v}" for k, v in (("depth", d), ("width", w), ("nodes", n)) if v < 1]
    if low:  # each at least 1: a chain of 6 is 6,1,7 (the root is a node)
        raise SystemExit(f"localspec: error: --draft-shape {text}: {', '.join(low)}; each must be at least 1 (e.g. 6,1,7)")
    return TreeShape(d, w, n, min_score=0.0)


def _tensor_split(text: str | None) -> list[float] | None:
    if not text:
        return None
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"localspec: error: --tensor-split takes comma-separated numbers (e.g. 3,1), not {text!r}") from None


def rpc_args(a: argparse.Namespace) -> dict:
    """The ``Engine`` keyword arguments of ``--rpc`` / ``--tensor-split`` / ``--rpc-local-gpu``."""
    rpc = getattr(a, "rpc", None)
    if rpc is not None and not rpc.strip():
        raise SystemExit("localspec: error: --rpc is empty; give the workers as HOST:PORT[,HOST:PORT...]")
    if not rpc:
        if getattr(a, "tensor_split", None) or getattr(a, "rpc_local_gpu", False):
            raise SystemExit("localspec: error: --tensor-split and --rpc-local-gpu apply with --rpc")
        return {}
    return dict(rpc=rpc, tensor_split=_tensor_split(a.tensor_split), rpc_local_gpu=a.rpc_local_gpu)


def need_extra(module: str, extra: str, command: str) -> None:
    """A one-line ``localspec: error:`` naming the extra to install when ``module`` cannot be
    imported (``make run`` installs only the running extras, tui and server)."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as e:
        raise SystemExit(
            f"localspec: error: localspec {command} needs the [{extra}] extra: pip install 'localspec[{extra}]' ({e})"
        ) from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IP address, IPv6 in brackets or not) is this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listen_address(host: str, api_key: str | None) -> None:
    """`serve` and `complete --serve` listen beyond this machine only behind a key: exits with
    one line when ``host`` is not loopback and ``api_key`` is empty."""
    if not is_loopback(host) and not api_key:
        raise SystemExit(f"localspec: error: listening on {host} (not this machine only) needs --api-key KEY")


def drafters_to_compare(flag: str, names: list[str]) -> list[str]:
    """``names`` when each is a drafter other than ``none`` (plain decoding runs beside them
    anyway); else exits with one line naming ``flag`` and the choices."""
    from ..drafters import drafter_names

    known = [n for n in drafter_names() if n != "none"]
    for n in names:
        if n not in known:
            raise SystemExit(f"localspec: error: {flag}: {n!r} is not a drafter to compare (choose from "
                             f"{', '.join(known)}; plain decoding always runs)")  # fmt: skip
    return names


def _whole_number(text: str, least: int) -> int:
    """``text`` as an integer of at least ``least``, else argparse's one-line error."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a whole number, got {text!r}") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {n}")
    return n


def positive(text: str) -> int:
    """argparse type of a count that must be at least 1 (prompts per category, tokens a bench
    times): refused before anything loads."""
    return _whole_number(text, 1)


def count(text: str) -> int:
    """argparse type of a token count: an integer >= 0 (refused before anything loads)."""
    return _whole_number(text, 0)


def check_model_files(a: argparse.Namespace) -> None:
    """The GGUF files named by ``a`` (``--model``, ``--draft-model``, ``--eagle``, ``--medusa``)
    exist and are GGUF files; else ``ModelLoadError`` (one line), before any model loads."""
    from ..backend.model import check_gguf_file

    kinds = {"model": "model file", "draft_model": "draft model file", "eagle": "EAGLE-3 head file", "medusa": "Medusa heads file"}
    for name, what in kinds.items():
        path = getattr(a, name, None)
        if path:
            check_gguf_file(path, what, "--" + name.replace("_", "-"))


def check_runtime_args(a: argparse.Namespace, drafter: str | None) -> None:
    """Before any model loads: ``-t`` at least 1 (a warning above this machine's CPUs, where
    llama.cpp's spinning threads make a decode many times slower), no empty ``--stop`` string,
    and ``--drafter draft`` with its ``--draft-model``; else SystemExit with one line (the
    drafter's: InvalidRequestError)."""
    from ..backend.context import available_cpus

    if a.threads is not None:
        if a.threads < 1:
            raise SystemExit(f"localspec: error: -t/--threads must be >= 1, got {a.threads} (default: the CPUs available)")
        n_cpus = available_cpus()
        if n_cpus is not None and a.threads > n_cpus:
            print(f"localspec: warning: -t {a.threads} is more threads than the {n_cpus} CPUs this process may use: "
                  "llama.cpp's threads will wait on each other and decodes run many times slower", file=sys.stderr)  # fmt: skip
    if "" in (getattr(a, "stop", None) or ()):
        raise SystemExit("localspec: error: --stop strings must not be empty")
    if drafter == "draft" and not getattr(a, "draft_model", None):  # the drafter's own error, before the target loads
        from ..drafters import make_drafter

        make_drafter("draft")


def check_engine_args(a: argparse.Namespace, drafter: str | None) -> None:
    """Every check ``make_engine`` makes of the arguments, without loading or allocating
    anything (``chat`` runs it before its app starts, where an error would be a screen).

    Raises:
        SystemExit: one line for a bad flag; ``ModelLoadError`` / ``InvalidRequestError``
            (one line each from ``main``) for a missing model file or an engine size.
    """
    from ..engine import check_engine_sizes

    thresholds_from_args(a)
    memory_file = getattr(a, "draft_memory", None) if _wants_memory(a) else None
    if memory_file and not Path(memory_file).expanduser().parent.is_dir():
        raise SystemExit(f"localspec: error: --draft-memory {memory_file}: the folder {Path(memory_file).expanduser().parent} "
                         "does not exist, so the memory could not be saved there")  # fmt: skip
    _draft_shape(getattr(a, "draft_shape", None))
    check_model_files(a)
    check_runtime_args(a, drafter)
    check_engine_sizes(n_ctx=a.n_ctx, n_threads=a.threads, max_tree_nodes=a.max_tree_nodes, n_gpu_layers=a.n_gpu_layers)


def make_engine(a: argparse.Namespace, drafter: str | None, *, progress: bool = True, drafter_flags: bool = True):
    """Build an ``Engine`` from parsed arguments, saying what it does on stderr (after the
    arguments and model files are checked: a bad one is one error line, nothing loaded; a
    cost table measured under contention is one note line);
    ``drafter_flags=False``: without the drafter option flags (a command that makes its
    drafters from ``drafter_options``)."""
    from ..engine import Engine

    if not drafter_flags:
        a = argparse.Namespace(**{**vars(a), **dict.fromkeys(_OPTION_FLAGS)})
    check_engine_args(a, drafter)
    thresholds = {k: v for k, v in thresholds_from_args(a).items() if v is not None}
    mem = memory_from_args(a)
    kwargs = dict(
        drafter=drafter,
        draft_model=getattr(a, "draft_model", None),
        draft_n_ctx=getattr(a, "draft_n_ctx", None),
        eagle=getattr(a, "eagle", None),
        medusa=getattr(a, "medusa", None),
        draft_shape=_draft_shape(getattr(a, "draft_shape", None)),
        n_ctx=a.n_ctx,
        n_threads=a.threads,
        n_gpu_layers=a.n_gpu_layers,
        max_tree_nodes=a.max_tree_nodes,
        adaptive=not a.no_adaptive,
        **thresholds,
        **rpc_args(a),
        draft_memory=mem,
    )
    usage_log = usage_log_from_args(a)  # a folder it cannot use is one line before the model loads
    memory_file = getattr(a, "draft_memory", None) if mem is not None else None
    if progress:
        print("localspec: loading model and measuring decode cost (cached after the first run)...", file=sys.stderr)
    engine = Engine(a.model, **kwargs)
    note = engine.cost_model.contention_note()
    if progress and note is not None:
        print(f"localspec: note: {note}", file=sys.stderr)
    if progress and a.n_gpu_layers and not getattr(a, "rpc", None) and not engine.model.on_local_gpu:
        print(f"localspec: note: -ngl {a.n_gpu_layers} has no effect: this llama.cpp build has no GPU backend "
              "(every layer runs on the CPU; docs/gpu.md builds one)", file=sys.stderr)  # fmt: skip
    if memory_file:
        attach_memory_file(mem, memory_file, engine.model)
    engine.usage_log = usage_log
    return engine


def exit_now_on_sigint(_signum, _frame) -> None:
    """SIGINT handler: flush what was generated, say so on one line, exit 130.

    A KeyboardInterrupt raised while llama.cpp calls back into Python (its log, progress and
    abort callbacks, which run throughout model loading, decode-cost measurement and long
    decodes) cannot cross the native call: the backend raises it once that call returns
    (``backend._llama.raise_if_interrupted``), which for a model load can be minutes; exiting
    from the handler stops the command at any moment."""
    try:
        sys.stdout.flush()
    except Exception:  # a write was interrupted half-way; what is lost is lost anyway
        pass
    from ..paths import remove_partial_files

    remove_partial_files()  # a model or head being written (``atomic_path``): none is left behind
    try:
        os.write(2, b"\nlocalspec: interrupted\n")
    except OSError:
        pass
    os._exit(130)


def server_interrupt(state: dict):
    """The SIGINT / SIGTERM handler of a server command (``serve``, ``complete --serve``;
    uvicorn passes the signals on once it has stopped). Until ``state["serving"]`` is set (its
    ``on_ready``), the process ends at once with "localspec: interrupted" and status 130, as
    ``generate`` does: the load runs native llama.cpp calls on another thread that nothing
    can cancel, and waiting for it can take minutes. Once serving, uvicorn's graceful shutdown
    is done and ``serve_while_loading`` returns (KeyboardInterrupt)."""

    def interrupt(signum, frame) -> None:
        if not state.get("serving"):
            exit_now_on_sigint(signum, frame)
        raise KeyboardInterrupt

    return interrupt


def training_context(path) -> int | None:
    """The training context of a model (``context_length`` in its GGUF), read without loading
    it or walking its header past that key (``gguf_value``); None where the file does not say
    (an unreadable file is left to the loader to report)."""
    from ..models import default_model_path
    from ..models.gguf_index import gguf_architecture, gguf_value

    path = path or default_model_path()
    arch = gguf_architecture(path)
    n = None if arch is None else gguf_value(path, f"{arch}.context_length")
    return int(n) if isinstance(n, int) and n > 0 else None


def check_parallel(parallel: int) -> None:
    """Refuse a ``--parallel`` (``serve``, ``batch``) the scheduler cannot run, before loading.

    Raises:
        SystemExit: one ``localspec: error:`` line with the range.
    """
    from ..scheduler import MAX_PARALLEL, MAX_SEQ

    if not 1 <= parallel <= MAX_PARALLEL:
        raise SystemExit(f"localspec: error: --parallel must be in 1..{MAX_PARALLEL} (llama.cpp's {MAX_SEQ} sequence "
                         f"ids), got {parallel}")  # fmt: skip


def check_request_context(model_path, n_ctx: int | None, flag: str) -> None:
    """Refuse a request context (``serve --ctx-per-request``, ``batch --n-ctx``) above the
    model's training context, before anything loads (positions past it are out of the
    model's range; ``generate --n-ctx`` sizes the whole context and is left as llama.cpp leaves it).

    Raises:
        SystemExit: one ``localspec: error:`` line naming ``flag`` and the largest value.
    """
    if n_ctx is None:
        return
    n_ctx_train = training_context(model_path)
    if n_ctx_train is not None and n_ctx > n_ctx_train:
        raise SystemExit(f"localspec: error: {flag} {n_ctx} is more than the model's training context of "
                         f"{n_ctx_train} tokens: give at most {n_ctx_train}")  # fmt: skip
