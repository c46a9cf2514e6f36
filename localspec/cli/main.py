"""``localspec`` command line: generate, chat, complete, bench, models, train-eagle3, rpc-worker."""

from __future__ import annotations

import argparse
import logging
import sys

from ..errors import LocalSpecError


def build_parser() -> argparse.ArgumentParser:
    from . import bench, chat, complete, generate, models, rpc, train

    p = argparse.ArgumentParser(
        prog="localspec",
        description="Lossless speculative decoding of GGUF models on llama.cpp.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for mod in (generate, chat, complete, bench, models, train, rpc):
        mod.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if not getattr(a, "func", None):
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if a.verbose:
        from ..backend._llama import set_log_level

        set_log_level("info")
    try:
        return int(a.func(a) or 0)
    except LocalSpecError as e:
        print(f"localspec: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nlocalspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `localspec generate ... | head`
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
