"""Exit codes shared by every rlkernel CLI (docs/contracts.md, section 5) and the one-line error helpers."""
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
