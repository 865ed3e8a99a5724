"""What the tests of ``rlkernel.sample(..., return_logprobs=True)`` share: the bound the fused sampler's raw log-probs
keep against ``rlkernel.logp`` (docs/contracts.md, section 1).

The fused sampler reduces each row to its max and sum of exponentials in its own pass (per chunk in the candidates
kernel, merged in select), in a fixed order that is not the logp forward's, so on that path the two agree within

    |sample - logp| <= 2^-17 * (1 + |logp|) + 2^-22 * (|z_id| + max_j |z_j|),   z = logits / T' (T' = T, 1 at T = 0)

(the first term: the two float32 sums of exponentials; the second: a per-row T, where ``rlkernel.logp`` scales by
1/T and the sampler by log2(e)/T). Where a row takes the whole-row path with a scalar T the sampler runs the logp
forward's own reduction: bit for bit. NaN and infinite values agree exactly.
"""
from __future__ import annotations

import torch

import rlkernel

REL = 2.0 ** -17
SCALE = 2.0 ** -22


def raw_temperature(temperature):
    """T' of the raw log-probs: T, with 1 where T = 0 (a number or a per-row tensor)."""
    if isinstance(temperature, torch.Tensor):
        return torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return temperature if temperature > 0 else 1.0


def raw_bound(logits, ids, temperature, want):
    """The contract's bound per row (float64), for the sampler's ids and rlkernel.logp's values ``want``."""
    t = raw_temperature(temperature)
    t = t.double().unsqueeze(-1) if isinstance(t, torch.Tensor) else t
    z = logits.double() / t
    z_max = z.abs().masked_fill(~torch.isfinite(z), 0).amax(-1)
    z_id = z.gather(-1, ids.clamp(min=0).unsqueeze(-1)).squeeze(-1).abs()
    return REL * (1 + want.double().abs()) + SCALE * (z_id + z_max)


def assert_raw_logprobs(lp, logits, ids, temperature, *, bitwise=False):
    """``lp`` (the sampler's return_logprobs=True) against rlkernel.logp on the same ids and T' (fused): within the
    bound, or bit for bit with ``bitwise``. Returns the largest difference seen (float)."""
    want = rlkernel.logp(logits, ids, temperature=raw_temperature(temperature), backend="fused")
    if bitwise:
        differ = (lp.view(torch.int32) != want.view(torch.int32)).nonzero()
        assert differ.numel() == 0, (f"row {int(differ[0])}: sampler {float(lp.flatten()[differ[0]])!r}, "
                                     f"logp {float(want.flatten()[differ[0]])!r}")
        return 0.0
    finite = torch.isfinite(want)
    assert torch.equal(torch.isnan(lp), torch.isnan(want)), "NaN rows differ"
    assert torch.equal(lp[~finite & ~torch.isnan(want)], want[~finite & ~torch.isnan(want)]), "infinite rows differ"
    diff = (lp.double() - want.double()).abs()
    bound = raw_bound(logits, ids, temperature, want)
    over = (finite & ~(diff <= bound)).nonzero()
    assert over.numel() == 0, (f"row {int(over[0])}: sampler {float(lp.flatten()[over[0]])!r}, logp "
                               f"{float(want.flatten()[over[0]])!r}, |diff| {float(diff.flatten()[over[0]]):.3g} > "
                               f"bound {float(bound.flatten()[over[0]]):.3g}")
    return float(diff[finite].max()) if bool(finite.any()) else 0.0
