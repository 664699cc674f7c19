"""The ``tierkv`` command-line tool (console script ``tierkv``, declared in ``setup.py``).

Subcommands (argparse sub-parsers; each module that owns a command provides ``add_arguments(parser)`` and
``run(args) -> int``; it is imported when the parser is built):

- ``tierkv server ...``: the L3 ZMQ cache server (:mod:`tierkv.cli_server`), e.g.
  ``tierkv server --port 5557 --capacity-bytes 8GiB [--spill-dir DIR] [--token SECRET]``.
- ``tierkv store stats|verify|gc|clear``: :mod:`tierkv.cli_store`; ``tierkv config check|docs``:
  :mod:`tierkv.cli_config`; ``tierkv bench e2e|transfer|storage``: :mod:`tierkv.cli_bench`; ``tierkv plan TRACE
  --l2 SIZES --l3 SIZES``: :mod:`tierkv.cli_plan`. Exit codes and the
  one-line error rule: :mod:`tierkv.cli_common`.

To add a command, append a ``(name, module, help)`` entry to :data:`COMMANDS`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional

#: (subcommand, module providing add_arguments/run, one-line help)
COMMANDS: list[tuple[str, str, str]] = [
    ("server", "tierkv.cli_server", "run the L3 ZMQ cache server"),
    ("store", "tierkv.cli_store", "inspect and maintain an L3 store: stats, verify, gc, clear"),
    ("config", "tierkv.cli_config", "validate a config file (check) or list every config key (docs)"),
    ("bench", "tierkv.cli_bench", "run a benchmark: e2e, transfer, storage"),
    ("plan", "tierkv.cli_plan", "size L2 and L3: replay a request trace, hit rate and tokens per tier"),
]


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line (``tierkv store stats: error: ... (see --help)``), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per entry of :data:`COMMANDS`."""
    p = OneLineParser(prog="tierkv", description="tierkv: hierarchical KV cache tools",
                      epilog="exit codes: see 'tierkv COMMAND --help' and docs/user-guide.md, section 'The tierkv command'")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, mod_name, help_text in COMMANDS:
        sp = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(mod_name)
        mod.add_arguments(sp)
        sp.set_defaults(_run=mod.run)
    return p


def main(argv: Optional[list] = None) -> int:
    """Entry point of the ``tierkv`` console script. Returns the process exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:  # e.g. `tierkv config docs | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"tierkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug: still one line (TIERKV_DEBUG=1 shows the traceback)
        if os.environ.get("TIERKV_DEBUG"):
            raise
        print(f"tierkv {args.command}: internal error: {type(e).__name__}: {' '.join(str(e).split())[:300]} "
              "(TIERKV_DEBUG=1 for the traceback)", file=sys.stderr)
        return 70


if __name__ == "__main__":
    sys.exit(main())
