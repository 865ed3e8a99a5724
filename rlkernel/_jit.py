"""Build a torch C++/CUDA extension once per machine into a cache, and load it from there (issue 30).

rlkernel._C's first-use build and ``python -m rlkernel.build`` go through here; so does the tiny C++ extension the
CI tests compile with g++ (tests/test_jit_build.py), so the code path they test is this one. Torch-free at import
(``setup.py`` reads the compile flags from this file without torch).

The cache root is ``$RLKERNEL_CACHE_DIR``, default ``~/.cache/rlkernel``. For an extension ``<name>`` whose
``key`` hashes every file under its sources' folder, the torch and CUDA versions, the target architectures, the
flags, the Python ABI and the machine:

- ``<name>-<key>/``: a finished entry, ``<name>.so`` and ``build.json``. It appears only by renaming a complete
  temporary folder, so a build killed at any point (kill -9 included) leaves nothing a later process would load.
- ``<name>-<key>.lock``: the file lock. One process builds; the others say that they wait, then load its entry.
- ``<name>-<key>.log``: the last build's whole output (the compiler's lines). A failed build's error names it.
- ``<name>-<key>.failed``: the last build failed. Processes that waited for that build take its failure rather
  than build again; a process started later tries again.
- ``.tmp-<name>-<key>-<pid>-<n>/``: a build in progress. The next builder, holding the lock, removes those left
  by a killed one.

Loading a finished entry imports its ``.so`` directly (no ninja, no compiler): well under a second.
"""
from __future__ import annotations

import errno
import hashlib
import importlib.machinery
import importlib.util
import itertools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlkernel.processes import alive

CACHE_ENV = "RLKERNEL_CACHE_DIR"
# rlkernel._C's flags, the same for setup.py's in-tree build (which reads them from here) and the cache's.
# -lineinfo: ncu maps its counters to source lines; it does not change the generated code.
CXX_FLAGS = ("-O3",)
NVCC_FLAGS = ("-O3", "-lineinfo", "-Xptxas=-warn-spills")
NINJA_HINT = "pip install 'rlkernel[cuda]' (or pip install ninja)"
_FORMAT = 1  # of build.json and the key: a change here makes every older entry a stranger
_serial = itertools.count()
# what a cache folder that cannot take a build answers (read-only, not a folder, full, over quota)
_CACHE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ENOSPC,
                 getattr(errno, "EDQUOT", errno.ENOSPC)}


class ExtensionNotBuilt(ImportError):
    """The extension is not there to load; ``reason`` says why in a few words and no path (it goes into dispatch
    records: docs/contracts.md, sections 2 and 9), ``detail`` says more for people (paths allowed)."""

    def __init__(self, reason: str, detail: str | None = None):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class ExtensionBuildFailed(ExtensionNotBuilt):
    """The build ran and failed; ``log`` is the file holding its whole output."""

    def __init__(self, detail: str, log: Path | None):
        super().__init__("extension build failed", detail)
        self.log = log


class ExtensionCacheUnwritable(ExtensionNotBuilt):
    """The cache folder cannot take a build (read-only, not a folder, full, or on a file system without locks)."""

    def __init__(self, root: Path, exc: OSError, what: str | None = None):
        full = exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
        reason = "extension cache full" if full else "extension cache not writable"
        if what is None:
            what = "is full" if full else "is not writable"
        else:
            reason = f"extension cache {what}"
        super().__init__(reason,
                         f"the extension cache {root} {what} ({exc.strerror or exc}): set {CACHE_ENV} to a "
                         f"writable folder, or build ahead of time with python -m rlkernel.build --out DIR")
        self.root = root


@dataclass(frozen=True)
class Spec:
    """One extension: what to compile and how. ``sources`` and ``include_dirs`` are relative to ``root``, whose
    every file is hashed into the key (headers included)."""

    name: str  # the library's name: <name>.so, PyInit_<name> (TORCH_EXTENSION_NAME)
    module: str  # the name it is imported under (rlkernel._C)
    label: str  # how the lines name it
    root: Path
    sources: tuple[str, ...]
    include_dirs: tuple[str, ...] = ()
    cflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    archs: tuple[str, ...] = ()  # sm_XX targets; () for an extension without CUDA
    with_cuda: bool = False
    extra: dict = field(default_factory=dict, compare=False)  # recorded in build.json, not keyed


def cache_root() -> Path:
    raw = os.environ.get(CACHE_ENV, "").strip()
    return Path(raw).expanduser().absolute() if raw else Path.home() / ".cache" / "rlkernel"


def source_files(root: Path) -> list[str]:
    """Every file under ``root`` (relative, sorted): what the key hashes, and what a wheel must ship."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def file_hashes(root: Path) -> dict[str, str]:
    return {rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in source_files(root)}


def sources_hash(root: Path) -> str:
    h = hashlib.sha256()
    for rel, digest in file_hashes(root).items():
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()


def _versions() -> dict:
    import torch

    return {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.implementation.cache_tag,
            "machine": platform.machine()}


def key_fields(spec: Spec, hashed: str | None = None) -> dict:
    """What an entry is keyed by. Include folders outside the sources' root (absolute: a wheel's headers in some
    venv) are left out, or the same versions installed elsewhere would miss a shared or prebuilt cache: a spec
    keys their contents by a flag (rlkernel: -DRLKERNEL_CUTLASS_VERSION)."""
    return {"format": _FORMAT, "name": spec.name, "sources": hashed or sources_hash(spec.root), **_versions(),
            "archs": list(spec.archs), "with_cuda": spec.with_cuda, "sources_list": list(spec.sources),
            "include_dirs": [d for d in spec.include_dirs if not Path(d).is_absolute()], "cflags": list(spec.cflags),
            "cuda_cflags": list(spec.cuda_cflags)}


def _without_archs(fields: dict) -> dict:
    """An entry's key fields less what its targets decide (the archs, and each flag that names one of them)."""
    archs = fields.get("archs") or []
    out = {k: v for k, v in fields.items() if k not in ("archs", "key")}
    for name in ("cflags", "cuda_cflags"):
        out[name] = [f for f in fields.get(name, []) if not any(a in f for a in archs)]
    return out


def key(spec: Spec, hashed: str | None = None) -> str:
    return hashlib.sha256(json.dumps(key_fields(spec, hashed), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Paths:
    name: str
    root: Path
    entry: Path
    lock: Path
    log: Path
    failed: Path
    key: str

    @property
    def library(self) -> Path:
        return self.entry / f"{self.name}.so"

    @property
    def meta(self) -> Path:
        return self.entry / "build.json"


def paths(spec: Spec, root: Path | None = None, hashed: str | None = None) -> Paths:
    return paths_for_key(spec.name, cache_root() if root is None else Path(root), key(spec, hashed))


def paths_for_key(name: str, root: Path, k: str) -> Paths:
    stem = root / f"{name}-{k}"
    return Paths(name, root, stem, stem.with_name(stem.name + ".lock"), stem.with_name(stem.name + ".log"),
                 stem.with_name(stem.name + ".failed"), k)


def find(p: Paths) -> Path | None:
    """The finished entry's library, or None. Cheap (no hashing of the library): an entry only exists complete."""
    try:
        meta = json.loads(p.meta.read_text())
    except (OSError, ValueError):
        return None
    return p.library if meta.get("key") == p.key and p.library.is_file() else None


def find_covering(spec: Spec, root: Path | None = None, hashed: str | None = None) -> Paths | None:
    """A finished entry built from the same sources, versions and flags for more targets than ``spec``'s (an image's
    ``rlkernel.build --arch sm_90a,sm_80 --out DIR`` on a node that sees only sm_90a), or None. Its library holds
    the code of each of ``spec``'s targets."""
    want = key_fields(spec, hashed)
    want_free = _without_archs(want)
    root = cache_root() if root is None else Path(root)
    for meta_file in sorted(root.glob(f"{spec.name}-*/build.json")):
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError):
            continue
        if not set(want["archs"]) <= set(meta.get("archs") or []):
            continue
        if _without_archs({k: meta.get(k) for k in want}) != want_free:
            continue
        q = paths_for_key(spec.name, root, str(meta.get("key")))
        if q.entry == meta_file.parent and find(q) is not None:
            return q
    return None


def import_library(spec: Spec, library: Path):
    """Import a built library as ``spec.module`` (registered in sys.modules, as an import would)."""
    loader = importlib.machinery.ExtensionFileLoader(spec.module, str(library))
    mspec = importlib.util.spec_from_file_location(spec.module, library, loader=loader)
    module = importlib.util.module_from_spec(mspec)
    sys.modules[spec.module] = module
    try:
        loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.module, None)
        raise
    return module


# ---------------------------------------------------------------------------------------------------- the tools

def _tool_path() -> str:
    """PATH for the build: the ninja wheel's binary folder and this interpreter's scripts folder first (a venv's
    ``bin`` is not on PATH when its python is run by path)."""
    dirs = []
    try:
        import ninja  # the rlkernel[cuda] extra

        dirs.append(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    dirs.append(sysconfig.get_path("scripts"))
    return os.pathsep.join([*dirs, os.environ.get("PATH", "")])


def missing_tool(spec: Spec) -> str | None:
    """What this machine lacks to build ``spec`` (one line naming it and how to get it), or None."""
    path = _tool_path()
    if shutil.which("ninja", path=path) is None:
        return f"ninja not found (torch builds extensions with it): {NINJA_HINT}"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx, path=path) is None:
        return f"no C++ compiler: {cxx} not found (install g++, or set CXX)"
    try:
        from torch.utils import cpp_extension  # imports setuptools
    except ImportError as exc:
        return f"torch.utils.cpp_extension does not import ({exc}): pip install setuptools"
    if spec.with_cuda:
        home = cpp_extension.CUDA_HOME
        if home is None or not (Path(home) / "bin" / "nvcc").exists():
            return "nvcc not found (install the CUDA toolkit, or set CUDA_HOME)"
    return None


# ---------------------------------------------------------------------------------------------------- the lines

def say(line: str) -> None:
    print(f"rlkernel: {line}", file=sys.stderr, flush=True)


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


def _last_build_seconds(root: Path, name: str) -> float | None:
    """How long the newest build of ``name`` in this cache took (any key): the estimate of the next one."""
    best = None
    for meta in root.glob(f"{name}-*/build.json"):
        try:
            doc = json.loads(meta.read_text())
            when, secs = float(doc["built_at"]), float(doc["seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if best is None or when > best[0]:
            best = (when, secs)
    return None if best is None else best[1]


def _estimate(spec: Spec, root: Path) -> str:
    last = _last_build_seconds(root, spec.name)
    jobs = os.environ.get("MAX_JOBS", "").strip()
    parallel = f"MAX_JOBS={jobs}" if jobs else "ninja's default parallelism"
    n = f"{len(spec.sources)} source{'s' if len(spec.sources) != 1 else ''}"
    if last is not None:
        return f"{n}, {parallel}; the last build here took {duration(last)}"
    return f"{n}, {parallel}; a few minutes the first time" if spec.with_cuda else f"{n}, {parallel}"


def _archs_text(spec: Spec) -> str:
    return ",".join(spec.archs) if spec.archs else "the host CPU"


# ---------------------------------------------------------------------------------------------------- the build

_CHILD = r"""
import json, os, signal, sys, threading, time
args, parent = json.loads(sys.argv[1]), int(sys.argv[2])
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())  # the builder's stop, or this session's own SIGTERM below
def watch():
    # the builder is gone (kill -9 included) or stops the build: SIGTERM to this session makes ninja stop the
    # compilers it runs (each in a process group of its own), then SIGKILL takes whatever is left
    while os.getppid() == parent and not stop.is_set():
        time.sleep(0.2)
    os.killpg(0, signal.SIGTERM)
    time.sleep(2)
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=watch, daemon=True).start()
from torch.utils import cpp_extension
cpp_extension.load(**args)  # builds, then imports the library once: a library that does not load fails the build
"""
_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\] (.*)$")


def progress_line(line: str) -> str | None:
    """ninja -v's ``[k/n] command`` as ``[k/n] compiling logp.cu`` (or ``linking _C.so``); None for other lines."""
    m = _PROGRESS.match(line.strip())
    if not m:
        return None
    k, n, cmd = m.groups()
    src = re.search(r"\s-c\s+(\S+)", cmd)
    if src:
        return f"[{k}/{n}] compiling {os.path.basename(src.group(1))}"
    out = re.search(r"\s-o\s+(\S+)", cmd)
    return f"[{k}/{n}] linking {os.path.basename(out.group(1))}" if out else f"[{k}/{n}]"


def _child_args(spec: Spec, work: Path) -> dict:
    return {"name": spec.name, "sources": [str(spec.root / s) for s in spec.sources],
            "extra_cflags": list(spec.cflags), "extra_cuda_cflags": list(spec.cuda_cflags),
            "extra_include_paths": [str(spec.root / d) for d in spec.include_dirs], "build_directory": str(work),
            "verbose": True, "with_cuda": spec.with_cuda}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale(p: Paths) -> None:
    """Temporary folders of this key left by builders that are gone (called with the lock held)."""
    for tmp in p.root.glob(f".tmp-{p.entry.name}-*"):
        pid = tmp.name.rsplit("-", 2)[-2]
        if not (pid.isdigit() and int(pid) != os.getpid() and alive(int(pid))):
            shutil.rmtree(tmp, ignore_errors=True)


def _stop(child: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, None)):
        try:
            os.killpg(child.pid, sig)
            child.wait(timeout=grace)
            return
        except (OSError, subprocess.TimeoutExpired):
            continue


def _compile(spec: Spec, p: Paths, tmp: Path, log, progress) -> tuple[int, Path]:
    """Run torch's build in a child process (its own session), its output into ``log``; (exit code, library)."""
    work = tmp / "build"
    work.mkdir()
    env = dict(os.environ, PATH=_tool_path())
    cmd = [sys.executable, "-c", _CHILD, json.dumps(_child_args(spec, work)), str(os.getpid())]
    log.write(f"# {spec.label} for {_archs_text(spec)}; key {p.key}\n# {json.dumps(key_fields(spec))}\n")
    log.flush()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             cwd=work, env=env, start_new_session=True, text=True, errors="replace")
    (tmp / "child.pid").write_text(str(child.pid))
    try:
        for line in child.stdout:
            log.write(line)
            log.flush()
            if progress is not None and (step := progress_line(line)):
                progress(step)
        rc = child.wait()
    except BaseException:  # Ctrl-C, or an error here: stop the build (its compilers too), then go on raising
        _stop(child)
        raise
    return rc, work / f"{spec.name}.so"


def _finish(spec: Spec, p: Paths, tmp: Path, library: Path, seconds: float) -> Path:
    """Move the library out of the build folder, record build.json, drop the rest, rename into place."""
    final_lib = tmp / library.name
    os.replace(library, final_lib)
    _fsync(final_lib)
    meta = {**key_fields(spec), "key": p.key, "files": file_hashes(spec.root),
            "library_sha256": hashlib.sha256(final_lib.read_bytes()).hexdigest(), "built_at": time.time(),
            "seconds": round(seconds, 1), "module": spec.module, **spec.extra}
    (tmp / "build.json").write_text(json.dumps(meta, indent=1))
    _fsync(tmp / "build.json")
    shutil.rmtree(tmp / "build", ignore_errors=True)
    (tmp / "child.pid").unlink(missing_ok=True)
    try:
        os.rename(tmp, p.entry)
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or find(p) is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another builder's entry is there (an --out folder shared)
    _fsync(p.root)
    return p.library


def build_locked(spec: Spec, p: Paths, progress=None) -> Path:
    """Build ``spec`` into ``p.entry`` (the lock held): its library. Raises ExtensionBuildFailed (naming the log)."""
    _remove_stale(p)
    if p.entry.exists():  # not a finished entry (find() said so) or a damaged one (intact() said so): in the way
        shutil.rmtree(p.entry)
    p.failed.unlink(missing_ok=True)
    tmp = p.root / f".tmp-{p.entry.name}-{os.getpid()}-{next(_serial)}"
    tmp.mkdir()
    t0 = time.monotonic()
    say(f"building {spec.label} for {_archs_text(spec)} into {p.entry} ({_estimate(spec, p.root)}); once per "
        f"machine and version, later processes load it")
    try:
        with open(p.log, "w") as log:
            rc, library = _compile(spec, p, tmp, log, progress)
        seconds = time.monotonic() - t0
        if rc != 0 or not library.is_file():
            full = "No space left on device" in p.log.read_text(errors="replace")
            p.failed.write_text(json.dumps({"log": str(p.log), "exit": rc, "at": time.time(), "full": full}))
            say(f"building {spec.label} for {_archs_text(spec)} failed after {duration(seconds)} (exit {rc}); the "
                f"log: {p.log}")
            if full:
                raise ExtensionCacheUnwritable(p.root, OSError(errno.ENOSPC, "no space left on device"))
            raise ExtensionBuildFailed(f"building {spec.label} for {_archs_text(spec)} failed (exit {rc}); see "
                                       f"the log {p.log}", p.log)
        out = _finish(spec, p, tmp, library, seconds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename happened
    say(f"built {spec.label} for {_archs_text(spec)} in {duration(seconds)}: {p.entry}")
    return out


def intact(p: Paths) -> bool:
    """Whether the entry's library is the one recorded when it was built (hashes it: for a tool, not every load)."""
    try:
        meta = json.loads(p.meta.read_text())
        return hashlib.sha256(p.library.read_bytes()).hexdigest() == meta.get("library_sha256")
    except (OSError, ValueError):
        return False


def _lock(lock, spec: Spec, p: Paths) -> float | None:
    """Take the build lock: None when it was free, else the time this process started waiting for it."""
    import fcntl

    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        pass
    waited_since = time.time()
    say(f"waiting for another process building {spec.label} for {_archs_text(spec)} (lock {p.lock})")
    fcntl.flock(lock, fcntl.LOCK_EX)
    return waited_since


def ensure(spec: Spec, root: Path | None = None, progress=None, verify: bool = False) -> tuple[Path, float | None]:
    """The library of ``spec`` in the cache (or of an entry built for more targets: ``find_covering``), built first
    if need be: (library, seconds it took to build here, or None when it was there or another process built it).
    N processes at once build once. ``verify``: an entry whose library differs from the one recorded (damaged) is
    rebuilt, not returned (hashing the library: for ``rlkernel.build``, not every first call)."""
    p = paths(spec, root)
    found = find(p)
    if found is not None and (not verify or intact(p)):  # no lock, no write: a read-only cache that holds it is fine
        return found, None
    if found is None:
        covering = find_covering(spec, p.root)
        if covering is not None and (not verify or intact(covering)):
            return covering.library, None
    problem = missing_tool(spec)
    if problem:
        raise ExtensionNotBuilt("extension not built", problem)
    try:
        p.root.mkdir(parents=True, exist_ok=True)
        lock = open(p.lock, "a")
    except OSError as exc:
        raise ExtensionCacheUnwritable(p.root, exc) from None
    with lock:
        try:
            waited_since = _lock(lock, spec, p)
        except OSError as exc:  # a file system without locks (NFS without lockd: ENOLCK; Lustre without flock)
            raise ExtensionCacheUnwritable(p.root, exc, "cannot be locked") from None
        found = find(p)
        if found is not None and (not verify or intact(p)):
            if waited_since is not None:
                say(f"{spec.label} is built: loading it from {p.entry}")
            return found, None
        if waited_since is not None:
            _raise_if_failed_since(spec, p, waited_since)
        try:
            t0 = time.monotonic()
            library = build_locked(spec, p, progress)
            return library, time.monotonic() - t0
        except OSError as exc:
            if exc.errno in _CACHE_ERRNOS:
                raise ExtensionCacheUnwritable(p.root, exc) from None
            raise ExtensionBuildFailed(f"building {spec.label} failed: {exc}", p.log if p.log.exists() else None) \
                from None


def _raise_if_failed_since(spec: Spec, p: Paths, since: float) -> None:
    """The build this process waited for failed: take its failure (N ranks need not fail N times, one by one)."""
    try:
        doc = json.loads(p.failed.read_text())
    except (OSError, ValueError):
        return
    if float(doc.get("at", 0)) < since:
        return
    if doc.get("full"):
        raise ExtensionCacheUnwritable(p.root, OSError(errno.ENOSPC, "no space left on device"))
    raise ExtensionBuildFailed(f"another process's build of {spec.label} failed (exit {doc.get('exit')}); see the "
                               f"log {p.log}", p.log)


def check(spec: Spec, root: Path | None = None) -> tuple[bool, str]:
    """Verify the cache entry of ``spec`` (or one built for more targets) against the sources: (ok, one line saying
    what was found)."""
    hashed = sources_hash(spec.root)
    p = paths(spec, root, hashed)
    if find(p) is None:
        covering = find_covering(spec, p.root, hashed)
        if covering is None:
            others = sorted(q.parent.name for q in p.root.glob(f"{spec.name}-*/build.json"))
            tail = f"; the cache holds other builds ({', '.join(others)}): other sources, versions or targets" \
                if others else ""
            return False, f"no build of {spec.label} for {_archs_text(spec)} matching these sources in {p.root}{tail}"
        p = covering
    meta = json.loads(p.meta.read_text())
    if meta.get("sources") != hashed or meta.get("files") != file_hashes(spec.root):
        return False, f"{p.entry}: recorded for other sources than {spec.root}"
    if not intact(p):
        return False, (f"{p.library}: differs from the library recorded when it was built (damaged: python -m "
                       f"rlkernel.build rebuilds it)")
    built_for = ",".join(meta.get("archs") or [])
    return True, f"{p.entry}: {spec.label} for {built_for}, built from these sources (sha256 {hashed[:16]})"
