"""The report's rows: the exact columns of issue 5, in order, the same in CSV and JSON.

A row is built from what ran (workload, shape, statistics, dispatch records) plus the node's identity
(``rlkernel.env``), so each row can be read on its own, away from the file it came from.
"""
from __future__ import annotations

import datetime as dt
import subprocess
from pathlib import Path

import torch

import rlkernel
from rlkernel.profiling.timing import Stats
from rlkernel.workloads import Shape, Workload

COLUMNS = (
    "timestamp", "workload", "op", "batch_size", "seq_len", "vocab_size", "dtype", "top_k", "top_p", "temperature",
    "total_tokens", "warmup", "repeat", "latency_ms", "latency_p20_ms", "latency_p80_ms", "tokens_per_sec",
    "bytes_moved", "achieved_gbps", "pct_of_peak_bandwidth", "peak_memory_bytes", "status", "dispatch", "notes",
    "gpu_name", "gpu_architecture", "gpu_backend", "gpu_compute_capability", "gpu_device_index",
    "gpu_physical_index", "driver", "cuda_runtime", "torch", "python", "rlkernel_version", "git_commit", "command",
)
STATUSES = ("pass", "blocked", "oom", "fail")
SMOKE_NOTE = "repeat 1: a single run is a smoke check, not a benchmark"
# ops that take no top-k/top-p: their rows leave those columns empty instead of echoing unused flags
_NO_FILTER_OPS = ("logp", "logp+backward", "linear_logp", "linear_logp+backward")


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def git_commit(root: Path | None = None) -> str:
    """HEAD of the checkout rlkernel was imported from; empty when that is not a git checkout."""
    root = root or Path(rlkernel.__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def context_columns(node: dict, device: dict, command: str, commit: str) -> dict:
    """The columns every row of one run shares: the device, the software, the command."""
    return {
        "gpu_name": device["name"], "gpu_architecture": device["architecture"], "gpu_backend": device["backend"],
        "gpu_compute_capability": device["compute_capability"], "gpu_device_index": device["index"],
        "gpu_physical_index": device["physical_index"], "driver": node["driver"],
        "cuda_runtime": node["cuda_runtime"], "torch": node["torch"], "python": node["python"],
        "rlkernel_version": rlkernel.__version__, "git_commit": commit, "command": command,
    }


def make_row(*, workload: Workload, shape: Shape, dtype: torch.dtype, warmup: int, repeat: int, status: str,
             dispatch: str, notes: list[str], stats: Stats | None, peak_memory: int | None,
             bandwidth: int | None, context: dict) -> dict:
    """One row. Timing columns are filled only for a row that was timed (status ``pass``)."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    eff = workload.effective_shape(shape)
    nbytes = workload.bytes_moved(shape, dtype)
    filters = workload.op not in _NO_FILTER_OPS and not workload.own_settings
    notes = list(notes)
    if workload.own_settings:
        notes.append("top_k / top_p / temperature empty: the workload sets its own per row")
    latency = p20 = p80 = tps = gbps = pct = None
    if stats is not None:
        latency, p20, p80 = stats.median_ms, stats.p20_ms, stats.p80_ms
        seconds = latency / 1e3
        if seconds > 0:
            tps = eff.rows / seconds
            gbps = nbytes / seconds / 1e9
            if bandwidth:
                pct = 100.0 * nbytes / seconds / bandwidth
            else:
                notes.append("pct_of_peak_bandwidth empty: no theoretical memory bandwidth known for this device")
        else:
            notes.append("median latency below the clock's resolution: no rates")
        if repeat == 1:
            notes.append(SMOKE_NOTE)
    row = {
        "timestamp": utc_now(), "workload": workload.name, "op": workload.op, "batch_size": eff.batch_size,
        "seq_len": eff.seq_len, "vocab_size": eff.vocab_size, "dtype": dtype_name(dtype),
        "top_k": eff.top_k if filters else None, "top_p": eff.top_p if filters else None,
        "temperature": None if workload.own_settings else eff.temperature, "total_tokens": eff.rows,
        "warmup": warmup, "repeat": repeat,
        "latency_ms": latency, "latency_p20_ms": p20, "latency_p80_ms": p80, "tokens_per_sec": tps,
        "bytes_moved": nbytes, "achieved_gbps": gbps, "pct_of_peak_bandwidth": pct, "peak_memory_bytes": peak_memory,
        "status": status, "dispatch": dispatch, "notes": "; ".join(n for n in notes if n),
        **context,
    }
    assert tuple(row) == COLUMNS, "row columns drifted from COLUMNS"
    return row
