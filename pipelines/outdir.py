"""The analyzer's output folder, replaced as a whole: which folders it may replace (only its own reports), and the
write phase that swaps a complete new set in (pipelines.swap: an atomic directory exchange, one writer at a time
per parent folder), so a reader or a ``kill -9`` finds the previous complete set or the new one, never a mix.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile

from pipelines import swap

# Every file the analyzer may write into an output directory: a directory holding anything else is not one of
# its reports, and is never replaced.
OUTPUT_NAMES = frozenset({"kernel_summary.csv", "range_summary.csv", "range_kernels.csv", "dispatch.csv",
                          "bandwidth.csv", "compare.csv", "compare.json", "gaps.csv", "utilization.csv",
                          "repetition_gaps.csv", "report.html",
                          "steps.csv", "phases.csv",  # the RL-step view (pipelines.phase_view)
                          "ranks.csv", "cross_rank.csv"})  # --ranks (pipelines.cross_rank)


class OutputError(Exception):
    """An output directory that cannot be (re)written; the message names it."""


def check_target(out_dir: pathlib.Path) -> None:
    """Raise OutputError unless ``out_dir`` can be replaced by a new report: absent, or a directory holding
    only the analyzer's own outputs, below directories, and not the current directory or one above it."""
    try:
        _check_target(out_dir)
    except OSError as e:  # a name longer than the file system takes (ENAMETOOLONG), a parent we cannot search
        raise OutputError(f"{out_dir}: cannot use it as the output directory ({e.strerror or e})") from None


def _tmp_prefix(out: pathlib.Path, kind: str) -> str:
    """The name prefix of ``out``'s temporary siblings, ``.<name>.<kind>-``: the name cut to 64 bytes so that a
    name of up to 255 bytes still gives a temporary name the file system takes."""
    return f".{os.fsdecode(os.fsencode(out.name)[:64])}.{kind}-"


def _check_target(out_dir: pathlib.Path) -> None:
    out = pathlib.Path(os.path.abspath(out_dir))
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            raise OutputError(f"{out_dir}: {'exists' if p == out else f'{p} exists'} and is not a directory")
    cwd = pathlib.Path.cwd().resolve()
    if out.resolve() == cwd or out.resolve() in cwd.parents:
        raise OutputError(f"{out_dir}: the current directory or one above it; the report replaces its output "
                          "directory as a whole, so give a directory of its own")
    _check_writable(out, out_dir)
    if out.is_dir():
        try:
            foreign = sorted(p.name for p in out.iterdir() if p.name not in OUTPUT_NAMES or not p.is_file())
        except OSError as e:
            raise OutputError(f"{out_dir}: cannot read it ({e.strerror})") from None
        if foreign:
            raise OutputError(f"{out_dir}: holds {len(foreign)} entries the analyzer did not write "
                              f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); the report "
                              "replaces its output directory as a whole, so give an empty or new directory")


def _check_writable(out: pathlib.Path, out_dir: pathlib.Path) -> None:
    """The report goes into a temporary sibling of ``out`` first: check that the nearest existing directory
    (``out``'s parent, or the first one above it that exists) takes a new entry, by making and removing one
    (permission bits do not say it for root, a read-only mount, an immutable directory)."""
    where = next(p for p in out.parents if p.exists())
    try:
        os.rmdir(tempfile.mkdtemp(prefix=_tmp_prefix(out, "new"), dir=where))
    except OSError as e:
        raise OutputError(f"{out_dir}: cannot write there ({where}: {e.strerror or e}); choose a writable "
                          "directory for the report with --out DIR") from None


def replace_dir(out_dir: pathlib.Path, files: dict[str, bytes], on_wait=None) -> list[pathlib.Path]:
    """Write the whole output set into a temporary sibling directory, then swap it in for ``out_dir``: at every
    instant a reader (and a ``kill -9``) finds the previous complete set or the new one, never a mix and never
    none. ``check_target`` first: a directory holding anything but reports is never replaced.

    One writer at a time per parent directory (a lock on it; ``on_wait()`` when another run holds it), so two
    runs on one directory both finish and the last one's set stays. Under the lock, the temporaries a killed
    run left (``.<name>.new-*``, ``.<name>.old-*``) are removed first."""
    check_target(out_dir)
    out = pathlib.Path(os.path.abspath(out_dir))
    if out.is_symlink():
        out = out.resolve()  # replace the directory the link points at, keep the link
    umask = os.umask(0)
    os.umask(umask)  # mkdtemp makes a 0700 directory; reports get the usual modes
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{out_dir}: cannot create it ({e.strerror})") from None
    with swap.locked(out.parent, on_wait):
        clean_stale(out)
        check_target(out_dir)  # again: another run may have written it while this one waited
        _write_and_switch(out, out_dir, files, umask)
    return [pathlib.Path(out_dir) / name for name in files]


def clean_stale(out: pathlib.Path) -> None:
    """Remove the temporary siblings of ``out`` that a killed run left. An ``.old-*`` is a whole previous set
    moved aside by the two-rename fallback: where ``out`` is missing (killed between the renames) the newest
    one is put back first."""
    try:
        stale = sorted((p for p in out.parent.iterdir() if p.name.startswith((_tmp_prefix(out, "new"),
                                                                             _tmp_prefix(out, "old")))),
                       key=lambda p: p.stat().st_mtime)
    except OSError:
        return
    olds = [p for p in stale if p.name.startswith(_tmp_prefix(out, "old"))]
    if olds and not os.path.lexists(out):
        with contextlib.suppress(OSError):
            os.rename(olds[-1], out)
            stale.remove(olds[-1])
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)


def _write_and_switch(out: pathlib.Path, out_dir: pathlib.Path, files: dict[str, bytes], umask: int) -> None:
    try:
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=_tmp_prefix(out, "new"), dir=out.parent))
    except OSError as e:
        raise OutputError(f"{out_dir}: cannot create it ({e.strerror})") from None
    try:
        for i, (name, data) in enumerate(files.items()):
            (tmp / name).write_bytes(data)
            if i == 0:
                swap.pause_for_test("writing")
        os.chmod(tmp, 0o777 & ~umask)
        swap.pause_for_test("switch")
        if not out.exists():
            os.rename(tmp, out)  # atomic: nothing there yet
        elif not swap.exchange(tmp, out):
            _rename_over(tmp, out)
        # tmp now holds the previous set (or nothing)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"{out_dir}: cannot write the report ({e.strerror or e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap.pause_for_test("cleanup")
    shutil.rmtree(tmp, ignore_errors=True)


def _rename_over(tmp: pathlib.Path, out: pathlib.Path) -> None:
    """Where no atomic exchange exists: the old set moves aside, the new one in. A kill between the two leaves
    the old set as ``.<name>.old-*``, which the next run's ``clean_stale`` puts back."""
    old = tmp.with_name(_tmp_prefix(out, "old") + tmp.name[len(_tmp_prefix(out, "new")):])
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    os.rename(old, tmp)  # the caller removes tmp
