"""Command line: argparse only. Each subcommand's module owns its flags (`add_cli_args`) and its run (`cli_main`).

mlaserve serve [MODEL]          OpenAI-compatible server
mlaserve generate [MODEL]       offline generation
mlaserve bench serve|compare    serving benchmark and A/B comparison
mlaserve make-random PRESET OUT random HF-format checkpoint
mlaserve train-draft TARGET OUT distill an EAGLE3 draft from a target's hidden states and greedy outputs
mlaserve train-model WORK       train a small DeepSeek-V3 model on this machine's Python source (a resumable recipe)
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .version import __version__

# subcommand -> module holding add_cli_args(parser) and cli_main(args)
COMMANDS = {
    "serve": ("mlaserve.server.api", "run the OpenAI-compatible HTTP server"),
    "generate": ("mlaserve.llm", "generate text offline from a prompt"),
    "make-random": ("mlaserve.models.make_random_cli", "write a random HF-format checkpoint from a preset"),
    "train-draft": ("mlaserve.train.train_draft", "distill an EAGLE3 draft from a target's own greedy outputs"),
    "train-model": ("mlaserve.train.train_model", "train a small DeepSeek-V3 model on this machine's Python source"),
}
BENCH_COMMANDS = {
    "serve": ("mlaserve.bench.serve", "benchmark a running server (docs/benchmarking.md protocol)"),
    "compare": ("mlaserve.bench.compare", "A/B-compare saved bench results and check outputs are identical"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlaserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help="on an error, show its traceback (default: one line)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    fmt = argparse.ArgumentDefaultsHelpFormatter  # every --help shows the defaults
    # Import only the module of the command being run: keeps `mlaserve --help` and each command fast.
    wanted = next((a for a in argv if a in COMMANDS or a == "bench"), None)
    for name, (mod, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=fmt)
        _add_debug(p)
        if name == wanted:
            importlib.import_module(mod).add_cli_args(p)
            p.set_defaults(module=mod)
    bench = sub.add_parser("bench", help="serving benchmark tools")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH_COMMAND")
    for name, (mod, help_) in BENCH_COMMANDS.items():
        p = bench_sub.add_parser(name, help=help_, description=help_, formatter_class=fmt)
        _add_debug(p)
        if wanted == "bench" and name in argv:
            importlib.import_module(mod).add_cli_args(p)
            p.set_defaults(module=mod)
    return parser


def _add_debug(p: argparse.ArgumentParser) -> None:
    # after the subcommand too; SUPPRESS keeps the subparser from resetting a --debug given before it
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="on an error, show its traceback")


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand. An error it raises is one line, `mlaserve: error: ...`, exit code 2 (`--debug`: the
    traceback), as argparse's own errors are."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        rc = importlib.import_module(args.module).cli_main(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if args.debug:
            raise
        msg = " ".join(str(e).split()) or type(e).__name__
        user = isinstance(e, (ValueError, OSError, LookupError))  # ConfigError is a ValueError
        hint = "" if user else f" ({type(e).__name__}; --debug shows the traceback)"
        print(f"mlaserve: error: {msg}{hint}", file=sys.stderr, flush=True)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
