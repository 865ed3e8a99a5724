"""The run directory: names, atomic rename, -failed runs, the manifest's keys, the environment allow-list."""
import datetime
import json

import pytest

from pipelines import manifest, runs

pytestmark = pytest.mark.smoke

WHEN = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)


def test_run_name():
    assert runs.run_name(["logp-fused"], WHEN) == "20260102T030405Z-logp-fused"
    assert runs.run_name(["logp-native", "logp-fused", "sampling-fused"], WHEN) == "20260102T030405Z-logp-native+2"


def test_env_allow_list_drops_everything_else():
    environ = {"CUDA_VISIBLE_DEVICES": "1", "NVIDIA_VISIBLE_DEVICES": "all", "RLKERNEL_VALIDATE": "0",
               "TORCH_CUDA_ARCH_LIST": "9.0a", "CUDA_LAUNCH_BLOCKING": "1", "HF_TOKEN": "secret",
               "AWS_SECRET_ACCESS_KEY": "secret", "PATH": "/usr/bin", "XRLKERNEL_": "no"}
    assert manifest.allowed_env(environ) == {"CUDA_LAUNCH_BLOCKING": "1", "CUDA_VISIBLE_DEVICES": "1",
                                             "NVIDIA_VISIBLE_DEVICES": "all", "RLKERNEL_VALIDATE": "0",
                                             "TORCH_CUDA_ARCH_LIST": "9.0a"}


def test_env_allow_list_names_the_projects_variables():
    # issue 19 item 4: a prefix let any RLKERNEL_* through, a token included
    ours = {"RLKERNEL_VALIDATE": "sync", "RLKERNEL_REQUIRE_FUSED": "1", "RLKERNEL_REQUIRE_NVCC": "0",
            "RLKERNEL_ANALYZE_MEMORY": "2GB"}
    environ = {**ours, "RLKERNEL_API_TOKEN": "secret", "RLKERNEL_": "x", "RLKERNEL_VALIDATEX": "1"}
    assert manifest.allowed_env(environ) == ours


def test_built_under_a_hidden_name_then_renamed(tmp_path):
    run = runs.RunDir(tmp_path, ["logp-fused"], WHEN)
    assert run.path.name.startswith(".") and run.path.is_dir()
    (run.path / "trace.sqlite").write_text("x")
    assert not (tmp_path / run.name).exists()  # nothing looks like a whole run while it is built
    final = run.complete()
    assert final == tmp_path / "20260102T030405Z-logp-fused" and not run.path.exists()
    assert (final / "trace.sqlite").exists()
    m = json.loads((final / "manifest.json").read_text())
    assert tuple(m) == manifest.MANIFEST_KEYS
    assert (m["schema"], m["status"], m["error"], m["created_at"]) == (1, "complete", None, "2026-01-02T03:04:05Z")
    assert [p.name for p in tmp_path.iterdir()] == [final.name]  # no temporary files left behind


def test_failed_run_keeps_its_error(tmp_path):
    run = runs.RunDir(tmp_path, ["logp-native", "logp-fused"], WHEN)
    final = run.fail("nsys profile exited 1: boom")
    assert final.name == "20260102T030405Z-logp-native+1-failed"
    m = json.loads((final / "manifest.json").read_text())
    assert (m["status"], m["error"]) == ("failed", "nsys profile exited 1: boom")


def test_same_second_runs_do_not_collide(tmp_path):
    first = runs.RunDir(tmp_path, ["logp-fused"], WHEN).complete()
    second = runs.RunDir(tmp_path, ["logp-fused"], WHEN).complete()
    assert first != second and first.exists() and second.exists()


def test_manifest_missing_a_key_is_refused(tmp_path):
    run = runs.RunDir(tmp_path, ["logp-fused"], WHEN)
    del run.manifest["env"]
    with pytest.raises(ValueError, match="env"):
        run.write_manifest()
