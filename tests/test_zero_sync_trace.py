"""The zero-sync contract proved from a real trace (docs/contracts.md, sections 1 and 3): a capture made on the
H200 of logp-fused, logp-fused-bwd, sampling-fused and grpo-step (tests/data/zero_sync/README.md says how), stripped.

Inside every repetition of the three single-op workloads and every fused op range of grpo-step, the range's thread
makes no synchronising CUDA call (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, synchronous
cudaMemcpy/cudaMemset), the export has no CUPTI_ACTIVITY_KIND_SYNCHRONIZATION row for a call of that thread in it,
no device-to-host copy is issued in it, and (inside op ranges) no memset. This sees raw CUDA calls made in csrc/,
which torch.cuda.set_sync_debug_mode does not.
"""
from __future__ import annotations

import json
import pathlib
import sqlite3
from collections import Counter

DATA = pathlib.Path(__file__).parent / "data" / "zero_sync"
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemset")
SINGLE_OP = ("logp-fused", "logp-fused-bwd", "sampling-fused")
DTOH = 2  # ENUM_CUDA_MEMCPY_OPER: CUDA_MEMCPY_OPER_DTOH


def _ranges(db):
    """(start, end, thread, message) of every closed push/pop or start/end NVTX range."""
    return db.execute("""
        SELECT n.start, n."end", n.globalTid, coalesce(n.text, s.value)
        FROM NVTX_EVENTS n LEFT JOIN StringIds s ON s.id = n.textId
        WHERE n.eventType IN (59, 60) AND n."end" IS NOT NULL""").fetchall()


def _calls(db):
    """(start, end, thread, base name, is a DtoH copy, is a memset, has a SYNCHRONIZATION row) per runtime call."""
    return db.execute(f"""
        SELECT r.start, r."end", r.globalTid,
               CASE WHEN instr(s.value, '_v') > 0 THEN substr(s.value, 1, instr(s.value, '_v') - 1) ELSE s.value END,
               EXISTS (SELECT 1 FROM CUPTI_ACTIVITY_KIND_MEMCPY m
                       WHERE m.correlationId = r.correlationId AND m.copyKind = {DTOH}),
               EXISTS (SELECT 1 FROM CUPTI_ACTIVITY_KIND_MEMSET m WHERE m.correlationId = r.correlationId),
               EXISTS (SELECT 1 FROM CUPTI_ACTIVITY_KIND_SYNCHRONIZATION y WHERE y.correlationId = r.correlationId)
        FROM CUPTI_ACTIVITY_KIND_RUNTIME r JOIN StringIds s ON s.id = r.nameId""").fetchall()


def violations(path) -> tuple[Counter, Counter]:
    """(what each checked range holds that it must not, {checked range message: instances})."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    ranges, calls = _ranges(db), _calls(db)
    grpo = [(s, e, t) for s, e, t, m in ranges if m == "grpo-step"]
    checked = [(s, e, t, m) for s, e, t, m in ranges
               if m in SINGLE_OP or (m.startswith("op.") and any(gs <= s and e <= ge and gt == t
                                                                  for gs, ge, gt in grpo))]
    found, seen = Counter(), Counter(m for *_, m in checked)
    for s, e, t, m in checked:
        for cs, ce, ct, name, dtoh, memset, sync_row in calls:
            if ct != t or cs < s or ce > e:
                continue
            if name in SYNC_CALLS:
                found[(m, name)] += 1
            if dtoh:
                found[(m, "device-to-host copy")] += 1
            if sync_row:
                found[(m, "SYNCHRONIZATION row")] += 1
            if memset and m.startswith("op."):
                found[(m, "memset")] += 1
    return found, seen


def test_fixture_is_the_four_workloads_fused():
    manifest = json.loads((DATA / "manifest.json").read_text())
    assert [w["name"] for w in manifest["workloads"]] == [*SINGLE_OP, "grpo-step"]
    statuses = {(d["op"], d["status"]) for d in manifest["dispatch"]}
    assert statuses == {("logp.forward", "fused"), ("logp.backward", "fused"), ("sample", "fused")}


def test_fused_ranges_hold_no_host_sync_copy_back_or_memset():
    found, seen = violations(DATA / "trace.sqlite")
    # every checked kind of range is there, so "no violation" is not vacuous
    assert all(seen[m] == 3 for m in SINGLE_OP), seen
    assert seen["op.logp.forward"] > 0 and seen["op.logp.backward"] > 0 and seen["op.sample"] > 0, seen
    assert found == Counter()


def test_the_check_finds_the_sync_of_the_old_fused_path():
    # the bundled example as it was before the zero-sync change: each logp-fused repetition read the bad-id flag
    # back (a device-to-host copy and a cudaStreamSynchronize after the op range)
    found, seen = violations(pathlib.Path(__file__).parent / "data" / "example_with_sync" / "trace.sqlite")
    assert seen["logp-fused"] > 0
    assert found[("logp-fused", "cudaStreamSynchronize")] > 0 and found[("logp-fused", "device-to-host copy")] > 0
