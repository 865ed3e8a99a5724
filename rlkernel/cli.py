"""Exit codes shared by every rlkernel CLI (docs/contracts.md, section 5), the one-line error helpers and the
argument parser every CLI uses. Torch-free: importing it costs no torch import."""
import argparse
import sys

EXIT_OK = 0
EXIT_CHECK_FAILED = 1  # a check the user asked for failed
EXIT_USAGE = 2  # bad input or usage
EXIT_BLOCKED = 3  # this machine lacks what the command needs


class CliError(Exception):
    """An error that ends a CLI with one line on stderr and the given exit code, no traceback."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


def fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: {message}", file=sys.stderr)
    return code


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
