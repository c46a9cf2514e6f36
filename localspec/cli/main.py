"""``localspec`` command line: generate, chat, complete, serve, batch, bench, models, train-eagle3, train-medusa, rpc-worker."""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
import threading

from ..errors import LocalSpecError


def build_parser() -> argparse.ArgumentParser:
    from . import batch, bench, chat, complete, generate, memory, models, rpc, serve, train, train_medusa

    p = argparse.ArgumentParser(
        prog="localspec",
        description="Lossless speculative decoding of GGUF models on llama.cpp.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for mod in (generate, chat, complete, serve, batch, bench, memory, models, train, train_medusa, rpc):
        mod.register(sub)
    return p


# commands whose Ctrl-C ends the process at once (see _exit_on_interrupt); the chat app reads
# Ctrl-C as a key, `complete --serve` hands signals to uvicorn once it serves
_HARD_INTERRUPT = ("generate", "complete", "bench", "models")


# options whose value is a list of numbers that may start with a minus sign ("-1,1,2"), which
# argparse takes for an option and answers "expected one argument"; glued to the option, the
# value reaches the option's own check, which says what is wrong with it
_NUMBER_LIST_OPTIONS = ("--draft-shape",)
_NUMBER_LIST = re.compile(r"^-[0-9][0-9,.\s-]*$")


def _glue_number_lists(argv: list[str]) -> list[str]:
    """``argv`` with each ``OPTION VALUE`` of ``_NUMBER_LIST_OPTIONS`` whose value starts with a
    minus sign written ``OPTION=VALUE``."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in _NUMBER_LIST_OPTIONS and i + 1 < len(argv) and _NUMBER_LIST.match(argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    """Run one ``localspec`` command; returns its exit status (130 after Ctrl-C, at any moment
    after this module's own light imports: the package imports llama.cpp and numpy on first
    use, here while the parser is built and the command runs)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("\nlocalspec: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    from .common import exit_now_on_sigint

    parser = build_parser()
    a = parser.parse_args(_glue_number_lists(sys.argv[1:] if argv is None else list(argv)))
    if not getattr(a, "func", None):
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if a.verbose:
        from ..backend._llama import set_log_level

        set_log_level("info")
    old_handler = None
    if a.command in _HARD_INTERRUPT and threading.current_thread() is threading.main_thread():
        old_handler = signal.signal(signal.SIGINT, exit_now_on_sigint)
    try:
        return int(a.func(a) or 0)
    except LocalSpecError as e:
        print(f"localspec: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `localspec generate ... | head`
        return 0
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
