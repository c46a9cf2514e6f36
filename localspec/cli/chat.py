"""``localspec chat``: the terminal chat app (needs the ``tui`` extra)."""

from __future__ import annotations

import argparse
import sys

from .common import (add_drafter_args, add_memory_args, add_model_args, add_sampling_args, add_usage_args,
                     check_engine_args, make_engine, positive, sampling_from_args, usage_log_from_args)


def register(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="chat in the terminal, seeing where each token came from",
        description="A terminal chat with the model (Textual). Tokens are coloured by how they were "
        "produced (n-gram, draft model, EAGLE-3, recovered, bonus, plain decoding); a panel shows the "
        "speculation statistics. Models with a chat template in their GGUF use it; others (the default "
        "base model) use a plain 'User:/Assistant:' transcript. ctrl+p lists every command.",
    )
    p.add_argument("-n", "--max-tokens", type=positive, default=512, help="most tokens per answer (default 512)")
    p.add_argument("--system", default=None, help="system message (the preamble of the plain transcript)")
    p.add_argument(
        "--transcript",
        action="store_true",
        help="use the plain 'User:/Assistant:' transcript even if the model has a chat template",
    )
    p.add_argument("--save-dir", default=".", help="default folder of saved transcripts")
    add_drafter_args(p)
    add_sampling_args(p)
    add_model_args(p)
    add_memory_args(p)
    add_usage_args(p)
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    if not (sys.stdin.isatty() and sys.stdout.isatty()):  # a full-screen app: keys in, screen out
        raise SystemExit("localspec: error: localspec chat needs a terminal (its standard input and output); "
                         "for scripts use localspec generate, batch or serve")  # fmt: skip
    try:
        from localspec.tui import ChatApp
        from localspec.tui.stderr import NativeStderr
    except ImportError as e:  # textual missing
        raise SystemExit(f"localspec: error: localspec chat needs the [tui] extra: pip install 'localspec[tui]' ({e})") from None
    sampling = sampling_from_args(a)
    check_engine_args(a, a.drafter)  # a bad flag or a missing model file: one line, before the app starts
    usage = usage_log_from_args(a)  # a bad --record-usage too

    def factory(path: str | None, drafter: str, **options):
        a.model = path
        for key, value in options.items():  # paths chosen in the app win over the command line's
            setattr(a, key, value)
        return make_engine(a, drafter, progress=False)

    drafter_options = {
        "draft": {"draft_model": a.draft_model, "draft_n_ctx": a.draft_n_ctx},
        "eagle3": {"eagle": a.eagle},
        "medusa": {"medusa": a.medusa},
    }

    native = NativeStderr()
    app = ChatApp(
        model=a.model,
        engine_factory=factory,
        drafter=a.drafter,
        drafter_options={k: {o: v for o, v in opts.items() if v is not None} for k, opts in drafter_options.items()},
        sampling=sampling,
        max_tokens=a.max_tokens,
        system=a.system,
        transcript=a.transcript,
        save_dir=a.save_dir,
        native_stderr=native,
    )
    with native:  # llama.cpp's own stderr lines must not land on the screen
        try:
            app.run()
        finally:
            app.shutdown_engine()
            if usage is not None:
                usage.close()
    return 0
