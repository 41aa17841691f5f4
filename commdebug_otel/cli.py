"""The ``commdebug-otel`` command: ``demo``, ``run``, ``summarize``, ``diagnose``, ``perfetto``, ``report``,
``receive``, ``signature``, ``compare``.

``commdebug-otel`` alone prints the help; ``--version`` the versions of ours, torch and the OTel SDK.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys

from commdebug_otel.config import BOOTSTRAP_DIR, OPTIONS, Detail, Option, run_environment


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _checked(option: Option):
    """An argparse type that validates with the option's own parser and keeps the text."""
    def check(text: str) -> str:
        try:
            option.parse(text)
        except (ValueError, TypeError):
            raise argparse.ArgumentTypeError(f"expected {option.accepted}, got {text!r}") from None
        return text
    return check


RUN_EXAMPLES = """\
examples:
  # every worker traced; no collector: OTLP-JSON files in ./commdebug-otel-out/run-<time>-<id>/
  commdebug-otel run -- torchrun --nproc-per-node 8 train.py
  # one step in 100, to a collector (OTLP/gRPC; for OTLP/HTTP on 4318 add OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf)
  OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4317 \\
    commdebug-otel run --trace-every 100 -- torchrun --nproc-per-node 8 train.py
  # DTensor ops as span events too, spans from ranks 0 and 4 only, a stall snapshot after 120 s
  commdebug-otel run --detail dtensor --ranks 0,4 --stall-after 120 -- python train.py
  # then, offline: commdebug-otel summarize|diagnose commdebug-otel-out/run-*/
"""


def _add_run(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "run", help="run a command with tracing on in every Python process it starts",
        description="Like opentelemetry-instrument: runs CMD with OTEL_PYTHON_COMMDEBUG_ENABLED=true "
                    "and our start-up hook on PYTHONPATH. Each option sets the environment variable "
                    "named in its help.",
        epilog=RUN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    for option in OPTIONS:
        if option.field == "enabled":
            continue
        run.add_argument(option.flag, dest=option.field, metavar="VALUE", type=_checked(option),
                         help=f"{option.help} Sets {option.env} ({option.accepted}).".replace("%", "%%"))
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commdebug-otel",
        description="PyTorch collectives and module passes as OpenTelemetry spans, events and metrics.")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command_name", metavar="COMMAND")
    demo = commands.add_parser("demo", help="run a traced multi-rank training job on CPU (gloo)")
    demo.add_argument("--ranks", type=_positive, default=2,
                      help="processes: 1 or 2 = tensor parallel, an even number from 4 = FSDP2 + TP on a "
                           "(ranks/2, 2) mesh (default 2)")
    demo.add_argument("--steps", type=_positive, default=5, help="optimizer steps (default 5)")
    demo.add_argument("--detail", choices=[level.label for level in Detail], default="collectives",
                      help="what becomes a span event (default collectives)")
    _add_run(commands)
    for name, module_name, help_text in (
            ("summarize", "offline.summary",
             "per-module collective tables, rank totals and stragglers from OTLP-JSON files"),
            ("diagnose", "offline.diagnose",
             "stuck ranks, desyncs, stragglers with the module that held them back, from OTLP-JSON files"),
            ("perfetto", "offline.perfetto", "convert OTLP-JSON files to a Chrome/Perfetto trace"),
            ("report", "offline.html_report",
             "one self-contained HTML page: the answer (hang, straggler or healthy), findings, per-rank step "
             "and wait time, step timelines, collectives by module ranked by bytes"),
            ("receive", "offline.receive",
             "a local OTLP receiver (gRPC 4317, HTTP 4318) writing OTLP-JSON run folders the commands above read"),
            ("signature", "offline.signature",
             "a run's communication signature: collectives and bytes per step, per module, pass, op, group, "
             "dtype and cause, as sorted JSON"),
            ("compare", "offline.compare",
             "what two signatures (or run folders) differ in: exit 0 equal, 1 different, 2 unreadable")):
        module = _optional_module(module_name)
        if module is not None:
            sub = commands.add_parser(name, help=help_text)
            module.add_arguments(sub)
            sub.set_defaults(handler=module.run)
    return parser


def _version() -> str:
    """``commdebug-otel X (torch Y, opentelemetry-sdk Z)``, from the installed metadata (torch is not imported)."""
    from importlib import metadata

    from commdebug_otel.version import __version__

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    sdk = installed("opentelemetry-sdk")
    return f"commdebug-otel {__version__} (torch {installed('torch')}, opentelemetry-sdk {sdk})"


def _optional_module(name: str):
    import importlib

    try:
        return importlib.import_module(f"commdebug_otel.{name}")
    except ImportError:
        return None


def run_command(args: argparse.Namespace) -> int:
    """Exec ``args.command`` with the settings as environment variables and tracing enabled."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("commdebug-otel run: give a command after --, e.g. commdebug-otel run -- torchrun train.py",
              file=sys.stderr)
        return 2
    env = run_environment({option.field: getattr(args, option.field, None) for option in OPTIONS})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BOOTSTRAP_DIR, env.get("PYTHONPATH", "")) if p)
    import shutil

    if shutil.which(command[0], path=env.get("PATH")) is None:
        print(f"commdebug-otel run: {command[0]!r}: command not found", file=sys.stderr)
        return 127
    restored = _restore_signal_defaults()
    try:
        os.execvpe(command[0], command, env)
    except OSError as error:
        for signum in restored:  # no exec: ours again, so a closed stderr raises BrokenPipeError
            signal.signal(signum, signal.SIG_IGN)
        print(f"commdebug-otel run: cannot run {command[0]!r}: {error.strerror}", file=sys.stderr)
        return 126
    return 0  # not reached


def _restore_signal_defaults() -> list[int]:
    """Give back the default action of the signals Python ignores at start-up (SIGPIPE, SIGXFSZ), as
    ``subprocess``'s ``restore_signals`` does: an exec'd command keeps ignored signals ignored, and a
    plain launch from a shell gets their defaults (``yes | head -1`` ends ``yes`` by SIGPIPE, status 141).
    Returns the signals restored."""
    restored = []
    for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ"):
        signum = getattr(signal, name, None)
        if signum is not None and signal.getsignal(signum) == signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            restored.append(signum)
    return restored


# What a shell reports for a process that SIGPIPE ended (128 + 13), as for `yes | head -1`.
EXIT_PIPE_CLOSED = 141


def _dispatch(args: argparse.Namespace) -> int:
    if args.command_name == "demo":
        from commdebug_otel.demo import demo_refusal, run_demo

        refusal = demo_refusal(args.ranks)
        if refusal:
            print(f"commdebug-otel demo: {refusal}", file=sys.stderr)
            return 2
        return run_demo(ranks=args.ranks, steps=args.steps, detail=args.detail)
    if args.command_name == "run":
        return run_command(args)
    return args.handler(args)


def main(argv: list[str] | None = None) -> int:
    """Run one ``commdebug-otel`` subcommand. Returns its exit status.

    A reader that closes stdout early (``commdebug-otel summarize ... | head``) ends the
    command quietly with :data:`EXIT_PIPE_CLOSED` (141), as Unix tools killed by SIGPIPE do.
    """
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse's --help ignores a closed stdout itself
    if args.command_name is None:  # `commdebug-otel` alone: what it can do
        parser.print_help()
        return 0
    try:
        status = _dispatch(args)
        sys.stdout.flush()  # inside the try: a buffered tail meets the closed pipe here, not at exit
        return status
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at devnull so that flush cannot fail too.
        with contextlib.suppress(OSError, ValueError):  # a stdout without a file descriptor
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, sys.stdout.fileno())
            finally:
                os.close(devnull)
        return EXIT_PIPE_CLOSED


if __name__ == "__main__":
    sys.exit(main())
