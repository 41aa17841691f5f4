"""The ``commdebug-otel`` command: ``demo`` (more subcommands in docs/cli.md)."""

from __future__ import annotations

import argparse
import logging
import sys

from .config import Detail


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commdebug-otel",
        description="PyTorch collectives and module passes as OpenTelemetry spans, events and metrics.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run a traced multi-rank training job on CPU (gloo)")
    demo.add_argument("--ranks", type=_positive, default=2,
                      help="processes; 2 = tensor parallel, 4 = FSDP2 + TP on a 2-D mesh (default 2)")
    demo.add_argument("--steps", type=_positive, default=5, help="optimizer steps (default 5)")
    demo.add_argument("--detail", choices=[level.label for level in Detail], default="collectives",
                      help="what becomes a span event (default collectives)")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(ranks=args.ranks, steps=args.steps, detail=args.detail)
    return 2


if __name__ == "__main__":
    sys.exit(main())
