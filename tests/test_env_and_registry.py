"""The node record and the workload registry (CPU)."""
import json
import subprocess
import sys

import pytest
import torch

from rlkernel import env, workloads
from rlkernel.workloads import Shape, Workload

pytestmark = pytest.mark.smoke


def test_cpu_node_record():
    rec = env.describe()
    for key in ("python", "torch", "cuda_runtime", "hip", "driver", "device_count", "extension", "devices"):
        assert key in rec
    if not torch.cuda.is_available():
        (dev,) = rec["devices"]
        assert dev["name"] == "CPU" and dev["backend"] == "cpu" and dev["index"] == -1
        assert rec["extension"]["built"] is False and rec["extension"]["reason"]


def test_env_cli_prints_and_json_round_trips():
    out = subprocess.run([sys.executable, "-m", "rlkernel.env", "--json"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["torch"] == torch.__version__
    text = subprocess.run([sys.executable, "-m", "rlkernel.env"], capture_output=True, text=True, check=True).stdout
    assert "extension" in text and "device" in text


def test_env_cli_prints_only_what_applies():
    # issue 19 item 25: a CPU node printed `cc None | None SMs | 0.0 GiB | nan TB/s`
    text = subprocess.run([sys.executable, "-m", "rlkernel.env"], capture_output=True, text=True, check=True).stdout
    assert "None" not in text and "nan" not in text, text
    cpu = env.device_line(env.cpu_device())
    assert cpu == f"device -1: CPU | {env.cpu_device()['architecture']} | cpu"
    gpu = {"index": 0, "physical_index": "3", "name": "NVIDIA H200", "architecture": "Hopper", "backend": "cuda",
           "compute_capability": "9.0", "sm_count": 132, "memory_bytes": 150 * 2**30,
           "memory_bandwidth_bytes_per_s": 4.8e12}
    assert env.device_line(gpu) == ("device  0 (physical 3): NVIDIA H200 | Hopper | cuda | cc 9.0 | 132 SMs | "
                                    "150.0 GiB | 4.80 TB/s")
    assert env.device_line({**gpu, "memory_bandwidth_bytes_per_s": None}).endswith("| 150.0 GiB")


@pytest.mark.parametrize("cc,arch", [((8, 0), "Ampere"), ((8, 6), "Ampere"), ((8, 9), "Ada Lovelace"),
                                     ((9, 0), "Hopper"), ((10, 0), "Blackwell"), ((12, 0), "Blackwell")])
def test_architecture_names(cc, arch):
    assert env.architecture(*cc) == arch


def test_physical_index_mapping():
    assert env._physical(0, "3,1", None) == "3"
    assert env._physical(1, "GPU-abc,GPU-def", None) == "GPU-def"
    assert env._physical(2, None, None) == "2"


def test_registry_entries_and_fields():
    expected = {"logp-native", "logp-fused", "logp-native-bwd", "logp-fused-bwd", "sampling-native",
                "sampling-fused", "linear-logp-native", "linear-logp-fused", "linear-logp-fused-bwd"}
    assert expected <= set(workloads.names())
    for name in workloads.names():
        w = workloads.get(name)
        assert w.path in ("native", "fused")
        assert bool(w.fused_ops) == (w.path == "fused")
        assert w.fused_patterns
    with pytest.raises(KeyError, match="unknown workload"):
        workloads.get("nope")


def test_registry_order_is_the_suites_run_order():
    # names() is the order the profile suite and capture run in and list: the package split (issue 28) kept it
    assert workloads.names() == [
        "logp-native", "logp-native-bwd", "sampling-native", "sampling-mixed-native",
        "logp-fused", "logp-fused-bwd", "sampling-fused", "sampling-mixed-fused",
        "linear-logp-native", "linear-logp-fused", "linear-logp-fused-bwd", "grpo-step"]


def test_registry_validates_entries():
    w = workloads.get("logp-native")
    with pytest.raises(ValueError, match="fused_ops"):
        Workload(name="x", op="logp", path="fused", backend="auto", fused_ops=(), description="",
                 build=w.build, step=w.step, count_bytes=w.count_bytes, count_flops=w.count_flops)
    with pytest.raises(ValueError, match="unknown ops"):
        Workload(name="x", op="logp", path="fused", backend="auto", fused_ops=("logp.sideways",), description="",
                 build=w.build, step=w.step, count_bytes=w.count_bytes, count_flops=w.count_flops)
    with pytest.raises(ValueError, match="twice"):
        workloads.register(w)


@pytest.mark.parametrize("name", ["logp-fused", "logp-fused-bwd", "sampling-fused"])
def test_fused_workloads_run_on_cpu_as_fallback_and_check_clean(name):
    w = workloads.get(name)
    shape = Shape(2, 3, 37)
    inputs = w.make_inputs(shape, torch.float32, "cpu", seed=0)
    assert not torch.all(inputs["logits"] == 0)
    assert w.check(inputs) is None
    assert workloads.fused_available(w, "cpu", torch.float32) == "tensor on cpu"
    from rlkernel import dispatch

    with dispatch.recording() as rec:
        w.repetition(inputs)
    assert rec.statuses() == {"fallback"}


@pytest.mark.parametrize("name", ["linear-logp-native", "linear-logp-fused", "linear-logp-fused-bwd"])
def test_linear_logp_workloads_run_on_cpu_and_check_clean(name):
    w = workloads.get(name)
    shape = Shape(2, 3, 37, hidden_size=24)
    inputs = w.make_inputs(shape, torch.float32, "cpu", seed=0)
    assert inputs["hidden"].shape == (6, 24) and inputs["weight"].shape == (37, 24)
    assert not torch.all(inputs["hidden"] == 0) and not torch.all(inputs["weight"] == 0)
    assert w.check(inputs) is None
    from rlkernel import dispatch

    with dispatch.recording() as rec:
        w.repetition(inputs)
    ops = {r.op for r, _ in rec.records}
    assert ops == ({"linear_logp.forward", "linear_logp.backward"} if w.has_backward else {"linear_logp.forward"})
    assert rec.statuses() == ({"native"} if w.path == "native" else {"fallback"})
    assert w.manifest_entry(shape, torch.float32, 1, 2)["shape"]["hidden_size"] == 24
    if w.path == "fused":
        assert workloads.fused_available(w, "cpu", torch.float32) == "tensor on cpu"
        assert set(w.fused_ops) <= {"linear_logp.forward", "linear_logp.backward"}


def test_linear_logp_check_catches_a_wrong_result(monkeypatch):
    import rlkernel

    w = workloads.get("linear-logp-fused")
    inputs = w.make_inputs(Shape(2, 3, 37, hidden_size=24), torch.float32, "cpu", seed=1)
    real = rlkernel.linear_logp

    def off(*args, backend="auto", **kw):  # the "fused" side one nat off, the native reference untouched
        lp, ent = real(*args, backend=backend, **kw)
        return (lp - 1.0, ent) if backend == "auto" else (lp, ent)

    monkeypatch.setattr(rlkernel, "linear_logp", off)
    assert "linear_logp: max |fused - native|" in w.check(inputs)


def test_linear_logp_bytes_and_flops():
    s = Shape(4, 8, 1000, hidden_size=64)
    fwd, bwd = workloads.get("linear-logp-native"), workloads.get("linear-logp-fused-bwd")
    assert fwd.flops(s, torch.bfloat16) == 2 * 32 * 64 * 1000 + 5 * 32 * 1000
    assert bwd.flops(s, torch.bfloat16) == 8 * 32 * 64 * 1000 + 10 * 32 * 1000
    assert fwd.bytes_moved(s, torch.bfloat16) == (32 + 1000) * 64 * 2 + 32 * 16
    assert Shape(4, 8, 1000).hidden_size == 1024
    assert workloads.get("sampling-native").effective_shape(s).hidden_size == 64
    assert fwd.shape_error(Shape(1, 1, 10, hidden_size=0))


def test_bytes_and_sampling_shape():
    s = Shape(4, 8, 1000)
    assert workloads.get("logp-native").bytes_moved(s, torch.bfloat16) == 32 * 1000 * 2 + 32 * 12
    assert workloads.get("logp-native-bwd").bytes_moved(s, torch.float32) == 3 * 32 * 1000 * 4 + 32 * 20
    sampling = workloads.get("sampling-native")
    assert sampling.effective_shape(s).seq_len == 1
    assert sampling.bytes_moved(s, torch.float32) == 4 * 1000 * 4 + 4 * 8


def test_sampling_check_at_temperature_zero_is_argmax(monkeypatch):
    import rlkernel

    w = workloads.get("sampling-fused")
    inputs = w.make_inputs(Shape(3, 1, 41, temperature=0.0), torch.float32, "cpu", seed=1)
    assert w.check(inputs) is None  # the native fallback draws the argmax: no mismatch
    real = rlkernel.sample
    monkeypatch.setattr(rlkernel, "sample", lambda *a, **k: (real(*a, **k) + 1) % 41)
    assert "temperature 0" in w.check(inputs)  # a sampler that misses the argmax is caught
