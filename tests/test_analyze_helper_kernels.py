"""Per-op helper kernels in the verdict (docs/contracts.md, section 3), on a copy of the committed `verdicts` H200
trace whose ranges and kernels are renamed in SQLite into the shapes linear_logp's ranges take:

* a fused `op.linear_logp.forward` (cuBLAS GEMM + the rlkernel_ kernel) reads fused, its GEMMs counted as helpers;
* the same GEMM inside `op.logp.forward` (an op without helpers) makes that range mixed;
* a native `op.linear_logp.forward` (a GEMM + PyTorch's gather) never reads fused;
* an `op.linear_logp_loss` running GEMMs only (no rlkernel_ kernel) is a fallback, not fused nor no-gpu-work;
* a training step's GEMM outside op ranges keeps its workload fused, as before.
"""
from __future__ import annotations

import fnmatch
import json
import pathlib
import shutil
import sqlite3

import pytest

from pipelines import analysis
from rlkernel import op_kernels
from tests.nsys_reference import DATA

pytestmark = pytest.mark.smoke

# cuBLAS names as nsys records them on Hopper/Ampere builds (short name, demangled name)
NVJET = ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT")
XMMA = ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_"
        "kernel__5x_cublas", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_"
        "execute_segment_k_off_kernel__5x_cublas")


def _string(con, value: str) -> int:
    row = con.execute("SELECT id FROM StringIds WHERE value = ?", (value,)).fetchone()
    if row:
        return row[0]
    new = con.execute("SELECT max(id) + 1 FROM StringIds").fetchone()[0]
    con.execute("INSERT INTO StringIds (id, value) VALUES (?, ?)", (new, value))
    return new


def _range_start(con, message: str, nth: int) -> tuple[int, int]:
    """(start, end) of the nth (1-based, in start order) push/pop range with this message."""
    rows = con.execute('SELECT e.start, e."end" FROM NVTX_EVENTS AS e JOIN StringIds AS s ON s.id = e.textId '
                       "WHERE e.eventType = 59 AND s.value = ? ORDER BY e.start", (message,)).fetchall()
    return rows[nth - 1]


def _edit_range(con, start: int, *, message: str | None = None, new_start: int | None = None) -> None:
    if message is not None:
        con.execute("UPDATE NVTX_EVENTS SET textId = ? WHERE eventType = 59 AND start = ?",
                    (_string(con, message), start))
    if new_start is not None:
        con.execute("UPDATE NVTX_EVENTS SET start = ? WHERE eventType = 59 AND start = ?", (new_start, start))


def _rename_kernels(con, lo: int, hi: int, short_like: str, name: tuple[str, str]) -> int:
    """Rename the kernels launched in [lo, hi] whose short name is LIKE short_like; returns how many."""
    ids = [r[0] for r in con.execute(
        "SELECT k.rowid FROM CUPTI_ACTIVITY_KIND_KERNEL AS k JOIN StringIds AS s ON s.id = k.shortName "
        "JOIN CUPTI_ACTIVITY_KIND_RUNTIME AS r ON r.correlationId = k.correlationId "
        "WHERE r.start >= ? AND r.\"end\" <= ? AND s.value LIKE ?", (lo, hi, short_like))]
    ids = sorted(set(ids))
    short, demangled = _string(con, name[0]), _string(con, name[1])
    for rid in ids:
        con.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET shortName = ?, demangledName = ? WHERE rowid = ?",
                    (short, demangled, rid))
    return len(ids)


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("helpers") / "verdicts"
    shutil.copytree(DATA / "verdicts", d, ignore=shutil.ignore_patterns("stats_*.csv"))
    con = sqlite3.connect(d / "trace.sqlite")
    step1, _ = _range_start(con, "grpo-step", 1)
    step2, _ = _range_start(con, "grpo-step", 2)
    # grpo-step #1: its op.logp.forward opened before the step's GEMM, renamed op.linear_logp.forward
    fwd1, _ = _range_start(con, "op.logp.forward", 4)
    fwd2, _ = _range_start(con, "op.logp.forward", 5)
    _edit_range(con, fwd1, message="op.linear_logp.forward", new_start=step1 + 1)
    # grpo-step #2: the same for op.logp.forward, which declares no helpers
    _edit_range(con, fwd2, new_start=step2 + 1)
    # logp-native's op range becomes a native linear_logp: its softmax kernel renamed to a cuBLAS GEMM
    nat, nat_end = _range_start(con, "op.logp.forward", 3)
    assert _rename_kernels(con, nat, nat_end, "cunn_SoftMax%", NVJET) == 1
    _edit_range(con, nat, message="op.linear_logp.forward")
    # logp-fused #1's op range (ATen kernels) becomes a linear_logp_loss running GEMMs alone
    loss, loss_end = _range_start(con, "op.logp.forward", 1)
    assert _rename_kernels(con, loss, loss_end, "%", XMMA) == 2
    _edit_range(con, loss, message="op.linear_logp_loss")
    con.commit()
    con.close()
    m = json.loads((d / "manifest.json").read_text())
    for w in m["workloads"]:
        if w["name"] == "logp-fused":
            w["fused_ops"] = ["logp.forward", "linear_logp_loss"]
    (d / "manifest.json").write_text(json.dumps(m))
    return d


def rows(res):
    d = res.tables["dispatch"]
    return [(r.level, r.range, int(r.instance), r.verdict, int(r.fused_kernels), int(r.other_kernels),
             int(r.helper_kernels)) for r in d.itertuples(index=False)]


EXPECTED = [
    # logp-fused #1: its required op.linear_logp_loss ran two GEMMs and nothing of ours: a fallback
    ("workload", "rlkernel:logp-fused", 1, "fallback", 0, 2, 0),
    ("op", "rlkernel:op.linear_logp_loss", 1, "fallback", 0, 0, 2),
    ("workload", "rlkernel:logp-fused", 2, "fused", 1, 0, 0),
    ("op", "rlkernel:op.logp.forward", 1, "fused", 1, 0, 0),
    # native linear_logp: a GEMM (a helper) and PyTorch's gather, no rlkernel_ kernel
    ("workload", "rlkernel:logp-native", 1, "native", 0, 2, 0),
    ("op", "rlkernel:op.linear_logp.forward", 1, "native", 0, 1, 1),
    # fused linear_logp: the step's GEMM (cutlass Kernel2 + cublasLt splitKreduce) and the rlkernel_ kernel
    ("workload", "rlkernel:grpo-step", 1, "fused", 2, 17, 0),
    ("op", "rlkernel:op.linear_logp.forward", 2, "fused", 1, 0, 2),
    ("op", "rlkernel:op.logp.backward", 1, "fused", 1, 0, 0),
    ("op", "rlkernel:op.sample", 1, "native", 0, 15, 0),
    # logp declares no helpers: the same GEMM inside its range makes it mixed, and the step with it
    ("workload", "rlkernel:grpo-step", 2, "mixed", 2, 17, 0),
    ("op", "rlkernel:op.logp.forward", 2, "mixed", 1, 2, 0),
    ("op", "rlkernel:op.logp.backward", 2, "fused", 1, 0, 0),
    ("op", "rlkernel:op.sample", 2, "native", 0, 15, 0),
    ("workload", ":bare-fused", 1, "fallback", 0, 2, 0),
]


def test_helper_kernels_count_only_inside_their_own_ops_range(case):
    m = json.loads((case / "manifest.json").read_text())
    res = analysis.analyze(analysis.Source(case / "trace.sqlite", case, m))
    assert rows(res) == EXPECTED
    assert analysis.failures(res) == [
        "workload rlkernel:logp-fused #1: fallback",
        "op rlkernel:op.linear_logp_loss #1 in rlkernel:logp-fused #1: fallback",
        "workload rlkernel:grpo-step #2: mixed",
        "op rlkernel:op.logp.forward #2 in rlkernel:grpo-step #2: mixed",
        "workload :bare-fused #1: fallback"]


def test_the_unedited_trace_has_no_helpers():
    res = analysis.analyze(analysis.Source(DATA / "verdicts" / "trace.sqlite"))
    assert set(res.tables["dispatch"]["helper_kernels"]) == {0}
    assert list(res.tables["dispatch"].columns[:8]) == analysis.COLUMNS["dispatch"][:8]


def test_helper_globs_match_cublas_names_and_no_pytorch_kernel():
    """The declared GEMM globs take the cuBLAS names above and the fixture's GEMM, and none of the PyTorch kernels
    the committed traces hold (softmax, gather, reductions, elementwise, RNG), nor our own."""
    globs = op_kernels.HELPER_GLOBS["linear_logp_loss"]

    def matched(short, demangled):
        return any(fnmatch.fnmatchcase(short, p) or fnmatch.fnmatchcase(demangled, p) for p in globs)

    assert matched(*NVJET) and matched(*XMMA)
    con = sqlite3.connect(f"file:{DATA / 'verdicts' / 'trace.sqlite'}?mode=ro", uri=True)
    names = con.execute("SELECT DISTINCT s.value, d.value FROM CUPTI_ACTIVITY_KIND_KERNEL AS k "
                        "JOIN StringIds AS s ON s.id = k.shortName JOIN StringIds AS d ON d.id = k.demangledName"
                        ).fetchall()
    con.close()
    gemm = {s for s, d in names if "cutlass" in d or "cublas" in d}
    assert gemm == {"Kernel2", "splitKreduce_kernel"}
    for short, demangled in names:
        assert matched(short, demangled) == (short in gemm), short


def test_helper_ops_are_dispatch_ops_and_the_analysis_reads_them_once():
    dispatch = pytest.importorskip("rlkernel.dispatch")
    assert "linear_logp_loss" in dispatch.OPS
    assert set(op_kernels.HELPER_GLOBS) <= set(dispatch.OPS)
    assert analysis.helper_globs() == op_kernels.helper_rows()
    assert all(op in op_kernels.HELPER_GLOBS for op, _ in op_kernels.helper_rows())
