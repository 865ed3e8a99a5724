"""The one loader of the CUDA extension ``rlkernel._C``: in the tree, else the cache, else built on first use.

Where it comes from, in this order (docs/contracts.md, section 7, ``source``):

- ``in-tree``: a library beside the package (``python setup.py build_ext --inplace``, or an install whose build
  had torch). It wins whenever it is there.
- ``cache``: the first call that needs it builds it from the ``csrc/`` sources the package ships, for the visible
  GPUs (``sm_90a`` for compute capability 9.0), into ``$RLKERNEL_CACHE_DIR`` (default ``~/.cache/rlkernel``);
  later processes load it from there (``rlkernel._jit``). ``python -m rlkernel.build`` builds it ahead of time.
- ``not built``: neither, and no build could be made (no CUDA torch, no GPU, no nvcc or ninja), or it failed.

Importing rlkernel never builds. ``load()`` never builds either (the ops call it when they are imported, to
register their fakes where the in-tree library is there); ``ensure()`` does, and the dispatcher calls it
(``unavailable_reason()``) when a call on CUDA tensors wants the fused path. ``fused_status()`` and
``python -m rlkernel.env`` say where it came from and why not, without building.
"""
from __future__ import annotations

import importlib
import importlib.util
import threading
from dataclasses import dataclass, field

from rlkernel import _jit
from rlkernel._jit import ExtensionBuildFailed, ExtensionCacheUnwritable, ExtensionNotBuilt

__all__ = ["ExtensionNotBuilt", "ExtensionBuildFailed", "ExtensionCacheUnwritable", "load", "ensure",
           "unavailable_reason", "has_op", "built_archs", "fused_status", "when_loaded", "rlkernel_spec"]
MODULE = "rlkernel._C"


@dataclass
class _State:
    module: object | None
    source: str  # "in-tree", "cache", "not built"
    reason: str | None = None  # path-free: what dispatch records say
    detail: str | None = None  # for people: paths allowed
    path: str | None = None  # the library loaded, or the cache entry it would be
    log: str | None = None
    build_seconds: float | None = None  # built by this process
    error: ExtensionNotBuilt | None = None
    archs: list = field(default_factory=list)


_state: _State | None = None  # the final answer for this process
_module = None  # the loaded module: load()'s fast path, a plain global that torch.compile reads
_tree: _State | None = None  # the in-tree probe, tried once
_lock = threading.RLock()
_hooks: list = []  # run once the library is loaded (ops register their fakes)
_ops: dict[str, bool] = {}


def _scrubbed(exc: BaseException) -> str:
    from rlkernel.textsafe import scrub_paths

    return scrub_paths(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def _probe_tree() -> _State | None:
    """The in-tree library, imported if it is there; None when there is none."""
    global _tree
    if _tree is not None:
        return _tree if _tree.source == "in-tree" else None
    spec = importlib.util.find_spec(MODULE)
    if spec is None:
        _tree = _State(None, "not built")
        return None
    try:
        # the library links against torch's (libc10.so, ...), which only importing torch puts in the process: a
        # fused_status() before any torch import read the in-tree build as "failed to load" (and kept that)
        import torch  # noqa: F401

        module = importlib.import_module(MODULE)  # importing registers torch.ops.rlkernel.*
    except (ImportError, OSError) as exc:  # OSError: e.g. a CUDA library missing at load time
        error = ExtensionNotBuilt(f"extension failed to load: {_scrubbed(exc)}",
                                  f"{spec.origin}: {exc} (the in-tree library wins over the cache: rebuild it with "
                                  f"python setup.py build_ext --inplace, or remove it)")
        _tree = _State(None, "in-tree", error.reason, error.detail, spec.origin, error=error)
    else:
        _tree = _State(module, "in-tree", path=spec.origin, archs=list(getattr(module, "BUILT_ARCHS", ())))
    return _tree


# ------------------------------------------------------------------------------------------- the cache's spec

def arch_of(major: int, minor: int) -> str:
    """The target for a GPU of compute capability major.minor: sm_90a on Hopper (the kernels use Hopper-only
    instructions; torch's flags would give sm_90), else sm_XY."""
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


def parse_archs(text: str) -> list[str]:
    """``sm_90a,sm_80`` / ``9.0a 8.0`` / ``90a`` -> ['sm_80', 'sm_90a'] (a bare 9.0 is sm_90a); ValueError else."""
    import re

    out = []
    for tok in re.split(r"[\s,;]+", text.strip()):
        if not tok:
            continue
        m = re.fullmatch(r"(?:sm_)?(\d{2,3})([af]?)", tok) or re.fullmatch(r"(\d+)\.(\d)([af]?)", tok)
        if m is None:
            raise ValueError(f"{tok!r} is not a GPU architecture (sm_90a, sm_80, 9.0, 8.6, ...)")
        if len(m.groups()) == 3:
            major, minor, suffix = m.groups()
            arch = arch_of(int(major), int(minor)) if not suffix else f"sm_{major}{minor}{suffix}"
        else:
            arch = f"sm_{m.group(1)}{m.group(2)}"
        if arch not in out:
            out.append(arch)
    if not out:
        raise ValueError("no architecture given")
    return sorted(out, key=lambda a: (int(re.sub(r"\D", "", a)), a))


def visible_archs() -> list[str]:
    """The targets of the visible GPUs (initialises CUDA); [] without any."""
    import torch

    if not torch.cuda.is_available():
        return []
    return sorted({arch_of(*torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())})


def _gencode(arch: str) -> str:
    return f"-gencode=arch=compute_{arch[3:]},code={arch}"


def rlkernel_spec(archs: list[str] | None = None) -> _jit.Spec:
    """What the cache builds: every csrc/*.cu and csrc/*.cpp the package ships (the files setup.py compiles),
    with setup.py's flags, for ``archs`` (default: the visible GPUs). Raises ExtensionNotBuilt where no build
    can target this machine."""
    import torch

    if torch.version.cuda is None:
        raise ExtensionNotBuilt("extension not built",
                                f"torch {torch.__version__} has no CUDA (the fused kernels need a CUDA build of torch)")
    if not archs:
        archs = visible_archs()
        if not archs:
            raise ExtensionNotBuilt("extension not built", "no CUDA device visible to build for (python -m "
                                    "rlkernel.build --arch ... builds for GPUs that are not here)")
    root = csrc_dir()
    sources = tuple(sorted(p.name for p in root.glob("*.cu")) + sorted(p.name for p in root.glob("*.cpp")))
    if not sources:
        raise ExtensionNotBuilt("extension not built", f"no csrc/*.cu or *.cpp sources in {root}")
    built = ",".join(archs)
    return _jit.Spec(name="_C", module=MODULE, label="rlkernel._C (the fused CUDA kernels)", root=root,
                     sources=sources, include_dirs=("include", *_cutlass_dirs()),
                     # the shell that ninja runs the compiler under takes the single quotes off
                     cflags=(*_jit.CXX_FLAGS, f"-DRLKERNEL_BUILT_ARCHS='\"{built}\"'"),
                     cuda_cflags=(*_jit.NVCC_FLAGS, *_cutlass_flags(), *map(_gencode, archs)), archs=tuple(archs),
                     with_cuda=True)


def _cutlass_dirs() -> tuple[str, ...]:
    """The CUTLASS headers' folder (absolute: root / an absolute path is that path), () without the wheel: then the
    epilogue GEMM is built as a stub that refuses (csrc/linear_logp_epilogue.cu)."""
    from rlkernel import cutlass_headers

    inc = cutlass_headers.include_dir()
    return (inc,) if inc else ()


def _cutlass_flags() -> tuple[str, ...]:
    """The wheel's version as a define: in the cache key, so other CUTLASS headers make another build."""
    from rlkernel import cutlass_headers

    v = cutlass_headers.version()
    return (f"-DRLKERNEL_CUTLASS_VERSION={v.replace('.', '_')}",) if v and cutlass_headers.include_dir() else ()


def csrc_dir():
    """The CUDA sources: the installed package's ``rlkernel/csrc`` (package data), else the checkout's ``csrc/``."""
    from pathlib import Path

    package = Path(__file__).resolve().parent
    inside = package / "csrc"
    return inside if inside.is_dir() else package.parent / "csrc"


_make_spec = rlkernel_spec  # what ensure() builds; tests/test_jit_build.py swaps in its tiny C++ extension


# ------------------------------------------------------------------------------------------------ the state

def _from_cache(spec: _jit.Spec, library, seconds) -> _State:
    try:
        module = _jit.import_library(spec, library)
    except (ImportError, OSError) as exc:
        error = ExtensionNotBuilt(f"extension failed to load: {_scrubbed(exc)}",
                                  f"{library}: {exc} (python -m rlkernel.build --check says whether it is damaged)")
        return _State(None, "cache", error.reason, error.detail, str(library), error=error, archs=list(spec.archs))
    archs = list(getattr(module, "BUILT_ARCHS", ())) or list(spec.archs)
    return _State(module, "cache", path=str(library), build_seconds=seconds, archs=archs)


def _settle(state: _State) -> _State:
    """Keep the final answer and, when the library loaded, run the hooks (they may call load(): it reads the
    answer without taking the lock)."""
    global _state, _module
    _state = state
    if state.module is not None:
        _module = state.module
        while _hooks:
            _hooks.pop(0)()
    return state


def _not_built(exc: ExtensionNotBuilt, path=None) -> _State:
    log = getattr(exc, "log", None)
    return _State(None, "not built", exc.reason, exc.detail, path, str(log) if log else None, error=exc)


def ensure() -> _State:
    """Load the extension, building it into the cache if it is nowhere yet (once per process; N processes at once
    build once). Never raises for a missing or failed build: the state says why."""
    if _state is not None:
        return _state
    with _lock:
        if _state is not None:
            return _state
        tree = _probe_tree()
        if tree is not None:
            return _settle(tree)
        try:
            spec = _make_spec()
        except ExtensionNotBuilt as exc:
            return _settle(_not_built(exc))
        try:
            library, seconds = _jit.ensure(spec)
        except ExtensionNotBuilt as exc:
            return _settle(_not_built(exc, str(_jit.paths(spec).entry)))
        return _settle(_from_cache(spec, library, seconds))


def _peek() -> _State:
    """The state without building: what is loaded, else the in-tree library, else the cache entry (loaded when it
    is there), else why it is not there (not kept: a later ensure() may build)."""
    if _state is not None:
        return _state
    with _lock:
        if _state is not None:
            return _state
        tree = _probe_tree()
        if tree is not None:
            return _settle(tree)
        try:
            spec = _make_spec()
        except ExtensionNotBuilt as exc:
            return _not_built(exc)
        p = _jit.paths(spec)
        library = _jit.find(p)
        if library is None and (covering := _jit.find_covering(spec, p.root)) is not None:
            library = covering.library  # built for more targets than this machine's
        if library is not None:
            return _settle(_from_cache(spec, library, None))
        problem = _jit.missing_tool(spec)
        how = (f"it cannot be built here: {problem}" if problem else
               "the first fused call builds it, or build it now with python -m rlkernel.build")
        return _State(None, "not built", "extension not built",
                      f"not in the cache yet ({p.entry}): {how}", str(p.entry), archs=list(spec.archs))


def load():
    """The loaded extension module; raises ExtensionNotBuilt (its ``reason``) when it is not loaded. Never builds:
    before ``ensure()`` ran it finds only the in-tree library."""
    if _module is not None:
        return _module
    state = _state
    if state is None:
        state = _probe_tree()
        if state is None:
            raise ExtensionNotBuilt("extension not built", "not loaded yet: the first call that needs it loads it "
                                    "from the cache or builds it")
        _settle(state)
    if state.module is None:
        if state.error is not None:
            raise state.error.with_traceback(None)  # one instance, kept: no traceback piling up on it
        raise ExtensionNotBuilt(state.reason or "extension not built", state.detail)
    return state.module


def when_loaded(hook) -> None:
    """Call ``hook()`` now if the extension is loaded (the in-tree library is, as soon as it is probed), else
    right after a later load in this process: ops register their fake kernels and autograd formulas with it."""
    with _lock:
        state = _state or _probe_tree()
        if state is None or state.module is None:
            _hooks.append(hook)
            return
        if _state is None:
            _settle(state)
    hook()


def unavailable_reason() -> str | None:
    """Why the fused path cannot run (path-free, for dispatch records), None when it can: builds it if need be."""
    return ensure().reason


def error() -> ExtensionNotBuilt | None:
    """The typed error behind ``unavailable_reason()`` (ExtensionBuildFailed names the log), None when loaded."""
    return _state.error if _state is not None else None


def has_op(name: str) -> bool:
    """Whether the loaded extension registered ``torch.ops.rlkernel.<name>*`` (e.g. ``logp``, ``sample``); what a
    loaded library registered never changes, so an answer given once it is loaded is kept."""
    known = _ops.get(name)
    if known is None:
        if _state is None or _state.module is None:
            return False
        known = _ops[name] = _has_op(name)
    return known


def _has_op(name: str) -> bool:
    import torch

    ns = torch.ops.rlkernel
    prefixes = {"logp": "logp_forward", "sample": "sample", "linear_logp": "linear_logp_fold",
                "linear_logp_loss": "logp_forward"}  # the loss runs the logp kernels between cuBLAS GEMMs
    try:
        getattr(ns, prefixes.get(name, name))
    except (AttributeError, RuntimeError):
        return False
    return True


def built_archs() -> list[str]:
    """The GPU architectures the loaded extension carries code for (recorded at build), [] when not loaded."""
    module = _state.module if _state is not None else None
    return list(getattr(module, "BUILT_ARCHS", [])) if module is not None else []


def fused_status() -> dict:
    """Whether the fused path is available, where the extension came from (``in-tree``, ``cache``, ``not built``)
    and why not. Builds nothing (a cache entry that is there is loaded). ``reason`` is path-free (what dispatch
    records say); ``detail``, ``path`` and ``log`` are for people."""
    state = _peek()
    return {"available": state.module is not None, "source": state.source, "reason": state.reason,
            "detail": state.detail, "archs": list(state.archs), "path": state.path, "log": state.log,
            "build_seconds": state.build_seconds, "cache_dir": str(_jit.cache_root())}
