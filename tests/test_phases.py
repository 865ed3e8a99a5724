"""rlkernel.phase / rlkernel.step (contract 3): the ranges a profiler sees, recorded by a real NVTX tool
(tests/nvtx_log.c, loaded as nsys loads its own) in a subprocess; the API's errors; no torch import; the
RLKERNEL_CAPTURE_STEPS window."""
import json
import subprocess
import sys
import textwrap
import warnings

import pytest

import rlkernel
from rlkernel import envflags, phases
from tests import nvtx_log


def run_recorded(tmp_path, code: str, env_extra=None) -> tuple[subprocess.CompletedProcess, list]:
    lib = nvtx_log.library(tmp_path)
    log = tmp_path / "nvtx.log"
    env = nvtx_log.environ(lib, log)
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc, nvtx_log.ranges(log)


PROGRAM = """
    import rlkernel

    @rlkernel.phase("loss")
    def loss():
        with rlkernel.phase("policy_forward"):
            pass

    opt = rlkernel.phase("optimizer")
    for _ in range(2):
        with rlkernel.step() as i:
            with rlkernel.phase("rollout"):
                with rlkernel.phase("rollout"):  # a nested entry of the same name is its own range
                    pass
            loss()
            opt.__enter__(); opt.__exit__(None, None, None)  # a callback pair (begin in one hook, end in another)
    rlkernel.step_begin(10)
    rlkernel.step_end()
    try:
        with rlkernel.step():
            raise KeyError("boom")
    except KeyError:
        pass
"""


@pytest.mark.smoke
def test_the_ranges_a_profiler_sees(tmp_path):
    _, got = run_recorded(tmp_path, PROGRAM)
    assert {r.domain for r in got} == {"rlkernel"}
    steps = [r for r in got if r.message == "phase:step"]
    # default indices count from 0; an explicit one restarts the count; a block that raises still closes its step
    assert [(r.payload, r.depth) for r in steps] == [(0, 0), (1, 0), (10, 0), (11, 0)]
    inner = [(r.message, r.depth, r.payload) for r in got if r.message != "phase:step"]
    one_step = [("phase:rollout", 1, None), ("phase:rollout", 2, None), ("phase:loss", 1, None),
                ("phase:policy_forward", 2, None), ("phase:optimizer", 1, None)]
    assert inner == one_step * 2
    for r in got:  # every phase lies inside its step
        if r.message != "phase:step":
            assert any(s.start < r.start and r.end < s.end for s in steps), r


@pytest.mark.smoke
def test_no_torch_is_imported(tmp_path):
    code = """
        import sys, rlkernel
        with rlkernel.step():
            with rlkernel.phase("rollout"):
                pass
        print("torch" in sys.modules)
    """
    proc, got = run_recorded(tmp_path, code)
    assert proc.stdout.strip() == "False" and [r.message for r in got] == ["phase:step", "phase:rollout"]


@pytest.mark.smoke
def test_without_a_profiler_nothing_is_pushed_and_the_decorator_adds_nothing():
    assert not phases._enabled  # the test process has no NVTX tool attached

    def f(x):
        return x + 1

    assert rlkernel.phase("loss")(f) is f  # no profiler can attach later: no wrapper, no cost
    assert rlkernel.phase("loss") is rlkernel.phase("loss")  # made once per name
    with rlkernel.phase("rollout") as p:
        assert p.name == "rollout" and repr(p) == "rlkernel.phase('rollout')"


@pytest.mark.smoke
@pytest.mark.parametrize("name, error, words", [
    (3, TypeError, "must be a str"), ("", ValueError, "must not be empty"), ("step", ValueError, "rlkernel.step()"),
])
def test_bad_phase_names(name, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        rlkernel.phase(name)


@pytest.fixture
def fresh_steps(monkeypatch):
    monkeypatch.delenv("RLKERNEL_CAPTURE_STEPS", raising=False)
    monkeypatch.setattr(phases, "_steps", phases._Steps())
    return phases


@pytest.mark.smoke
def test_step_misuse_raises_before_touching_a_range(fresh_steps):
    with pytest.raises(RuntimeError, match="no step is open"):
        rlkernel.step_end()
    assert rlkernel.step_begin(4) == 4
    with pytest.raises(RuntimeError, match="step 4 is still open"):
        rlkernel.step_begin()
    assert rlkernel.step_end() == 4
    with pytest.raises(TypeError, match="must be an int"):
        rlkernel.step_begin(True)
    with pytest.raises(TypeError, match="must be an int"):
        rlkernel.step_begin(1.0)
    with pytest.raises(ValueError, match="int64"):
        rlkernel.step_begin(2 ** 63)
    with rlkernel.step() as i:
        assert i == 5  # the count goes on from the last step


def test_capture_steps_start_and_stop_the_profiler_around_the_window(tmp_path):
    # cudaProfilerStart/Stop need a GPU: the one edge replaced, by a function printing when it was called; the
    # ranges come from the NVTX tool, on the same clock (CLOCK_MONOTONIC)
    code = """
        import json, time, rlkernel
        from rlkernel import phases
        calls = []
        phases._cuda_profiler = lambda start: calls.append(("start" if start else "stop", time.monotonic_ns()))
        for i in range(6):
            with rlkernel.step(i):
                pass
        print(json.dumps(calls))
    """
    proc, got = run_recorded(tmp_path, code, {"RLKERNEL_CAPTURE_STEPS": "2:3"})
    calls = json.loads(proc.stdout)
    assert [c[0] for c in calls] == ["start", "stop"]
    steps = {r.payload: r for r in got}
    assert steps[1].end < calls[0][1] < steps[2].start  # started before step 2's range opens
    assert steps[3].end < calls[1][1] < steps[4].start  # stopped after step 3's range closes


@pytest.mark.smoke
@pytest.mark.parametrize("window, indices, want", [
    ("2:3", range(6), [("start", "begin", 2), ("stop", "end", 3)]),
    ("0", range(3), [("start", "begin", 0), ("stop", "end", 0)]),
    ("2:3", [0, 5, 6], []),  # the window was jumped over: never started
    ("2:4", [0, 3, 9], [("start", "begin", 3), ("stop", "begin", 9)]),  # late start; the last step skipped
    ("2:3", [2], [("start", "begin", 2)]),  # the job ended inside the window: nsys ends the capture at exit
])
def test_capture_window_rules(fresh_steps, monkeypatch, window, indices, want):
    monkeypatch.setenv("RLKERNEL_CAPTURE_STEPS", window)
    seen, at = [], {}
    monkeypatch.setattr(phases, "_cuda_profiler", lambda start: seen.append(("start" if start else "stop", *at["now"])))
    for i in indices:
        at["now"] = ("begin", i)
        rlkernel.step_begin(i)
        at["now"] = ("end", i)
        rlkernel.step_end()
    assert seen == want


def test_a_bad_capture_window_is_an_env_flag_error_at_the_first_step(fresh_steps, monkeypatch):
    monkeypatch.setenv("RLKERNEL_CAPTURE_STEPS", "3:1")
    with pytest.raises(envflags.EnvFlagError, match="RLKERNEL_CAPTURE_STEPS '3:1': the first step 3 is after"):
        rlkernel.step_begin()


def test_capture_window_without_cuda_warns_and_runs_on():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA warning")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        phases._cuda_profiler(True)
    assert any("has no CUDA device" in str(x.message) for x in w)
