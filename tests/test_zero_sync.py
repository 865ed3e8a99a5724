"""GPU tests of the zero-sync contract (docs/contracts.md, section 1): no op call blocks the host, bad input goes to
the device error record and ``rlkernel.check_errors`` raises it; CUDA graphs and torch.compile end to end.

``torch.cuda.set_sync_debug_mode("error")`` sees syncs that go through torch (``.item()``, ``nonzero``, a
blocking copy); a raw CUDA call made in csrc/ is not seen by it: the committed trace fixture
(tests/test_zero_sync_trace.py) is the proof for those.
"""
from __future__ import annotations

import contextlib
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from cuda_graphs import warm_on_side_stream

import rlkernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = pathlib.Path(__file__).resolve().parents[1]
V = 32003  # odd: rows start off vector alignment in bf16


@pytest.fixture(autouse=True)
def _need_fused_and_a_clean_record():
    from rlkernel import _ext

    # not a skip: on a CUDA machine these tests need the build (python setup.py build_ext --inplace)
    assert _ext.unavailable_reason() is None, _ext.unavailable_reason()
    rlkernel.check_errors()  # start from an empty record
    yield
    with contextlib.suppress(IndexError, ValueError):
        rlkernel.check_errors()


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def inputs(n=48, v=V, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(n, v, device="cuda", generator=g) * 3).to(dtype)
    ids = torch.randint(0, v, (n,), device="cuda", generator=g)
    return x, ids


@pytest.mark.parametrize("backend", ["fused", "native"])
def test_every_op_runs_without_a_host_sync(backend):
    x, ids = inputs()
    x.requires_grad_(True)
    gen = torch.Generator(device="cuda").manual_seed(5)
    bad = ids.clone()
    bad[7] = V + 3
    with no_sync():
        lp, ent = rlkernel.logp(x, ids, return_entropy=True, temperature=0.7, backend=backend)
        (lp.sum() + 0.1 * ent.sum()).backward()
        lp2 = rlkernel.logp(x.detach(), ids, backend=backend)
        tok = rlkernel.sample(x.detach(), top_k=50, top_p=0.9, generator=gen, backend=backend)
        tok2, tok_lp = rlkernel.sample(x.detach(), temperature=0.8, return_logprobs=True, backend=backend)
        greedy = rlkernel.sample(x.detach(), temperature=0, backend=backend)
        rlkernel.logp(x.detach(), bad, backend=backend)  # a bad id: NaN there, and a record entry
    torch.cuda.synchronize()
    assert x.grad is not None and torch.isfinite(lp).all() and torch.isfinite(lp2).all()
    assert ((tok >= 0) & (tok < V)).all() and ((tok2 >= 0) & (tok2 < V)).all() and torch.isfinite(tok_lp).all()
    assert torch.equal(greedy, x.detach().float().argmax(-1))
    with pytest.raises(IndexError, match=rf"logp.forward: token id out of range at position \(7,\) \(id {V + 3}"):
        rlkernel.check_errors()
    rlkernel.check_errors()  # cleared


def test_eager_entry_gives_the_registered_ops_bits_and_modes_still_see_the_op():
    """The no-grad eager forward goes straight into rlkernel._C (csrc/python_module.cpp); under a torch dispatch mode,
    or with a gradient to record, the registered op runs: same bits either way, errors reported the same way."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class SeenOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x, ids = inputs(n=67, dtype=torch.float16, seed=4)
    ids[9] = -5  # a bad id: NaN there, and a record entry, on both entries
    with no_sync():
        lp, ent = rlkernel.logp(x, ids, return_entropy=True, temperature=1.3, backend="fused")
    with SeenOps() as seen:
        lp_op, ent_op = rlkernel.logp(x, ids, return_entropy=True, temperature=1.3, backend="fused")
    assert any("rlkernel.logp_forward" in op for op in seen.ops), seen.ops
    lp_grad, ent_grad = rlkernel.logp(x.clone().requires_grad_(True), ids, return_entropy=True, temperature=1.3,
                                      backend="fused")
    torch.cuda.synchronize()
    for a, b in ((lp, lp_op), (ent, ent_op), (lp, lp_grad.detach()), (ent, ent_grad.detach())):
        assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    assert lp[9].isnan() and torch.isfinite(lp[torch.arange(67, device="cuda") != 9]).all()
    with pytest.raises(IndexError, match=r"position \(9,\) \(id -5"):
        rlkernel.check_errors()
    # the sampler: seeded rows (a pure function of logits, settings, seed and offset), per-row and scalar settings
    seeds = torch.arange(67, device="cuda") * 7919 + 3
    top_p = torch.linspace(0.2, 1.0, 67, device="cuda")
    kw = dict(top_k=50, top_p=top_p, min_p=0.01, seed=seeds, offset=11, return_logprobs="processed", backend="fused")
    with no_sync():
        ids_e, lp_e = rlkernel.sample(x, **kw)
    with SeenOps() as seen:
        ids_o, lp_o = rlkernel.sample(x, **kw)
    assert any("rlkernel.sample" in op for op in seen.ops), seen.ops
    torch.cuda.synchronize()
    assert torch.equal(ids_e, ids_o) and torch.equal(lp_e, lp_o) and (ids_e >= 0).all()
    rlkernel.check_errors()


@pytest.mark.parametrize("backend", ["fused", "native"])
def test_the_first_error_of_the_earliest_call_is_kept(backend):
    x, ids = inputs(n=12)
    a, b = ids.clone(), ids.clone()
    a[9], a[4] = -5, V
    b[1] = V + 100
    rows = x.float().clone()
    rows[5] = float("-inf")
    with no_sync():
        out_a = rlkernel.logp(x.view(3, 4, V), a.view(3, 4), backend=backend)
        rlkernel.logp(x, b, backend=backend)
        tok, tok_lp = rlkernel.sample(rows, top_k=20, return_logprobs=True, backend=backend)
    torch.cuda.synchronize()
    assert out_a.view(-1)[[4, 9]].isnan().all() and out_a.view(-1)[:4].isfinite().all()
    assert tok[5].item() == -1 and tok_lp[5].isnan() and (tok[:5] >= 0).all()
    with pytest.raises(IndexError, match=rf"position \(1, 0\) \(id {V}, vocab size {V}\)"):
        rlkernel.check_errors()  # the first call's first position (4 -> (1, 0)), not -5 at (2, 1) nor b's
    rlkernel.check_errors()
    rows2 = x.float().clone()
    rows2[3, 10] = float("nan")
    rlkernel.sample(rows2, backend=backend)
    with pytest.raises(ValueError, match="sample: row 3 has no finite probabilities"):
        rlkernel.check_errors()


def test_validate_modes(monkeypatch):
    x, ids = inputs(n=6)
    ids[2] = V
    monkeypatch.setenv("RLKERNEL_VALIDATE", "sync")
    with pytest.raises(IndexError, match=r"\(2,\)"):
        rlkernel.logp(x, ids)  # raised inside the call
    monkeypatch.setenv("RLKERNEL_VALIDATE", "0")
    out = rlkernel.logp(x, ids)
    assert out[2].isnan()
    rlkernel.check_errors()  # nothing was recorded
    monkeypatch.setenv("RLKERNEL_VALIDATE", "always")
    with pytest.raises(ValueError, match="RLKERNEL_VALIDATE"):
        rlkernel.logp(x, ids)


@pytest.mark.parametrize("backend", ["fused", "native"])
def test_sample_graph_with_a_user_generator_replays_as_eager_calls(backend):
    x, _ = inputs(n=64, dtype=torch.float32)
    gen = torch.Generator(device="cuda")

    def draw():
        return rlkernel.sample(x, top_k=50, top_p=0.9, generator=gen, backend=backend)

    warm_on_side_stream(draw)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(gen)
    with torch.cuda.graph(graph):
        out = draw()
    gen.manual_seed(7)
    replays = []
    for _ in range(4):
        graph.replay()
        replays.append(out.clone())
    gen.manual_seed(7)
    eager = [draw() for _ in range(4)]
    assert all(torch.equal(r, e) for r, e in zip(replays, eager, strict=True))
    assert not torch.equal(replays[0], replays[1])  # successive replays draw afresh


def isolated(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter: a capture that fails half-way leaves torch's default CUDA generator
    unusable for the rest of the process ("Offset increment outside graph capture"), so such cases run apart."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_sample_graph_with_an_unregistered_generator_is_a_clear_error():
    r = isolated("""
        import torch, rlkernel
        x = torch.randn(8, 5000, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(1)
        rlkernel.sample(x, top_k=5, generator=gen, backend="fused")
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                rlkernel.sample(x, top_k=5, generator=gen, backend="fused")
        except RuntimeError as e:
            print("raised:", e)
        """)
    assert "raised:" in r.stdout and "graph.register_generator_state(generator)" in r.stdout, r.stdout + r.stderr


def test_a_capture_needs_a_record_made_before_it():
    r = isolated("""
        import torch, rlkernel
        x, ids = torch.randn(4, 300, device="cuda"), torch.zeros(4, dtype=torch.long, device="cuda")
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                rlkernel.logp(x, ids, backend="fused")
        except RuntimeError as e:
            print("raised:", e)
        """)
    assert "raised:" in r.stdout and "before capturing" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("backend", ["fused", "native"])
def test_logp_step_graph_equals_eager_bitwise(backend):
    x0, ids = inputs(n=40)
    ids[3] = -100
    x = x0.clone().requires_grad_(True)

    def step():
        x.grad = None
        lp, ent = rlkernel.logp(x, ids, return_entropy=True, temperature=0.9, backend=backend)
        (lp.sum() - 0.01 * ent.sum()).backward()
        return lp.detach(), ent.detach(), x.grad

    lp_e, ent_e, grad_e = (t.clone() for t in step())
    warm_on_side_stream(step)
    graph = torch.cuda.CUDAGraph()
    x.grad = None
    with torch.cuda.graph(graph):
        lp_g, ent_g, grad_g = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(lp_g, lp_e) and torch.equal(ent_g, ent_e) and torch.equal(grad_g, grad_e)


def test_grpo_loss_step_graph_equals_eager_bitwise():
    from rlkernel.grpo import GRPOConfig, Trainer, rollout

    cfg = GRPOConfig(num_prompts=2, samples_per_prompt=4, prompt_len=4, completion_len=8, vocab_size=5003,
                     hidden_dim=64, seed=3, dtype=torch.bfloat16)
    trainer = Trainer(cfg, "cuda")
    ro = rollout(trainer.policy, cfg, trainer.generator, torch.device("cuda"))
    params = list(trainer.policy.parameters())

    def step():
        for p in params:
            p.grad = None
        t = trainer.loss_terms(ro)
        t.logits.retain_grad()
        t.loss.backward()
        return t.lp.detach(), t.loss.detach(), t.logits.grad

    lp_e, loss_e, grad_e = (t.clone() for t in step())
    warm_on_side_stream(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lp_g, loss_g, grad_g = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(lp_g, lp_e) and torch.equal(loss_g, loss_e) and torch.equal(grad_g, grad_e)
    rlkernel.check_errors()


def test_compiled_fused_logp_and_sample_have_no_graph_break_and_equal_eager(monkeypatch):
    from rlkernel import errors

    torch._dynamo.reset()
    monkeypatch.setattr(errors, "_records", {})  # no record yet: the trace makes it
    monkeypatch.setattr(errors, "_addresses", {})
    x0, ids = inputs(n=64)

    def logp_step(x, ids):
        lp, ent = rlkernel.logp(x, ids, return_entropy=True, temperature=0.8)
        return lp, ent

    def draw(x):
        return rlkernel.sample(x, top_k=50, top_p=0.9, return_logprobs=True)

    x = x0.clone().requires_grad_(True)
    explain = torch._dynamo.explain(logp_step)(x, ids)
    assert explain.graph_break_count == 0, explain.break_reasons
    explain = torch._dynamo.explain(draw)(x0)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(logp_step, fullgraph=True)
    bad = ids.clone()
    bad[5] = V
    with rlkernel.dispatch.recording() as rec:
        with torch._dynamo.config.patch(error_on_recompile=True):  # counting the records must not recompile
            for _ in range(10):
                x.grad = None
                lp_c, ent_c = compiled(x, ids)
                (lp_c.sum() + ent_c.sum()).backward()
        compiled(x.detach(), bad)  # no grad needed: a second graph, whose bad ids are reported too
    with pytest.raises(IndexError, match=rf"position 5 \(id {V}\) \[a torch.compile'd call"):
        rlkernel.check_errors()
    grad_c, x.grad = x.grad.clone(), None
    assert {(r.op, r.status): n for r, n in rec.records} == {("logp.forward", "fused"): 11,
                                                             ("logp.backward", "fused"): 10}
    lp, ent = logp_step(x, ids)
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(lp_c, lp) and torch.equal(ent_c, ent) and torch.equal(grad_c, x.grad)
    torch.manual_seed(3)
    ids_c, tlp_c = torch.compile(draw, fullgraph=True)(x0)
    torch.manual_seed(3)
    ids_e, tlp_e = draw(x0)
    assert torch.equal(ids_c, ids_e) and torch.equal(tlp_c, tlp_e)
