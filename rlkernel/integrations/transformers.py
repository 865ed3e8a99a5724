"""rlkernel.integrations.transformers: a causal LM's loss and per-token log-probs without the N x V logits.

``apply(model)`` replaces the model's ``forward`` (an instance attribute over the class's method, as Liger-Kernel's
patch functions and TRL's ``add_fused_lm_head`` do), so DDP / FSDP / ZeRO wrappers still call it and their hooks
still run. The patched forward runs the model's own backbone (``model.model``) and then, instead of
``lm_head(hidden)`` and ``loss_function(logits, labels)``:
- ``model(..., labels=labels)``: the model's causal-LM loss (labels shifted by one, or ``shift_labels`` as given;
  ``-100`` ignored; mean over the scored tokens, or sum / ``num_items_in_batch``) by ``rlkernel.linear_logp_loss``
  on the last hidden states and the LM head's weight and bias; ``logits`` is None. Backward once, as the op's
  contract says (its gradients are computed in the forward). A batch with no scored token gives loss 0 (the
  model: NaN).
- ``model(..., labels=labels, per_token_logps=True, temperature=1.0, return_entropy=False)``: ``token_logps`` (and
  ``entropy``) of each next-token label at ``temperature``, float32, shape ``(batch, seq_len - 1)`` (``(batch,
  seq_len)`` with ``shift_labels``), 0 where the label is ignored, by ``rlkernel.linear_logp`` (autograd through
  hidden states, weight and bias); ``loss`` is the mean negative log-prob at that temperature.
- without labels (generation, ``model(ids).logits``): the model's own forward, unchanged.

Tied embeddings, an ``lm_head`` bias and a padded vocabulary (``config.vocab_size`` above the tokenizer's) are the
model's own: the op reads ``lm_head.weight`` / ``lm_head.bias`` as they are, so the padded rows are in the softmax
exactly as in the model's logits. Families: Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text), and subclasses.
Back to the model's own forward, with the reason recorded (``integrations.transformers`` fallback):
``final_logit_softcapping`` (Gemma 2's default, 30), mixed dtypes or an autocast dtype other than the weights',
a DTensor / ZeRO-3 head, a head on another device than the backbone's output (``device_map``), an ``lm_head``
that is not a plain ``nn.Linear`` or has hooks, a custom
``loss_function``, ``logits_to_keep`` with labels.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

import torch

import rlkernel
from rlkernel import dispatch
from rlkernel.integrations import _head
from rlkernel.integrations._patch import Patch, check_options, check_version, reuse
from rlkernel.ops.linear_logp_loss import check_chunk_size

OP = "integrations.transformers"
MINIMUM, BELOW = (5, 0), (6, 0)
FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
            "Gemma3ForCausalLM")
IGNORE = -100
_MARK = "_rlkernel_patch"  # the model's active Patch, for idempotence
# keywords of the patched forward that the model's own forward does not have
_OWN = ("per_token_logps", "temperature", "return_entropy")


@functools.cache
def _token_output_class():
    """The per-token output: the model's CausalLMOutputWithPast plus ``token_logps`` and ``entropy``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    @dataclasses.dataclass
    class TokenLogpsOutput(CausalLMOutputWithPast):
        token_logps: torch.Tensor | None = None
        entropy: torch.Tensor | None = None

    return TokenLogpsOutput


def _family(model) -> str | None:
    return next((c.__name__ for c in type(model).__mro__ if c.__name__ in FAMILIES), None)


def _head_reason(model, head) -> str | None:
    """Why the model's LM head step cannot be replaced by the op, whatever the inputs."""
    import torch.nn as nn
    from torch.nn.modules import module as nn_module
    from transformers.loss.loss_utils import LOSS_MAPPING

    softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if softcap is not None:
        return f"softcap (final_logit_softcapping={softcap}) not supported"
    if type(head).forward is not nn.Linear.forward or "forward" in vars(head) or not isinstance(head, nn.Linear):
        return f"lm_head is a {type(head).__name__}, not a plain nn.Linear"
    hooks = (head._forward_hooks, head._forward_pre_hooks, nn_module._global_forward_hooks,
             nn_module._global_forward_pre_hooks)
    if any(hooks):
        return "lm_head has forward hooks, which the fused loss would skip"
    if model.loss_function is not LOSS_MAPPING["ForCausalLM"]:
        return f"a custom loss_function ({getattr(model.loss_function, '__name__', model.loss_function)!r})"
    return None


def _backbone_fields(cls, backbone_out) -> dict:
    """The backbone's cache / hidden states / attentions under the names ``cls`` has as fields (``cache`` in
    transformers 5, ``past_key_values`` before; 5.x's outputs answer ``in`` for the old alias too, and giving both
    is an error)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {name: backbone_out[name] for name in ("cache", "past_key_values", "hidden_states", "attentions")
            if name in names and name in backbone_out}


def _outputs(cls, backbone_out, **fields):
    """``cls`` filled with ``fields`` and the backbone's cache / hidden states / attentions."""
    return cls(**fields, **_backbone_fields(cls, backbone_out))


def _shifted(labels, shift_labels):
    """(targets, hidden slice): the next-token labels and the positions that predict them."""
    if shift_labels is not None:
        return shift_labels, slice(None)
    return labels[:, 1:], slice(None, -1)


def _make_forward(model, options: dict):
    cls_forward = type(model).forward
    sig = inspect.signature(cls_forward)
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    backend, require_fused = options["backend"], options["require_fused"]

    @functools.wraps(cls_forward)  # keeps the signature: generate and Trainer read it
    def forward(self, *args, per_token_logps=False, temperature=1.0, return_entropy=False, **kwargs):
        # the class's forward bound to self at each call, never to the model patched: a deep copy of the model (a
        # frozen reference policy) carries this forward and must run its own weights
        original = cls_forward.__get__(self)
        arguments = dict(sig.bind(self, *args, **kwargs).arguments)  # a TypeError as the model's own would raise
        arguments.pop(next(iter(sig.parameters)))  # self
        extra = dict(arguments.pop(var_kw, {})) if var_kw else {}
        labels = arguments.pop("labels", None)
        if per_token_logps and labels is None and extra.get("shift_labels") is None:
            raise ValueError("per_token_logps=True needs labels (or shift_labels)")
        if labels is None and not per_token_logps:  # no loss asked for (the model computes one only with labels)
            return original(*args, **kwargs)
        head = self.get_output_embeddings()
        logits_to_keep = arguments.pop("logits_to_keep", 0)
        reason = _head_reason(self, head)
        if reason is None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            reason = f"logits_to_keep={logits_to_keep} with labels"
        if reason is not None:  # before any work: the model's own forward, whole
            dispatch.framework_fallback(OP, reason, backend=backend, require_fused=require_fused)
            if not per_token_logps:
                return original(*args, **kwargs)
            call = {**arguments, "logits_to_keep": logits_to_keep, **extra}  # everything but the labels
            return _own_forward(original, call, labels, temperature, return_entropy, options)
        loss_kwargs = dict(extra)  # what the model's loss_function gets
        return_dict = extra.pop("return_dict", None)
        return_dict = getattr(self.config, "return_dict", True) if return_dict is None else return_dict
        backbone_out = self.model(**arguments, **extra)  # the model's own backbone call, as its forward makes it
        hidden = backbone_out.last_hidden_state
        reason = _head.unsupported_reason(hidden, head.weight, head.bias)
        if reason is not None:  # the backbone ran: the model's own head and loss on its output
            dispatch.framework_fallback(OP, reason, backend=backend, require_fused=require_fused)
            result = _own_head(self, head, hidden, backbone_out, labels, loss_kwargs, per_token_logps,
                               temperature, return_entropy, options)
        else:
            result = _rlkernel_head(head, hidden, backbone_out, labels, loss_kwargs, per_token_logps, temperature,
                                    return_entropy, options)
        return result if return_dict else result.to_tuple()

    return forward


def _count(targets, ignore, num_items):
    return (targets != ignore).sum().clamp(min=1) if num_items is None else num_items


def _rlkernel_head(head, hidden, backbone_out, labels, loss_kwargs, per_token_logps, temperature, return_entropy,
                   options):
    ignore, num_items = loss_kwargs.get("ignore_index", IGNORE), loss_kwargs.get("num_items_in_batch")
    targets, rows = _shifted(labels, loss_kwargs.get("shift_labels"))
    hidden = hidden[:, rows]
    targets = targets.to(hidden.device)
    ops = {"backend": options["backend"], "require_fused": options["require_fused"]}
    with _head.autocast_off(hidden):
        if per_token_logps:
            out = rlkernel.linear_logp(hidden, head.weight, targets, bias=head.bias, temperature=temperature,
                                       ignore_index=ignore, return_entropy=return_entropy, **ops)
            logp, ent = out if return_entropy else (out, None)
            return _outputs(_token_output_class(), backbone_out, loss=-logp.sum() / _count(targets, ignore, num_items),
                            token_logps=logp, entropy=ent)
        loss = rlkernel.linear_logp_loss(hidden, head.weight, targets, lambda lp, ent, sl: -lp, bias=head.bias,
                                         ignore_index=ignore, reduction="mean" if num_items is None else "sum",
                                         chunk_size=options["chunk_size"], **ops)
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return _outputs(CausalLMOutputWithPast, backbone_out, loss=loss)


def _score_logits(logits, labels, loss_kwargs, temperature, return_entropy, fields, options):
    """Per-token log-probs of the model's own logits (rlkernel.logp, with the patch's backend and require_fused),
    in the patched forward's output."""
    ignore, num_items = loss_kwargs.get("ignore_index", IGNORE), loss_kwargs.get("num_items_in_batch")
    targets, rows = _shifted(labels, loss_kwargs.get("shift_labels"))
    logits = logits[:, rows]
    targets = targets.to(logits.device)
    res = rlkernel.logp(logits, targets, temperature=temperature, ignore_index=ignore, return_entropy=return_entropy,
                        backend=options["backend"], require_fused=options["require_fused"])
    logp, ent = res if return_entropy else (res, None)
    return _token_output_class()(loss=-logp.sum() / _count(targets, ignore, num_items), token_logps=logp,
                                 entropy=ent, **fields)


def _own_head(model, head, hidden, backbone_out, labels, loss_kwargs, per_token_logps, temperature, return_entropy,
              options):
    """The tail of the families' forward (no softcap: _head_reason sent that to _own_forward): lm_head, then the
    model's loss_function."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    logits = head(hidden)
    if per_token_logps:
        fields = {"logits": logits, **_backbone_fields(_token_output_class(), backbone_out)}
        return _score_logits(logits, labels, loss_kwargs, temperature, return_entropy, fields, options)
    loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size, **loss_kwargs)
    return _outputs(CausalLMOutputWithPast, backbone_out, loss=loss, logits=logits)


def _own_forward(original, call: dict, labels, temperature, return_entropy, options):
    """Per-token log-probs from the model's own forward (``call``: its arguments without the labels): its logits
    scored by rlkernel.logp."""
    loss_kwargs = {"shift_labels": call.pop("shift_labels", None)}
    loss_kwargs |= {k: call[k] for k in ("num_items_in_batch", "ignore_index") if k in call}
    return_dict = call.pop("return_dict", True)
    out = original(**call, return_dict=True)
    fields = {k: v for k, v in out.items() if k != "loss"}
    result = _score_logits(out.logits, labels, loss_kwargs, temperature, return_entropy, fields, options)
    return result if return_dict else result.to_tuple()


def _unmark(patch: Patch) -> None:
    """On undo: the mark off the model this patch replaced the forward of (a deep copy's patch: the copy's)."""
    vars(patch.owners()[0]).pop(_MARK, None)


def apply(model, *, backend: str = "auto", require_fused: bool = False, chunk_size: int | None = None,
          phases: bool = True) -> Patch:
    """Patch ``model.forward`` (a Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 causal LM, before it is
    wrapped by DDP, FSDP, DeepSpeed or PEFT) as the module docstring says. Returns the Patch (``undo()``, or a
    context manager); applying again with the same options returns the active one. ``backend``, ``require_fused``
    and ``chunk_size`` go to the rlkernel ops (checked here); ``phases``: accepted as by every integration, no
    range here (a model's forward runs in every phase). Raises UnsupportedVersionError outside transformers >=5,<6
    and TypeError for another model."""
    import transformers

    check_version("transformers", "transformers", transformers.__version__, MINIMUM, BELOW)
    options = {"backend": backend, "require_fused": bool(require_fused), "chunk_size": chunk_size}
    recorded = {**options, "phases": bool(phases)}
    existing = reuse(vars(model).get(_MARK) if hasattr(model, "__dict__") else None,
                     "rlkernel.integrations.transformers", recorded)
    if existing is not None:
        return existing
    if _family(model) is None:
        raise TypeError(f"rlkernel.integrations.transformers.apply: {type(model).__name__} is not a supported causal "
                        f"LM (supported: {', '.join(FAMILIES)}); pass the model itself, before any wrapper")
    if "forward" in vars(model):
        raise TypeError(f"rlkernel.integrations.transformers.apply: {type(model).__name__}.forward is already "
                        "replaced on this model (another patch, e.g. TRL's add_fused_lm_head: use "
                        "rlkernel.integrations.trl for TRL trainers)")
    check_options(backend, require_fused)
    check_chunk_size(chunk_size)
    forward = _make_forward(model, options).__get__(model)
    patch = Patch("rlkernel.integrations.transformers", [(model, "forward", forward)], recorded,
                  on_undo=_unmark)
    vars(model)[_MARK] = patch
    return patch
