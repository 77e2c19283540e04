"""The `llm-ring` command: one subcommand per module, imported only when used.

Each command module exposes `configure(parser)` (adds its options) and
`main(args) -> int` (runs it). Bad input raises `UsageError` (caught here: one line,
exit code 2); see extproc/cli_input.py. Keeping the imports lazy keeps `llm-ring --help`
fast and lets `serve` start without loading the analysis stack.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from extproc.cli_input import OneLineParser, UsageError, report_usage_error

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("extproc.service.main", "run the ext_proc routing service"),
    "up": ("extproc.stack.commands", "start the local stack: replicas, router, Envoy"),
    "status": ("extproc.stack.commands", "show the local stack"),
    "down": ("extproc.stack.commands", "stop the local stack"),
    "scale": ("extproc.stack.commands", "change the number of local replicas"),
    "models": ("extproc.stack.models_cli", "list or prepare models"),
    "run": ("extproc.experiments.run", "run a policy comparison against a gateway"),
    "report": ("extproc.analysis.report", "summarise an experiment folder"),
    "sim": ("extproc.sim.cli", "simulate policies on a calibrated cost model"),
    "calibrate": ("extproc.sim.calibrate", "measure a live replica into a cost model"),
    "bench": ("extproc.bench.cli", "benchmarks: decisions, gateway, hostile, sim"),
    "demo": ("extproc.experiments.demo", "set up, start the stack, compare policies, report"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    run = getattr(module, f"main_{args.command}", None) or module.main
    try:
        return int(run(args) or 0)
    except UsageError as exc:
        return report_usage_error(args.command, exc)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Configure only the command being run (other modules stay unimported)."""
    parser = OneLineParser(prog="llm-ring", description="Cache-aware routing for LLM replicas.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = argv[0] if argv else None
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(_module=module_name)
        if name == wanted:
            module = importlib.import_module(module_name)
            configure = getattr(module, f"configure_{name}", None) or module.configure
            configure(command)
    return parser


if __name__ == "__main__":
    sys.exit(main())
