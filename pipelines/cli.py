"""The command-line parser both pipelines CLIs use: argparse, but bad usage is one line and exit 2.

The exit codes and ``CliError`` are rlkernel's (``rlkernel.cli``, torch-free; docs/contracts.md, section 5).
"""
from __future__ import annotations

import argparse
import sys

from rlkernel.cli import EXIT_USAGE, CliError


class OneLineParser(argparse.ArgumentParser):
    """``error`` raises ``CliError(..., EXIT_USAGE)`` instead of printing argparse's usage block and exiting;
    the CLI's main turns it into one line on stderr. An unknown ``--option`` is named even when a required
    option is also missing (argparse would only name the missing one)."""

    def error(self, message):
        raise CliError(f"{message} (see --help)", EXIT_USAGE)

    def parse_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        known = list(self._option_string_actions)
        for a in argv:
            if a == "--":
                break
            if a.startswith("--"):
                name = a.split("=", 1)[0]
                if not any(k == name or (self.allow_abbrev and k.startswith(name)) for k in known):
                    self.error(f"unrecognized arguments: {a}")
        return super().parse_args(argv, namespace)
