"""``python -m rlkernel.build`` (console script ``rlkernel-build``): build rlkernel._C, the fused CUDA kernels, ahead
of time into the cache the first fused call would build it into, or into a folder for images and clusters.

Prints a progress line per source on stderr and, when done, the entry's folder on stdout. Exit codes
(docs/contracts.md, section 5): 0 built, already there, or ``--check`` passed; 1 the build or the check failed
(the line names the log); 2 bad usage; 3 this machine cannot build it (no CUDA torch, no GPU and no ``--arch``,
no nvcc or ninja, a cache folder that cannot be written or locked); 130 interrupted (Ctrl-C).
"""
from __future__ import annotations

import sys
from pathlib import Path

from rlkernel.cli import (
    EXIT_BLOCKED,
    EXIT_CHECK_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    OneLineParser,
    fail,
    message_prefix,
    prog_name,
)

PROG = "rlkernel-build"  # what its lines start with: main sets the name the user typed (python -m rlkernel.build)
EPILOG = """\
The cache is $RLKERNEL_CACHE_DIR (default ~/.cache/rlkernel); an entry is keyed by the sources' hash, the torch and
CUDA versions and the targets, so a new version of any of them builds anew; an entry built for more targets (--arch
sm_90a,sm_80) serves a machine that needs fewer. MAX_JOBS caps the parallel compiles (ninja's default otherwise).
A folder built with --out is used by pointing RLKERNEL_CACHE_DIR at it (it may be read-only then). An entry whose
library is damaged is rebuilt. An in-tree build (python setup.py build_ext --inplace) wins over the cache where it
is there.

exit codes: 0 built, already there, or --check passed; 1 the build or the check failed; 2 bad usage; 3 this machine
cannot build it (no CUDA torch, no GPU and no --arch, no nvcc or ninja, a cache folder that cannot be written or
locked); 130 interrupted (Ctrl-C)."""


def build_parser(prog: str = "rlkernel-build") -> OneLineParser:
    from argparse import RawDescriptionHelpFormatter

    ap = OneLineParser(prog=prog, description="Build rlkernel._C (the fused CUDA kernels) into the cache, or into "
                       "--out DIR, as the first fused call would.", epilog=EPILOG,
                       formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--arch", metavar="LIST", help="target GPU architectures, comma-separated: sm_90a,sm_80 or "
                    "9.0,8.0 (a bare 9.0 is sm_90a, as the kernels need). Default: the visible GPUs")
    ap.add_argument("--out", metavar="DIR", type=Path, help="build into DIR (a cache folder of its own) instead of "
                    "$RLKERNEL_CACHE_DIR")
    ap.add_argument("--check", action="store_true", help="build nothing: verify the existing build for these "
                    "targets against the sources' hash (exit 1 when it is missing, stale or damaged)")
    return ap


def _progress(step: str) -> None:
    print(f"{PROG}: {step}", file=sys.stderr, flush=True)


def run(args) -> int:
    from rlkernel import _ext, _jit

    try:
        archs = _ext.parse_archs(args.arch) if args.arch is not None else None
    except ValueError as exc:
        raise CliError(f"--arch: {exc}", EXIT_USAGE) from None
    try:
        spec = _ext.rlkernel_spec(archs)
    except _ext.ExtensionNotBuilt as exc:
        return fail(PROG, exc.detail or exc.reason, EXIT_BLOCKED)
    root = args.out.expanduser().resolve() if args.out is not None else _jit.cache_root()
    if args.check:
        ok, line = _jit.check(spec, root)
        if not ok:
            return fail(PROG, line, EXIT_CHECK_FAILED)
        print(line)
        return EXIT_OK
    import importlib.util

    tree = importlib.util.find_spec(_ext.MODULE)
    if tree is not None:
        _progress(f"note: an in-tree build is there ({tree.origin}); it wins over this one wherever it is found")
    try:
        library, seconds = _jit.ensure(spec, root, progress=_progress, verify=True)
    except _ext.ExtensionBuildFailed as exc:
        return fail(PROG, str(exc.detail), EXIT_CHECK_FAILED)
    except _ext.ExtensionNotBuilt as exc:  # no nvcc / ninja, or the folder cannot take it
        return fail(PROG, exc.detail or exc.reason, EXIT_BLOCKED)
    if seconds is None:
        _progress(f"{spec.label} for {','.join(spec.archs)} is already built, intact: {library.parent}")
    if args.out is not None:
        _progress(f"use it with RLKERNEL_CACHE_DIR={root}")
    print(library.parent)
    return EXIT_OK


def main(argv=None) -> int:
    global PROG  # one CLI run per process: its lines name the command as typed, a caller's argv the script
    prog = prog_name("rlkernel.build", sys.argv[0]) if argv is None else "rlkernel-build"
    PROG = message_prefix(prog)
    try:
        return run(build_parser(prog).parse_args(argv))
    except CliError as exc:
        return fail(PROG, str(exc), exc.code)
    except KeyboardInterrupt:  # the build's compilers are stopped and its folder removed (rlkernel._jit)
        return fail(PROG, "interrupted (Ctrl-C)", EXIT_INTERRUPTED)


if __name__ == "__main__":
    raise SystemExit(main())
