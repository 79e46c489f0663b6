"""The one command-line shape of `python -m qerl.flows.<name>`: each module declares its own arguments and what to run;
this builds the parser (with --params and -S overrides), sets up logging and ends every error in one line.

Exit codes are `qerl.errors`': 2 for what the user can fix (bad input; an unreachable tracking or Prefect server, whose
line names the URL and the setting; a registry without the version asked for), 1 for anything else, 130 for Ctrl-C;
QERL_DEBUG=1 shows the traceback.
"""

from __future__ import annotations

from qerl.flows import startup  # noqa: F401 (first of all: the process's settings, before Prefect, MLflow, torch)

import argparse
import logging
import sys
from typing import Callable

from qerl.flows.prefect_api import PrefectUnavailable
from qerl.flows.tracking import TrackingUnavailable
from qerl.debug import debug_requested
from qerl.errors import BAD_INPUT_EXIT, report

DEFAULT_PARAMS = "params/default.yaml"


def add_params(parser: argparse.ArgumentParser, default: str | None = DEFAULT_PARAMS, help: str | None = None) -> None:
    """--params FILE and repeatable -S SECTION.KEY=VALUE overrides (into `args.params`, `args.overrides`)."""
    parser.add_argument("--params", default=default)
    parser.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help=help)


def main(argv: list[str] | None, *, module: str, doc: str | None,
         arguments: Callable[[argparse.ArgumentParser], None], run: Callable[[argparse.Namespace], str],
         params: str | None = DEFAULT_PARAMS, overrides_help: str | None = None,
         expected: tuple[type[BaseException], ...] = ()) -> int:
    """Parse `argv`, call `run(args)` and print the line it returns; returns the exit code.

    `params`: the default of --params (None: the module adds its own, e.g. per subcommand). `expected`: failures
    whose message is the whole story and says what the user can do (no "unexpected" hint, no type name), reported
    in one line with exit 2, as an unreachable tracking or Prefect server is (the README's exit 2: what the user can
    fix).
    """
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if params is not None:
        add_params(parser, params, overrides_help)
    arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        summary = run(args)
    except (TrackingUnavailable, PrefectUnavailable, *expected) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT
    except (Exception, KeyboardInterrupt) as exc:  # one line (exit 2 for bad input); QERL_DEBUG=1: the traceback
        return report(parser.prog, exc, debug_requested())
    print(summary)
    return 0
