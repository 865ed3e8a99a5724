"""The CPU tests' view of a program's NVTX ranges: tests/nvtx_log.c, a minimal NVTX tool loaded the way nsys loads
its own (NVTX_INJECTION64_PATH), writes every push and pop to a text file.

``library(tmp_dir)`` builds it once per test session (skipped without a C compiler); ``environ(lib, log)`` is what
a process needs to be recorded (its children inherit it); ``events(log)`` reads the file back; ``ranges(log)``
pairs each thread's pushes and pops into closed ranges.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import subprocess

SOURCE = pathlib.Path(__file__).with_name("nvtx_log.c")
_built: dict[str, pathlib.Path] = {}


def library(build_dir: pathlib.Path) -> pathlib.Path:
    if "lib" in _built:
        return _built["lib"]
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        import pytest  # here only: tests/fake_nsys.py reads logs with this module outside pytest

        pytest.skip("no C compiler to build the NVTX recorder (tests/nvtx_log.c)")
    lib = pathlib.Path(build_dir) / "libnvtx_log.so"
    proc = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(SOURCE)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    _built["lib"] = lib
    return lib


def environ(lib: pathlib.Path, log: pathlib.Path, base=None) -> dict:
    env = dict(os.environ if base is None else base, NVTX_INJECTION64_PATH=str(lib), NVTX_LOG_FILE=str(log))
    env.pop("NVTX_DISABLE", None)
    return env


@dataclasses.dataclass(frozen=True)
class Event:
    ns: int
    pid: int
    tid: int
    kind: str  # push or pop
    domain: str
    message: str = ""
    payload: int | None = None


def events(log: pathlib.Path) -> list[Event]:
    out = []
    if not pathlib.Path(log).exists():
        return out
    for line in pathlib.Path(log).read_text().splitlines():
        f = line.split("\t")
        if f[3] == "push":
            out.append(Event(int(f[0]), int(f[1]), int(f[2]), "push", f[4], f[5], None if f[6] == "-" else int(f[6])))
        else:
            out.append(Event(int(f[0]), int(f[1]), int(f[2]), "pop", f[4]))
    return out


@dataclasses.dataclass(frozen=True)
class Range:
    pid: int
    tid: int
    domain: str
    message: str
    payload: int | None
    start: int
    end: int
    depth: int  # 0 = outermost on its thread


def ranges(log: pathlib.Path) -> list[Range]:
    """Closed push/pop ranges, each thread's stack matched as NVTX does; an unmatched pop fails the test."""
    stacks: dict[tuple[int, int], list[Event]] = {}
    out = []
    for e in events(log):
        stack = stacks.setdefault((e.pid, e.tid), [])
        if e.kind == "push":
            stack.append(e)
            continue
        assert stack, f"a pop without a push on thread {e.pid}/{e.tid}"
        p = stack.pop()
        out.append(Range(p.pid, p.tid, p.domain, p.message, p.payload, p.ns, e.ns, len(stack)))
    return sorted(out, key=lambda r: (r.start, r.depth))
