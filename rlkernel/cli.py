"""Exit codes shared by every rlkernel CLI (docs/contracts.md, section 5), the one-line error helpers and the
argument parser every CLI uses. Torch-free: importing it costs no torch import."""
import argparse
import sys
from pathlib import Path

from rlkernel import envflags

EXIT_OK = 0
EXIT_CHECK_FAILED = 1  # a check the user asked for failed
EXIT_USAGE = 2  # bad input or usage
EXIT_BLOCKED = 3  # this machine lacks what the command needs
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as a shell reports a process SIGINT ended
INT64_MAX = 2 ** 63 - 1  # the largest size, count or seed a CLI passes on (torch takes them as int64)


class CliError(Exception):
    """An error that ends a CLI with one line on stderr and the given exit code, no traceback."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


def fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: {message}", file=sys.stderr)
    return code


def prog_name(module: str, argv0: str | None = None) -> str:
    """The command as the user typed it, for usage lines and errors: a console script's or a script's file name
    (``rlkernel-profile``, ``run_profile_suite.py``), ``python -m PACKAGE.MODULE`` when argv[0] is a module file of a
    package (what ``python -m`` puts there), and ``python -m MODULE`` when there is no argv[0] to go by (``-c``,
    a caller passing its own argv to ``main``). ``message_prefix`` gives the form error lines start with."""
    if not argv0 or argv0 in ("-c", "-m"):
        return f"python -m {module}"
    path = Path(argv0)
    if path.suffix == ".py" and (path.parent / "__init__.py").is_file():
        parts, folder = ([] if path.stem == "__main__" else [path.stem]), path.parent
        while (folder / "__init__.py").is_file():
            parts.insert(0, folder.name)
            folder = folder.parent
        return "python -m " + ".".join(parts)
    return path.name


def message_prefix(prog: str) -> str:
    """What an error or progress line starts with: ``pipelines.analyze`` for ``python -m pipelines.analyze``,
    the script's name otherwise."""
    return prog.removeprefix("python -m ")


def check_env_flags(environ=None) -> None:
    """The project's run-time variables (``envflags.check_runtime_flags``: RLKERNEL_REQUIRE_FUSED, RLKERNEL_VALIDATE,
    RLKERNEL_CAPTURE_STEPS) checked before any work: a bad value is bad usage, ``CliError`` (exit 2, one line),
    never a failed row, a failed run or a traceback once the work has started."""
    try:
        envflags.check_runtime_flags(environ)
    except envflags.EnvFlagError as e:
        raise CliError(str(e), EXIT_USAGE) from None


# capture's and the profile suite's --output-dir is a parent folder (analyze's --out is the report folder itself)
OUTPUT_DIR_HINTS = {f: "did you mean --output-dir? it names the parent folder new results go into"
                    for f in ("--outdir", "--out-dir", "--output-directory", "--outputdir")}


class OneLineParser(argparse.ArgumentParser):
    """``error`` raises ``CliError(..., EXIT_USAGE)`` instead of printing argparse's usage block and exiting;
    the CLI's main turns it into one line on stderr. An unknown ``--option`` is named even when a required
    option is also missing (argparse would only name the missing one), with the right one where it is a near
    miss: ``hints`` maps a wrong flag to its answer (``--output-dir`` -> "did you mean --out? ..."), else the
    closest known option is named."""

    def __init__(self, *args, hints: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.hints = dict(hints or {})

    def _unknown(self, arg: str, known: list[str]):
        import difflib

        name = arg.split("=", 1)[0]
        hint = self.hints.get(name)
        if hint is None:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            hint = f"did you mean {close[0]}?" if close else None
        self.error(f"unrecognized arguments: {arg}" + (f" ({hint})" if hint else ""))

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
                    self._unknown(a, [k for k in known if k.startswith("--")])
        return super().parse_args(argv, namespace)
