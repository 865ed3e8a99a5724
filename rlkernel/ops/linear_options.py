"""The logit options of rlkernel.linear_logp and rlkernel.linear_logp_loss (issue 31, items 2-5): a per-row
temperature, the logit transform (``logit_scale`` then ``softcap``), entropy without ids and the extra per-token
outputs. Checked here (numbers at once; a CPU tensor's values at once; a CUDA tensor's values on the device, through
the error record: no host sync) and applied to one chunk of logits by ``Options.apply``.

The order is TRL's (``trl.kernels.chunked_logprob._transform``, TRL 1.16): ``z' = softcap * tanh(z * logit_scale /
softcap) / T``, every statistic on z'. With the defaults ``apply`` is ``z / T``, today's arithmetic bit for bit.
The fused linear_logp and linear_logp_loss kernels have every option, the extra statistics included
(rlkernel.ops.fused.linear_logp_options). ``fused_gap`` names what is missing (a float32-output GEMM for a softcap, a
temperature whose scale overflows float32 or is below its smallest normal number), and such a call is a recorded
fallback to the native path (``fallback``), or ``blocked`` where the fused path is demanded.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

import torch

from rlkernel import dispatch
from rlkernel.ops import blas
from rlkernel.validate import ARGUMENTS, _float_rows, _row_tensor, bad_arg_error, check_temperature

OUTPUT_NAMES = ("entropy", "log_sum_sq_probs", "mean_logit", "is_top1")
_LOG2E = 1.4426950408889634
_F32_MAX = torch.finfo(torch.float32).max
TEMPERATURE_CODE = ARGUMENTS.index("temperature")  # the device error record's argument code (ERR_BAD_ARG)


class LinearLogpOutput(NamedTuple):
    """What ``linear_logp(..., outputs=...)`` returns: float32 ``hidden.shape[:-1]`` tensors (``is_top1`` bool),
    None for a field not asked (``logp`` None with ``token_ids=None``)."""
    logp: torch.Tensor | None
    entropy: torch.Tensor | None
    log_sum_sq_probs: torch.Tensor | None
    mean_logit: torch.Tensor | None
    is_top1: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class Options:
    """One call's options, checked. ``temperature``: a float, or the per-row values as a contiguous [N] tensor in
    the compute dtype (float64 for float64 hidden states, else float32), bad rows (``faults``) replaced by 1.
    ``extras``: the statistics asked for besides logp and entropy. ``has_ids``: token ids were given."""
    temperature: float | torch.Tensor = 1.0
    scale: float = 1.0
    softcap: float | None = None
    extras: tuple[str, ...] = ()
    has_ids: bool = True
    faults: torch.Tensor | None = None  # [N] bool: rows whose temperature is out of range (CUDA only; NaN rows)

    @property
    def per_row(self) -> bool:
        return isinstance(self.temperature, torch.Tensor)

    @property
    def transformed(self) -> bool:
        return self.scale != 1.0 or self.softcap is not None

    def fused_gap(self, device: torch.device, dtype: torch.dtype, loss: bool = False,
                  batch_invariant: bool = False) -> str | None:
        """Why the fused kernels cannot run this call (the first option they lack), None when they can. linear_logp's
        have every option, the extra statistics included (rlkernel.ops.fused.linear_logp_options); linear_logp_loss's
        too (a logit_scale with a number T folded into it for the logp kernels, a per-row T or a softcap by the same
        option kernels); both need the float32-output GEMM for a softcap of 16-bit inputs."""
        if not self.per_row and not _valid_temperature(self.temperature / self.scale):
            return "temperature / logit_scale: its log2(e) scale is outside float32's normal range in the fused kernels"
        if self.softcap is not None and dtype in blas.SIXTEEN_BIT:
            reason, _ = blas.float32_output_gemm(device, dtype, batch_invariant)  # softcapped tiles are float32
            if reason is not None:
                return f"softcap needs float32 logits: {reason}"
        return None

    def rows_temperature(self, r0: int, r1: int, rows: int | None = None):
        """The temperature of rows r0..r1 as a divisor of their logits: the float, or a [k, 1] column (padded with 1
        up to ``rows`` rows: batch_invariant's zero rows)."""
        if not self.per_row:
            return self.temperature
        t = self.temperature[r0:r1]
        if rows is not None and rows > t.shape[0]:
            t = torch.cat([t, t.new_ones(rows - t.shape[0])])
        return t.unsqueeze(-1)

    def apply(self, z: torch.Tensor, r0: int, r1: int, rows: int | None = None):
        """(z' = transform(z) / T, d z'/d z times T or None): the chunk's logits z (compute dtype, rows r0..r1)
        as the softmax sees them, and the transform's derivative the backward multiplies by (None: 1)."""
        deriv = None
        if self.scale != 1.0:
            z = z * self.scale
            deriv = self.scale
        if self.softcap is not None:
            t = torch.tanh(z / self.softcap)
            z = self.softcap * t
            deriv = (1.0 - t * t) * self.scale
        return z / self.rows_temperature(r0, r1, rows), deriv


def _valid_temperature(t: float) -> bool:
    try:
        check_temperature(t, allow_zero=False)
    except ValueError:
        return False
    return True


def _finite_real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    v = float(value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return v


def check_outputs(outputs, has_ids: bool) -> tuple[str, ...]:
    """The names asked for, in OUTPUT_NAMES order; TypeError for a bare string or non-strings, ValueError for an
    unknown name or ``is_top1`` without ids."""
    if isinstance(outputs, str):
        raise TypeError(f"outputs must be a tuple of names, got the string {outputs!r}: pass ({outputs!r},)")
    try:
        names = tuple(outputs)
    except TypeError:
        raise TypeError(f"outputs must be a tuple of names among {', '.join(OUTPUT_NAMES)}, got "
                        f"{type(outputs).__name__}") from None
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"outputs must be names (str), got {type(name).__name__}")
        if name not in OUTPUT_NAMES:
            hint = " (TRL calls it mean_logits)" if name == "mean_logits" else ""
            raise ValueError(f"unknown output {name!r}{hint}: choose among {', '.join(OUTPUT_NAMES)}")
    if "is_top1" in names and not has_ids:
        raise ValueError("is_top1 compares the argmax with token_ids: it needs token_ids (got None)")
    return tuple(n for n in OUTPUT_NAMES if n in names)


def linear_faults(t: torch.Tensor) -> torch.Tensor:
    """[N] bool: temperatures out of range for the linear ops (T > 0 finite with log2(e) / T a finite float32; NaN
    fails every comparison), by tensor ops on their device."""
    w = t.double()
    return ~((w > 0) & (w < math.inf) & (_LOG2E / w <= _F32_MAX))


def check_options(hidden: torch.Tensor, temperature, softcap, logit_scale, outputs, has_ids: bool,
                  op: str, compute: torch.dtype | None = None) -> tuple[Options, tuple[str, ...]]:
    """(Options, the names asked for in ``outputs``). Numbers and metadata at once; a CPU temperature tensor's
    values too (``ValueError`` naming the first bad row, as ``rlkernel.logp`` does); a CUDA one's on the device
    (``Options.faults``, no host sync). ``compute``: the GEMMs' dtype (default hidden's): a per-row temperature
    is float64 for float64 compute, else float32, so that dividing the logits by it keeps their dtype (float64
    hidden with a float32 weight computes in float32: a float64 temperature would promote the backward's logits
    gradient to float64 against the float32 weight)."""
    names = check_outputs(outputs, has_ids)
    scale = _finite_real("logit_scale", logit_scale) if type(logit_scale) is not float or logit_scale != 1.0 else 1.0
    cap = None if softcap is None else _finite_real("softcap", softcap)
    faults = None
    if isinstance(temperature, torch.Tensor):
        if (compute or hidden.dtype) == torch.float64:
            t = _row_tensor("temperature", temperature, hidden, torch.float64)
        else:
            t = _float_rows("temperature", temperature, hidden)
        bad = linear_faults(t)
        if hidden.device.type == "cpu" and not torch.compiler.is_compiling():
            if bool(bad.any()):
                row = int(bad.nonzero()[0])
                given = temperature.expand(hidden.shape[:-1]).reshape(-1)
                raise bad_arg_error(op, "temperature", row, given[row].item())
        else:
            faults = bad
            t = torch.where(bad, torch.ones_like(t), t)  # computed with T = 1, then NaN: no inf / NaN in the GEMMs
        temperature = t
    else:
        temperature = check_temperature(temperature, allow_zero=False)
    extras = tuple(n for n in names if n != "entropy")
    return Options(temperature, scale, cap, extras, has_ids, faults), names


def fallback_for(op: str, opts: Options, backend: str, require_fused: bool, device: torch.device,
                 dtype: torch.dtype, loss: bool = False, batch_invariant: bool = False):
    """The dispatch record of a call whose fused path would lack a kernel for its options: ``fallback`` to native
    with that reason (``blocked`` and FusedKernelUnavailable where the fused path is demanded); None when nothing
    is missing or the fused path is out of the question anyway (the caller then resolves as usual)."""
    if backend == "native" or device.type != "cuda":
        return None
    compiling = torch.compiler.is_compiling()
    if not compiling and dispatch.fused_unavailable_reason(op, device, dtype) is not None:
        return None  # no fused path for this call anyway: its own reason
    gap = opts.fused_gap(device, dtype, loss, batch_invariant)
    if gap is None:
        return None
    if compiling:  # the traced decision: native, as eager would run it
        return dispatch.resolve(op, "native", False, device, dtype)
    if backend == "fused" or require_fused or dispatch.strict_from_env():
        dispatch.record(op, backend, "none", "blocked", gap)
        raise dispatch.FusedKernelUnavailable(f"{op}: fused path required but unavailable: {gap}")
    return dispatch.record(op, backend, "native", "fallback", gap)
