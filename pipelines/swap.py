"""Directory switching for the analyzer's write phase: an atomic exchange of two directories, a lock that lets
one writer at a time into a parent directory, and the test hook that pauses the write phase.

Why an exchange: replacing a directory by renaming the old one away and the new one in leaves an instant with
no directory at all, and a ``kill -9`` in that instant leaves none for good. ``renameat2(RENAME_EXCHANGE)``
(Linux 3.15+, on ext4, xfs, btrfs, tmpfs, ...) and ``renamex_np(RENAME_SWAP)`` (macOS) swap the two names in
one step. Where neither is available, :func:`exchange` says so and the caller falls back to the two renames.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import pathlib
import sys
import time

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h
_RENAME_SWAP = 2  # macOS sys/stdio.h
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Swap the directories ``a`` and ``b`` atomically: True when done, False when this system or file system
    cannot (the caller then renames); OSError for any other failure."""
    fn, flag = None, 0
    if _LIBC is not None and sys.platform.startswith("linux"):
        fn, flag = getattr(_LIBC, "renameat2", None), _RENAME_EXCHANGE
        args = (_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flag) if fn else ()
    elif _LIBC is not None and sys.platform == "darwin":
        fn, flag = getattr(_LIBC, "renamex_np", None), _RENAME_SWAP
        args = (os.fsencode(a), os.fsencode(b), flag) if fn else ()
    if fn is None:
        return False
    if fn(*args) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(a))


@contextlib.contextmanager
def locked(directory: pathlib.Path, on_wait=None):
    """Hold an exclusive lock on ``directory`` itself (``flock`` on its descriptor: no lock file is left
    behind) while the block runs; ``on_wait()`` is called once if another process holds it. Where locks are
    not supported (no ``fcntl``, a file system without flock), the block runs unlocked."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # ENOLCK and the like: no locking here
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


PAUSE_ENV = "RLKERNEL_ANALYZE_TEST_PAUSE"


def pause_for_test(stage: str) -> None:
    """Test hook of the write phase only: with ``RLKERNEL_ANALYZE_TEST_PAUSE=<stage>:<gate file>``, say so on
    stderr at ``stage`` and wait there until the gate file exists (the kill and concurrency tests use it to
    stop a real run at a known instant). Unset in any real use."""
    spec = os.environ.get(PAUSE_ENV, "")
    want, _, gate = spec.partition(":")
    if not spec or want != stage:
        return
    print(f"pipelines.analyze: test pause at {stage}", file=sys.stderr, flush=True)
    while not (gate and os.path.exists(gate)):
        time.sleep(0.01)
