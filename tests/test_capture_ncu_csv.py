"""ncu's raw CSV -> ncu.csv, on real output of `ncu --import ... --csv --page raw --print-units base` (H200)."""
import csv
import pathlib

import pytest

from pipelines import ncu_csv

pytestmark = pytest.mark.smoke

DATA = pathlib.Path(__file__).parent / "data" / "capture"
RAW = (DATA / "ncu_raw_logp-native.csv").read_text()  # logp-native, 3 repetitions, 2x64x4096 bf16
RUN = DATA / "20261202T095005Z-logp-native+1"


def test_units_row_and_thousands_separators():
    header, units, launches = ncu_csv.parse_raw(RAW)
    assert header[0] == "ID" and units[0] == ""
    assert dict(zip(header, units, strict=True))["gpu__time_duration.sum"] == "ns"
    assert ncu_csv.number("1,980,000") == 1980000 and ncu_csv.number("0.07") == 0.07
    assert ncu_csv.number("n/a") == "n/a"
    assert len(launches) == 90


def test_long_rows_of_a_real_capture():
    rows, notes = ncu_csv.to_long(RAW, "logp-native", repeat=3)
    assert notes == []
    assert len(rows) == 90 * len(ncu_csv.METRICS)
    assert {r[0] for r in rows} == {"logp-native"}
    per_instance = {i: sum(1 for r in rows if r[1] == i) for i in (0, 1, 2)}
    assert per_instance == {0: 30 * 7, 1: 30 * 7, 2: 30 * 7}
    units = {r[4]: r[5] for r in rows}
    assert units["gpu__time_duration.sum"] == "ns" and units["dram__bytes_read.sum"] == "byte"
    assert units["launch__registers_per_thread"] == "register/thread"
    assert all(isinstance(r[6], (int, float)) for r in rows)
    assert any(r[6] >= 1000 for r in rows if r[4] == "dram__bytes_read.sum")  # separators were removed


def test_same_as_the_ncu_csv_written_on_the_gpu():
    rows, _ = ncu_csv.to_long(RAW, "logp-native", repeat=3)
    with open(RUN / "ncu.csv") as f:
        written = [r for r in csv.reader(f)]
    assert tuple(written[0]) == ncu_csv.LONG_COLUMNS
    mine = [[str(x) for x in r] for r in rows]
    assert mine == [r for r in written[1:] if r[0] == "logp-native"]


def test_write_long_round_trips(tmp_path):
    rows, _ = ncu_csv.to_long(RAW, "logp-native", repeat=3)
    ncu_csv.write_long(tmp_path / "ncu.csv", rows[:5])
    back = list(csv.reader(open(tmp_path / "ncu.csv")))
    assert back[0] == list(ncu_csv.LONG_COLUMNS) and len(back) == 6
    assert [p.name for p in tmp_path.iterdir()] == ["ncu.csv"]


def test_launch_outside_the_range_is_an_error():
    # ncu's own NVTX stack column must agree with the --nvtx-include filter
    with pytest.raises(ncu_csv.NcuCsvError, match="not inside NVTX range rlkernel:logp-fused"):
        ncu_csv.to_long(RAW, "logp-fused", repeat=3)


def test_uneven_launches_leave_instance_empty():
    rows, notes = ncu_csv.to_long(RAW, "logp-native", repeat=4)
    assert {r[1] for r in rows} == {""} and "do not split into 4" in notes[0]


def test_missing_metric_is_noted():
    rows, notes = ncu_csv.to_long(RAW, "logp-native", 3, metrics=("gpu__time_duration.sum", "no__such.metric"))
    assert len(rows) == 90 and "no__such.metric" in notes[0]


def test_malformed_csv():
    with pytest.raises(ncu_csv.NcuCsvError, match="no header"):
        ncu_csv.parse_raw("==PROF== nothing profiled\n")
    header_only = RAW.splitlines()[0] + "\n" + RAW.splitlines()[2] + "\n"
    with pytest.raises(ncu_csv.NcuCsvError, match="units row"):
        ncu_csv.parse_raw(header_only)
