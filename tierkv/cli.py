"""The ``tierkv`` command-line tool (console script ``tierkv``, declared in ``setup.py``).

Subcommands (argparse sub-parsers; each module that owns a command provides ``add_arguments(parser)`` and
``run(args) -> int``; it is imported when the parser is built):

- ``tierkv server ...``: the L3 ZMQ cache server (:mod:`tierkv.storage_backends.zmq_server`), e.g.
  ``tierkv server --port 5557 --capacity-bytes 8GiB [--spill-dir DIR] [--token SECRET]``.

To add a command, append a ``(name, module, help)`` entry to :data:`COMMANDS`.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

#: (subcommand, module providing add_arguments/run, one-line help)
COMMANDS: list[tuple[str, str, str]] = [
    ("server", "tierkv.storage_backends.zmq_server", "run the L3 ZMQ cache server"),
]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per entry of :data:`COMMANDS`."""
    p = argparse.ArgumentParser(prog="tierkv", description="tierkv: hierarchical KV cache tools")
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
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
