"""rlkernel.integrations.trl: TRL's fused LM head through rlkernel.linear_logp.

TRL (1.16 and later 1.x) computes the per-token log-probs and entropy of ``GRPOTrainer`` (and of the other trainers
that call ``trl.trainer.utils.add_fused_lm_head``: RLOO, DPO, KTO, SFT) in the model's patched forward, through
the module global ``trl.trainer.utils._ChunkedLogProbFunction`` (``trl.kernels.ChunkedLogProbFunction``). ``apply()``
replaces that global, so the call stays inside the model's forward (DDP, FSDP and ZeRO hooks run as before) and
TRL's masking, compaction of ignored rows (on Triton devices TRL passes only the scored rows), loss and
``FusedCausalLMOutput`` are TRL's own.

Options of TRL's head, mapped:
- ``temperature``: the op's temperature; ``outputs`` ``log_probs`` and ``entropy``: the op's logp and entropy;
- ``cast_lm_head_to_fp32`` and autocast: the op runs when hidden states, weight and bias already have the dtype
  TRL would compute in (a float32 model, or a model in the autocast dtype); float32 hidden states against a
  16-bit weight with autocast off (TRL's ``cast_lm_head_to_fp32`` over a 16-bit head) run on the weight's dtype
  with ``logits_dtype=torch.float32`` (``float32_head``); other mixed dtypes go back to TRL;
- ``chunk_size`` (TRL's vocabulary tile width): not used, the op picks its own tiles;
- back to TRL, with the reason recorded (``integrations.trl`` fallback): the extra outputs ``log_sum_sq_probs``,
  ``mean_logits``, ``is_top1``; ``final_logit_softcapping`` (Gemma 2/3); a ``logit_scale`` other than 1 (Cohere,
  Granite, ...); a DTensor or DeepSpeed ZeRO-3 head (the op's backward recomputes outside TRL's gather; under
  ``loss=True`` the policy's ZeRO-3 head is computed: ``linear_logp_loss`` computes its gradients inside TRL's
  gather, in the model's forward, as TRL requires of a fused loss).

Loss (``loss=True``; rlkernel.integrations.trl_loss, contract 2): ``GRPOTrainer._compute_loss`` as one
``rlkernel.linear_logp_loss`` call inside the model's forward, for the options TRL's loss has that it fuses; the
others go to TRL's own ``_compute_loss`` with the reason recorded.

Phases (``phases=True``, the default; contract 3): ``GRPOTrainer``'s own methods, replaced on the class (trainers
built before or after ``apply``), open the standard ``rlkernel.phase`` ranges where TRL runs them:

  step               TrainerCallback.on_step_begin / on_step_end (index: state.global_step at the step's start)
  rollout            GRPOTrainer._generate (generation)
  old_logprob        GRPOTrainer._get_per_token_logps_and_entropies of the policy without grad (num_iterations > 1)
  reference_logprob  the same for the reference model (beta > 0)
  policy_forward     the same with grad: the training forward, inside loss
  loss               GRPOTrainer.compute_loss
  backward           the trainer's Accelerator.backward
  optimizer          TrainerCallback.on_pre_optimizer_step / on_optimizer_step
  weight_sync        VLLMGeneration.sync_weights (TRL with vLLM)

``GRPOTrainer.train`` adds the callback and wraps its accelerator's ``backward`` for the run, and takes both away
when it returns (or raises, closing a step left open). ``head=False, phases=True``: the phases without the head.
"""
from __future__ import annotations

import functools

import torch

import rlkernel
from rlkernel import dispatch
from rlkernel.integrations import _head, trl_loss
from rlkernel.integrations._patch import (
    _MISSING,
    Patch,
    ProcessPatch,
    UnsupportedVersionError,
    check_options,
    check_version,
)

OP = "integrations.trl"
MINIMUM, BELOW = (1, 16), (2, 0)
SUPPORTED_OUTPUTS = ("log_probs", "entropy")
PHASED_METHODS = ("_generate", "_get_per_token_logps_and_entropies", "compute_loss", "train")
_slot = ProcessPatch("rlkernel.integrations.trl")


def fallback_reason(hidden, weight, bias, final_logit_softcapping, logit_scale, outputs,
                    loss: bool = False) -> str | None:
    """Why this call of TRL's head goes back to TRL; None when rlkernel.linear_logp computes it (``loss``: the
    pending loss' linear_logp_loss, which computes its gradients inside TRL's ZeRO-3 gather of the head)."""
    extra = [o for o in outputs if o not in SUPPORTED_OUTPUTS]
    if extra:
        return f"outputs {', '.join(extra)} not supported (rlkernel computes log_probs and entropy)"
    if final_logit_softcapping is not None:
        return f"softcap (final_logit_softcapping={final_logit_softcapping}) not supported"
    if logit_scale != 1.0:
        return f"logit_scale={logit_scale} not supported"
    return _head.unsupported_reason(hidden, weight, bias, zero3_gathered=loss)


def float32_head(hidden, weight, bias) -> bool:
    """TRL's ``cast_lm_head_to_fp32`` over a 16-bit head weight: float32 hidden states (TRL's ``.float()`` of the
    backbone's 16-bit output) against a 16-bit weight (and bias), autocast off (TRL's cast context). TRL then
    computes a float32 GEMM of these values; rlkernel takes the hidden states back to the weight's dtype (exact
    for a 16-bit backbone's output) and keeps the logits float32 (``logits_dtype=torch.float32``)."""
    sixteen = (torch.bfloat16, torch.float16)
    return (hidden.dtype == torch.float32 and weight.dtype in sixteen
            and (bias is None or bias.dtype == weight.dtype)
            and not torch.is_autocast_enabled(hidden.device.type))


class RlkernelHead:
    """Stands in for ``ChunkedLogProbFunction``: ``apply`` takes its arguments and returns its 5-tuple
    ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``. With a ``pending`` loss
    (``rlkernel.integrations.trl_loss``, set by ``apply(loss=True)``'s ``_compute_loss`` for the next call) the
    call computes that loss too, in one ``linear_logp_loss`` call."""

    def __init__(self, original, backend: str, require_fused: bool):
        self.original = original
        self.backend, self.require_fused = backend, require_fused
        self.patch: Patch | None = None
        self.pending = None

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
        args = (hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale,
                outputs)
        logits32 = float32_head(hidden, weight, bias)
        if logits32:
            hidden = hidden.to(weight.dtype)
        pending, self.pending = self.pending, None  # one forward's head call
        reason = fallback_reason(hidden, weight, bias, final_logit_softcapping, logit_scale, outputs,
                                 loss=pending is not None)
        if reason is not None:
            dispatch.framework_fallback(OP, reason, backend=self.backend, require_fused=self.require_fused)
            out = self.original.apply(*args)
            if pending is not None:
                trl_loss.loss_from_rows(pending, out[0], out[1])
            return out
        options = dict(backend=self.backend, require_fused=self.require_fused,
                       logits_dtype=torch.float32 if logits32 else None)
        if pending is not None:
            with _head.autocast_off(hidden):
                return trl_loss.fused_loss(pending, hidden, weight, bias, temperature, outputs, options)
        entropy = "entropy" in outputs
        with _head.autocast_off(hidden):
            out = rlkernel.linear_logp(hidden, weight, targets, bias=bias, temperature=temperature,
                                       return_entropy=entropy, **options)
        logp, ent = out if entropy else (out, None)
        return logp, ent, None, None, None


def _phased(name, fn):
    mark = rlkernel.phase(name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with mark:
            return fn(*args, **kwargs)

    return wrapper


def _phase_targets(trl) -> list:
    """``(owner, attr, new)`` for GRPOTrainer's phases (the table in the module docstring)."""
    import torch
    import transformers

    trainer_cls = trl.GRPOTrainer
    missing = [m for m in PHASED_METHODS if not hasattr(trainer_cls, m)]
    if missing:
        raise UnsupportedVersionError(f"rlkernel.integrations.trl: trl {trl.__version__}'s GRPOTrainer has no "
                                      f"{', '.join(missing)} (the methods of trl 1.16 the phases wrap)")
    logps, train = trainer_cls._get_per_token_logps_and_entropies, trainer_cls.train
    marks = {n: rlkernel.phase(n) for n in ("old_logprob", "reference_logprob", "policy_forward", "backward")}

    @functools.wraps(logps)
    def per_token_logps(self, model, *args, **kwargs):
        if getattr(self, "ref_model", None) is not None and model is self.ref_model:
            name = "reference_logprob"
        else:  # the policy: the training forward has grad; the old log-probs of the rollout do not
            name = "policy_forward" if torch.is_grad_enabled() else "old_logprob"
        with marks[name]:
            return logps(self, model, *args, **kwargs)

    class Phases(transformers.TrainerCallback):
        """The step and optimizer ranges, from the Trainer's callbacks (one per train() call)."""

        optimizer = rlkernel.phase("optimizer")

        def __init__(self):
            self.step_open = self.optimizer_open = False

        # Each hook checks what it opened: a marker must never stop a training run (a step whose begin the
        # Trainer skipped is not closed; one left open is closed before the next).
        def on_step_begin(self, args, state, control, **kwargs):
            self.close()
            rlkernel.step_begin(state.global_step)
            self.step_open = True

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if not self.optimizer_open:
                self.optimizer.__enter__()
                self.optimizer_open = True

        def on_optimizer_step(self, args, state, control, **kwargs):
            if self.optimizer_open:
                self.optimizer_open = False
                self.optimizer.__exit__(None, None, None)

        def on_step_end(self, args, state, control, **kwargs):
            if self.step_open:
                self.step_open = False
                rlkernel.step_end()

        def close(self):  # also when train() raised inside a step: its ranges end there
            self.on_optimizer_step(None, None, None)
            self.on_step_end(None, None, None)

    @functools.wraps(train)
    def phased_train(self, *args, **kwargs):
        callback, accelerator = Phases(), self.accelerator
        previous = vars(accelerator).get("backward", _MISSING)
        backward = accelerator.backward

        def phased_backward(*a, **k):
            with marks["backward"]:
                return backward(*a, **k)

        accelerator.backward = phased_backward
        self.add_callback(callback)
        try:
            return train(self, *args, **kwargs)
        finally:
            callback.close()
            self.remove_callback(callback)
            if previous is _MISSING:
                del accelerator.backward
            else:
                accelerator.backward = previous

    targets = [(trainer_cls, "_generate", _phased("rollout", trainer_cls._generate)),
               (trainer_cls, "_get_per_token_logps_and_entropies", per_token_logps),
               (trainer_cls, "compute_loss", _phased("loss", trainer_cls.compute_loss)),
               (trainer_cls, "train", phased_train)]
    from trl.generation import vllm_generation  # imports without vllm: the class TRL builds when it uses vLLM

    vllm = getattr(vllm_generation, "VLLMGeneration", None)
    if vllm is not None and hasattr(vllm, "sync_weights"):
        targets.append((vllm, "sync_weights", _phased("weight_sync", vllm.sync_weights)))
    return targets


def _loss_target(trl, rk_head: RlkernelHead, phases: bool) -> tuple:
    """``(GRPOTrainer, "_compute_loss", new)``: the fused loss (rlkernel.integrations.trl_loss), TRL's own for the
    options it does not fuse, with the reason recorded."""
    trainer_cls = trl.GRPOTrainer
    original = getattr(trainer_cls, "_compute_loss", None)
    if original is None:
        raise UnsupportedVersionError(f"rlkernel.integrations.trl: trl {trl.__version__}'s GRPOTrainer has no "
                                      "_compute_loss (the loss of trl 1.16 that loss=True replaces)")
    mark = rlkernel.phase("policy_forward") if phases else None

    @functools.wraps(original)
    def _compute_loss(self, model, inputs):
        reason = trl_loss.fallback_reason(self, inputs)
        if reason is not None:
            dispatch.framework_fallback(OP, reason, backend=rk_head.backend, require_fused=rk_head.require_fused)
            return original(self, model, inputs)
        return trl_loss.compute_loss(self, model, inputs, rk_head, mark)

    return trainer_cls, "_compute_loss", _compute_loss


def apply(*, backend: str = "auto", require_fused: bool = False, head: bool = True, phases: bool = True,
          loss: bool = False) -> Patch:
    """Route TRL's fused LM head through ``rlkernel.linear_logp`` (``head``: process-wide, every trainer, models
    patched before or after) and mark GRPOTrainer's phases (``phases``: the table in the module docstring).
    ``loss``: GRPOTrainer's loss as one ``rlkernel.linear_logp_loss`` call in the model's forward
    (rlkernel.integrations.trl_loss; needs ``head``). Returns the Patch (``undo()``, or a context manager); a
    second call with the same options returns the active one. Raises UnsupportedVersionError outside trl
    >=1.16,<2, ValueError when ``head`` and ``phases`` are both off, or ``loss`` without ``head``."""
    import trl

    check_version("trl", "trl", trl.__version__, MINIMUM, BELOW)
    from trl.trainer import utils as trl_utils

    options = {"backend": backend, "require_fused": bool(require_fused), "head": bool(head),
               "phases": bool(phases), "loss": bool(loss)}
    existing = _slot.reuse(options)
    if existing is not None:
        return existing
    if not (head or phases):
        raise ValueError("rlkernel.integrations.trl.apply: head=False and phases=False patch nothing")
    if loss and not head:
        raise ValueError("rlkernel.integrations.trl.apply: loss=True needs head=True (the head computes the loss)")
    check_options(backend, require_fused)
    targets, rk_head = [], None
    if head:
        current = getattr(trl_utils, "_ChunkedLogProbFunction", None)
        if current is None:
            raise UnsupportedVersionError(f"rlkernel.integrations.trl: trl {trl.__version__} has no "
                                          "trl.trainer.utils._ChunkedLogProbFunction (the fused LM head of trl "
                                          "1.16)")
        rk_head = RlkernelHead(current, backend, bool(require_fused))
        targets.append((trl_utils, "_ChunkedLogProbFunction", rk_head))
    if loss:
        targets.append(_loss_target(trl, rk_head, bool(phases)))
    if phases:
        targets += _phase_targets(trl)
    patch = _slot.install(targets, options)
    if rk_head is not None:
        rk_head.patch = patch
    return patch
