"""The loop over workloads x shapes: one row per (workload, shape), each with an honest status.

- ``blocked``: a fused workload where its fused path cannot run (any CPU device, or ``--require-fused``
  on a GPU without it), or an op that raised ``FusedKernelUnavailable``; ``notes`` says why.
- ``fail``: a fused result that does not match native on the same inputs (checked once, before any
  timing, so a wrong kernel never gets a number), or any other error (its first line in ``notes``).
- ``oom``: out of memory anywhere in the row; the row's tensors are dropped and the next shape runs.
- ``pass``: timed. ``dispatch`` is the worst status the dispatcher recorded during the timed
  repetitions, so a fused workload that fell back reads ``pass`` + ``fallback`` + the reason.
"""
from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlkernel import dispatch
from rlkernel.profiling.rows import make_row
from rlkernel.profiling.timing import CacheFlusher, summarize, time_repetitions
from rlkernel.workloads import Shape, Workload, fused_available


@dataclass(frozen=True)
class SuiteConfig:
    device: torch.device
    dtype: torch.dtype
    batch_sizes: tuple[int, ...]
    seq_lens: tuple[int, ...]
    vocab_sizes: tuple[int, ...]
    workloads: tuple[Workload, ...]
    top_k: int = 50
    top_p: float = 0.9
    temperature: float = 1.0
    seed: int = 0
    warmup: int = 3
    repeat: int = 10
    require_fused: bool = False


def plan(cfg: SuiteConfig) -> list[tuple[Workload, Shape]]:
    """Every (workload, shape) to run. A workload that ignores seq_len gets one row per (batch, vocab)."""
    out = []
    for w in cfg.workloads:
        seq_lens = cfg.seq_lens if w.uses_seq_len else (1,)
        for b in cfg.batch_sizes:
            for s in seq_lens:
                for v in cfg.vocab_sizes:
                    out.append((w, Shape(b, s, v, cfg.top_k, cfg.top_p, cfg.temperature)))
    return out


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    # the CPU allocator raises a plain RuntimeError
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _fallback_notes(records) -> list[str]:
    return sorted({f"fallback: {r.op} ran native ({r.reason})" for r, _ in records if r.status == "fallback"})


def _free(device: torch.device, after_oom: bool) -> None:
    gc.collect()  # tensors held by reference cycles (e.g. an exception's frames) go now, not later
    if device.type == "cuda" and after_oom:
        torch.cuda.empty_cache()  # hand cached blocks back so the next shape starts from a clean pool


def blocked_reason(w: Workload, cfg: SuiteConfig) -> str | None:
    """Why a fused workload is not run at all here. On a GPU without the fused path it runs (and records
    ``fallback``) unless --require-fused; on a CPU a fused workload would only time native code under a fused name."""
    if w.path != "fused":
        return None
    reason = fused_available(w, cfg.device, cfg.dtype)
    if reason is None:
        return None
    if cfg.device.type != "cuda":
        return f"fused path cannot run here: {reason}"
    if cfg.require_fused:
        return f"fused path cannot run here: {reason} (required by --require-fused)"
    return None


def run_row(w: Workload, shape: Shape, cfg: SuiteConfig, flush: CacheFlusher, context: dict,
            bandwidth: int | None) -> dict:
    dev, dtype = cfg.device, cfg.dtype
    common = dict(workload=w, shape=shape, dtype=dtype, warmup=cfg.warmup, repeat=cfg.repeat, context=context,
                  bandwidth=bandwidth)
    reason = blocked_reason(w, cfg)
    if reason:
        return make_row(status="blocked", dispatch="blocked", notes=[reason], stats=None, peak_memory=None, **common)

    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
        baseline = torch.cuda.memory_allocated(dev)  # includes the flush buffer: not this row's memory
    status, notes, stats, peak, oom = "pass", [], None, None, False
    check_rec, timed_rec = dispatch.Recording(), None
    inputs = None
    try:
        inputs = w.make_inputs(shape, dtype, dev, cfg.seed)
        with dispatch.recording() as check_rec:
            mismatch = w.check(inputs)
        if mismatch:
            status, notes = "fail", [f"check against native failed: {mismatch}"]
        else:
            if cuda:  # the check's native reference is not this row's memory: count from the inputs on
                torch.cuda.reset_peak_memory_stats(dev)
            with dispatch.recording() as timed_rec:
                times = time_repetitions(lambda: w.repetition(inputs), device=dev, warmup=cfg.warmup,
                                         repeat=cfg.repeat, flush=flush)
            stats = summarize(times)
            if cuda:
                peak = torch.cuda.max_memory_allocated(dev) - baseline
            else:
                notes.append("peak_memory_bytes empty: not tracked on cpu")
    except dispatch.FusedKernelUnavailable as exc:  # strict mode from RLKERNEL_REQUIRE_FUSED=1
        status, notes = "blocked", [exc.reason]
    except Exception as exc:  # noqa: BLE001 - any error is this row's `fail`, the suite goes on
        oom = is_oom(exc)
        status, notes = ("oom" if oom else "fail"), [first_line(exc)]
    inputs = None  # noqa: F841 - drop the row's tensors before the next shape allocates its own
    _free(dev, oom)

    records = (timed_rec or check_rec).records
    if status == "blocked":
        verdict = "blocked"
    else:
        verdict = dispatch.worst(r.status for r, _ in records) or ""
    notes = _fallback_notes(records) + notes
    if status == "pass" and cfg.require_fused and w.path == "fused" and verdict != "fused":
        notes.append(f"--require-fused: dispatch was {verdict}, not fused")
    return make_row(status=status, dispatch=verdict, notes=notes, stats=stats if status == "pass" else None,
                    peak_memory=peak, **common)


def run_suite(cfg: SuiteConfig, context: dict, bandwidth: int | None,
              on_row: Callable[[int, int, dict], None] | None = None) -> list[dict]:
    flush = CacheFlusher(cfg.device)
    todo = plan(cfg)
    rows = []
    for i, (w, shape) in enumerate(todo, 1):
        row = run_row(w, shape, cfg, flush, context, bandwidth)
        rows.append(row)
        if on_row:
            on_row(i, len(todo), row)
    return rows


def exit_status(rows: list[dict], cfg: SuiteConfig) -> str:
    """``ok``, ``failed`` (a fail row, or under --require-fused a fused row that ran but not fused, or that ran out
    of memory: nothing proved at that shape) or ``blocked``."""
    fused = fused_rows(rows, cfg)
    if any(r["status"] == "fail" for r in rows):
        return "failed"
    if cfg.require_fused and any(r["status"] == "pass" and r["dispatch"] != "fused" or r["status"] == "oom"
                                 for r in fused):
        return "failed"
    if cfg.require_fused and any(r["status"] == "blocked" for r in fused):
        return "blocked"
    return "ok"


def fused_rows(rows: list[dict], cfg: SuiteConfig) -> list[dict]:
    """The rows of the run's fused workloads."""
    fused = {w.name for w in cfg.workloads if w.path == "fused"}
    return [r for r in rows if r["workload"] in fused]
