"""python -m pipelines.analyze --ranks DIR on real committed exports: per-rank folders and one multi-process
export split by process, the cross-rank table, --require-fused across ranks, communication kernels apart from
compute (on a copy whose kernels are renamed nccl*), and the executors (process pool; Dask when installed)."""
from __future__ import annotations

import csv
import os
import pathlib
import shutil
import sqlite3
import subprocess
import sys

import pytest

from pipelines import analyze, cross_rank, ranks
from rlkernel import envflags
from tests.nsys_reference import DATA, stats
from tests.subprocess_env import pythonpath

NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096>)"


def main(*argv):
    return analyze.main([str(a) for a in argv])


def rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def cross(out) -> dict[tuple[str, int], dict]:
    return {(r["range"], int(r["rank"])): r for r in rows(out / "cross_rank.csv")}


def copy_run(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("stats_*.csv"))
    return dst


def stretch_after(trace: pathlib.Path, t: int, d: int) -> None:
    """What a sleep of ``d`` ns at time ``t`` does to a trace: everything that starts at or after ``t`` starts ``d``
    later, and the ranges open at ``t`` end ``d`` later."""
    con = sqlite3.connect(trace)
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    for table in ("NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_KERNEL",
                  "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET"):
        if table in tables:
            con.execute(f'UPDATE {table} SET start = start + ?, "end" = "end" + ? WHERE start >= ?', (d, d, t))
    con.execute('UPDATE NVTX_EVENTS SET "end" = "end" + ? WHERE start < ? AND "end" >= ? AND eventType IN (59, 60)',
                (d, t, t))
    con.commit()
    con.close()


def range_span(trace: pathlib.Path, message: str) -> int:
    con = sqlite3.connect(f"file:{trace}?mode=ro", uri=True)
    lo, hi = con.execute('SELECT min(e.start), max(e."end") FROM NVTX_EVENTS AS e LEFT JOIN StringIds AS s '
                         "ON s.id = e.textId WHERE e.eventType IN (59, 60) AND coalesce(e.text, s.value) = ?",
                         (message,)).fetchone()
    con.close()
    return hi - lo


def host_start(trace: pathlib.Path, message: str) -> int:
    con = sqlite3.connect(f"file:{trace}?mode=ro", uri=True)
    t = con.execute("SELECT (SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME) + min(e.start) "
                    "FROM NVTX_EVENTS AS e LEFT JOIN StringIds AS s ON s.id = e.textId "
                    "WHERE e.eventType IN (59, 60) AND coalesce(e.text, s.value) = ?", (message,)).fetchone()[0]
    con.close()
    return t


def csv_rows_without_rank(path, rank: int) -> list[list[str]]:
    with open(path, newline="") as f:
        r = csv.reader(f)
        head = next(r)
        assert head[0] == "rank"
        return [row[1:] for row in r if int(row[0]) == rank]


def test_per_rank_tables_are_the_single_trace_tables_and_fused_needs_every_rank(tmp_path, capsys):
    d = tmp_path / "job"
    copy_run(DATA / "example_with_sync", d / "rank0")
    copy_run(DATA / "verdicts", d / "rank1")
    out = tmp_path / "rep"
    assert main("--ranks", d, "--out", out, "--jobs", "1") == 0
    # the union of the per-rank tables: each rank's rows are, byte for byte, what the single-trace CLI writes
    for rank, case in ((0, "example_with_sync"), (1, "verdicts")):
        single = tmp_path / f"single-{case}"
        assert main(DATA / case, "--out", single) == 0
        for p in single.glob("*.csv"):
            with open(p, newline="") as f:
                expected = list(csv.reader(f))[1:]
            assert csv_rows_without_rank(out / p.name, rank) == expected, (case, p.name)
    # and rank 1's kernel table is nsys stats' for its export (cuda_gpu_kern_sum)
    ks = {r["kernel"]: r for r in rows(out / "kernel_summary.csv") if r["rank"] == "1"}
    ref = stats("verdicts", "cuda_gpu_kern_sum")
    assert len(ks) == len(ref)
    for name, inst, total in ref[["Name", "Instances", "Total Time (ns)"]].itertuples(index=False):
        assert (int(ks[name]["instances"]), int(ks[name]["total_ns"])) == (inst, total), name
    c = cross(out)
    assert c[("rlkernel:logp-fused", 0)]["verdict"] == "fused"
    assert c[("rlkernel:logp-fused", 1)]["verdict"] == "fallback"
    assert c[("rlkernel:logp-fused", 0)]["fused_all_ranks"] == "False"
    assert c[("rlkernel:grpo-step", 0)]["instances"] == "0"  # only rank 1 ran it
    # one host clock: each export's time plus its session start (UTC ns), the earliest rank at 0
    host = [host_start(d / f"rank{n}" / "trace.sqlite", "logp-fused") for n in (0, 1)]
    assert [int(c[("rlkernel:logp-fused", n)]["start_offset_ns"]) for n in (0, 1)] == [h - min(host) for h in host]
    assert min(host) != max(host)
    assert c[("rlkernel:grpo-step", 1)]["fused_all_ranks"] == "False"
    assert [r["source"] for r in rows(out / "ranks.csv")] == ["rank0", "rank1"]
    html = (out / "report.html").read_text()
    assert "TARGET_INFO_SESSION_START_TIME" in html and "rank 0 fused, rank 1 fallback" in html
    capsys.readouterr()
    assert main("--ranks", d, "--out", out, "--jobs", "1", "--require-fused") == 1
    err = capsys.readouterr().err
    assert "not fused: rank 1: workload rlkernel:logp-fused #1: fallback" in err
    assert "not fused: rank 0: rlkernel:grpo-step: absent" in err


def test_slow_rank_is_named_with_its_spread(tmp_path, capsys):
    """capture --ranks' layout (trace_rank<N>.sqlite beside one manifest); rank 1 sleeps 50 ms in the last
    logp-native repetition."""
    d = tmp_path / "run"
    d.mkdir()
    shutil.copy(DATA / "example_with_sync" / "manifest.json", d / "manifest.json")
    for n in (2, 1):  # rank numbers from the names, not the order
        shutil.copy(DATA / "example_with_sync" / "trace.sqlite", d / f"trace_rank{n}.sqlite")
    stretch_after(d / "trace_rank2.sqlite", 6070684377, 50_000_000)
    out = tmp_path / "rep"
    assert main("--ranks", d, "--out", out, "--jobs", "1", "--require-fused") == 0
    c = cross(out)
    span1, span2 = (range_span(d / f"trace_rank{n}.sqlite", "logp-native") for n in (1, 2))
    assert span2 == span1 + 50_000_000
    r1, r2 = c[("rlkernel:logp-native", 1)], c[("rlkernel:logp-native", 2)]
    assert (int(r1["span_ns"]), int(r2["span_ns"])) == (span1, span2)
    assert r1["slowest_rank"] == r2["slowest_rank"] == "2"
    assert float(r2["spread"]) == pytest.approx(span2 / ((span1 + span2) / 2), abs=1e-4)
    assert r1["busy_ns"] == r2["busy_ns"] and r1["start_offset_ns"] == r2["start_offset_ns"] == "0"
    assert c[("rlkernel:logp-fused", 1)]["fused_all_ranks"] == "True"
    assert "rlkernel:logp-native: slowest rank 2" in capsys.readouterr().out


def test_real_job_of_three_ranks_on_the_h200_names_its_slow_rank_and_matches_nsys_stats_per_rank(tmp_path, capsys):
    """tests/data/ranks: tools/traces/ranks.py as one gloo job of three processes on the H200, each under its own
    nsys; rank 1 sleeps 20 ms and runs two more matmuls in each `compute` range (tools/make_fixtures.sh ranks)."""
    out = tmp_path / "rep"
    assert main("--ranks", DATA / "ranks", "--out", out, "--jobs", "3") == 0
    said = capsys.readouterr().out
    assert "(whole trace): slowest rank 1" in said
    c = cross(out)
    assert {c[("ranks:compute", r)]["slowest_rank"] for r in range(3)} == {"1"}
    # the spans are evened out by the all-reduce (spread ~1.06); the busy time names the straggler
    busy = sorted(int(c[("ranks:compute", r)]["busy_ns"]) for r in range(3))
    assert {float(c[("ranks:compute", r)]["busy_imbalance"]) for r in range(3)} == {round(busy[2] / busy[1], 4)}
    assert busy[2] / busy[1] > 1.8
    assert "ranks:compute: slowest rank 1 (spread 1.059); busiest rank 1 (busy imbalance 1.906" in said
    # gloo: the all-reduce has no GPU work, so no imbalance, and the terminal says why comm_ns is 0
    assert c[("ranks:allreduce", 0)]["busy_imbalance"] == "" and c[("ranks:allreduce", 0)]["comm_ns"] == "0"
    assert "ranks:allreduce: slowest rank 2 (spread 1.106); no GPU work on any rank; no verdict (" in said
    assert "note: comm_ns is 0 on every rank: no kernel matches nccl*" in said
    html = (out / "report.html").read_text()
    assert "Straggler: rank 1 does 1.91× the median rank&#39;s GPU busy time in ranks:compute." in html
    for r in range(3):
        nvtx = stats(f"ranks/rank{r}", "nvtx_sum").set_index("Range")
        kern = stats(f"ranks/rank{r}", "cuda_gpu_kern_sum")
        for name in ("ranks:step", "ranks:compute", "ranks:allreduce"):
            row = c[(name, r)]
            assert (int(row["instances"]), int(row["range_total_ns"])) == (
                nvtx.loc[name, "Instances"], nvtx.loc[name, "Total Time (ns)"]), (name, r)
        mine = [k for k in rows(out / "kernel_summary.csv") if int(k["rank"]) == r]
        assert sorted((k["kernel"], int(k["instances"]), int(k["total_ns"])) for k in mine) == sorted(
            zip(kern["Name"], kern["Instances"], kern["Total Time (ns)"], strict=True))
        rank_row = next(k for k in rows(out / "ranks.csv") if int(k["rank"]) == r)
        assert int(rank_row["kernels"]) == kern["Instances"].sum()
    # the slow rank's extra matmuls: more GPU time in its compute ranges than any other rank's
    per_rank = {r: int(c[("ranks:compute", r)]["busy_ns"]) for r in range(3)}
    assert per_rank[1] > max(per_rank[0], per_rank[2])
    # the others wait for it in the all-reduce: its own all-reduce time is the smallest
    waits = {r: int(c[("ranks:allreduce", r)]["range_total_ns"]) for r in range(3)}
    assert waits[1] < min(waits[0], waits[2])


def test_default_report_folder_is_not_named_ranks_ranks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(DATA / "ranks", tmp_path / "ranks", ignore=shutil.ignore_patterns("stats_*.csv"))
    shutil.copytree(tmp_path / "ranks", tmp_path / "job")
    assert main("--ranks", "ranks", "--jobs", "1") == 0 and main("--ranks", "job", "--jobs", "1") == 0
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == ["ranks", "ranks-job"]
    assert (tmp_path / "reports" / "ranks" / "cross_rank.csv").is_file()


def test_multi_process_export_is_split_by_process_and_sums_to_nsys_stats_on_a_process_pool(tmp_path):
    out = tmp_path / "rep"
    assert main("--ranks", DATA / "multiproc", "--out", out, "--jobs", "2") == 0
    con = sqlite3.connect(f"file:{DATA / 'multiproc' / 'trace.sqlite'}?mode=ro", uri=True)
    per_pid = dict(con.execute("SELECT (globalPid >> 24) & 16777215, count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL "
                               "GROUP BY 1").fetchall())
    con.close()
    rk = rows(out / "ranks.csv")
    assert [int(r["pid"]) for r in rk] == sorted(per_pid)  # numbered by (device, pid); the launcher has no GPU work
    assert {int(r["pid"]): int(r["kernels"]) for r in rk} == per_pid
    ks = rows(out / "kernel_summary.csv")
    ref = stats("multiproc", "cuda_gpu_kern_sum")
    for name, inst, total in ref[["Name", "Instances", "Total Time (ns)"]].itertuples(index=False):
        mine = [r for r in ks if r["kernel"] == name]
        assert sum(int(r["instances"]) for r in mine) == inst and sum(int(r["total_ns"]) for r in mine) == total
    c = cross(out)
    assert (c[("worker:proc_work", 0)]["instances"], c[("worker:proc_work", 1)]["instances"]) == ("2", "3")
    assert c[("extra0:only_in_child0", 1)]["instances"] == "0"
    nvtx = stats("multiproc", "nvtx_sum")
    assert int(nvtx.loc[nvtx["Range"] == "worker:proc_work", "Instances"].iloc[0]) == 5


def _union(iv):
    iv = sorted(iv)
    out = []
    for s, e in iv:
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _length(iv):
    return sum(e - s for s, e in iv)


def test_communication_kernels_apart_from_compute_with_overlap(tmp_path):
    """The add kernels renamed to an NCCL all-reduce, and one of them moved to run during the kernel before it
    (as a collective on its own stream would): comm, compute and overlap against a reference computed here."""
    d = tmp_path / "job"
    d.mkdir()
    trace = d / "trace.sqlite"
    shutil.copy(DATA / "multiproc" / "trace.sqlite", trace)
    con = sqlite3.connect(trace)
    con.execute("UPDATE StringIds SET value = ? WHERE value LIKE 'void %CUDAFunctorOnSelf_add%'", (NCCL,))
    nccl_id = con.execute("SELECT id FROM StringIds WHERE value = ?", (NCCL,)).fetchone()[0]
    k = con.execute('SELECT rowid, start, "end" FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE demangledName = ? '
                    "ORDER BY start LIMIT 1", (nccl_id,)).fetchone()
    prev = con.execute('SELECT start, "end" FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE start < ? ORDER BY start DESC '
                       "LIMIT 1", (k[1],)).fetchone()
    shift = prev[0] + (prev[1] - prev[0]) // 2 - k[1]
    con.execute('UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = start + ?, "end" = "end" + ? WHERE rowid = ?',
                (shift, shift, k[0]))
    con.commit()
    kernels = con.execute('SELECT (globalPid >> 24) & 16777215, start, "end", demangledName = ? '
                          "FROM CUPTI_ACTIVITY_KIND_KERNEL", (nccl_id,)).fetchall()
    con.close()
    out = tmp_path / "rep"
    assert main("--ranks", d, "--out", out, "--jobs", "1") == 0
    pids = {int(r["rank"]): int(r["pid"]) for r in rows(out / "ranks.csv")}
    c = cross(out)
    overlapped = 0
    for rank, pid in pids.items():
        comm = _union([(s, e) for p, s, e, n in kernels if p == pid and n])
        comp = _union([(s, e) for p, s, e, n in kernels if p == pid and not n])
        both = _length(comm) + _length(comp) - _length(_union(comm + comp))
        r = c[(ranks.WHOLE_TRACE, rank)]
        assert (int(r["comm_ns"]), int(r["compute_ns"]), int(r["overlap_ns"])) == (_length(comm), _length(comp), both)
        overlapped += both
        assert 0 < int(c[("worker:proc_work", rank)]["comm_ns"]) <= _length(comm)
    assert overlapped > 0


def test_usage_errors_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    dup = tmp_path / "dup"
    dup.mkdir()
    for name in ("a_rank1.sqlite", "b_rank1.sqlite"):
        shutil.copy(DATA / "no_nvtx" / "trace.sqlite", dup / name)
    broken = tmp_path / "broken.sqlite"  # an SQLite header, then garbage: split-by-process reads it first
    whole = (DATA / "no_nvtx" / "trace.sqlite").read_bytes()
    broken.write_bytes(whole[:100] + b"\xff" * (len(whole) - 100))
    cases = [
        (["--ranks", DATA / "multiproc", DATA / "verdicts"], "takes no INPUT"),
        (["--executor", "dask://127.0.0.1:1", DATA / "verdicts"], "go with --ranks"),
        (["--ranks", DATA / "multiproc", "--executor", "spark://x"], "give local or dask://HOST:PORT"),
        (["--ranks", tmp_path / "missing"], "no such file or directory"),
        (["--ranks", tmp_path / "empty"], "no exports in it"),
        (["--ranks", dup], "two exports name rank 1"),
        (["--ranks", DATA / "multiproc", "--jobs", "0"], "--jobs must be at least 1"),
        (["--ranks", broken], "cannot read as SQLite"),
    ]
    for argv, words in cases:
        assert main(*argv, "--out", tmp_path / "rep") == 2, argv
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and err.count("\n") == 1, (argv, err)


def test_rank_numbers_from_names_else_sorted_order():
    assert ranks.rank_numbers(["rank10.sqlite", "rank2.sqlite"]) == [10, 2]
    assert ranks.rank_numbers(["b.sqlite", "a.sqlite", "rank3.sqlite"]) == [1, 0, 2]


def test_dask_executor_gives_the_local_csvs_byte_for_byte(tmp_path):
    if envflags.env_bool("CI", default=False):
        import distributed  # CI installs the dask extra (tox's py environment): a missing one fails here
    else:
        distributed = pytest.importorskip("distributed", reason="the dask extra is not installed here")
    local = tmp_path / "local"
    assert main("--ranks", DATA / "multiproc", "--out", local, "--jobs", "1") == 0
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=None) as cluster:
        address = cluster.scheduler_address.removeprefix("tcp://")
        out = tmp_path / "dask"
        assert main("--ranks", DATA / "multiproc", "--out", out, "--executor", f"dask://{address}") == 0
    names = sorted(p.name for p in local.glob("*.csv"))
    assert names == sorted(p.name for p in out.glob("*.csv")) and "cross_rank.csv" in names
    for name in names:
        assert (out / name).read_bytes() == (local / name).read_bytes(), name


def test_cross_rank_columns_are_the_documented_ones():
    doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "contracts.md").read_text()
    assert "`cross_rank.csv`: " + ", ".join(f"`{c}`" for c in cross_rank.COLUMNS) in doc


def test_ranks_reach_the_workers_as_absolute_paths(tmp_path, monkeypatch):
    """A Dask worker runs in another directory: the exports must travel as absolute paths."""
    monkeypatch.chdir(DATA)
    specs = ranks.discover(pathlib.Path("multiproc"))
    assert len(specs) == 2 and all(s.source.trace.is_absolute() and s.source.trace.is_file() for s in specs)


def test_dask_executor_without_a_scheduler_exits_3(tmp_path, monkeypatch, capsys):
    # without dask installed: exit 3 saying so; with it (CI): exit 3 saying no scheduler answers
    monkeypatch.setattr(ranks, "CONNECT_TIMEOUT_S", 1)
    assert main("--ranks", DATA / "multiproc", "--out", tmp_path / "rep", "--executor", "dask://127.0.0.1:1") == 3
    err = capsys.readouterr().err
    assert "--executor dask://" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "rep").exists()


def test_unknown_range_with_ranks_exits_2(tmp_path, capsys):
    assert main("--ranks", DATA / "multiproc", "--out", tmp_path / "rep", "--jobs", "1", "--range", "nosuch") == 2
    assert "--range nosuch: no such range" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--range", "nosuch", "--jobs", "1", "--out", "rep"], "--range nosuch: no such range in the input"),
    (["--out", "."], ".: the current directory or one above it"),
], ids=["unknown-range", "out-is-cwd"])
def test_usage_errors_of_ranks_exit_2_under_python_m(tmp_path, argv, words):
    """`python -m pipelines.analyze` runs the module as __main__: a usage error of --ranks is still one line and
    exit 2 (it was a traceback and exit 1 while cross_rank raised the UsageError of a second copy of the module)."""
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": pythonpath(root)}
    r = subprocess.run([sys.executable, "-m", "pipelines.analyze", "--ranks", str(DATA / "multiproc"), *argv],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    err = [ln for ln in r.stderr.splitlines() if not ln.startswith("analyze: ")]  # the progress lines
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith(f"pipelines.analyze: {words}"), r.stderr
