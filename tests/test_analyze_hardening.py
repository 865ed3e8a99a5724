"""Issue 19, the analyzer's side: bad traces, manifests and outputs found by a red-team pass, each refused with
one line and exit 2 (or handled), built from the real committed fixtures modified with sqlite3."""
from __future__ import annotations

import pathlib
import shutil
import sqlite3

import pytest

from pipelines import analyze, inputs
from tests.nsys_reference import DATA

pytestmark = pytest.mark.smoke
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1


def main(*argv):
    return analyze.main([str(a) for a in argv])


def trace_copy(tmp_path, *sql, case="verdicts", name="trace.sqlite") -> pathlib.Path:
    """A copy of a fixture trace with ``sql`` applied."""
    p = tmp_path / name
    shutil.copy(DATA / case / "trace.sqlite", p)
    con = sqlite3.connect(p)
    for q in sql:
        con.execute(q)
    con.commit()
    con.close()
    return p


def one_line_exit_2(capsys, *argv) -> str:
    rc = main(*argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("analyze: ")]
    assert rc == 2 and len(err) == 1 and err[0].startswith("pipelines.analyze: "), (rc, err)
    return err[0]


def test_non_utf8_blob_in_string_ids_is_one_line(tmp_path, capsys):
    t = trace_copy(tmp_path, "UPDATE StringIds SET value = x'fffe41' "
                             "WHERE id = (SELECT textId FROM NVTX_EVENTS WHERE textId IS NOT NULL LIMIT 1)")
    line = one_line_exit_2(capsys, t, "--out", tmp_path / "rep")
    assert "StringIds" in line and "UTF-8" in line


FIRST_KERNEL = "rowid = (SELECT min(rowid) FROM CUPTI_ACTIVITY_KIND_KERNEL)"
FIRST_PUSH = "rowid = (SELECT min(rowid) FROM NVTX_EVENTS WHERE eventType = 59)"


@pytest.mark.parametrize("sql", [
    f"UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = {INT64_MIN} WHERE {FIRST_KERNEL}",
    f'UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET "end" = {INT64_MIN} WHERE {FIRST_KERNEL}',
    f"UPDATE NVTX_EVENTS SET start = {INT64_MIN} WHERE {FIRST_PUSH}",
    f'UPDATE NVTX_EVENTS SET "end" = {INT64_MIN} WHERE {FIRST_PUSH}',
    f'UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = 0, "end" = {INT64_MAX}',  # every kernel: the sums overflow
], ids=["kernel-start-min", "kernel-end-min", "nvtx-start-min", "nvtx-end-min", "kernel-sums"])
def test_int64_extreme_timestamps_are_one_line(tmp_path, capsys, sql):
    t = trace_copy(tmp_path, sql)
    assert "out of range" in one_line_exit_2(capsys, t, "--out", tmp_path / "rep")
    assert not (tmp_path / "rep").exists()


def test_int64_extreme_timestamps_in_the_compare_baseline_are_one_line(tmp_path, capsys):
    base = trace_copy(tmp_path, f"UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = {INT64_MIN} WHERE {FIRST_KERNEL}",
                      name="base.sqlite")
    line = one_line_exit_2(capsys, DATA / "verdicts", "--compare", base, "--out", tmp_path / "rep")
    assert "base.sqlite" in line and "out of range" in line
    assert not (tmp_path / "rep").exists()


def test_int64_extreme_timestamps_in_a_rank_are_one_line(tmp_path, capsys):
    # the map step (ranks.analyze_rank) turns DuckDB's numeric errors into the same one-line TraceError
    (tmp_path / "job").mkdir()
    shutil.copy(DATA / "verdicts" / "trace.sqlite", tmp_path / "job" / "rank0.sqlite")
    trace_copy(tmp_path / "job", f"UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = {INT64_MIN} WHERE {FIRST_KERNEL}",
               name="rank1.sqlite")
    line = one_line_exit_2(capsys, "--ranks", tmp_path / "job", "--jobs", "1", "--out", tmp_path / "rep")
    assert "rank1.sqlite: values out of range for 64-bit arithmetic" in line
    assert not (tmp_path / "rep").exists()


def run_copy(tmp_path, case="verdicts") -> pathlib.Path:
    """A run directory built from a fixture: its trace and manifest."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("trace.sqlite", "manifest.json"):
        shutil.copy(DATA / case / name, run / name)
    return run


@pytest.mark.parametrize("text", ["[" * 200000, '{"a":' * 200000])
def test_deeply_nested_manifest_is_one_line(tmp_path, capsys, text):
    run = run_copy(tmp_path)
    (run / "manifest.json").write_text(text)
    assert "manifest.json: not a readable JSON manifest" in one_line_exit_2(capsys, run)
    assert not (run / "report").exists()


def test_deeply_nested_child_record_is_one_line(tmp_path):
    from pipelines import capture
    from rlkernel.cli import EXIT_USAGE, CliError

    rec = tmp_path / "child-nsys.json"
    for text in ("[" * 200000, "[]", '{"dispatch": {}}'):
        rec.write_text(text)
        with pytest.raises(CliError) as e:
            capture.read_child_record(rec, "nsys profile")
        assert e.value.code == EXIT_USAGE and "child-nsys.json" in str(e.value) and "\n" not in str(e.value)
    rec.write_text('{"dispatch": [], "node": {}, "timings": {}}')
    assert capture.read_child_record(rec, "nsys profile")["dispatch"] == []


CAPTURE_RUN = DATA / "capture" / "20261202T095005Z-logp-native+1"  # a real H200 run with its ncu.csv


@pytest.mark.parametrize("column,value", [("instance", "1.5"), ("instance", "abc"),
                                          ("instance", str(2 ** 63)), ("launch", "x"), ("launch", "")])
def test_ncu_csv_bad_integer_is_one_line(tmp_path, capsys, column, value):
    run = tmp_path / "run"
    shutil.copytree(CAPTURE_RUN, run)
    lines = (run / "ncu.csv").read_text().splitlines()
    cols = lines[0].split(",")
    row = lines[1].split(",")
    row[cols.index(column)] = value
    (run / "ncu.csv").write_text("\n".join([lines[0], ",".join(row), *lines[2:]]) + "\n")
    line = one_line_exit_2(capsys, run, "--out", tmp_path / "rep")
    assert "ncu.csv" in line and f"{column} " in line and "line 2" in line


def test_ncu_csv_empty_instance_is_allowed(tmp_path):
    # to_long leaves instance empty when the launches do not split into repetitions: not an error
    run = tmp_path / "run"
    shutil.copytree(CAPTURE_RUN, run)
    lines = (run / "ncu.csv").read_text().splitlines()
    rows = [ln.split(",") for ln in lines[1:]]
    for r in rows:
        r[1] = ""
    (run / "ncu.csv").write_text("\n".join([lines[0], *(",".join(r) for r in rows)]) + "\n")
    assert main(run, "--out", tmp_path / "rep") == 0


def test_input_path_longer_than_255_bytes_is_one_line(tmp_path, capsys):
    for long in (tmp_path / ("x" * 300 + ".sqlite"), tmp_path / ("d" * 300)):
        assert "too long" in one_line_exit_2(capsys, long, "--out", tmp_path / "rep").lower()
        assert "too long" in one_line_exit_2(capsys, DATA / "no_cuda", "--compare", long,
                                             "--out", tmp_path / "rep").lower()


def test_out_name_longer_than_255_bytes_is_one_line(tmp_path, capsys):
    for out in (tmp_path / ("r" * 300), tmp_path / ("r" * 300) / "rep"):
        assert "too long" in one_line_exit_2(capsys, DATA / "no_cuda", "--out", out).lower()
    assert not list(tmp_path.iterdir())


def test_out_name_of_255_bytes_is_written(tmp_path):
    # the name fits; the temporary sibling's name must fit too
    out = tmp_path / ("r" * 255)
    assert main(DATA / "no_cuda", "--out", out) == 0 and (out / "report.html").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_wal_mode_trace_gets_nothing_written_beside_it(tmp_path):
    t = trace_copy(tmp_path, "PRAGMA journal_mode=wal")  # persists in the file's header
    assert t.read_bytes()[18:20] == b"\x02\x02"
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(t, "--out", tmp_path / "rep") == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "rep") == before  # no -wal, no -shm


def test_wal_mode_trace_with_its_wal_is_read_whole(tmp_path):
    # A writer that has not checkpointed: the newest rows live in trace.sqlite-wal, copied as they are.
    src = tmp_path / "live"
    src.mkdir()
    t = trace_copy(src, "PRAGMA journal_mode=wal")
    con = sqlite3.connect(t)
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("UPDATE StringIds SET value = 'renamed_in_wal' WHERE id = "
                "(SELECT shortName FROM CUPTI_ACTIVITY_KIND_KERNEL LIMIT 1)")
    con.commit()
    run = tmp_path / "copy"
    run.mkdir()
    for p in src.iterdir():
        shutil.copy(p, run / p.name)
    con.close()
    (run / "trace.sqlite-shm").unlink()
    names = sorted(p.name for p in run.iterdir())
    assert names == ["trace.sqlite", "trace.sqlite-wal"]
    assert main(run / "trace.sqlite", "--out", tmp_path / "rep") == 0
    assert "renamed_in_wal" in (tmp_path / "rep" / "kernel_summary.csv").read_text()
    assert sorted(p.name for p in run.iterdir()) == names


def test_unwritable_output_is_refused_before_the_analysis(tmp_path, capsys):
    # /sys takes no new entries for any user, root included (EPERM on a host, EROFS in a container), which
    # permission bits cannot give a root test; a read-only run directory's report/ takes the same check.
    out = pathlib.Path("/sys/rlkernel-analyze-test-report")
    rc = main(DATA / "nvtx_mix", "--out", out)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err  # one line, and no "analyze: ... loaded" progress: nothing analyzed
    assert "cannot write" in err[0] and "--out" in err[0]
    assert not out.exists()


def test_report_shows_no_absolute_path_of_the_runs_command(tmp_path):
    import json

    run = run_copy(tmp_path)
    m = json.loads((run / "manifest.json").read_text())
    m["command"] = ["/home/alice/proj/.venv/bin/python", "-m", "pipelines.capture", "--output-dir",
                    "/home/alice/proj/runs", "--log=/home/alice/secret/log.txt", "rel/path"]
    (run / "manifest.json").write_text(json.dumps(m))
    assert main(run) == 0
    html = (run / "report" / "report.html").read_text()
    assert "/home/alice" not in html
    assert ("&lt;path&gt;/python -m pipelines.capture --output-dir &lt;path&gt;/runs "
            "--log=&lt;path&gt;/log.txt rel/path") in html


FORMULAS = ('=HYPERLINK("http://evil.example/","click")', "+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A9)")


def text_cells(path: pathlib.Path) -> list[str]:
    import csv

    with open(path, newline="") as f:
        return [c for row in csv.reader(f) for c in row]


def test_csv_text_cells_are_neutralised_and_numbers_are_not(tmp_path):
    import csv

    from pipelines import analysis
    from rlkernel import textsafe

    kernel, range_msg, domain_msg, _ = FORMULAS
    t = trace_copy(tmp_path,
                   f"UPDATE StringIds SET value = '{kernel.replace(chr(39), chr(39) * 2)}' "
                   "WHERE id = (SELECT shortName FROM CUPTI_ACTIVITY_KIND_KERNEL LIMIT 1)",
                   f"UPDATE StringIds SET value = '{range_msg.replace(chr(39), chr(39) * 2)}' "
                   "WHERE id = (SELECT textId FROM NVTX_EVENTS WHERE eventType = 59 AND textId IS NOT NULL LIMIT 1)",
                   f"UPDATE NVTX_EVENTS SET text = '{domain_msg}' WHERE eventType = 75 AND text = 'app'",
                   case="nvtx_mix")
    base = trace_copy(tmp_path, 'UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET "end" = "end" + 100000', case="nvtx_mix",
                      name="base.sqlite")
    out = tmp_path / "rep"
    assert main(t, "--compare", base, "--out", out) == 0
    cells = [c for p in out.glob("*.csv") for c in text_cells(p)]
    assert not [c for c in cells if c[:1] in ("=", "+", "@", "\t", "\r")]
    assert not [c for c in cells if c[:1] == "-" and not textsafe.NUMBER.fullmatch(c)]
    assert f"'{kernel}" in cells and any(c.startswith(f"'{domain_msg}:") for c in cells)
    assert any(c.endswith(f":{range_msg}") for c in cells)
    # numbers stay numbers: compare.csv's delta_pct is negative here (the baseline's kernels ran longer)
    rows = list(csv.DictReader(open(out / "compare.csv", newline="")))
    assert rows and all(float(r["delta_pct"]) < 0 for r in rows if r["kind"] == "kernel")
    # Read back and un-neutralised, the names equal the analysis' own (what the nsys-equality tests compare).
    ours = analysis.analyze(analysis.Source(t)).tables["kernel_summary"]
    back = list(csv.DictReader(open(out / "kernel_summary.csv", newline="")))
    for col in ("kernel", "kernel_short"):
        assert [textsafe.from_spreadsheet(r[col]) for r in back] == list(ours[col])
    assert kernel in list(ours["kernel_short"])


def test_profile_suite_csv_is_neutralised_and_json_exact(tmp_path):
    import csv
    import json

    from rlkernel.profiling import rows, writers

    row = {k: "" for k in rows.COLUMNS}
    row.update(workload=FORMULAS[0], command=FORMULAS[1], notes=FORMULAS[2], gpu_name=FORMULAS[3], latency_ms=-1.5,
               batch_size=4, dispatch="'quoted")
    paths = writers.write_reports(tmp_path, [row], csv_out=True, json_out=True, command=FORMULAS[1], node={},
                                  generated_at="t")
    got = next(csv.DictReader(open(next(p for p in paths if p.suffix == ".csv"), newline="")))
    assert [got[k] for k in ("workload", "command", "notes", "gpu_name", "dispatch")] == \
        ["'" + f for f in FORMULAS] + ["''quoted"]
    assert got["latency_ms"] == "-1.5" and got["batch_size"] == "4"
    doc = json.loads(next(p for p in paths if p.suffix == ".json").read_text())
    assert doc["rows"][0]["workload"] == FORMULAS[0] and doc["command"] == FORMULAS[1]


def test_control_characters_are_escaped_on_the_terminal_and_visible_in_html(tmp_path, capsys):
    evil = "ev\x1b[31mil\nname\x00\x07\x9b-fused"  # ESC, newline, NUL, BEL, a C1 CSI: a *-fused workload range
    t = trace_copy(tmp_path, case="nvtx_mix")
    con = sqlite3.connect(t)
    con.execute("UPDATE NVTX_EVENTS SET text = ? WHERE text = 'outer'", (evil,))
    con.execute("UPDATE StringIds SET value = ? WHERE id = (SELECT shortName FROM CUPTI_ACTIVITY_KIND_KERNEL "
                "LIMIT 1)", ("k\x1b]0;title\x07ernel",))
    con.commit()
    con.close()
    out = tmp_path / "rep"
    assert main(t, "--out", out, "--require-fused") == 1  # the evil range is a *-fused workload, not fused
    cap = capsys.readouterr()
    for stream in (cap.out, cap.err):
        assert not any(ch in stream for ch in "\x1b\x00\x07\x9b"), repr(stream)
    assert "ev\\x1b[31mil\\nname\\x00\\x07\\x9b-fused" in cap.out and "\\x1b" in cap.err
    assert all(ln.startswith(("  ", "pipelines.analyze: ", "analyze: ")) for ln in (cap.out + cap.err).splitlines())
    html = (out / "report.html").read_text()
    assert not any(ch in html for ch in "\x1b\x00\x07\x9b")
    assert "ev␛[31mil␊name␀␇\\x9b-fused" in html and "k␛]0;title␇ernel" in html


def test_range_matching_nothing_is_a_usage_error_naming_the_closest(tmp_path, capsys):
    line = one_line_exit_2(capsys, DATA / "verdicts", "--range", "logp-nativ", "--out", tmp_path / "rep")
    assert "--range logp-nativ" in line and "logp-native" in line
    assert not (tmp_path / "rep").exists()
    # matched in one of several inputs is enough; each form of a name matches
    for name in ("logp-native", "rlkernel:logp-native"):
        assert main(DATA / "verdicts", DATA / "no_nvtx", "--range", name, "--out", tmp_path / name) == 0
    line = one_line_exit_2(capsys, DATA / "no_nvtx", "--range", "x", "--out", tmp_path / "rep")
    assert "no NVTX ranges" in line


# ---- issue 19, item 26: report text ------------------------------------------------------------------------

def html_of(tmp_path, inp, *extra) -> str:
    out = tmp_path / "rep"
    assert main(inp, "--out", out, *extra) == 0
    return (out / "report.html").read_text()


def test_header_renders_backticks_as_code_and_ends_sentences_once(tmp_path):
    import re

    html = html_of(tmp_path, inputs.EXAMPLE_DIR)
    header = re.search(r'<p class="where">(.*?)</p>', html, re.S).group(1)
    assert "`" not in header and ".." not in header
    assert "<code>python -m pipelines.capture --workload logp-native" in header


def test_env_block_lists_each_variable_once(tmp_path):
    html = html_of(tmp_path, inputs.EXAMPLE_DIR)
    assert html.count("<dt>CUDA_VISIBLE_DEVICES</dt>") == 1


def test_svg_value_labels_fit_the_chart(tmp_path):
    import re

    html = html_of(tmp_path, DATA / "verdicts")
    width = float(re.search(r'viewBox="0 0 (\d+) ', html).group(1))
    labels = re.findall(r'<text x="([\d.]+)" y="12" class="val">([^<]*)</text>', html)
    assert labels
    for x, text in labels:  # 11px system-ui: at most 0.6 em a character
        assert float(x) + 0.6 * 11 * len(text) <= width, (x, text)


def test_csv_counts_are_integers(tmp_path):
    import csv

    out = tmp_path / "rep"
    assert main(CAPTURE_RUN, "--out", out) == 0
    rows = list(csv.DictReader(open(out / "bandwidth.csv", newline="")))
    assert rows and all(r["ncu_launches"].isdigit() and r["instances"].isdigit() for r in rows), rows
    for r in csv.DictReader(open(out / "dispatch.csv", newline="")):
        assert r["instance"].isdigit() and r["fused_kernels"].isdigit() and r["other_kernels"].isdigit(), r


def test_chart_messages_say_what_is_missing(tmp_path):
    no_nvtx = html_of(tmp_path / "a", DATA / "no_nvtx")  # kernels ran, no ranges
    assert "No GPU work in this trace" not in no_nvtx and "No NVTX ranges in this trace" in no_nvtx
    no_cuda = html_of(tmp_path / "b", DATA / "no_cuda")  # ranges, no kernels: no zero-length bars
    assert 'class="bar"' not in no_cuda and "No kernels in this trace" in no_cuda
    assert "No GPU work inside the NVTX ranges" in no_cuda


# ---- issue 19, item 27: near-miss flags, and what each folder holds ---------------------------------------

def test_analyze_output_dir_is_answered_with_out(tmp_path, capsys):
    for flag in ("--output-dir", "--output-dir=x", "--outdir"):
        line = one_line_exit_2(capsys, DATA / "no_cuda", flag, *([] if "=" in flag else ["x"]))
        assert "did you mean --out? it names the report folder itself" in line, line
    line = one_line_exit_2(capsys, DATA / "no_cuda", "--thresold", "3")
    assert "did you mean --threshold?" in line
    assert "unrecognized arguments: --bogus (see --help)" in one_line_exit_2(capsys, DATA / "no_cuda", "--bogus")


def test_capture_and_profile_suite_near_misses_name_output_dir():
    from pipelines import capture
    from rlkernel.cli import CliError
    from rlkernel.profiling import cli as profile_cli

    for build in (capture.build_parser, profile_cli.parser):
        with pytest.raises(CliError) as e:
            build().parse_args(["--outdir", "x"])
        assert "did you mean --output-dir?" in str(e.value) and "parent folder" in str(e.value)


def test_each_help_says_what_its_folder_holds():
    from pipelines import capture
    from rlkernel.profiling import cli as profile_cli

    def helps(p):
        return " ".join(p.format_help().split())

    assert "the report folder itself" in helps(analyze.parser())
    assert "parent folder" in helps(capture.build_parser()) and "manifest.json" in helps(capture.build_parser())
    assert "parent folder" in helps(profile_cli.parser()) and "profile_" in helps(profile_cli.parser())
