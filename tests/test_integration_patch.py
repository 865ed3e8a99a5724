"""The pieces every rlkernel.integrations module shares, without any framework: the Patch handle (undo, context
manager, idempotence, refusing to drop a later patch), the version check, and dispatch.framework_fallback
(docs/contracts.md, section 2)."""
from __future__ import annotations

import copy
import sys
import types
import warnings

import pytest
import torch

import rlkernel
from rlkernel import dispatch
from rlkernel.dispatch import Dispatch
from rlkernel.integrations import _head, _patch

pytestmark = pytest.mark.smoke


def _owner():
    mod = types.ModuleType("fake_framework")
    mod.entry = "original"
    return mod


def test_patch_replaces_and_undo_restores_once():
    mod = _owner()
    p = _patch.Patch("x", [(mod, "entry", "ours")], {})
    assert mod.entry == "ours" and p.active
    p.undo()
    assert mod.entry == "original" and not p.active
    p.undo()  # a second undo does nothing
    assert mod.entry == "original"


def test_patch_is_a_context_manager_and_deletes_an_attribute_that_was_not_there():
    obj = types.SimpleNamespace()
    with _patch.Patch("x", [(obj, "forward", "ours")], {}) as p:
        assert obj.forward == "ours"
    assert not hasattr(obj, "forward") and not p.active


def test_a_patch_of_several_attributes_undoes_all_or_none():
    a, b = _owner(), _owner()
    p = _patch.Patch("x", [(a, "entry", "ours-a"), (b, "entry", "ours-b")], {})
    assert (a.entry, b.entry) == ("ours-a", "ours-b")
    b.entry = "later"
    with pytest.raises(RuntimeError):
        p.undo()
    assert (a.entry, b.entry) == ("ours-a", "later")  # nothing restored halfway
    b.entry = "ours-b"
    p.undo()
    assert (a.entry, b.entry) == ("original", "original")


def test_undo_refuses_to_drop_a_later_patch():
    mod = _owner()
    p = _patch.Patch("x", [(mod, "entry", "ours")], {})
    mod.entry = "someone else's"
    with pytest.raises(RuntimeError, match="replaced again after this patch"):
        p.undo()
    assert mod.entry == "someone else's" and p.active


def test_reuse_returns_the_active_patch_and_refuses_other_options():
    p = _patch.Patch("x", [(_owner(), "entry", "ours")], {"backend": "auto"})
    assert _patch.reuse(p, "x", {"backend": "auto"}) is p
    with pytest.raises(ValueError, match="already applied"):
        _patch.reuse(p, "x", {"backend": "native"})
    p.undo()
    assert _patch.reuse(p, "x", {"backend": "native"}) is None


def test_a_process_patch_keeps_the_originals_past_undo_and_reuses_the_active_patch():
    mod = _owner()
    slot = _patch.ProcessPatch("x")
    p = slot.install([(mod, "entry", "ours")], {"backend": "auto"}, {"backend": "auto"})
    assert slot.active and slot.options == {"backend": "auto"} and mod.entry == "ours"
    assert slot.reuse({"backend": "auto"}) is p
    with pytest.raises(ValueError, match="already applied"):
        slot.reuse({"backend": "native"})
    p.undo()
    assert not slot.active and slot.options == {} and mod.entry == "original"
    assert slot.originals == {"entry": "original"}  # what a replacement bound elsewhere falls back to
    assert slot.reuse({"backend": "native"}) is None


def test_undoing_a_deep_copy_of_a_process_patch_frees_the_process_slot():
    # a patch of class attributes survives copy.deepcopy (classes are not copied): undoing the copy restores the
    # classes, so the process' slot must be freed too, or the next apply would return a patch that patches nothing
    cls = type("Trainer", (), {"step": "original"})
    slot = _patch.ProcessPatch("x")
    p = slot.install([(cls, "step", "ours")], {})
    copy.deepcopy(p).undo()
    assert cls.step == "original" and not slot.active and slot.reuse({}) is None


def test_bound_by_name_finds_the_modules_that_imported_a_patched_function(monkeypatch):
    home, user, other = (types.ModuleType(f"fakefw.{n}") for n in ("utils", "actor", "misc"))
    home.fn = user.fn = object()  # user: "from .utils import fn"
    other.fn = object()  # a function of the same name that is not the patched one
    for m in (home, user, other):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    monkeypatch.setitem(sys.modules, "elsewhere.actor", user)  # outside the prefix: not searched under its name
    assert _patch.bound_by_name("fakefw.", [(home, "fn", "ours")]) == [(user, "fn", "ours")]


@pytest.mark.parametrize(("version", "ok"), [("1.16.0", True), ("1.16.0.dev0", True), ("1.99", True),
                                             ("1.15.9", False), ("2.0.0", False), ("garbage", False)])
def test_version_check_has_one_clear_error(version, ok):
    if ok:
        _patch.check_version("trl", "trl", version, (1, 16), (2, 0))
    else:
        with pytest.raises(_patch.UnsupportedVersionError,
                           match=rf"rlkernel.integrations.trl supports trl >=1.16,<2.0; found trl {version}"):
            _patch.check_version("trl", "trl", version, (1, 16), (2, 0))


def test_framework_fallback_is_recorded_with_its_reason_and_warns_once():
    with pytest.warns(rlkernel.FallbackWarning, match="softcap.*running the framework's own code"):
        rec = dispatch.framework_fallback("integrations.trl", "softcap not supported")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch.framework_fallback("integrations.trl", "softcap not supported")
    assert rec == Dispatch("integrations.trl", "auto", "framework", "fallback", "softcap not supported")
    assert dispatch.history() == [(rec, 2)]
    assert dispatch.worst(r.status for r, _ in dispatch.history()) == "fallback"


@pytest.mark.parametrize("how", ["backend", "require_fused", "env"])
def test_framework_fallback_where_fused_is_demanded_is_blocked(how, monkeypatch):
    kwargs = {"backend": {"backend": "fused"}, "require_fused": {"require_fused": True}, "env": {}}[how]
    if how == "env":
        monkeypatch.setenv("RLKERNEL_REQUIRE_FUSED", "1")
    with pytest.raises(rlkernel.FusedKernelUnavailable, match="integrations.trl: fused path required.*softcap"):
        dispatch.framework_fallback("integrations.trl", "softcap", **kwargs)
    [(rec, n)] = dispatch.history()
    assert (rec.status, rec.backend, n) == ("blocked", "none", 1)


@pytest.mark.parametrize(("op", "reason"), [("linear_logp.forward", "x"), ("integrations.", "x"),
                                            ("integrations.trl", "")])
def test_framework_fallback_rejects_other_ops_and_empty_reasons(op, reason):
    with pytest.raises(ValueError, match="framework_fallback"):
        dispatch.framework_fallback(op, reason)
    assert dispatch.history() == []


def test_head_reasons_name_the_dtypes_and_sharding():
    h, w = torch.randn(3, 4), torch.randn(5, 4)
    assert _head.unsupported_reason(h, w, None) is None
    assert _head.unsupported_reason(h, w.double(), None) == (
        "mixed dtypes (hidden float32, weight float64, compute float32): the ops take one dtype")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "compute bfloat16" in _head.unsupported_reason(h, w, None)
        assert _head.unsupported_reason(h.bfloat16(), w.bfloat16(), torch.zeros(5, dtype=torch.bfloat16)) is None
    assert _head.unsupported_reason(h, w.to("meta"), None) == (
        "hidden states on cpu, the LM head on meta (a model split across devices)")
    zero3 = torch.nn.Parameter(w.clone())
    zero3.ds_id = 0  # what DeepSpeed ZeRO-3 sets on a partitioned parameter
    assert "ZeRO-3" in _head.unsupported_reason(h, zero3, None)


def test_the_adapters_are_reached_from_a_plain_import_rlkernel_without_importing_the_frameworks():
    import subprocess
    import sys

    code = ("import sys, rlkernel; i = rlkernel.integrations\n"
            "fns = [i.trl.apply, i.transformers.apply, i.openrlhf.apply, i.verl.apply]\n"
            "assert not {'trl', 'transformers', 'openrlhf', 'verl'} & set(sys.modules)\n"
            "import rlkernel.integrations as i\n"
            "try:\n    i.nope\nexcept AttributeError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "has no attribute 'nope'" in out
