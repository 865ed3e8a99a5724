"""The project's environment variables, parsed one way (docs/contracts.md, section 1).

Torch-free, so shell-facing tools can use it: ``python -m rlkernel.envflags CI`` prints ``true``/``false``
(exit 2 with one line on a bad value).
"""
from __future__ import annotations

import os
import sys

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
VALIDATE_MODES = ("1", "sync", "0")


class EnvFlagError(ValueError):
    """An environment variable holds a value the project does not accept."""


def env_bool(name: str, default: bool = False, environ=None) -> bool:
    """1/true/yes/on -> True, 0/false/no/off -> False (any case, surrounding blanks ignored); unset or empty ->
    ``default``; anything else raises EnvFlagError naming the variable and the accepted values."""
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if value == "":
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise EnvFlagError(f"{name}={raw!r} is not a boolean: use one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}")


def validate_mode(environ=None) -> str:
    """RLKERNEL_VALIDATE: '1' (default, also unset or empty: the device error record), 'sync' (raise inside each
    call) or '0' (no record)."""
    raw = (os.environ if environ is None else environ).get("RLKERNEL_VALIDATE", "")
    value = raw.strip().lower()
    if value == "":
        return "1"
    if value not in VALIDATE_MODES:
        raise EnvFlagError(f"RLKERNEL_VALIDATE={raw!r}: use 1 (device error record, the default), sync or 0")
    return value


def parse_steps(text: str, what: str = "--steps") -> tuple[int, int]:
    """``A:B`` (or ``N``, meaning ``N:N``): the training steps A to B, both included, integers 0 <= A <= B."""
    parts = text.strip().split(":")
    try:
        if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError
        first, last = int(parts[0]), int(parts[-1])
    except ValueError:
        raise EnvFlagError(f"{what} {text!r}: use A:B (steps A to B, both included, 0 <= A <= B) or N") from None
    if first > last:
        raise EnvFlagError(f"{what} {text!r}: the first step {first} is after the last {last}")
    if last >= 2 ** 63:
        raise EnvFlagError(f"{what} {text!r}: a step index must fit in int64")
    return first, last


def capture_steps(environ=None) -> tuple[int, int] | None:
    """RLKERNEL_CAPTURE_STEPS (set by ``pipelines.capture --steps``): (A, B), or None when unset or empty."""
    raw = (os.environ if environ is None else environ).get("RLKERNEL_CAPTURE_STEPS", "")
    return parse_steps(raw, "RLKERNEL_CAPTURE_STEPS") if raw.strip() else None


def check_runtime_flags(environ=None) -> None:
    """Every variable an rlkernel process reads while it runs, parsed once: EnvFlagError for the first bad one.
    The CLIs call it before any work, so a bad value is a usage error (exit 2, one line, nothing written)
    instead of failed rows, a failed run or a traceback half-way."""
    env_bool("RLKERNEL_REQUIRE_FUSED", False, environ)
    validate_mode(environ)
    capture_steps(environ)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or args[0] in ("-h", "--help"):
        print("usage: python -m rlkernel.envflags NAME [DEFAULT]: print true/false for a boolean variable",
              file=sys.stderr if args and args[0] not in ("-h", "--help") else sys.stdout)
        return 0 if args and args[0] in ("-h", "--help") else 2
    try:
        default = env_bool("default", False, {"default": args[1]}) if len(args) == 2 else False
        print("true" if env_bool(args[0], default) else "false")
    except EnvFlagError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
