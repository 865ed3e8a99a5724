"""The first-use build of the extension (issue 30), on CPU: a real tiny C++ extension (tests/data/jit_probe/probe.cpp)
compiled with g++ through rlkernel._jit, the loader rlkernel._C's first call and ``python -m rlkernel.build`` take:
cache keying, the lines before and after a build, the file lock (processes that arrive while a build runs wait and
load its result), a build killed with SIGKILL (nothing loadable is left), a read-only cache (a clear error, and a
fallback), a failed build (the typed error names its log; the dispatch record says "extension build failed" and no
path), and importing rlkernel building nothing.

Processes that build run as children (each a fresh interpreter, as a job's ranks are). A build takes a few
seconds (the compile is quick; torch's import in the builder is most of it), so the module builds as few times as
it can: one shared build, one for the lock test, one after the killed build, and one that fails.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from rlkernel import _ext, _jit, dispatch, env
from tests.subprocess_env import pythonpath

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "tests" / "data" / "jit_probe"
TAG = "hello, world"  # a -D string with a space and a comma: it reaches the compiler whole, or the TAG differs
FLAGS = ("-O0", f"-DPROBE_TAG='\"{TAG}\"'")

pytestmark = pytest.mark.skipif(shutil.which("ninja", path=_jit._tool_path()) is None or shutil.which("c++") is None,
                                reason="needs ninja and a C++ compiler (pip install ninja; the test extra has it)")

# a process that wants the extension: ensure (build or load) and import it, as rlkernel._ext does for rlkernel._C
LOADER = r"""
import json, sys, time
import torch
from pathlib import Path
from rlkernel import _jit
a = json.loads(sys.argv[1])
spec = _jit.Spec(name=a["name"], module=a["module"], label="the probe", root=Path(a["root"]),
                 sources=tuple(a["sources"]), cflags=tuple(a["cflags"]))
t0 = time.perf_counter()
library, seconds = _jit.ensure(spec, Path(a["cache"]), progress=_jit.say if a.get("progress") else None)
module = _jit.import_library(spec, library)
print(json.dumps({"library": str(library), "seconds": seconds, "tag": module.TAG, "load_s": time.perf_counter() - t0}))
"""


def probe_spec(root: Path = PROBE, cflags=FLAGS, name="_C", sources=("probe.cpp",)) -> _jit.Spec:
    # named _C, as rlkernel's: the same library can stand in for an in-tree rlkernel._C
    return _jit.Spec(name=name, module=f"rlk_jit_probe.{name}", label="the probe", root=root, sources=tuple(sources),
                     cflags=tuple(cflags))


def _args(spec: _jit.Spec, cache: Path, progress=False) -> str:
    return json.dumps({"name": spec.name, "module": spec.module, "root": str(spec.root), "sources": list(spec.sources),
                       "cflags": list(spec.cflags), "cache": str(cache), "progress": progress})


def _env(**extra) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "MAX_JOBS"}
    environ["PYTHONPATH"] = pythonpath()
    return {**environ, **extra}


def run_loader(spec, cache, progress=False, **env_extra) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", LOADER, _args(spec, cache, progress)], capture_output=True, text=True,
                         env=_env(**env_extra), timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


def start_loader(spec, cache, tmp: Path, tag: str, **env_extra) -> tuple[subprocess.Popen, Path, Path]:
    out, err = tmp / f"{tag}.out", tmp / f"{tag}.err"
    proc = subprocess.Popen([sys.executable, "-c", LOADER, _args(spec, cache)], stdout=out.open("w"),
                            stderr=err.open("w"), env=_env(**env_extra))
    return proc, out, err


def wait_for(what, timeout=60.0, step=0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = what()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie nobody reaped yet is gone too
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One real build of the probe into a cache of this module, by a fresh process, MAX_JOBS=1, with progress."""
    cache = tmp_path_factory.mktemp("jit") / "cache"
    result, err = run_loader(probe_spec(), cache, progress=True, MAX_JOBS="1")
    return {"cache": cache, "result": result, "err": err, "paths": _jit.paths(probe_spec(), cache)}


def _lines(err: str, word: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(f"rlkernel: {word}")]


# ------------------------------------------------------------------------------------------------ build, lines

def test_first_build_says_what_where_and_how_long_before_and_when_done(built):
    p, err = built["paths"], built["err"]
    (before,) = _lines(err, "building")
    assert f"the probe for the host CPU into {p.entry} (1 source, MAX_JOBS=1" in before
    (done,) = _lines(err, "built")
    assert done.startswith("rlkernel: built the probe for the host CPU in ") and done.endswith(f": {p.entry}")
    # a progress line per source, and the link (what rlkernel-build prints)
    assert "rlkernel: [1/2] compiling probe.cpp" in err and "rlkernel: [2/2] linking _C.so" in err
    assert built["result"]["tag"] == TAG and built["result"]["seconds"] > 0
    assert Path(built["result"]["library"]) == p.library


def test_the_entry_holds_only_the_library_and_its_record(built):
    p = built["paths"]
    assert sorted(x.name for x in p.entry.iterdir()) == ["_C.so", "build.json"]
    assert sorted(x.name for x in p.root.iterdir()) == sorted([p.entry.name, p.lock.name, p.log.name])  # no .tmp-*
    meta = json.loads(p.meta.read_text())
    assert meta["key"] == p.key and meta["sources"] == _jit.sources_hash(PROBE)
    assert meta["torch"] == torch.__version__ and meta["files"] == {"probe.cpp": _jit.file_hashes(PROBE)["probe.cpp"]}
    assert "probe.cpp" in p.log.read_text()  # the log holds the compiler's command lines


def test_a_later_process_loads_from_the_cache_silently_and_fast(built):
    result, err = run_loader(probe_spec(), built["cache"])
    assert err == "" and result["seconds"] is None and result["tag"] == TAG
    assert result["load_s"] < 0.5, result  # the bound: load after `import torch`


# ------------------------------------------------------------------------------------------------ keying

def test_the_key_follows_sources_headers_flags_targets_and_versions(tmp_path, monkeypatch):
    copy = tmp_path / "src"
    shutil.copytree(PROBE, copy)
    base = _jit.key(probe_spec())
    assert _jit.key(probe_spec(copy)) == base  # the folder's place is not in it: an install and a checkout agree
    (copy / "include").mkdir()
    (copy / "include" / "extra.h").write_text("// a header the build may include\n")
    assert _jit.key(probe_spec(copy)) != base  # every file under the folder counts, headers too
    assert _jit.key(probe_spec(cflags=("-O1",))) != base
    assert _jit.key(_jit.Spec(**{**probe_spec().__dict__, "archs": ("sm_90a",)})) != base
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert _jit.key(probe_spec()) != base


def test_a_half_written_folder_is_never_loaded(built, tmp_path):
    # what a kill -9 can leave: the library without its record (a rename never leaves this, a copy would), or a
    # complete build still under its temporary name
    p = built["paths"]
    other = _jit.paths(probe_spec(), tmp_path)
    other.entry.mkdir()
    shutil.copy(p.library, other.library)
    assert _jit.find(other) is None
    shutil.copytree(p.entry, tmp_path / f".tmp-{other.entry.name}-1-0")
    assert _jit.find(other) is None
    (other.entry / "build.json").write_text(json.dumps({"key": "another"}))
    assert _jit.find(other) is None
    shutil.copy(p.meta, other.meta)
    assert _jit.find(other) == other.library


def test_check_verifies_the_entry_against_the_sources(built, tmp_path):
    ok, line = _jit.check(probe_spec(), built["cache"])
    assert ok and "built from these sources" in line
    cache = tmp_path / "cache"
    shutil.copytree(built["cache"], cache)
    p = _jit.paths(probe_spec(), cache)
    data = bytearray(p.library.read_bytes())
    data[-1] ^= 0xFF
    p.library.write_bytes(bytes(data))
    ok, line = _jit.check(probe_spec(), cache)
    assert not ok and "damaged" in line
    changed = tmp_path / "changed"
    shutil.copytree(PROBE, changed)
    (changed / "probe.cpp").write_text((PROBE / "probe.cpp").read_text() + "\n// changed\n")
    ok, line = _jit.check(probe_spec(changed), built["cache"])
    assert not ok and "other sources, versions or targets" in line and p.entry.name in line


def _multi_target_copy(built, cache: Path, spec: _jit.Spec) -> _jit.Paths:
    """The shared build recorded as ``spec``'s entry in ``cache`` (what rlkernel-build --arch LIST --out writes)."""
    q = _jit.paths(spec, cache)
    q.entry.mkdir(parents=True)
    shutil.copy(built["paths"].library, q.library)
    meta = json.loads(built["paths"].meta.read_text())
    q.meta.write_text(json.dumps({**meta, **_jit.key_fields(spec), "key": q.key}))
    return q


def _for_archs(archs, extra=()) -> _jit.Spec:
    # as rlkernel_spec: the targets in a define of cflags and in the archs field
    return _jit.Spec(**{**probe_spec(cflags=(*FLAGS, *extra, f"-DBUILT='\"{','.join(archs)}\"'")).__dict__,
                        "archs": tuple(archs)})


def test_an_entry_built_for_more_targets_serves_a_machine_that_needs_fewer(built, tmp_path):
    # an image built with --arch sm_80,sm_90a on a node whose GPUs make the spec sm_90a alone: loaded, not rebuilt
    cache = tmp_path / "image"
    q = _multi_target_copy(built, cache, _for_archs(["sm_80", "sm_90a"]))
    one = _for_archs(["sm_90a"])
    assert _jit.find(_jit.paths(one, cache)) is None and _jit.find_covering(one, cache) == q
    assert _jit.ensure(one, cache) == (q.library, None)
    ok, line = _jit.check(one, cache)
    assert ok and line.startswith(f"{q.entry}: the probe for sm_80,sm_90a")
    for other in (_for_archs(["sm_100a"]), _for_archs(["sm_90a"], extra=("-O1",))):  # other target; other flags
        assert _jit.find_covering(other, cache) is None


def test_the_key_leaves_out_include_folders_outside_the_sources():
    # a wheel's headers (CUTLASS) in one venv or another: the same build (a flag keys their version)
    at = lambda *dirs: _jit.key(_jit.Spec(**{**probe_spec().__dict__, "include_dirs": dirs}))
    assert at("/venv-a/site-packages/cutlass/include") == at("/venv-b/site-packages/cutlass/include") == at()
    assert at("include") != at()  # a folder of the sources' own still counts


def test_the_build_tool_rebuilds_a_damaged_entry(built, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(built["cache"], cache)
    p = _jit.paths(probe_spec(), cache)
    p.library.write_bytes(p.library.read_bytes()[:100])  # truncated: --check says damaged, the import fails
    assert _jit.ensure(probe_spec(), cache) == (p.library, None)  # a first call does not hash the library
    library, seconds = _jit.ensure(probe_spec(), cache, verify=True)  # rlkernel-build's call
    assert library == p.library and seconds is not None and _jit.intact(p) and _jit.check(probe_spec(), cache)[0]


def test_a_cache_on_a_file_system_without_locks_is_a_typed_error(tmp_path, monkeypatch):
    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(_jit.ExtensionCacheUnwritable) as caught:
        _jit.ensure(probe_spec(cflags=("-O1",)), tmp_path / "nfs")
    assert caught.value.reason == "extension cache cannot be locked"
    assert "No locks available" in caught.value.detail and "RLKERNEL_CACHE_DIR" in caught.value.detail


# ------------------------------------------------------------------------------------------------ concurrency

def test_processes_that_arrive_during_a_build_wait_and_it_happens_once(tmp_path):
    spec, cache = probe_spec(), tmp_path / "cache"
    p = _jit.paths(spec, cache)
    cache.mkdir()
    with open(p.lock, "a") as held:  # another builder holds the lock
        fcntl.flock(held, fcntl.LOCK_EX)
        procs = [start_loader(spec, cache, tmp_path, f"rank{i}") for i in range(2)]
        for _, _, err in procs:
            wait_for(lambda err=err: "rlkernel: waiting for another process building the probe" in err.read_text())
    results = []
    for proc, out, err in procs:
        assert proc.wait(timeout=300) == 0, err.read_text()
        results.append((json.loads(out.read_text()), err.read_text()))
    assert sum(len(_lines(e, "building")) for _, e in results) == 1  # one build
    assert sum(len(_lines(e, "the probe is built: loading it")) for _, e in results) == 1  # the other loaded it
    assert {r["tag"] for r, _ in results} == {TAG} and len({r["library"] for r, _ in results}) == 1


def test_a_build_killed_mid_compile_leaves_nothing_loadable(tmp_path):
    spec, cache = probe_spec(), tmp_path / "cache"
    p = _jit.paths(spec, cache)
    marker = tmp_path / "compiling"
    slow = tmp_path / "slow-c++"  # the compiler, slow: the kill lands while it runs
    slow.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) echo $$ > "{marker}"; sleep 120;; esac\nexec c++ "$@"\n')
    slow.chmod(0o755)
    proc, _, err = start_loader(spec, cache, tmp_path, "killed", CXX=str(slow))
    compiler = int(wait_for(lambda: marker.exists() and marker.read_text().strip()))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    wait_for(lambda: _gone(compiler), timeout=10)  # the compilers die with their builder: no orphan finishes later
    assert _jit.find(p) is None and not p.entry.exists()
    assert [x.name for x in cache.glob(".tmp-*")] != []  # what it left is only a temporary folder
    p.entry.mkdir()  # and, in the rename's way, a folder of that name that is no finished entry (no build.json)
    (p.entry / "_C.so").write_text("half")
    result, err = run_loader(spec, cache)  # the next process takes the lock the kernel released, and builds
    assert len(_lines(err, "building")) == 1 and result["tag"] == TAG
    assert list(cache.glob(".tmp-*")) == [] and _jit.find(p) == p.library  # and cleared the leftovers


# ------------------------------------------------------------------------------------------------ faults

def _unwritable_cache(tmp_path: Path) -> Path:
    """A cache folder this process cannot write: read-only by mode, or (as root, which ignores modes) a folder
    under a file."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if not os.access(ro, os.W_OK):
        return ro
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return blocker / "cache"


def test_a_read_only_cache_loads_what_it_holds_and_refuses_a_build_clearly(built, tmp_path):
    ro = tmp_path / "image"
    shutil.copytree(built["cache"], ro)
    for path in [ro, *ro.rglob("*")]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    before = sorted(str(x) for x in ro.rglob("*"))
    result, err = run_loader(probe_spec(), ro)  # an image's folder (rlkernel-build --out): loads, writes nothing
    assert result["tag"] == TAG and err == "" and sorted(str(x) for x in ro.rglob("*")) == before
    bad = _unwritable_cache(tmp_path)
    with pytest.raises(_jit.ExtensionCacheUnwritable) as caught:
        _jit.ensure(probe_spec(cflags=("-O1",)), bad)
    assert caught.value.reason == "extension cache not writable" and "/" not in caught.value.reason
    assert str(bad.parent if bad.parent.name == "a-file" else bad) in caught.value.detail
    assert "RLKERNEL_CACHE_DIR" in caught.value.detail


def test_a_full_cache_says_so():
    exc = _jit.ExtensionCacheUnwritable(Path("/x"), OSError(errno.ENOSPC, "No space left on device"))
    assert exc.reason == "extension cache full" and "is full" in exc.detail


@pytest.fixture
def fresh_ext(monkeypatch, tmp_path):
    """rlkernel._ext as a fresh process has it, building ``spec`` (set by the test) into a cache of the test's."""
    monkeypatch.setattr(_ext, "_state", None)
    monkeypatch.setattr(_ext, "_module", None)
    monkeypatch.setattr(_ext, "_tree", _ext._State(None, "not built"))  # no in-tree library (as in an install)
    monkeypatch.setattr(_ext, "_hooks", [])  # rlkernel's ops' hooks are for rlkernel._C, not the probe
    monkeypatch.setattr(_ext, "_ops", {})
    monkeypatch.setattr(dispatch, "_decisions", {})
    monkeypatch.setenv("RLKERNEL_CACHE_DIR", str(tmp_path / "cache"))
    return monkeypatch


def test_a_failed_build_raises_its_typed_error_and_falls_back_without_a_path(fresh_ext, tmp_path, capfd):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "broken.cpp").write_text('#error "deliberately broken"\n')
    spec = probe_spec(broken, name="rlk_jit_broken", sources=("broken.cpp",))
    fresh_ext.setattr(_ext, "_make_spec", lambda: spec)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert dispatch.fused_unavailable_reason("logp.forward", cuda, bf16) == "extension build failed"
    err = capfd.readouterr().err
    (line,) = _lines(err, "building the probe for the host CPU failed after")
    log = _jit.paths(spec).log
    assert line.endswith(f"the log: {log}") and "deliberately broken" in log.read_text()
    status = _ext.fused_status()
    assert status["available"] is False and status["source"] == "not built" and status["log"] == str(log)
    exc = _ext.error()
    assert isinstance(exc, _ext.ExtensionBuildFailed) and exc.log == log and str(log) in str(exc)
    with pytest.raises(_ext.ExtensionBuildFailed):
        _ext.load()
    with warnings.catch_warnings(record=True) as caught:  # auto: the native path, with the reason
        warnings.simplefilter("always")
        rec = dispatch.resolve("logp.forward", "auto", False, cuda, bf16)
    assert (rec.status, rec.reason) == ("fallback", "extension build failed")
    assert any("extension build failed" in str(w.message) for w in caught)
    with pytest.raises(dispatch.FusedKernelUnavailable) as blocked:  # demanded: blocked, the build error its cause
        dispatch.resolve("logp.forward", "auto", True, cuda, bf16)
    assert str(blocked.value).endswith("unavailable: extension build failed") and blocked.value.__cause__ is exc
    recorded = json.dumps(dispatch.history_json()) + json.dumps(env.extension_record(status))
    assert "/" not in recorded and "extension build failed" in recorded  # contract 9: no path in records
    assert _ext.unavailable_reason() == "extension build failed"  # once per process: no second build
    assert _lines(capfd.readouterr().err, "building") == []


def test_the_cache_entry_is_the_extension_rlkernel_loads(fresh_ext, built):
    fresh_ext.setenv("RLKERNEL_CACHE_DIR", str(built["cache"]))
    fresh_ext.setattr(_ext, "_make_spec", probe_spec)
    with pytest.raises(_ext.ExtensionNotBuilt, match="not loaded yet"):
        _ext.load()  # load() never builds nor looks further than the tree
    ran = []
    _ext.when_loaded(lambda: ran.append(_ext.load().TAG))  # what the ops do at import: deferred, not built
    assert ran == []
    status = _ext.fused_status()  # the entry is there: loaded, not built
    assert status["available"] and status["source"] == "cache" and status["path"] == str(built["paths"].library)
    assert ran == [TAG] and _ext.load().TAG == TAG and _ext.unavailable_reason() is None
    assert env.extension_record(status) == {"built": True, "archs": [], "reason": None, "source": "cache"}
    assert env.extension_line(status) == f"built for unknown targets, from the cache: {built['paths'].library}"


def test_an_in_tree_library_wins_over_the_cache(fresh_ext, built, tmp_path):
    # a library beside the package (build_ext --inplace): the probe, named _C, copied where rlkernel._C is found
    import importlib.machinery

    import rlkernel

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    library = pkg / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    shutil.copy(built["paths"].library, library)
    fresh_ext.setattr(_ext, "_tree", None)
    # first on the path: a checkout with its own build_ext --inplace library (the GPU node's) must not shadow it
    fresh_ext.setattr(rlkernel, "__path__", [str(pkg), *rlkernel.__path__])
    # a real rlkernel._C an earlier test loaded is put aside, and restored at teardown
    fresh_ext.delitem(sys.modules, "rlkernel._C", raising=False)
    fresh_ext.delattr(rlkernel, "_C", raising=False)
    fresh_ext.setattr(_ext, "_make_spec", lambda: pytest.fail("the cache was looked at"))
    try:
        ran = []
        _ext.when_loaded(lambda: ran.append(_ext.load().TAG))  # as the ops at import in such a checkout: at once
        assert ran == [TAG]
        status = _ext.fused_status()
        assert (status["available"], status["source"], status["path"]) == (True, "in-tree", str(library))
        assert _ext.unavailable_reason() is None and _ext.ensure().module.TAG == TAG
    finally:  # the probe is no rlkernel._C for the tests after this one
        sys.modules.pop("rlkernel._C", None)
        rlkernel.__dict__.pop("_C", None)


def test_an_unwritable_cache_falls_back_with_its_reason(fresh_ext, tmp_path):
    bad = _unwritable_cache(tmp_path)
    fresh_ext.setenv("RLKERNEL_CACHE_DIR", str(bad))
    fresh_ext.setattr(_ext, "_make_spec", probe_spec)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    rec = dispatch.resolve("logp.forward", "auto", False, cuda, bf16)
    assert (rec.status, rec.reason) == ("fallback", "extension cache not writable")
    status = _ext.fused_status()
    assert status["reason"] == "extension cache not writable" and "RLKERNEL_CACHE_DIR" in status["detail"]
    with pytest.raises(dispatch.FusedKernelUnavailable) as blocked:
        dispatch.resolve("logp.forward", "fused", False, cuda, bf16)
    assert isinstance(blocked.value.__cause__, _ext.ExtensionCacheUnwritable)


def test_without_an_entry_status_builds_nothing_and_says_how(fresh_ext, tmp_path):
    fresh_ext.setattr(_ext, "_make_spec", probe_spec)
    status = _ext.fused_status()
    assert status["available"] is False and status["source"] == "not built"
    assert status["reason"] == "extension not built" and "python -m rlkernel.build" in status["detail"]
    assert not (tmp_path / "cache").exists()


def test_importing_rlkernel_builds_nothing(tmp_path):
    # a buildable extension stands in for rlkernel._C before the ops are imported; importing them, the node
    # record and the status make no cache folder and no build line
    code = ("from rlkernel import _ext\nimport tests.test_jit_build as t\n_ext._make_spec = t.probe_spec\n"
            "import rlkernel, rlkernel.ops.logp, rlkernel.ops.sampling, rlkernel.ops.linear_logp, rlkernel.env\n"
            "print(rlkernel.fused_status()['source'])\n")
    cache = tmp_path / "cache"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=_env(RLKERNEL_CACHE_DIR=str(cache)), timeout=120)
    assert out.returncode == 0, out.stderr
    # a checkout holding its own build_ext --inplace library (the GPU node's) reports it; either way nothing builds
    in_tree = any((ROOT / "rlkernel").glob("_C*.so"))
    assert out.stdout.strip() == ("in-tree" if in_tree else "not built")
    assert "rlkernel: building" not in out.stderr and not cache.exists()



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and a built extension")
def test_status_before_any_torch_import_loads_the_in_tree_library():
    # the H200 read "extension failed to load: libc10.so" here: the in-tree library was imported before torch, which
    # alone puts libc10 in the process, and the failure was kept for the process's later fused calls
    if not any((ROOT / "rlkernel").glob("_C*.so")):
        pytest.skip("no in-tree build (python setup.py build_ext --inplace)")
    code = ("import sys, rlkernel\nassert 'torch' not in sys.modules\ns = rlkernel.fused_status()\n"
            "print(s['source'], s['available'], s['reason'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=_env(),
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["in-tree", "True", "None"], out.stdout

# ------------------------------------------------------------------------------------------------ rlkernel._C

@pytest.mark.parametrize("text, archs", [("9.0", ["sm_90a"]), ("sm_90", ["sm_90"]), ("8.0,9.0a", ["sm_80", "sm_90a"]),
                                         ("sm_90a sm_80 90a", ["sm_80", "sm_90a"]), ("10.0", ["sm_100"]),
                                         ("8.6", ["sm_86"])])
def test_arch_lists(text, archs):
    assert _ext.parse_archs(text) == archs


@pytest.mark.parametrize("text", ["foo", "", "9", "sm_9x"])
def test_bad_arch_lists(text):
    with pytest.raises(ValueError):
        _ext.parse_archs(text)


def test_rlkernel_spec_compiles_every_csrc_source_for_sm_90a(monkeypatch):
    if torch.version.cuda is None:
        with pytest.raises(_ext.ExtensionNotBuilt, match="has no CUDA"):
            _ext.rlkernel_spec(["sm_90a"])
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # the spec of a CUDA torch (nothing is built here)
    spec = _ext.rlkernel_spec(["sm_90a"])
    csrc = ROOT / "csrc"  # the checkout's, or the same files inside an install (tox imports the installed package)
    assert spec.root in (csrc, _ext.csrc_dir()) and _jit.sources_hash(spec.root) == _jit.sources_hash(csrc)
    assert set(spec.sources) == {p.name for p in [*csrc.glob("*.cu"), *csrc.glob("*.cpp")]}
    assert "-gencode=arch=compute_90a,code=sm_90a" in spec.cuda_cflags and spec.with_cuda
    assert "-DRLKERNEL_BUILT_ARCHS='\"sm_90a\"'" in spec.cflags and spec.archs == ("sm_90a",)
    assert set(_jit.NVCC_FLAGS) <= set(spec.cuda_cflags) and set(_jit.CXX_FLAGS) <= set(spec.cflags)


def test_build_cli_help_and_usage():
    run = lambda *a: subprocess.run([sys.executable, "-m", "rlkernel.build", *a], capture_output=True, text=True,
                                    env=_env(), timeout=120)
    helped = run("--help")
    assert helped.returncode == 0 and "--arch" in helped.stdout and "exit codes" in helped.stdout
    for bad in (["--arch", "foo"], ["--nope"]):
        out = run(*bad)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    if torch.version.cuda is None:  # this machine cannot build it: one line, exit 3
        out = run("--arch", "9.0")
        assert out.returncode == 3 and out.stderr.strip() == (
            f"rlkernel.build: torch {torch.__version__} has no CUDA (the fused kernels need a CUDA build of torch)")


def test_build_cli_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    from rlkernel import build

    def interrupted(_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "run", interrupted)
    assert build.main(["--arch", "9.0"]) == 130
    assert capsys.readouterr().err.strip() == "rlkernel-build: interrupted (Ctrl-C)"


def test_setup_py_builds_in_the_tree_with_the_cache_s_flags(monkeypatch, capsys):
    import runpy

    import setuptools

    monkeypatch.setattr(setuptools, "setup", lambda **kw: None)
    monkeypatch.setenv("RLKERNEL_BUILD_EXT", "0")  # the opt-out an install that leaves the build to first use sets
    ns = runpy.run_path(str(ROOT / "setup.py"), run_name="setup")
    assert ns["_jit_flags"]() == (_jit.CXX_FLAGS, _jit.NVCC_FLAGS) and ns["ext_modules"] == []
    assert "not building the CUDA extension (RLKERNEL_BUILD_EXT=0" in capsys.readouterr().err
