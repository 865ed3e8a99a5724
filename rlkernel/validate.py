"""Argument checks shared by the ops (docs/contracts.md, section 1: bad input gets a clear error before any work).

They read Python values and tensor metadata only, never a CUDA tensor's values (no host sync). On CPU the token
ids are checked here too, so a rejected call leaves no dispatch record. Bad values on CUDA go to the device error
record instead (``rlkernel.errors``).
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

_INT64 = (-(1 << 63), (1 << 63) - 1)
_LOG2E = 1.4426950408889634  # the fused kernels scale by log2(e) / T: it must stay finite too
_F32_MAX = torch.finfo(torch.float32).max
_F32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32


def position_in(flat: int, shape) -> tuple[int, ...]:
    """The index tuple of flat position ``flat`` in a tensor of ``shape`` (row-major)."""
    pos = []
    for size in reversed(tuple(shape)):
        pos.append(flat % size if size else 0)
        flat //= max(size, 1)
    return tuple(reversed(pos))


def bad_id_error(where, value: int, vocab_size: int | None, op: str = "logp.forward", note: str = "") -> IndexError:
    """The IndexError for a token id outside [0, V) that is not ignore_index: the op, the first bad position (an
    index tuple, or a flat position), the id and V. The CPU check and the device error record both raise it."""
    size = f", vocab size {vocab_size}" if vocab_size is not None else ""
    return IndexError(f"{op}: token id out of range at position {where} (id {value}{size}){note}")


# The per-row settings, in the order of their code in the device error record (entry kind ERR_BAD_ARG: the entry's
# value is the index here). Seed and offset take any int64, so their codes are reserved, never reported today.
ARGUMENTS = ("temperature", "top_k", "top_p", "min_p", "seed", "offset")
_RULES = {"temperature": "a finite number >= 0 whose log2(e) / temperature is a finite float32",
          "top_k": "an integer >= 0 (0 = all tokens)", "top_p": "in (0, 1]", "min_p": "in [0, 1]", "seed": "an int64",
          "offset": "an int64"}


def bad_arg_error(op: str, argument: str, row: int, value=None, note: str = "") -> ValueError:
    """The ValueError for a per-row setting out of range: the op, the argument, the row (counted flat) and the rule.
    The CPU check and the device error record (kind ERR_BAD_ARG, no value then) both raise it."""
    got = f" ({value})" if value is not None else ""
    rule = _RULES[argument]
    if argument == "temperature" and op.startswith("linear_logp"):  # the linear ops have no greedy T = 0 rows
        rule = rule.replace(">= 0", "> 0")
    return ValueError(f"{op}: {argument} of row {row} is out of range{got}: must be {rule}{note}")


def no_distribution_error(row: int, note: str = "") -> ValueError:
    """The ValueError for a row ``sample`` cannot draw from (a NaN, or no finite logit), counted flat."""
    return ValueError(f"sample: row {row} has no finite probabilities (all -inf or NaN logits){note}")


def _check_ids_dtype(token_ids: torch.Tensor) -> None:
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool or token_ids.is_complex():
        raise TypeError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    if token_ids.dtype == torch.uint64:  # the ops read ids as int64: 2^64 - 1 would become id -1 (an ignore_index)
        raise TypeError("token_ids must be an integer tensor that int64 holds, got torch.uint64 (an id >= 2^63 "
                        "would wrap to a negative one): convert to int64")


def check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary)")
    if logits.is_meta:
        raise ValueError("logits are on the meta device, which holds no values: use a CPU or CUDA tensor")


def _real(name: str, value) -> float:
    if type(value) is float:  # the common case first: an ABC isinstance costs a loop's microseconds
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def _int64(name: str, value) -> int:
    if type(value) is int and _INT64[0] <= value <= _INT64[1]:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if not _INT64[0] <= value <= _INT64[1]:
        raise ValueError(f"{name} must fit in int64, got {value}")
    return int(value)


def check_temperature(temperature, allow_zero: bool) -> float:
    """A finite T > 0 (>= 0 for sample) whose scale log2(e) / T is a finite, normal float32, the type the fused
    kernels scale in and logp returns: 1e-45 would turn finite logits into -inf/NaN, and 1e39 every logit into 0."""
    t = _real("temperature", temperature)
    low_ok = t >= 0.0 if allow_zero else t > 0.0
    if not (low_ok and t < math.inf):  # also rejects NaN
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"temperature must be a finite number {bound}, got {temperature}")
    if t > 0.0 and _LOG2E / t > _F32_MAX:
        raise ValueError(f"temperature {temperature} is too small: 1/temperature overflows float32")
    # the kernels flush a subnormal scale to 0: every logit times 0, and -inf times 0 is NaN
    if t > 0.0 and _LOG2E / t < _F32_TINY:
        raise ValueError(f"temperature {temperature} is too large: log2(e)/temperature is below float32's "
                         "smallest normal number")
    return t


class RowSettings(NamedTuple):
    """The filters of one call, each a Python number or a contiguous tensor of shape [N] (N = rows) on the logits'
    device: temperature, top_p, min_p float32, top_k int64. Made by ``check_logp_args`` / ``check_sample_args``."""
    temperature: float | torch.Tensor
    top_k: int | torch.Tensor
    top_p: float | torch.Tensor
    min_p: float | torch.Tensor

    def per_row(self) -> bool:
        return any(isinstance(v, torch.Tensor) for v in self)

    def filtered(self, vocab: int) -> bool:
        """Whether the distribution is anything but softmax(logits / T) with one T > 0: the processed log-probs of
        rlkernel.logp (and the filtered law of sample) differ from the plain ones only then."""
        if self.per_row():
            return True
        return self.temperature == 0 or 0 < self.top_k < vocab or self.top_p < 1.0 or self.min_p > 0.0


_FLOAT_SETTINGS = ("temperature", "top_p", "min_p")


def _row_tensor(name: str, value: torch.Tensor, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value`` (0-dim, or shaped ``logits.shape[:-1]``) as a contiguous ``dtype`` tensor of shape [N] on the
    logits' device; metadata only, no value is read."""
    lead = logits.shape[:-1]
    if value.dtype == torch.bool or value.is_complex():
        raise TypeError(f"{name} must be a real tensor, got {value.dtype}")
    if dtype == torch.int64 and value.is_floating_point():
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    if name == "top_k" and value.dtype == torch.uint64:  # 2^64 - 1 would become -1 (a seed keeps its 64 bits)
        raise TypeError("top_k must be an integer tensor that int64 holds, got torch.uint64: convert to int64")
    if value.device != logits.device:
        raise ValueError(f"{name} on {value.device} but logits on {logits.device}: must be on one device")
    if value.dim() != 0 and value.shape != lead:
        raise ValueError(f"{name} must be a number, a 0-dim tensor or a tensor of shape {tuple(lead)} (one value per "
                         f"row, logits.shape[:-1]), got shape {tuple(value.shape)}"
                         + _per_sequence_hint(name, value, lead))
    n = lead.numel()
    flat = value.expand(n) if value.dim() == 0 else value.reshape(n)
    return flat.to(dtype).contiguous()


def _per_sequence_hint(name: str, value: torch.Tensor, lead) -> str:
    """For one value per sequence ([B] or [B, 1]) with [B, T, V] logits: how to give it per row."""
    if len(lead) < 2 or value.numel() != lead[0] or value.shape[0] != lead[0]:
        return ""
    ones = ", ".join(["1"] * (len(lead) - 1))
    return (f"; for one value per sequence, expand it over the positions: "
            f"{name}.reshape({lead[0]}, {ones}).expand({', '.join(map(str, lead))})")


def row_faults(settings: RowSettings) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(bad [N] bool, argument code [N] int64: the first bad setting of each row) over the tensor settings, by tensor
    ops on their device (no host sync); None when every setting is a (checked) Python number."""
    bad = code = None
    for index, name in enumerate(("temperature", "top_k", "top_p", "min_p")):
        v = getattr(settings, name)
        if not isinstance(v, torch.Tensor):
            continue
        if name == "temperature":
            t = v.double()
            ok = (t >= 0) & (t < math.inf) & ((t == 0) | (_LOG2E / t <= _F32_MAX))
        elif name == "top_k":
            ok = v >= 0
        elif name == "top_p":
            ok = (v > 0) & (v <= 1)
        else:
            ok = (v >= 0) & (v <= 1)
        this = ~ok  # NaN fails every comparison: bad
        if bad is None:
            bad, code = this, torch.where(this, index, -1)
        else:
            code = torch.where(~bad & this, index, code)
            bad = bad | this
    if bad is None:
        return None
    return bad, code.to(torch.int64)


def _raise_cpu_faults(op: str, settings: RowSettings, logits: torch.Tensor, given: tuple) -> None:
    """CPU tensors: values are checked at once (no sync to fear), naming the first bad row's argument and its value
    as given (``given``: the four settings as the caller passed them, before any rounding to float32)."""
    if logits.device.type != "cpu" or torch.compiler.is_compiling() or not settings.per_row():
        return
    faults = row_faults(settings)
    if faults is not None and bool(faults[0].any()):
        row = int(faults[0].nonzero()[0])
        code = int(faults[1][row])
        value = given[code]
        value = value.expand(logits.shape[:-1]).reshape(-1) if value.dim() == 0 else value.reshape(-1)
        as_given = value[row].item()
        # a float64 value > 0 that float32 rounds to 0 (top_p 1e-50) is out of range there: say why
        rounds_to_0 = value.is_floating_point() and as_given > 0 and float(value[row].to(torch.float32)) == 0
        raise bad_arg_error(op, ARGUMENTS[code], row, as_given, "; it rounds to 0 in float32" if rounds_to_0 else "")


# A float64 per-row setting is judged as given, as the same Python number is: (its range as given, whether float32
# rounding a nonzero value to 0 changes its meaning: T = 0 is a greedy row, top_p 0 is out of range; min_p 0 is
# simply no filter)
_AS_GIVEN = {"temperature": (lambda w: w >= 0, True), "top_p": (lambda w: (w > 0) & (w <= 1), True),
             "min_p": (lambda w: (w >= 0) & (w <= 1), False)}


def _float_rows(name: str, value: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """A temperature / top_p / min_p tensor as float32 [N]. A float64 value out of range as given (min_p 1 + 1e-10,
    which float32 rounds to 1; a temperature of -1e-50, which it rounds to -0.0) or one > 0 that float32 rounds to 0
    where 0 means something else (_AS_GIVEN) becomes NaN: out of range there too, refused on CPU at once and on CUDA
    through the device error record, never a silent greedy or unfiltered row."""
    t = _row_tensor(name, value, logits, torch.float32)
    if value.dtype == torch.float64:
        in_range, zero_differs = _AS_GIVEN[name]
        wide = _row_tensor(name, value, logits, torch.float64)
        bad = ~in_range(wide)
        if zero_differs:
            bad = bad | ((wide != 0) & (t == 0))
        t = torch.where(bad, torch.full_like(t, math.nan), t)
    return t


def _settings(logits, temperature, top_k, top_p, min_p) -> RowSettings:
    """Each setting checked (numbers at once: ValueError/TypeError naming it) and normalised (see RowSettings)."""
    vocab = logits.shape[-1]
    if isinstance(temperature, torch.Tensor):
        temperature = _float_rows("temperature", temperature, logits)
    else:
        temperature = check_temperature(temperature, allow_zero=True)
    if type(top_k) is int and top_k >= 0:  # the common case first: the ABC checks below cost a loop's microseconds
        top_k = min(top_k, vocab)  # k >= V keeps every token, as 0 does
    elif isinstance(top_k, torch.Tensor):
        top_k = _row_tensor("top_k", top_k, logits, torch.int64)
    else:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Real) or not math.isfinite(top_k) \
                or int(top_k) != top_k or top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {top_k!r}"
                             + (" (0 = all tokens: pass 0 for vLLM's -1)" if top_k == -1 else ""))
        top_k = min(int(top_k), vocab)  # k >= V keeps every token, as 0 does
    if isinstance(top_p, torch.Tensor):
        top_p = _float_rows("top_p", top_p, logits)
    elif not (0.0 < _real("top_p", top_p) <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    else:
        top_p = float(top_p)
    if isinstance(min_p, torch.Tensor):
        min_p = _float_rows("min_p", min_p, logits)
    elif not (0.0 <= _real("min_p", min_p) <= 1.0):
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    else:
        min_p = float(min_p)
    return RowSettings(temperature, top_k, top_p, min_p)


def check_logp_args(logits, token_ids, temperature, ignore_index, top_k=0, top_p=1.0, min_p=0.0) -> RowSettings:
    """Checks rlkernel.logp's arguments; returns the normalised filters (temperature 0 is allowed: the greedy
    distribution, a processed log-prob)."""
    check_logits(logits)
    if not isinstance(token_ids, torch.Tensor):
        raise TypeError(f"token_ids must be a torch.Tensor, got {type(token_ids).__name__}")
    _check_ids_dtype(token_ids)
    if token_ids.shape != logits.shape[:-1]:
        raise ValueError(
            f"token_ids shape {tuple(token_ids.shape)} must equal logits.shape[:-1] {tuple(logits.shape[:-1])}"
            f" (logits shape {tuple(logits.shape)})"
        )
    if logits.device != token_ids.device:
        raise ValueError(f"logits on {logits.device} and token_ids on {token_ids.device}: must be on one device")
    settings = _settings(logits, temperature, top_k, top_p, min_p)
    ignore_index = _int64("ignore_index", ignore_index)
    # A CPU check costs no sync: raise before any work, as the contract says. Not while torch.compile traces: a
    # compiled graph cannot raise on values (the bad rows are NaN).
    if logits.device.type == "cpu" and not torch.compiler.is_compiling():
        _raise_cpu_faults("logp.forward", settings, logits, (temperature, top_k, top_p, min_p))
        ids = token_ids.reshape(-1).long()
        bad = (ids != ignore_index) & ((ids < 0) | (ids >= logits.shape[-1]))
        if bool(bad.any()):
            first = int(bad.nonzero()[0])
            raise bad_id_error(position_in(first, token_ids.shape), int(ids[first]), logits.shape[-1])
    return settings


def _tensor(name: str, value, *, floating: bool) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if value.is_meta:
        raise ValueError(f"{name} is on the meta device, which holds no values: use a CPU or CUDA tensor")
    return value


def check_logits_dtype(logits_dtype) -> bool:
    """Whether the linear ops keep float32 logits: ``logits_dtype`` is None (the logits in the compute dtype) or
    ``torch.float32``; anything else is refused (``TypeError`` for a non-dtype, ``ValueError`` for another dtype)."""
    if logits_dtype is None:
        return False
    if not isinstance(logits_dtype, torch.dtype):
        raise TypeError(f"logits_dtype must be None or torch.float32, got {type(logits_dtype).__name__}")
    if logits_dtype != torch.float32:
        raise ValueError(f"logits_dtype must be None or torch.float32, got {logits_dtype}")
    return True


def check_linear_args(hidden, weight, token_ids, bias, temperature, ignore_index, op: str) -> None:
    """The checks rlkernel.linear_logp and rlkernel.linear_logp_loss share: hidden [..., H], weight [V, H], bias [V]
    or None (floating, any mix of dtypes: rlkernel.ops.precision picks the compute dtype), token_ids, temperature > 0
    and ignore_index (tensor metadata only: no host sync on CUDA). On CPU the ids
    are checked last (their values: the one costly check), raising ``bad_id_error`` naming ``op``."""
    if isinstance(weight, torch.nn.Module) and isinstance(getattr(weight, "weight", None), torch.Tensor):
        bias_too = ", and bias=lm_head.bias" if getattr(weight, "bias", None) is not None else ""
        raise TypeError(f"weight must be a torch.Tensor, got the module {type(weight).__name__}: pass its "
                        f"parameter (lm_head.weight{bias_too})")
    _tensor("hidden", hidden, floating=True)
    _tensor("weight", weight, floating=True)
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension (the hidden size): [..., H]")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H] (the LM head's layout), got shape {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight shape {tuple(weight.shape)} must be [V, H] with H = hidden.shape[-1] = "
                         f"{hidden.shape[-1]}")
    if weight.shape[0] == 0:
        raise ValueError("weight has no rows: a vocabulary of size 0 has no distribution")
    if weight.shape[1] == 0:  # refused rather than answered: every row's logits would be the bias alone
        raise ValueError(f"{op}: hidden size 0 (weight shape {tuple(weight.shape)}): the logits would not depend on "
                         f"hidden; use rlkernel.logp on the bias (or zeros) instead")
    if weight.shape[0] >= 1 << 31:
        raise ValueError(f"weight has {weight.shape[0]} rows: the vocabulary must be < 2^31")
    if weight.device != hidden.device:
        raise ValueError(f"hidden on {hidden.device} and weight on {weight.device}: must be on one device")
    if bias is not None:
        _tensor("bias", bias, floating=True)
        if bias.shape != weight.shape[:1]:
            raise ValueError(f"bias shape {tuple(bias.shape)} must be [V] = ({weight.shape[0]},)")
        if bias.device != hidden.device:
            raise ValueError(f"hidden on {hidden.device} and bias on {bias.device}: must be on one device")
    if token_ids is None:  # entropy / statistics without ids (rlkernel.ops.linear_options checks it is asked)
        if not isinstance(temperature, torch.Tensor):
            check_temperature(temperature, allow_zero=False)
        _int64("ignore_index", ignore_index)
        return
    _tensor("token_ids", token_ids, floating=False)
    _check_ids_dtype(token_ids)
    if token_ids.shape != hidden.shape[:-1]:
        raise ValueError(f"token_ids shape {tuple(token_ids.shape)} must equal hidden.shape[:-1] "
                         f"{tuple(hidden.shape[:-1])} (hidden shape {tuple(hidden.shape)})")
    if token_ids.device != hidden.device:
        raise ValueError(f"hidden on {hidden.device} and token_ids on {token_ids.device}: must be on one device")
    if not isinstance(temperature, torch.Tensor):  # a per-row tensor: rlkernel.ops.linear_options checks it
        check_temperature(temperature, allow_zero=False)
    ignore_index = _int64("ignore_index", ignore_index)
    if hidden.device.type == "cpu":  # no sync on CPU: raise at once, as rlkernel.logp does
        ids = token_ids.reshape(-1).long()
        vocab = weight.shape[0]
        bad = (ids != ignore_index) & ((ids < 0) | (ids >= vocab))
        if bool(bad.any()):
            first = int(bad.nonzero()[0])
            raise bad_id_error(position_in(first, token_ids.shape), int(ids[first]), vocab, op)


def _seed_like(name: str, value, logits):
    if value is None or not isinstance(value, torch.Tensor):
        return value if value is None else _int64(name, value)
    return _row_tensor(name, value, logits, torch.int64)


def check_return_logprobs(value):
    """False, True or "processed" (anything else that is a string: ValueError)."""
    if isinstance(value, str):
        if value != "processed":
            raise ValueError(f'return_logprobs must be False, True or "processed", got {value!r}')
        return value
    return bool(value)


def check_sample_args(logits, temperature, top_k, top_p, generator, min_p=0.0, seed=None, offset=0):
    """Checks rlkernel.sample's arguments; returns (RowSettings, seed, offset): seed None, an int or an int64 [N]
    tensor, offset an int or an int64 [N] tensor."""
    check_logits(logits)
    settings = _settings(logits, temperature, top_k, top_p, min_p)
    if logits.shape[-1] == 0 and logits.shape[:-1].numel() > 0:
        raise ValueError("sample: a vocabulary of size 0 has no distribution")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if seed is not None:
            raise ValueError("generator and seed are exclusive: pass one (seed makes each row's draw a function of "
                             "its seed and offset alone)")
        if generator.device.type != logits.device.type:
            raise ValueError(f"generator on {generator.device} but logits on {logits.device}")
    seed = _seed_like("seed", seed, logits)
    offset = _seed_like("offset", offset, logits)
    if seed is None and (isinstance(offset, torch.Tensor) or offset != 0):
        raise ValueError("offset needs seed: it is the counter of the per-row seeded generator")
    _raise_cpu_faults("sample", settings, logits, (temperature, top_k, top_p, min_p))
    return settings, seed, offset
