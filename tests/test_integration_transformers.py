"""rlkernel.integrations.transformers against the real transformers: each family's patched forward(labels=...)
gives the model's own loss and gradients (float32 rounding), with tied, bias and padded-vocabulary heads; the
per-token log-probs / entropy call; every fallback with its recorded reason; a spy that fails if the model's own
head ran instead of rlkernel's; a two-process gloo DDP run through the patched forward. Skipped without
transformers; required in `tox -e transformers` (tests/integration_support.py)."""
from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from integration_support import framework  # noqa: E402

tf = framework("transformers", "transformers")

import rlkernel  # noqa: E402
from rlkernel import dispatch  # noqa: E402
from rlkernel.integrations import UnsupportedVersionError  # noqa: E402
from rlkernel.integrations import transformers as rk  # noqa: E402

V, H = 64, 32
SMALL = dict(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "llama": lambda **kw: tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, **kw)),
    "mistral": lambda **kw: tf.MistralForCausalLM(tf.MistralConfig(**SMALL, **kw)),
    "qwen2": lambda **kw: tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL, **kw)),
    "qwen3": lambda **kw: tf.Qwen3ForCausalLM(tf.Qwen3Config(**SMALL, head_dim=8, **kw)),
    "gemma2": lambda **kw: tf.Gemma2ForCausalLM(tf.Gemma2Config(**SMALL, head_dim=8, **{
        "final_logit_softcapping": None, **kw})),
    "gemma3": lambda **kw: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**SMALL, head_dim=8, **kw)),
}
LINEAR_OPS = {"linear_logp_loss", "linear_logp.forward", "linear_logp.backward"}


def make(family="qwen2", seed=0, **kw):
    torch.manual_seed(seed)
    model = FAMILIES[family](**kw)
    model.eval()  # no dropout: one function for both paths
    return model


def batch(seed=1, b=3, s=10, vocab=V):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    labels[1, -3:] = -100  # right padding
    return ids, labels


def loss_and_grads(model, *args, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(*args, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(ref, got, rtol=1e-5):
    assert ref.keys() == got.keys()
    for n in ref:
        rel = ((ref[n] - got[n]).norm() / ref[n].norm().clamp_min(1e-30)).item()
        assert rel <= rtol, f"{n}: gradient relative difference {rel:.3g}"


class LmHeadSpy:
    """Counts calls of nn.Linear.forward on the model's lm_head: the model's own head step."""

    def __init__(self, monkeypatch, model):
        self.calls = 0
        original = torch.nn.Linear.forward

        def spy(mod, x):
            if mod is model.lm_head:
                self.calls += 1
            return original(mod, x)

        monkeypatch.setattr(torch.nn.Linear, "forward", spy)


def ops(rec):
    return {r.op: r for r, _ in rec.records}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_loss_and_grads_equal_the_models_own(family, monkeypatch):
    model = make(family)
    ids, labels = batch()
    ref, ref_g = loss_and_grads(model, ids, labels=labels)
    spy = LmHeadSpy(monkeypatch, model)
    with rk.apply(model), dispatch.recording() as rec:
        out, g = loss_and_grads(model, ids, labels=labels)
    assert spy.calls == 0  # the model's own lm_head never ran: rlkernel's op did
    assert "linear_logp_loss" in ops(rec) and rk.OP not in ops(rec)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-7)
    assert_grads_close(ref_g, g)


@pytest.mark.parametrize("variant", ["tied", "bias", "padded"])
def test_tied_bias_and_padded_heads(variant):
    model = make("llama", tie_word_embeddings=variant == "tied")
    if variant == "tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if variant == "bias":
        torch.manual_seed(5)
        head = torch.nn.Linear(H, V, bias=True)
        model.lm_head = head
    # padded: the tokenizer's ids stop at 48; rows 48..63 of the head are padding, in the softmax as in the model
    ids, labels = batch(vocab=48 if variant == "padded" else V)
    ref, ref_g = loss_and_grads(model, ids, labels=labels)
    with rk.apply(model):
        out, g = loss_and_grads(model, ids, labels=labels)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-7)
    assert_grads_close(ref_g, g)
    if variant == "padded":
        assert g["lm_head.weight"][48:].abs().sum() > 0  # the padded rows take part in the softmax
    if variant == "bias":
        assert "lm_head.bias" in g


def test_num_items_in_batch_and_shift_labels_and_return_dict():
    model = make("qwen2")
    ids, labels = batch()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    n = torch.tensor(7)
    cases = [dict(labels=labels, num_items_in_batch=n), dict(labels=labels, shift_labels=shifted),
             dict(labels=labels.masked_fill(labels == -100, 5), ignore_index=5)]
    for kwargs in cases:
        ref, ref_g = loss_and_grads(model, ids, **kwargs)
        with rk.apply(model), dispatch.recording() as rec:
            out, g = loss_and_grads(model, ids, **kwargs)
            as_tuple = model(ids, labels=labels, return_dict=False)
        assert "linear_logp_loss" in ops(rec), kwargs
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-7)
        assert_grads_close(ref_g, g)
        assert isinstance(as_tuple, tuple) and as_tuple[0].ndim == 0


def _reference_token_logps(model, ids, labels, temperature):
    logits = model(ids).logits[:, :-1].float() / temperature
    la = torch.log_softmax(logits, -1)
    targets = labels[:, 1:]
    keep = targets != -100
    lp = torch.where(keep, la.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1), 0.0)
    ent = torch.where(keep, -(la.exp() * la).sum(-1), 0.0)
    return lp, ent


@pytest.mark.parametrize("family", ["qwen2", "gemma2_softcap"])
def test_per_token_logps_and_entropy(family, monkeypatch):
    model = make("gemma2", final_logit_softcapping=30.0) if family == "gemma2_softcap" else make(family)
    ids, labels = batch()
    t = 0.7
    lp, ent = _reference_token_logps(model, ids, labels, t)
    model.zero_grad()
    (lp.sum() + 0.1 * ent.sum()).backward()
    ref_g = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    spy = LmHeadSpy(monkeypatch, model)
    with rk.apply(model), dispatch.recording() as rec:
        out = model(ids, labels=labels, per_token_logps=True, temperature=t, return_entropy=True)
        (out.token_logps.sum() + 0.1 * out.entropy.sum()).backward()
    assert out.token_logps.shape == out.entropy.shape == (3, 9) and out.token_logps.dtype == torch.float32
    torch.testing.assert_close(out.token_logps, lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy, ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, -lp.sum() / (labels[:, 1:] != -100).sum())
    assert_grads_close(ref_g, {n: p.grad for n, p in model.named_parameters()}, rtol=1e-4)
    if family == "gemma2_softcap":
        assert ops(rec)[rk.OP].reason == "softcap (final_logit_softcapping=30.0) not supported"
        assert spy.calls == 1
    else:
        assert {"linear_logp.forward", "linear_logp.backward"} <= set(ops(rec)) and spy.calls == 0


def test_per_token_logps_need_labels():
    model = make()
    with rk.apply(model), pytest.raises(ValueError, match="needs labels"):
        model(batch()[0], per_token_logps=True)


def _custom_loss(logits, labels, vocab_size, **kwargs):
    return tf.loss.loss_utils.ForCausalLMLoss(logits, labels, vocab_size, **kwargs) * 2


def _fallback_case(case):
    """(model, forward kwargs, recorded reason, context) for each fallback."""
    import contextlib

    ids, labels = batch()
    ctx = contextlib.nullcontext()
    kwargs = dict(labels=labels)
    if case == "gemma2_default_softcap":
        model = make("gemma2", final_logit_softcapping=30.0)
        reason = "softcap (final_logit_softcapping=30.0) not supported"
    elif case == "gemma3_softcap":
        model = make("gemma3", final_logit_softcapping=20.0)
        reason = "softcap (final_logit_softcapping=20.0) not supported"
    elif case == "autocast":
        model, ctx = make(), torch.autocast("cpu", dtype=torch.bfloat16)
        reason = "mixed dtypes (hidden float32, weight float32, compute bfloat16): the ops take one dtype"
    elif case == "custom_loss":
        model = make()
        model.loss_function = _custom_loss
        reason = "a custom loss_function ('_custom_loss')"
    elif case == "hooked_head":
        model = make()
        model.lm_head.register_forward_hook(lambda mod, inp, out: None)
        reason = "lm_head has forward hooks, which the fused loss would skip"
    elif case == "logits_to_keep":
        model = make()
        kwargs = dict(labels=labels[:, -4:], logits_to_keep=4)
        reason = "logits_to_keep=4 with labels"
    elif case == "zero3":
        model = make()
        model.lm_head.weight.ds_id = 0  # what DeepSpeed ZeRO-3 sets on a partitioned parameter
        reason = "the LM head weight is a DeepSpeed ZeRO-3 parameter: sharded weights are not supported"
    else:
        raise AssertionError(case)
    return model, ids, kwargs, reason, ctx


FALLBACKS = ["gemma2_default_softcap", "gemma3_softcap", "autocast", "custom_loss", "hooked_head",
             "logits_to_keep", "zero3"]


@pytest.mark.parametrize("case", FALLBACKS)
def test_every_fallback_runs_the_models_own_code_with_its_reason(case, monkeypatch):
    model, ids, kwargs, reason, ctx = _fallback_case(case)
    with ctx:
        ref = model(ids, **kwargs)
    spy = LmHeadSpy(monkeypatch, model)
    with rk.apply(model), dispatch.recording() as rec, ctx, pytest.warns(rlkernel.FallbackWarning, match="framework"):
        out = model(ids, **kwargs)
    assert [r for r, _ in rec.records] == [dispatch.Dispatch(rk.OP, "auto", "framework", "fallback", reason)]
    assert spy.calls == 1  # the model's own head
    torch.testing.assert_close(out.loss, ref.loss)
    assert out.logits is not None


def test_a_fallback_where_fused_is_required_is_blocked_before_the_model_runs(monkeypatch):
    model = make("gemma2", final_logit_softcapping=30.0)
    spy = LmHeadSpy(monkeypatch, model)
    ids, labels = batch()
    with rk.apply(model, require_fused=True), pytest.raises(rlkernel.FusedKernelUnavailable, match="softcap"):
        model(ids, labels=labels)
    assert spy.calls == 0
    assert [r.status for r, _ in dispatch.history()] == ["blocked"]


def test_without_labels_and_generate_are_the_models_own(monkeypatch):
    model = make()
    ids, _ = batch()
    ref_logits = model(ids).logits
    ref_gen = model.generate(ids[:, :4], max_new_tokens=5, do_sample=False)
    with rk.apply(model), dispatch.recording() as rec:
        torch.testing.assert_close(model(ids).logits, ref_logits, rtol=0, atol=0)
        assert torch.equal(model.generate(ids[:, :4], max_new_tokens=5, do_sample=False), ref_gen)
    assert rec.records == []


def test_apply_is_idempotent_undoes_and_checks_what_it_patches(monkeypatch):
    model = make()
    p = rk.apply(model)
    assert rk.apply(model) is p and "forward" in vars(model)
    with pytest.raises(ValueError, match="already applied"):
        rk.apply(model, backend="native")
    p.undo()
    assert "forward" not in vars(model) and model.forward.__func__ is type(model).forward
    with rk.apply(model, backend="native") as q:
        assert q is not p and q.active
    assert not q.active
    with pytest.raises(TypeError, match="not a supported causal LM"):
        rk.apply(tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V)))
    other = make()
    other.forward = lambda *a, **k: None
    with pytest.raises(TypeError, match="already replaced"):
        rk.apply(other)
    model = make()
    # transformers may replace its module in sys.modules while it builds a model: patch the one apply imports
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.40.0")
    with pytest.raises(UnsupportedVersionError, match="supports transformers >=5.0,<6.0; found transformers 4.40.0"):
        rk.apply(model)


def test_signature_is_the_models_own():
    import inspect

    model = make()
    before = inspect.signature(model.forward)
    with rk.apply(model):
        assert inspect.signature(model.forward) == before


def _ddp_worker(rank, world, init_file, out_dir, patched):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = make("qwen2")
        if patched:
            rk.apply(model)
        ddp = DDP(model)
        ids, labels = batch(seed=10 + rank)
        with dispatch.recording() as rec:
            ddp(ids, labels=labels).loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        torch.save({"grads": grads, "ops": sorted(r.op for r, _ in rec.records)}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_process_gloo_ddp_through_the_patched_forward(tmp_path):
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_ddp_worker, args=(world, str(tmp_path / "init"), str(tmp_path), True), nprocs=world, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    # the reference: the model's own loss, each rank's batch, gradients averaged as DDP does
    model = make("qwen2")
    ref = {}
    for r in range(world):
        _, g = loss_and_grads(model, *batch(seed=10 + r)[:1], labels=batch(seed=10 + r)[1])
        for n, t in g.items():
            ref[n] = ref.get(n, 0) + t / world
    for r in range(world):
        assert got[r]["ops"] == ["linear_logp_loss"]
        assert_grads_close(ref, got[r]["grads"])  # synced: every rank holds the average


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_path_on_cuda():
    model = make("qwen2").cuda()
    ids, labels = (t.cuda() for t in batch())
    ref, ref_g = loss_and_grads(model, ids, labels=labels)
    with rk.apply(model), dispatch.recording() as rec:
        out, g = loss_and_grads(model, ids, labels=labels)
    assert ops(rec)["linear_logp_loss"].status == "fused"
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(ref_g, g, rtol=1e-4)


def test_a_batch_without_scored_tokens_gives_loss_zero_where_the_model_gives_nan():
    model = make()
    ids, _ = batch()
    labels = torch.full_like(ids, -100)
    assert torch.isnan(model(ids, labels=labels).loss)
    with rk.apply(model):
        out, g = loss_and_grads(model, ids, labels=labels)
    assert out.loss.item() == 0.0 and all(t.abs().sum() == 0 for t in g.values())


@pytest.mark.parametrize("case", ["autocast", "zero3"])
def test_per_token_logps_where_the_fallback_comes_after_the_backbone(case):
    """A fallback decided on the backbone's output (mixed dtypes under autocast, a ZeRO-3 head): the model's own
    head scored by rlkernel.logp, the backbone's cache under one name (transformers 5 answers `in` for the old
    alias too: both passed once raised 'cannot specify both'), the record and the model's values."""
    model, ids, kwargs, reason, ctx = _fallback_case(case)
    labels = kwargs["labels"]
    with ctx:
        lp, _ = _reference_token_logps(model, ids, labels, 0.8)
    with rk.apply(model), dispatch.recording() as rec, ctx, pytest.warns(rlkernel.FallbackWarning, match="framework"):
        out = model(ids, labels=labels, per_token_logps=True, temperature=0.8)
    assert ops(rec)[rk.OP].reason == reason
    torch.testing.assert_close(out.token_logps, lp, rtol=1e-5, atol=1e-5)


def test_a_fallback_scores_the_models_logits_with_the_patchs_backend():
    """backend / require_fused reach rlkernel.logp on the fallback's logits: backend='native' records native
    there, with no FallbackWarning (on a GPU 'auto' would have run the fused kernel against the user's choice)."""
    model = make("gemma2", final_logit_softcapping=30.0)
    ids, labels = batch()
    with rk.apply(model, backend="native"), dispatch.recording() as rec, warnings.catch_warnings():
        warnings.simplefilter("ignore", rlkernel.FallbackWarning)  # the framework fallback's own warning
        model(ids, labels=labels, per_token_logps=True)
    logp_rec = [r for r, _ in rec.records if r.op == "logp.forward"]
    assert logp_rec and all(r.requested == "native" and r.status == "native" for r in logp_rec), rec.records


def test_a_deep_copy_runs_its_own_weights():
    """copy.deepcopy of a patched model (a frozen reference policy) runs the copy's weights on every path: the
    model's own forward (no labels), the per-token path and the loss."""
    model = make()
    ids, labels = batch()
    rk.apply(model)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(1.5)
        want = type(ref).forward(ref, ids).logits
        torch.testing.assert_close(ref(ids).logits, want, rtol=0, atol=0)
        lp, _ = _reference_token_logps(ref, ids, labels, 1.0)
        torch.testing.assert_close(ref(ids, labels=labels, per_token_logps=True).token_logps, lp, rtol=1e-5,
                                   atol=1e-5)
        assert not torch.equal(model(ids).logits, want)


def test_apply_checks_chunk_size_and_takes_phases():
    model = make()
    with pytest.raises(ValueError, match="chunk_size must be a positive integer or None, got 0"):
        rk.apply(model, chunk_size=0)
    assert "forward" not in vars(model)  # nothing patched
    with rk.apply(model, phases=False) as p:
        assert p.options["phases"] is False


def test_undoing_a_deep_copys_patch_leaves_the_original_patched():
    """The copy's patch undoes the copy alone: its forward is the class's again, the original keeps its patch and
    its mark (apply() on it returns the active patch)."""
    model = make()
    patch = rk.apply(model)
    ref = copy.deepcopy(model)
    ref_patch = rk.apply(ref)  # the copy's own (deep-copied) patch, recognised by its mark
    assert ref_patch is not patch and ref_patch.active
    ref_patch.undo()
    assert "forward" not in vars(ref) and "forward" in vars(model)
    assert rk.apply(model) is patch
    ids, labels = batch()
    with dispatch.recording() as rec:
        model(ids, labels=labels)
    assert LINEAR_OPS & set(ops(rec))
    patch.undo()
    assert "forward" not in vars(model)
