"""The run directory of ``pipelines.capture`` (docs/contracts.md, section 6; the manifest's keys and its reader
are pipelines.manifest).

A run is built under a hidden temporary name in the output folder (same filesystem, so the final rename is
atomic) and renamed only when complete; a failed run is renamed ``<name>-failed`` with its error in the
manifest. A folder named like a run is therefore always a whole one.
"""
from __future__ import annotations

import datetime
import errno
import json
import os
import pathlib

from pipelines.manifest import MANIFEST_KEYS, SCHEMA


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def run_name(workloads: list[str], when: datetime.datetime) -> str:
    """``<YYYYmmddTHHMMSSZ>-<first workload>[+<n more>]``."""
    more = f"+{len(workloads) - 1}" if len(workloads) > 1 else ""
    return f"{when.strftime('%Y%m%dT%H%M%SZ')}-{workloads[0]}{more}"


def write_json_atomic(path: pathlib.Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


class RunDir:
    """One capture's folder: ``path`` is where to write while it is being built."""

    def __init__(self, output_dir, workloads: list[str], when: datetime.datetime | None = None):
        self.when = when or utc_now()
        self.output_dir = pathlib.Path(output_dir)
        self.name = run_name(workloads, self.when)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / f".{self.name}.tmp-{os.getpid()}"
        self.path.mkdir()
        self.final: pathlib.Path | None = None
        self.manifest: dict = {"schema": SCHEMA, "created_at": self.when.strftime("%Y-%m-%dT%H:%M:%SZ"),
                               "status": "failed", "error": "capture did not finish", "command": [],
                               "workloads": [], "node": {}, "tools": {}, "steps": [], "dispatch": [], "env": {}}

    def write_manifest(self) -> None:
        missing = [k for k in MANIFEST_KEYS if k not in self.manifest]
        if missing:
            raise ValueError(f"manifest lacks {missing}")
        write_json_atomic((self.final or self.path) / "manifest.json", self.manifest)

    def _rename(self, name: str) -> pathlib.Path:
        """Move the finished folder to ``name``, or to ``name.2``, ``name.3``, ... where that is taken (two runs
        of the same workloads in the same second). The rename itself is the claim: a directory renamed onto a
        non-empty one fails (POSIX: EEXIST or ENOTEMPTY; ENOTDIR where a file holds the name) and this run,
        which holds its manifest by now, is never empty; so of several runs finishing at once each lands under
        its own name. Checking that a name is free and then renaming lost that race."""
        target, n = self.output_dir / name, 1
        while True:
            try:
                os.rename(self.path, target)
                break
            except (FileExistsError, NotADirectoryError):
                pass
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
            n += 1
            target = self.output_dir / f"{name}.{n}"
        self.final = target
        return target

    def complete(self) -> pathlib.Path:
        self.manifest.update(status="complete", error=None)
        self.write_manifest()
        return self._rename(self.name)

    def fail(self, error: str) -> pathlib.Path:
        self.manifest.update(status="failed", error=error)
        self.write_manifest()
        return self._rename(f"{self.name}-failed")
