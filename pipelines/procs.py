"""Signals and process trees for ``pipelines.capture``: a SIGTERM (what ``timeout``, CI runners and Slurm send) or
SIGHUP ends a capture as Ctrl-C does, and ending a child ends its whole process tree.

``signals_raise()`` makes SIGTERM and SIGHUP raise ``Terminated`` in the main thread (SIGINT raises
``KeyboardInterrupt`` as usual); after the first of them, the others are ignored until the block ends, so the
cleanup that follows (ending the children, renaming the run ``-failed``) runs to its end. ``end(procs)`` ends
still-running children: SIGTERM to each one's process group (when it leads its own session) and to every
descendant found in /proc, then SIGKILL to what is left after ``grace`` seconds.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

from rlkernel.processes import alive  # noqa: F401  (procs.alive: the name callers use)

GRACE_S = 10.0  # nsys finishes its report on SIGTERM; past this, SIGKILL
HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: like KeyboardInterrupt, not an ``Exception`` (no ``except Exception`` eats it)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def exit_code(exc: BaseException) -> int:
    """The shell's code for a process ended by the signal: 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP."""
    return 128 + (exc.signum if isinstance(exc, Terminated) else signal.SIGINT)


def describe(exc: BaseException) -> str:
    return f"terminated ({exc})" if isinstance(exc, Terminated) else "interrupted (SIGINT)"


@contextlib.contextmanager
def signals_raise():
    """SIGTERM / SIGHUP raise Terminated, SIGINT KeyboardInterrupt, the first one only (main thread only)."""
    previous = {s: signal.getsignal(s) for s in HANDLED}

    def handler(signum, frame):
        for s in HANDLED:  # the cleanup the exception starts is not cut short by a second signal
            signal.signal(s, signal.SIG_IGN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    for s in HANDLED:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (Linux /proc; empty elsewhere)."""
    out = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:  # ended meanwhile
                continue
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
            out[int(name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return out


def descendants(pid: int) -> set[int]:
    parents = _parents()
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for child, parent in parents.items():
            if parent == p and child not in found:
                found.add(child)
                todo.append(child)
    return found


def _signal(pids: set[int], groups: set[int], sig: int) -> None:
    for g in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, sig)
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


def end(procs: list[subprocess.Popen], own_session: bool, grace: float = GRACE_S) -> None:
    """End the still-running ``procs`` with their whole trees; returns once each Popen has been reaped and no
    descendant found runs (or SIGKILL was sent to it)."""
    running = [p for p in procs if p.poll() is None]
    if not running:
        return
    tree = set().union(*({p.pid, *descendants(p.pid)} for p in running))
    groups = {p.pid for p in running} if own_session else set()  # a session leader's pid is its group id
    _signal(tree, groups, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        for p in running:
            p.poll()  # reaps an ended child, so it no longer counts as alive
        if not any(alive(pid) for pid in tree):
            break
        time.sleep(0.05)
    left = {pid for pid in tree if alive(pid)}
    for p in running:
        if p.poll() is None:
            left |= descendants(p.pid)
    if left:
        _signal(left, groups, signal.SIGKILL)
    for p in running:
        p.wait()
