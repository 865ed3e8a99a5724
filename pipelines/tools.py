"""Finding Nsight Systems (nsys) and Nsight Compute (ncu), their versions, and why nsys left only a .qdstrm.

Search order (issue 7): the ``--nsys/--ncu`` flag, then ``$NSYS``/``$NCU``, then PATH, then ``$CUDA_HOME/bin``,
then the standard install roots, newest version first. The project's GPU node has no standalone Nsight
Systems: the copy bundled inside Nsight Compute (``host/target-linux-x64/nsys``) is the last resort.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from rlkernel.cli import EXIT_BLOCKED, EXIT_USAGE, CliError

OPT_ROOT = "/opt/nvidia"  # tests point this at a temporary tree

_INSTALL_HINT = {
    "nsys": "install Nsight Systems or pass --nsys PATH",
    "ncu": "install Nsight Compute (it ships with the CUDA toolkit), or pass --ncu PATH",
}


@dataclass(frozen=True)
class Tool:
    name: str  # nsys | ncu
    path: str
    version: str
    source: str  # which rule of the search order found it

    def record(self) -> dict:
        return {"path": self.path, "version": self.version, "source": self.source}


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _version_key(path: str) -> list:
    # /opt/nvidia/nsight-systems/2025.3.1/bin/nsys -> compare 2025.3.1 numerically, so the newest install wins
    parts = re.findall(r"\d+", path)
    return [int(p) for p in parts]


def _install_candidates(name: str, opt_root: str) -> list[tuple[str, str]]:
    if name == "nsys":
        patterns = [(f"{opt_root}/nsight-systems/*/bin/nsys", "nsight-systems install"),
                    (f"{opt_root}/nsight-compute/*/host/target-linux-x64/nsys", "nsys bundled with Nsight Compute")]
    else:
        patterns = [(f"{opt_root}/nsight-compute/*/ncu", "nsight-compute install")]
    out = []
    for pattern, source in patterns:
        for path in sorted(glob.glob(pattern), key=_version_key, reverse=True):
            out.append((path, source))
    return out


def candidates(name: str, flag: str | None, environ=None, opt_root: str | None = None) -> list[tuple[str, str]]:
    """Every place ``name`` may be, in search order, as (path, source). The flag, when given, is the only one."""
    environ = os.environ if environ is None else environ
    if flag:
        return [(flag, f"--{name}")]
    out = []
    env_var = name.upper()
    if environ.get(env_var):
        out.append((environ[env_var], f"${env_var}"))
    on_path = shutil.which(name, path=environ.get("PATH", ""))
    if on_path:
        out.append((on_path, "PATH"))
    if environ.get("CUDA_HOME"):
        out.append((os.path.join(environ["CUDA_HOME"], "bin", name), "$CUDA_HOME/bin"))
    out.extend(_install_candidates(name, opt_root or OPT_ROOT))
    return out


def parse_version(name: str, text: str) -> str:
    """The version in ``nsys --version`` ('NVIDIA Nsight Systems version 2025.3.1.90-...') or ``ncu --version``
    (its last line: 'Version 2025.3.1.0 (build ...)')."""
    if name == "nsys":
        m = re.search(r"version\s+(\S+)", text, re.IGNORECASE)
    else:
        m = re.search(r"^Version\s+(\S+)", text, re.IGNORECASE | re.MULTILINE)
    if not m:
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        return lines[-1].strip() if lines else "unknown"
    return m.group(1)


def version(name: str, path: str, environ=None) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, env=environ)
    except (OSError, subprocess.SubprocessError) as e:
        raise CliError(f"{name} at {path} does not run ({e}); {_INSTALL_HINT[name]}", EXIT_BLOCKED) from None
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        raise CliError(f"`{path} --version` exited {out.returncode}: {tail[0]}", EXIT_BLOCKED)
    return parse_version(name, out.stdout + out.stderr)


def find(name: str, flag: str | None = None, environ=None, opt_root: str | None = None) -> Tool:
    """The first usable ``name`` in search order, with its version. CliError(2) for a bad flag, (3) when none."""
    environ = dict(os.environ if environ is None else environ)
    found = candidates(name, flag, environ, opt_root)
    for path, source in found:
        if _executable(path):
            return Tool(name, os.path.abspath(path), version(name, path, environ), source)
        if source == f"--{name}":
            raise CliError(f"--{name} {path}: not an executable file", EXIT_USAGE)
        if source == f"${name.upper()}":
            raise CliError(f"${name.upper()}={path} is not an executable file; unset it or fix it", EXIT_BLOCKED)
    raise CliError(f"{name} not found (looked at ${name.upper()}, PATH, $CUDA_HOME/bin, {opt_root or OPT_ROOT}); "
                   f"{_INSTALL_HINT[name]}", EXIT_BLOCKED)


# ---- the .qdstrm-only failure ----------------------------------------------------------------------------

def importer_paths(nsys_path: str) -> list[str]:
    """Where the QdstrmImporter that converts nsys's raw stream into a .nsys-rep lives, relative to nsys."""
    bindir = os.path.dirname(os.path.realpath(nsys_path))
    root = os.path.dirname(bindir)
    hits = glob.glob(os.path.join(bindir, "QdstrmImporter")) + glob.glob(os.path.join(root, "*", "QdstrmImporter"))
    return sorted(set(hits))


def missing_libraries(ldd_output: str) -> list[str]:
    """The 'libX.so.N => not found' lines of ldd's output."""
    return re.findall(r"^\s*(\S+)\s+=>\s+not found", ldd_output, re.MULTILINE)


def diagnose_qdstrm(nsys_path: str, qdstrm: str) -> str:
    """One line: nsys wrote only a raw .qdstrm because its importer could not start; what it lacks and the fix."""
    libs: list[str] = []
    importers = importer_paths(nsys_path)
    for imp in importers:
        try:
            out = subprocess.run(["ldd", imp], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        libs += [lib for lib in missing_libraries(out.stdout) if lib not in libs]
    where = importers[0] if importers else "QdstrmImporter (not found next to nsys)"
    lacks = f"it cannot load {', '.join(libs)}" if libs else "it could not start (e.g. a missing libdw.so.1)"
    return (f"nsys left only {os.path.basename(qdstrm)}, no .nsys-rep: its importer {where} did not run, {lacks}; "
            "fix: install them (Debian/Ubuntu: apt-get install libdw1 libelf1) or put a folder holding them on "
            "LD_LIBRARY_PATH")
