"""The run manifest, both halves of docs/contracts.md section 6 in one home: what capture writes (the schema
version, the keys every manifest holds, the environment allow-list) and how the analyzer reads it back (the
shape checks every later ``.get`` relies on).

Imports no DuckDB at module level: capture writes manifests and never loads the analyzer's database.
"""
from __future__ import annotations

import json
import pathlib

from rlkernel.cli import INT64_MAX

SCHEMA = 1
MANIFEST_KEYS = ("schema", "created_at", "status", "error", "command", "workloads", "node", "tools", "steps",
                 "dispatch", "env")
# The traced process's environment may hold secrets (tokens, keys): only these reach the manifest (and the report,
# which filters by the same list). By name, never by prefix: RLKERNEL_API_TOKEN is a user's variable, not ours.
# A new variable the project reads is added here and in docs/contracts.md section 6.
ENV_ALLOWED = frozenset({
    "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "TORCH_CUDA_ARCH_LIST", "CUDA_LAUNCH_BLOCKING",
    "RLKERNEL_VALIDATE", "RLKERNEL_REQUIRE_FUSED", "RLKERNEL_REQUIRE_NVCC", "RLKERNEL_ANALYZE_MEMORY",
    "RLKERNEL_CAPTURE_STEPS",
})


def allowed_env(environ) -> dict:
    return {k: v for k, v in sorted(environ.items()) if k in ENV_ALLOWED}


def _trace_error(message: str) -> Exception:
    # trace_db imports DuckDB; the reader's errors are its TraceError (exit 2), fetched only when one is raised
    from pipelines.trace_db import TraceError

    return TraceError(message)


def read_json(path: pathlib.Path, what: str):
    try:
        return json.loads(path.read_text())
    # JSONDecodeError and UnicodeDecodeError are ValueErrors; nesting deeper than the parser's stack
    # (`[` x 200000) is a RecursionError
    except (OSError, ValueError, RecursionError) as e:
        why = str(e).splitlines()[0][:160] if not isinstance(e, RecursionError) else "nested too deeply"
        raise _trace_error(f"{path}: not a readable JSON {what} ({why})") from None


_KIND_NAMES = {str: "a string", list: "a list", dict: "an object"}


def manifest_problem(data) -> str | None:
    """What makes ``data`` not a run manifest the analyzer can read (docs/contracts.md, section 6), or None.

    Only the fields the analyzer reads are checked, and only their shape: every later ``.get`` and ``int`` on
    a manifest can then trust it."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    if data.get("schema", 1) != 1:
        return f"schema {data.get('schema')!r}, this analyzer reads schema 1"
    if not isinstance(data.get("workloads", []), list):
        return "workloads is not a list"
    for i, w in enumerate(data.get("workloads", [])):
        if not isinstance(w, dict):
            return f"workloads[{i}] is not an object"
        if not isinstance(w.get("name"), str) or not w["name"]:
            return f"workloads[{i}] has no name"
        for key in ("fused_ops", "fused_patterns"):
            v = w.get(key, [])
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                return f"workloads[{i}].{key} is not a list of strings"
        if not isinstance(w.get("path", ""), str):
            return f"workloads[{i}].path is not a string"
        for key in ("bytes", "flops"):
            v = w.get(key)
            # the bytes / flops columns are BIGINT
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= INT64_MAX):
                return f"workloads[{i}].{key} is {v!r}, not a non-negative integer"
    if not isinstance(data.get("dispatch", []), list):
        return "dispatch is not a list"
    for i, r in enumerate(data.get("dispatch", [])):
        if not isinstance(r, dict) or not isinstance(r.get("op"), str) or not isinstance(r.get("status"), str):
            return f"dispatch[{i}] is not a record with op and status strings"
    for key, kind in (("status", str), ("created_at", str), ("command", list), ("node", dict), ("tools", dict),
                      ("env", dict)):
        if data.get(key) is not None and not isinstance(data[key], kind):
            return f"{key} is not {_KIND_NAMES[kind]}"
    devices = (data.get("node") or {}).get("devices") or []
    if not isinstance(devices, list) or not all(
            isinstance(d, dict) and isinstance(d.get("index", -1), int) for d in devices):
        return "node.devices is not a list of records with an integer index"
    ext = (data.get("node") or {}).get("extension")
    if ext is not None and not (isinstance(ext, dict) and isinstance(ext.get("archs") or [], list)
                                and all(isinstance(a, str) for a in ext.get("archs") or [])):
        return "node.extension is not a record with a list of arch strings"
    return None


def read_manifest(path: pathlib.Path) -> dict:
    """The run's manifest, its shape checked once here; a TraceError naming the file otherwise."""
    data = read_json(path, "manifest")
    problem = manifest_problem(data)
    if problem:
        raise _trace_error(f"{path}: not a run manifest ({problem})")
    return data


def read_provenance(path: pathlib.Path) -> dict:
    data = read_json(path, "provenance record")
    if not isinstance(data, dict):
        raise _trace_error(f"{path}: not a provenance record (a JSON {type(data).__name__}, not an object)")
    return data
