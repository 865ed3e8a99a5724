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
  TRL would compute in (a float32 model, or a model in the autocast dtype); mixed dtypes go back to TRL;
- ``chunk_size`` (TRL's vocabulary tile width): not used, the op picks its own tiles;
- back to TRL, with the reason recorded (``integrations.trl`` fallback): the extra outputs ``log_sum_sq_probs``,
  ``mean_logits``, ``is_top1``; ``final_logit_softcapping`` (Gemma 2/3); a ``logit_scale`` other than 1 (Cohere,
  Granite, ...); a DTensor or DeepSpeed ZeRO-3 head (the op's backward recomputes outside TRL's gather).
"""
from __future__ import annotations

import rlkernel
from rlkernel import dispatch
from rlkernel.integrations import _head
from rlkernel.integrations._patch import Patch, UnsupportedVersionError, check_options, check_version, reuse

OP = "integrations.trl"
MINIMUM, BELOW = (1, 16), (2, 0)
SUPPORTED_OUTPUTS = ("log_probs", "entropy")


def fallback_reason(hidden, weight, bias, final_logit_softcapping, logit_scale, outputs) -> str | None:
    """Why this call of TRL's head goes back to TRL; None when rlkernel.linear_logp computes it."""
    extra = [o for o in outputs if o not in SUPPORTED_OUTPUTS]
    if extra:
        return f"outputs {', '.join(extra)} not supported (rlkernel computes log_probs and entropy)"
    if final_logit_softcapping is not None:
        return f"softcap (final_logit_softcapping={final_logit_softcapping}) not supported"
    if logit_scale != 1.0:
        return f"logit_scale={logit_scale} not supported"
    return _head.unsupported_reason(hidden, weight, bias)


class RlkernelHead:
    """Stands in for ``ChunkedLogProbFunction``: ``apply`` takes its arguments and returns its 5-tuple
    ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``."""

    def __init__(self, original, backend: str, require_fused: bool):
        self.original = original
        self.backend, self.require_fused = backend, require_fused
        self.patch: Patch | None = None

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
        reason = fallback_reason(hidden, weight, bias, final_logit_softcapping, logit_scale, outputs)
        if reason is not None:
            dispatch.framework_fallback(OP, reason, backend=self.backend, require_fused=self.require_fused)
            return self.original.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                       final_logit_softcapping, logit_scale, outputs)
        entropy = "entropy" in outputs
        with _head.autocast_off(hidden):
            out = rlkernel.linear_logp(hidden, weight, targets, bias=bias, temperature=temperature,
                                       return_entropy=entropy, backend=self.backend,
                                       require_fused=self.require_fused)
        logp, ent = out if entropy else (out, None)
        return logp, ent, None, None, None


def apply(*, backend: str = "auto", require_fused: bool = False) -> Patch:
    """Route TRL's fused LM head through ``rlkernel.linear_logp`` (process-wide, every trainer, models patched
    before or after). Returns the Patch (``undo()``, or a context manager); a second call with the same options
    returns the active one. Raises UnsupportedVersionError outside trl >=1.16,<2."""
    import trl

    check_version("trl", "trl", trl.__version__, MINIMUM, BELOW)
    from trl.trainer import utils as trl_utils

    current = getattr(trl_utils, "_ChunkedLogProbFunction", None)
    if current is None:
        raise UnsupportedVersionError(f"rlkernel.integrations.trl: trl {trl.__version__} has no "
                                      "trl.trainer.utils._ChunkedLogProbFunction (the fused LM head of trl 1.16)")
    options = {"backend": backend, "require_fused": bool(require_fused)}
    if isinstance(current, RlkernelHead):
        existing = reuse(current.patch, "rlkernel.integrations.trl", options)
        if existing is not None:
            return existing
    check_options(backend, require_fused)
    head = RlkernelHead(current, backend, bool(require_fused))
    head.patch = Patch("rlkernel.integrations.trl", [(trl_utils, "_ChunkedLogProbFunction", head)], options)
    return head.patch
