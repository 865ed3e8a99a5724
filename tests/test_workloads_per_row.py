"""The registry's per-row sampling: Shape.min_p / per_row, the mixed-settings workload (CPU: native, and the fused
entry as a recorded fallback whose check passes)."""
import warnings

import pytest
import torch

from rlkernel import dispatch, workloads
from rlkernel.workloads import Shape


@pytest.mark.parametrize("name", ["sampling-mixed-native", "sampling-mixed-fused", "sampling-native",
                                  "sampling-fused"])
@pytest.mark.parametrize("per_row", [False, True])
def test_per_row_sampling_workloads_run_and_check(name, per_row):
    w = workloads.get(name)
    shape = Shape(5, 3, 211, top_k=20, top_p=0.8, temperature=0.9, min_p=0.05, per_row=per_row)
    inputs = w.make_inputs(shape, torch.float32, "cpu", seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dispatch.FallbackWarning)
        ids = w.run(inputs)
        assert ids.shape == (5,) and bool(((ids >= 0) & (ids < 211)).all())
        if w.compare is not None:
            assert w.compare(inputs) is None
    if name.startswith("sampling-mixed"):
        assert isinstance(inputs["top_k"], torch.Tensor) and inputs["seed"] is not None
        assert inputs["top_k"].tolist() == [0, 0, 0, 0, 0]  # the grid's first configs: T = 0, k = 0
    elif per_row:
        assert inputs["min_p"].tolist() == pytest.approx([0.05] * 5) and inputs["generator"] is None


def test_mixed_rows_cycle_the_grid_and_greedy_rows_are_argmax():
    w = workloads.get("sampling-mixed-native")
    inputs = w.make_inputs(Shape(120, 1, 64), torch.float32, "cpu", seed=1)
    t, k = inputs["temperature"], inputs["top_k"]
    assert sorted(set(t.tolist())) == pytest.approx([0.0, 0.7, 1.0]) and set(k.tolist()) == {0, 1, 50, 64}
    ids = w.run(inputs)
    greedy = t == 0
    assert torch.equal(ids[greedy], inputs["logits"].argmax(-1)[greedy])


def test_shape_as_dict_has_min_p_and_per_row():
    d = Shape(2, 1, 10, min_p=0.1, per_row=True).as_dict()
    assert d["min_p"] == 0.1 and d["per_row"] is True
