"""``commdebug-otel compare BASE NEW``: what two communication signatures differ in.

Each of BASE and NEW is a signature file (``commdebug-otel signature -o``, a pytest baseline) or a
run folder / OTLP-JSON trace files, made into a signature first (:func:`.signature.load`). The
typical steps are compared, then the first and last steps' differences from them (unless
``--typical-only``). Exit status: 0 equal, 1 different, 2 a side could not be read (a signature
file of an older format, or with two entries for one key and rank, too). The text diff is
:func:`.signature.format_diff`'s; ``--format json`` prints :func:`.signature.compare`'s dict.
"""

from __future__ import annotations

import argparse
import json
import sys

from commdebug_otel.offline import EXIT_DONE, EXIT_UNREADABLE, signature

__all__ = ["EXIT_DIFFERENT", "EXIT_EQUAL", "EXIT_UNREADABLE", "add_arguments", "run"]

EXIT_EQUAL = EXIT_DONE
EXIT_DIFFERENT = 1


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")  # argparse would name this function in its message
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``compare``'s arguments to ``parser``."""
    parser.add_argument("base", metavar="BASE", help="signature file, run folder or OTLP-JSON trace file")
    parser.add_argument("new", metavar="NEW", help="signature file, run folder or OTLP-JSON trace file")
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="a readable diff, or the diff as JSON (default text)")
    parser.add_argument("--count-tolerance", type=_non_negative, default=0.0, metavar="N",
                        help="collectives per step a count may move by and still be equal (default 0)")
    parser.add_argument("--bytes-tolerance", type=_non_negative, default=0.0, metavar="FRACTION",
                        help="share of the base's bytes per step they may move by, e.g. 0.05 (default 0)")
    parser.add_argument("--typical-only", action="store_true",
                        help="compare the typical steps only, not how the first and last steps differ from them "
                             "(default: those differences are compared too)")
    # Every step is read now (the first one's difference reported apart): accepted so scripts keep working.
    parser.add_argument("--include-warmup", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Print the diff of ``args.base`` and ``args.new``. Returns 0 equal, 1 different, 2 unreadable."""
    documents = []
    for path in (args.base, args.new):
        messages: list[str] = []
        try:
            documents.append(signature.load(path, messages))
        except signature.SignatureError as error:
            print(f"commdebug-otel compare: {error}", file=sys.stderr)
            return EXIT_UNREADABLE
        finally:
            for message in messages:
                print(f"commdebug-otel compare: {message}", file=sys.stderr)
    base, new = documents
    diff = signature.compare(base, new, count_tolerance=args.count_tolerance,
                             bytes_tolerance=args.bytes_tolerance, typical_only=args.typical_only)
    if args.format == "json":
        print(json.dumps(diff, indent=2))
    elif diff["equal"]:
        print(f"communication equal: {len(documents[1]['entries'])} entries ({args.new} against {args.base})")
    else:
        print(signature.format_diff(diff, args.base, args.new))
    return EXIT_EQUAL if diff["equal"] else EXIT_DIFFERENT
