"""The RL-step view (issue 35): `analyze --phase / --step-range`, steps.csv, phases.csv, the headline.

Three kinds of input: a tiny export written here in nsys's schema whose kernels overlap (the busy time is an
interval union, checked against numbers worked out by hand); the verl-style H200 fixture (tests/data/verl_ranges)
with --phase, against the `nsys stats` / `nsys analyze` CSVs beside it; and a command captured on the CPU under
tests/fake_nsys.py (its rlkernel.phase / rlkernel.step ranges, no GPU work). The real H200 captures
(tests/data/capture_*/, when present) are compared with their NVIDIA CSVs the same way.
"""
from __future__ import annotations

import csv
import pathlib
import sqlite3
import subprocess
import sys

import pandas as pd
import pytest

from pipelines import analysis, analyze, durations, phase_view
from rlkernel import op_kernels
from rlkernel.cli import EXIT_OK, EXIT_USAGE
from tests.nsys_reference import DATA, check_against_nvidia, nvidia, nvtx_instances
from tests.subprocess_env import pythonpath

ROOT = pathlib.Path(__file__).resolve().parent.parent
PID, TID = 100, 100
GTID, GPID = (PID << 24) | TID, PID << 24


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---- a synthetic export: overlapping kernels ------------------------------------------------------------------

def synthetic(path: pathlib.Path) -> pathlib.Path:
    """One step [0, 1000] (payload 7) holding rollout [100, 400] and loss [500, 900] in domain rlkernel.
    rollout launches kernels [200, 300] and [250, 350] (overlapping) and [400, 420] (after the phase closed):
    busy 170 ns of 220 ns kernel time. loss launches a log_softmax kernel [600, 700] and a GEMM [620, 650]
    inside it (busy 100 ns) and calls cudaStreamSynchronize [800, 850]. A kernel launched after the step counts
    nowhere."""
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    con.execute("CREATE TABLE META_DATA_EXPORT (name TEXT, value TEXT)")
    con.execute("INSERT INTO META_DATA_EXPORT VALUES ('EXPORT_PRODUCT_NAME', 'synthetic')")
    con.execute("CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, "
                "text TEXT, globalTid INTEGER, endGlobalTid INTEGER, textId INTEGER, domainId INTEGER, "
                "int64Value INTEGER)")
    con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, deviceId INTEGER, "
                "streamId INTEGER, correlationId INTEGER, globalPid INTEGER, demangledName INTEGER, "
                "shortName INTEGER)")
    con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER, end INTEGER, globalTid INTEGER, "
                "correlationId INTEGER, nameId INTEGER)")
    strings = ["phase:step", "phase:rollout", "phase:loss", "elementwise_kernel", "cunn_SoftMaxForward",
               "void cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>(float *, float *, int)",
               "sm90_xmma_gemm_bf16", "cudaLaunchKernel_v7000", "cudaStreamSynchronize_v3020"]
    sid = {s: i + 1 for i, s in enumerate(strings)}
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", [(i, s) for s, i in sid.items()])
    con.execute("INSERT INTO NVTX_EVENTS (start, eventType, text, globalTid, domainId) VALUES (0, 75, 'rlkernel', "
                "?, 1)", (GTID,))
    for name, start, end, payload in (("phase:step", 0, 1000, 7), ("phase:rollout", 100, 400, None),
                                      ("phase:loss", 500, 900, None)):
        con.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, globalTid, textId, domainId, int64Value) "
                    "VALUES (?, ?, 59, ?, ?, 1, ?)", (start, end, GTID, sid[name], payload))
    ew, sm, gemm = sid["elementwise_kernel"], sid["cunn_SoftMaxForward"], sid["sm90_xmma_gemm_bf16"]
    smd = sid[strings[5]]
    kernels = [  # (corr, launch start, start, end, short, demangled)
        (1, 110, 200, 300, ew, ew), (2, 120, 250, 350, ew, ew), (3, 130, 400, 420, ew, ew),
        (4, 510, 600, 700, sm, smd), (5, 520, 620, 650, gemm, gemm), (6, 1100, 1200, 1300, ew, ew)]
    for corr, launch, start, end, short, dem in kernels:
        con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, ?, ?, ?, ?, ?)",
                    (start, end, 7 + corr % 2, corr, GPID, dem, short))
        con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, ?, ?, ?)",
                    (launch, launch + 5, GTID, corr, sid["cudaLaunchKernel_v7000"]))
    con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (800, 850, ?, 99, ?)",
                (GTID, sid["cudaStreamSynchronize_v3020"]))
    con.commit()
    con.close()
    return path


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return synthetic(tmp_path_factory.mktemp("phases") / "synthetic.sqlite")


def test_busy_time_is_the_union_of_overlapping_kernels(synth):
    res = analysis.analyze(analysis.Source(synth), phases=[])
    steps, phases = res.tables["steps"], res.tables["phases"].set_index("name")
    assert len(steps) == 1
    s = steps.iloc[0]
    assert (s.step, s.wall_ns, s.gpu_busy_ns, s.kernel_ns, s.gpu_idle_ns, s.host_syncs) == (7, 1000, 270, 350, 730, 1)
    assert s.busy_pct == 27.0 and (s.pct_rollout, s.pct_loss) == (30.0, 40.0)
    assert list(steps.columns[-2:]) == ["pct_rollout", "pct_loss"]  # in the order the phases ran
    r, lo = phases.loc["rollout"], phases.loc["loss"]
    assert (r.instances, r.total_ns, r.gpu_busy_ns, r.proj_total_ns, r.gpu_ops) == (1, 300, 170, 220, 3)
    assert r.longest_gaps == "50 ns in #1"  # [350, 400]: between the union and the late kernel
    assert (lo.gpu_busy_ns, lo.host_syncs, lo.step_share_pct, lo.busy_pct) == (100, 1, 40.0, 25.0)
    assert lo.sync_calls == "cudaStreamSynchronize_v3020 (cuda_api_sync) x1"
    assert lo.top_kernels == "cunn_SoftMaxForward 100 ns; sm90_xmma_gemm_bf16 30 ns"
    assert (lo.logprob_by, lo.logprob_ns) == ("PyTorch log_softmax", 100)
    assert pd.isna(r.logprob_by)
    assert res.phase_view.headline == ("GPU busy 27 % of the step; loss 40 % of wall time, host-bound "
                                       "(1 syncs/step); log-probs: PyTorch log_softmax, 100 ns/step")
    tl = res.phase_view.timeline
    assert set(tl["workload"]) == {"step 7"} and set(tl.loc[tl.kind == "range", "label"]) == {
        "rlkernel:phase:step", "rlkernel:phase:rollout", "rlkernel:phase:loss"}


def test_without_the_option_the_view_is_left_out_and_the_cli_writes_it(synth, tmp_path, capsys):
    assert analysis.analyze(analysis.Source(synth)).phase_view is None  # --ranks, library callers
    out = tmp_path / "rep"
    assert analyze.main([str(synth), "--out", str(out)]) == EXIT_OK
    said = capsys.readouterr().out
    assert "  GPU busy 27 % of the step; loss 40 % of wall time" in said
    assert {"steps.csv", "phases.csv"} <= {p.name for p in out.iterdir()}
    assert read_csv(out / "steps.csv")[0]["gpu_busy_ns"] == "270"
    assert [r["name"] for r in read_csv(out / "phases.csv")] == ["step", "rollout", "loss"]
    html = (out / "report.html").read_text()
    assert html.index("Where a training step goes") < html.index("<h2>Environment</h2>")
    assert "GPU busy 27 % of the step" in html and "step 7</strong>: the step with the median wall span" in html


def test_no_step_view_leaves_the_view_out_and_takes_no_phase(synth, tmp_path, capsys):
    assert analyze.main([str(synth), "--out", str(tmp_path / "r"), "--no-step-view"]) == EXIT_OK
    assert not (tmp_path / "r" / "steps.csv").exists() and not (tmp_path / "r" / "phases.csv").exists()
    assert "GPU busy " not in capsys.readouterr().out
    assert analyze.main([str(synth), "--out", str(tmp_path / "s"), "--no-step-view", "--phase", "rollout"]) == \
        EXIT_USAGE
    assert "--no-step-view leaves the RL-step view out" in capsys.readouterr().err and not (tmp_path / "s").exists()


def test_step_range_names_another_range_and_bad_names_exit_2(synth, tmp_path, capsys):
    res = analysis.analyze(analysis.Source(synth), phases=[], step_range="phase:loss")
    steps = res.tables["steps"]
    assert list(steps["range"]) == ["rlkernel:phase:loss"] and list(steps["gpu_busy_ns"]) == [100]
    assert "pct_rollout" not in steps.columns  # rollout lies outside the loss "step"
    for flag in ("--phase", "--step-range"):
        assert analyze.main([str(synth), "--out", str(tmp_path / "x"), flag, "phase:rolout"]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert f"{flag} phase:rolout: no such range in the input; closest: phase:rollout" in err
    assert not (tmp_path / "x").exists()


def test_logprob_families_are_data_beside_the_helper_globs():
    fams = [f for f, _ in op_kernels.LOGPROB_FAMILIES]
    assert fams[0] == "rlkernel fused" and {"Liger", "TRL chunked", "PyTorch log_softmax",
                                            "PyTorch cross-entropy"} <= set(fams)
    assert all(pats for _, pats in op_kernels.LOGPROB_FAMILIES)
    assert op_kernels.logprob_rows()[0] == (0, "rlkernel fused", "rlkernel_logp_*")


# ---- the verl-style H200 fixture, against nsys's own CSVs -----------------------------------------------------

VERL_PHASES = ["gen", "old_log_prob", "ref", "update_actor", "optimizer", "worker"]


def test_verl_phases_equal_nsys():
    case = DATA / "verl_ranges"
    res = analysis.analyze(analysis.Source(case / "trace.sqlite"), phases=VERL_PHASES, step_range="verl:step")
    check_against_nvidia(case, res)
    phases = res.tables["phases"].set_index("name")
    assert list(phases.index) == ["step", "gen", "old_log_prob", "ref", "update_actor", "optimizer", "worker"]
    # update_actor's first instance holds the gap gpu_gaps finds second longest (the longest is before the steps):
    # the same number, and it lies inside that instance
    rule = nvidia(case, "rules_gpu_gaps").sort_values("Duration (ns)", ascending=False).iloc[1]
    assert phases.loc["update_actor", "longest_gaps"].startswith(f"{rule['Duration (ns)']} ns in #1")
    ua = nvtx_instances(case / "trace.sqlite").query("range == 'verl:update_actor'").sort_values("start").iloc[0]
    assert ua.start <= rule["Start (ns)"] <= ua.end
    steps = res.tables["steps"]
    assert list(steps["step"]) == [0, 1, 2] and (steps["gpu_busy_ns"] <= steps["wall_ns"]).all()
    # the steps' busy time: the union per step is at most their projections, and the kernels alone
    assert steps["gpu_busy_ns"].sum() <= phases.loc["step", "proj_total_ns"]
    assert steps["host_syncs"].sum() == phases.loc["step", "host_syncs"] == 3
    assert steps["dtoh_copies"].sum() == phases.loc["step", "dtoh_copies"] <= \
        nvidia(case, "stats_cuda_gpu_mem_time_sum")["Count"].sum()
    assert "worker" not in steps.columns and "pct_worker" not in steps.columns  # the worker thread's range


CAPTURES = sorted(p for p in DATA.glob("capture_*") if (p / "trace.sqlite").is_file())


@pytest.mark.skipif(not CAPTURES, reason="no tests/data/capture_*/ fixtures (real H200 captures) here yet")
@pytest.mark.parametrize("case", CAPTURES, ids=lambda p: p.name)
def test_real_captures_phases_equal_nsys(case):
    res = analysis.analyze(analysis.Source(case / "trace.sqlite"), phases=[])
    assert res.phase_view is not None, "a capture of a job marked with rlkernel.phase/step"
    check_against_nvidia(case, res)
    assert res.phase_view.headline.startswith("GPU busy ")


# ---- a command captured on the CPU: the phases' plumbing ------------------------------------------------------

JOB = """
import rlkernel

for i in range(3):
    with rlkernel.step(index=10 + i):
        with rlkernel.phase("rollout"):
            sum(range(200000))
        with rlkernel.phase("loss"):
            with rlkernel.phase("policy_forward"):
                pass
"""


def test_a_captured_command_gives_steps_and_phases(tmp_path):
    pytest.importorskip("duckdb")
    import os

    from tests import fake_nsys, nvtx_log

    env = dict(os.environ, PATH=f"{fake_nsys.install(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}",
               FAKE_NSYS_NVTX_LIB=str(nvtx_log.library(tmp_path)),
               PYTHONPATH=pythonpath())
    for var in ("NSYS", "FAKE_NSYS_FAIL", "FAKE_NSYS_NO_REP", "FAKE_NSYS_EXPORT_FAIL", "RLKERNEL_CAPTURE_STEPS"):
        env.pop(var, None)
    (tmp_path / "job.py").write_text(JOB)
    proc = subprocess.run([sys.executable, "-m", "pipelines.capture", "--output-dir", str(tmp_path / "runs"), "--",
                           sys.executable, str(tmp_path / "job.py")], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (run,) = (tmp_path / "runs").iterdir()
    proc = subprocess.run([sys.executable, "-m", "pipelines.analyze", str(run)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "  GPU busy 0 % of the step (3 steps); rollout " in proc.stdout
    assert "log-probs: no log-prob kernels seen" in proc.stdout
    steps = read_csv(run / "report" / "steps.csv")
    assert [s["step"] for s in steps] == ["10", "11", "12"]
    phases = {p["name"]: p for p in read_csv(run / "report" / "phases.csv")}
    assert list(phases) == ["step", "rollout", "loss", "policy_forward"]
    for s in steps:
        assert s["gpu_busy_ns"] == "0" and s["gpu_idle_ns"] == s["wall_ns"] and s["host_syncs"] == "0"
        shares = [float(s[f"pct_{n}"]) for n in ("rollout", "loss", "policy_forward")]
        assert 0 < shares[0] < 100 and shares[2] <= shares[1] and shares[0] + shares[1] <= 100
    for name in ("rollout", "loss", "policy_forward"):
        p = phases[name]
        assert p["instances"] == "3" and p["gpu_busy_ns"] == "0" and float(p["step_share_pct"]) > 0
    wall = sum(int(s["wall_ns"]) for s in steps)
    assert int(phases["step"]["total_ns"]) == wall and phases["step"]["step_share_pct"] == "100.0"
    rollout = sum(float(s["pct_rollout"]) * int(s["wall_ns"]) for s in steps) / wall
    assert abs(rollout - float(phases["rollout"]["step_share_pct"])) < 0.05


def test_phase_specs_match_like_range():
    distinct = pd.DataFrame({"range": ["rlkernel:phase:step", "rlkernel:phase:rollout", "verl:gen", ":gen"],
                             "domain": ["rlkernel", "rlkernel", "verl", ""],
                             "message": ["phase:step", "phase:rollout", "gen", "gen"]})
    assert phase_view.phase_specs(distinct, [], None) == [("rlkernel:phase:step", "step", True),
                                                          ("rlkernel:phase:rollout", "rollout", False)]
    got = phase_view.phase_specs(distinct, ["gen"], "rollout")
    assert got == [("rlkernel:phase:step", "step", False), ("rlkernel:phase:rollout", "rollout", True),
                   ("verl:gen", "gen", False), (":gen", ":gen", False)]
    with pytest.raises(phase_view.PhaseError, match="--phase nope: no such range in the input"):
        phase_view.phase_specs(distinct, ["nope"], None)


def test_op_verdicts_and_the_rlkernel_logprob_paths_inside_phases():
    """tests/data/verdicts (H200): workload ranges named as phases hold rlkernel op ranges of both paths; their
    kernels count as rlkernel fused or native by the op range's verdict, whatever their names."""
    from pipelines import inputs

    res = analysis.analyze(inputs.resolve(DATA / "verdicts"), phases=["logp-fused", "logp-native", "grpo-step"])
    check_against_nvidia(DATA / "verdicts", res)
    p = res.tables["phases"].set_index("name")
    assert p.loc["logp-native", "op_verdicts"] == "rlkernel:op.logp.forward native x1"
    assert p.loc["logp-native", "logprob_by"] == "rlkernel native"
    assert p.loc["grpo-step", "op_verdicts"] == ("rlkernel:op.logp.backward fused x2; rlkernel:op.logp.forward "
                                                 "fused x2; rlkernel:op.sample native x2")
    assert p.loc["grpo-step", "logprob_by"] == "rlkernel fused"
    d = res.tables["dispatch"]
    ops = d[(d["level"] == "op") & d["range"].str.startswith("rlkernel:op.logp.") & (d["in_workload"] ==
                                                                                     "rlkernel:grpo-step")]
    assert p.loc["grpo-step", "logprob_ns"] == ops["kernel_ns"].sum() > 0  # the log-prob op ranges' kernels
    assert res.tables["steps"].empty and res.phase_view.headline == ""  # phases, but no step range


TORCHRUN = DATA / "capture_torchrun"


@pytest.fixture(scope="module")
def torchrun_ranks(tmp_path_factory):
    """`analyze --ranks` on the committed torchrun capture (H200: one export, 2 processes): its report folder and
    terminal output."""
    if not (TORCHRUN / "trace.sqlite").is_file():
        pytest.skip("no tests/data/capture_torchrun")
    out = tmp_path_factory.mktemp("ranks") / "r"
    proc = subprocess.run([sys.executable, "-m", "pipelines.analyze", "--ranks", str(TORCHRUN), "--out", str(out),
                           "--jobs", "1"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out, proc.stdout


def test_per_rank_phases_add_up_to_nvidias_numbers_for_the_whole_export(torchrun_ranks):
    """Each rank's phases.csv rows (a map step per process), summed over the ranks, equal nsys stats and the sync
    rules on the whole export; every rank's steps are push/pop instances of it."""
    out, _ = torchrun_ranks
    phases, steps = pd.read_csv(out / "phases.csv"), pd.read_csv(out / "steps.csv")
    assert sorted(set(phases["rank"])) == [0, 1] and list(steps.groupby("rank").size()) == [3, 3]
    assert list(steps.columns[:2]) == ["rank", "step"] and list(steps["step"]) == [0, 1, 2, 0, 1, 2]
    summed = phases.groupby("phase", sort=False).agg(
        name=("name", "first"), instances=("instances", "sum"), total_ns=("total_ns", "sum"),
        proj_total_ns=("proj_total_ns", "sum"), gpu_ops=("gpu_ops", "sum"), host_syncs=("host_syncs", "sum"),
        longest_gaps=("longest_gaps", lambda g: "; ".join(g.dropna()) or None)).reset_index()
    assert summed["host_syncs"].sum() > 0 and summed["gpu_ops"].sum() > 0
    check_against_nvidia(TORCHRUN, type("Res", (), {"tables": {"phases": summed, "steps": steps}}))


def test_the_cross_rank_phase_table_and_the_per_rank_headlines(torchrun_ranks):
    out, stdout = torchrun_ranks
    phases = pd.read_csv(out / "phases.csv")
    cross = pd.read_csv(out / "phases_cross_rank.csv")
    assert list(dict.fromkeys(cross["name"])) == list(dict.fromkeys(phases["name"]))  # phases.csv's order
    assert len(cross) == 2 * cross["name"].nunique() and list(cross["rank"][:2]) == [0, 1]
    mine = cross.merge(phases, on=["name", "rank"], suffixes=("", "_rank"))
    assert (mine["total_ns"] == mine["total_ns_rank"]).all() and (mine["gpu_busy_ns"] ==
                                                                  mine["gpu_busy_ns_rank"]).all()
    for name, g in cross.groupby("name"):
        slow = g.sort_values(["total_ns", "rank"], ascending=[False, True]).iloc[0]
        assert (g["slowest_rank"] == slow["rank"]).all(), name
        assert g["spread"].iloc[0] == round(g["total_ns"].max() / g["total_ns"].median(), 4), name
        if g["gpu_busy_ns"].max() > 0:
            assert g["busy_imbalance"].iloc[0] == round(g["gpu_busy_ns"].max() / g["gpu_busy_ns"].median(), 4)
    lines = stdout.splitlines()
    for rank in (0, 1):
        (line,) = [ln for ln in lines if ln.startswith(f"  rank {rank}: GPU busy ")]
        assert "(3 steps)" in line and "log-probs: rlkernel fused" in line
    assert any(ln.startswith("  phase ") and "per rank in phases_cross_rank.csv" in ln for ln in lines)
    html = (out / "report.html").read_text()
    assert "RL phases across ranks" in html and "rank 1: GPU busy " in html


def test_ranks_with_a_phase_or_step_range_no_rank_has_is_a_usage_error(tmp_path, capsys):
    if not (TORCHRUN / "trace.sqlite").is_file():
        pytest.skip("no tests/data/capture_torchrun")
    for flag in ("--phase", "--step-range"):
        out = tmp_path / flag.strip("-")
        assert analyze.main(["--ranks", str(TORCHRUN), "--out", str(out), "--jobs", "1", flag, "rolout"]) == \
            EXIT_USAGE
        assert f"{flag} rolout: no such range in any rank; closest: " in capsys.readouterr().err
        assert not out.exists()


def test_ranks_with_phase_names_a_range_as_a_phase(tmp_path):
    """--phase with --ranks: an op range named as a phase is one on every rank."""
    if not (TORCHRUN / "trace.sqlite").is_file():
        pytest.skip("no tests/data/capture_torchrun")
    assert analyze.main(["--ranks", str(TORCHRUN), "--out", str(tmp_path / "r"), "--jobs", "1", "--phase",
                         "op.sample"]) == EXIT_OK
    phases = pd.read_csv(tmp_path / "r" / "phases.csv")
    rows = phases[phases["phase"] == "rlkernel:op.sample"]
    assert list(rows["rank"]) == [0, 1] and (rows["instances"] > 0).all()


def test_the_trl_capture_names_trls_chunked_logprob_kernels():
    """tests/data/capture_trl (H200, TRL 1.16 GRPOTrainer, no rlkernel swap): the log-probs of every phase that
    computes them are TRL's Triton `_forward_kernel`; attention's plain softmax_warp_forward (is_log_softmax 0) is
    not a log-prob kernel."""
    case = DATA / "capture_trl"
    if not (case / "trace.sqlite").is_file():
        pytest.skip("no tests/data/capture_trl")
    res = analysis.analyze(analysis.Source(case / "trace.sqlite"), phases=[])
    p = res.tables["phases"].set_index("name")
    ref = nvidia(case, "stats_nvtx_kern_sum")
    fwd = ref[ref["Kernel Name"] == "_forward_kernel"].groupby("NVTX Range")["Total Time (ns)"].sum()
    for name in ("old_logprob", "reference_logprob", "policy_forward", "step"):
        assert p.loc[name, "logprob_by"] == "TRL chunked", name
        assert p.loc[name, "logprob_ns"] == fwd[f"rlkernel:phase:{name}"], name
    assert pd.isna(p.loc["rollout", "logprob_by"])  # generation: attention softmax only
    assert res.phase_view.headline.endswith(f"log-probs: TRL chunked, {fwd['rlkernel:phase:step'] / 1e3:.3g} µs/step")


LIGER = DATA / "capture_liger"
LIGER_KERNELS = {  # tools/traces/liger_job.py's phases -> the Liger kernels nsys names in them (Triton functions)
    "liger_flce": ("liger_cross_entropy_kernel*", "element_mul_kernel*"),
    "liger_selective_logprob": ("_selective_log_softmax_kernel*",),
    "liger_grpo_loss": ("_grpo_loss_fwd_kernel*", "_grpo_loss_bwd_kernel*"),
}


def test_the_logprob_globs_tell_ligers_triton_kernels_from_pytorchs():
    """The first family whose glob matches (SQL GLOB, here fnmatchcase: the same for these patterns) of the kernel
    names liger-kernel 0.8.5 launches (its @triton.jit function names) and of PyTorch's log_softmax."""
    import fnmatch

    def family(name):
        return next((f for f, pats in op_kernels.LOGPROB_FAMILIES if any(fnmatch.fnmatchcase(name, p)
                                                                          for p in pats)), None)
    for name in ("liger_cross_entropy_kernel", "element_mul_kernel", "_selective_log_softmax_kernel",
                 "_grpo_loss_fwd_kernel", "_grpo_loss_bwd_kernel_seq"):
        assert family(name) == "Liger", name
    assert family("_forward_kernel") == "TRL chunked"
    assert family("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
                  "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float *, const float *, int)") \
        == "PyTorch log_softmax"
    assert family("void at::native::vectorized_elementwise_kernel<4, at::native::log_kernel_cuda>") is None


def test_the_liger_capture_names_ligers_logprob_kernels():
    """tests/data/capture_liger (H200, tools/make_capture_fixtures.sh OUTDIR liger: tools/traces/liger_job.py,
    liger-kernel 0.8.5): each phase running one of Liger's Triton log-prob paths is `Liger`, with exactly the GPU
    time nsys gives those kernels in that range; Liger's chunked GRPO loss (plain PyTorch ops) and PyTorch's own
    log_softmax are not."""
    import fnmatch

    res = analysis.analyze(analysis.Source(LIGER / "trace.sqlite"), phases=[])
    check_against_nvidia(LIGER, res)
    p = res.tables["phases"].set_index("name")
    ref = nvidia(LIGER, "stats_nvtx_kern_sum")
    for name, pats in LIGER_KERNELS.items():
        mine = ref[(ref["NVTX Range"] == f"rlkernel:phase:{name}")
                   & ref["Kernel Name"].map(lambda k, pats=pats: any(fnmatch.fnmatchcase(k, x) for x in pats))]
        assert len(mine) and p.loc[name, "logprob_by"] == "Liger", name
        assert p.loc[name, "logprob_ns"] == mine["Total Time (ns)"].sum(), name
    assert p.loc["liger_chunked_grpo", "logprob_by"] != "Liger"
    assert p.loc["torch_log_softmax", "logprob_by"] == "PyTorch log_softmax"
    assert res.phase_view.headline.startswith("GPU busy ") and "(2 steps)" in res.phase_view.headline


def _headline_of(phase_rows):
    """phase_view.headline over one 3 ms step and the given phases (name, wall ns inside the step, GPU busy ns)."""
    steps = pd.DataFrame({"wall_ns": [3_000_000], "gpu_busy_ns": [1_000_000]})
    rows = [dict(name="step", is_step=True, step_share_pct=100.0, step_span_ns=3_000_000, total_ns=3_000_000,
                 gpu_busy_ns=1_000_000, busy_pct=33.33, host_syncs=0, logprob_by=None, logprob_ns=None)]
    for name, span, busy in phase_rows:
        rows.append(dict(name=name, is_step=False, step_share_pct=round(100.0 * span / 3_000_000, 2),
                         step_span_ns=span, total_ns=span, gpu_busy_ns=busy, busy_pct=round(100.0 * busy / span, 2),
                         host_syncs=0, logprob_by=None, logprob_ns=None))
    return phase_view.headline(steps, pd.DataFrame(rows))


def test_the_headline_ranks_and_judges_phases_unrounded():
    # 49.996 % busy rounds to 50.00 in the column: still host-bound (< 50 %)
    assert "loss 33 % of wall time, host-bound" in _headline_of([("loss", 1_000_000, 499_960)])
    # b is longer by 30 ns, both 33.33 % once rounded: b is named, not the first by name
    assert "; b 33 % of wall time" in _headline_of([("a", 999_990, 0), ("b", 1_000_020, 0)])


@pytest.mark.parametrize(("ns", "text"), [(999_600, "1 ms"), (999_400, "999 µs"), (999.6, "1 µs"), (999.4, "999 ns"),
                                          (1_234_567_890, "1.23 s"), (None, ""), (float("nan"), "")])
def test_durations_move_up_a_unit_rather_than_print_an_exponent(ns, text):
    assert durations.fmt_ns(ns) == text


@pytest.mark.parametrize(("pct", "text"), [(1e-8, "0"), (0.0, "0"), (2.54, "2.5"), (27.3, "27"), (99.6, "99.6"),
                                           (99.96, "99.9"), (100.0, "100")])
def test_headline_shares_never_print_an_exponent_or_round_up_to_100(pct, text):
    assert phase_view._pct(pct) == text
