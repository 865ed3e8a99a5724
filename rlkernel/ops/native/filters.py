"""The kept set of the filtered distribution and the seeded noise, in plain PyTorch (docs/contracts.md, section 1).

Shared by the native sampler and the native processed log-probs, so ``sample(..., return_logprobs="processed")``
and ``rlkernel.logp`` with the same filters compute the same bits.

Batch invariance: a row's results must not depend on the other rows of the call. Elementwise ops, sorts, max and
argmax have no such dependence, but torch's sums and scans pick their reduction order from the whole shape (one
row alone is split differently from a row among many), so every sum and prefix sum here is a fixed-order tree of
elementwise adds over the last dimension (``row_sum``, ``row_prefix_sum``).
"""
from __future__ import annotations

import torch

from rlkernel.ops.native.softmax import compute_dtype

_M32 = 0xFFFFFFFF
# Philox4x32-10 (Salmon et al., SC'11; the constants of Random123 and cuRAND)
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in a fixed pairwise order (element j of the first half plus element j of the second),
    the same for every row whatever the batch: [..., V] -> [...]."""
    v = x.shape[-1]
    if v == 0:
        return x.new_zeros(x.shape[:-1])
    width = 1 << (v - 1).bit_length()
    if width != v:
        x = torch.nn.functional.pad(x, (0, width - v))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def row_prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sums over the last dim by a Hillis-Steele scan of elementwise adds (fixed order per
    element, the same for every row whatever the batch)."""
    shift = 1
    v = x.shape[-1]
    while shift < v:
        x = torch.cat([x[..., :shift], x[..., shift:] + x[..., :-shift]], dim=-1)
        shift *= 2
    return x


def column(value, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A per-row setting (number or [N] tensor) as an [N, 1] tensor of ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype).view(n, 1)
    return torch.full((n, 1), value, dtype=dtype, device=device)


class Filtered:
    """The filtered distribution of rows [N, V] under per-row settings (numbers or [N] tensors).

    Attributes: ``x`` the scaled logits ``logits * (1 / T)`` (T = 1 for T = 0 rows) in the compute dtype, ``m`` their
    row max [N, 1], ``e = exp(x - m)`` (p up to the row's constant), ``kept`` [N, V] bool in token-id order
    (``kept_sorted`` the same in the order ``order`` of the sort below),
    ``s`` the kept mass of e [N, 1] and ``log_s`` its log (log S = log_s - log sum(e)), ``greedy`` [N] (T = 0 rows),
    ``top`` the argmax of the raw logits (lowest id among ties), ``scale`` = 1 / T [N, 1] (1 for T = 0 rows). For
    T = 0 rows ``kept`` is the argmax alone.

    The kept set (exactly): sort by the raw logits, descending, ties by lower id (the order of p = softmax(logits /
    T) in exact arithmetic); keep the first k (k = 0 or k >= V: all); keep, among those, token j while the mass of
    e before it (a prefix sum) is below top_p times the kept top-k mass (every token when top_p = 1); keep the tokens
    with e >= min_p, that is p >= min_p * max(p).
    """

    def __init__(self, rows: torch.Tensor, temperature, top_k, top_p, min_p):
        n, vocab = rows.shape  # vocab >= 1 (the callers answer V = 0 themselves)
        dt = compute_dtype(rows.dtype)
        dev = rows.device
        raw = rows.to(dt)
        t = column(temperature, n, dt, dev)
        self.greedy = (t == 0).view(n)
        self.scale = torch.reciprocal(torch.where(t > 0, t, torch.ones_like(t)))
        self.x = raw * self.scale
        self.m = self.x.amax(dim=-1, keepdim=True)
        self.e = torch.exp(self.x - self.m)
        _, self.order = torch.sort(raw, dim=-1, descending=True, stable=True)
        self.top = self.order[:, 0]  # the argmax of the raw logits, lowest id among ties
        e_sorted = self.e.gather(-1, self.order)
        rank = torch.arange(vocab, device=dev).view(1, vocab)
        k = column(top_k, n, torch.int64, dev)
        k = torch.where((k <= 0) | (k > vocab), vocab, k)
        keep = rank < k
        e_top = torch.where(keep, e_sorted, torch.zeros_like(e_sorted))
        p = column(top_p, n, dt, dev)
        mass_k = row_sum(e_top).unsqueeze(-1)
        # the mass before each token: the prefix sums shifted by one (no subtraction, whose rounding could let a
        # token's "before" pass the total)
        before = torch.cat([torch.zeros_like(e_top[..., :1]), row_prefix_sum(e_top)[..., :-1]], dim=-1)
        keep = keep & ((p >= 1) | (before < p * mass_k))
        keep = keep & (e_sorted >= column(min_p, n, dt, dev))
        self.kept_sorted = torch.where(self.greedy.view(n, 1), rank == 0, keep)  # in the order of ``order``
        self.kept = torch.zeros_like(keep).scatter(-1, self.order, self.kept_sorted)
        self.s = row_sum(torch.where(self.kept, self.e, torch.zeros_like(self.e))).unsqueeze(-1)
        self.log_s = torch.log(self.s)

    def kept_probs(self) -> torch.Tensor:
        """q = the filtered, renormalised distribution [N, V] (0 outside the kept set)."""
        return torch.where(self.kept, self.e / self.s, torch.zeros_like(self.e))

    def no_distribution(self) -> torch.Tensor:
        """[N] bool: rows without a distribution (a NaN; no finite logit; at T > 0 a +inf logit or 1/T overflow)."""
        finite = torch.isfinite(self.e).all(dim=-1)
        top = self.m.view(-1)  # for greedy rows x = the raw logits; amax propagates a NaN
        greedy_bad = torch.isnan(top) | (top == float("-inf"))
        return torch.where(self.greedy, greedy_bad, ~finite)


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of the 64-bit product of uint32 ``a`` (held in int64) and the constant ``m``, in
    16-bit pieces so no int64 product overflows (signed overflow is not something to lean on)."""
    m0, m1 = m & 0xFFFF, m >> 16
    a0, a1 = a & 0xFFFF, a >> 16
    mid = a0 * m1 + a1 * m0  # < 2^33
    t = a0 * m0 + ((mid & 0xFFFF) << 16)  # < 2^33
    return (a1 * m1 + (mid >> 16) + (t >> 32)) & _M32, t & _M32


def philox4x32(counter, key, rounds: int = 10):
    """Philox4x32-``rounds`` on int64 tensors holding uint32 words (broadcasting): counter (c0, c1, c2, c3), key (k0,
    k1) -> four uint32 words. Checked against Random123's known-answer vectors (tests/test_sample_per_row.py)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        hi0, lo0 = _mulhilo(c0, _PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, _PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        if r + 1 < rounds:
            k0, k1 = (k0 + _PHILOX_W[0]) & _M32, (k1 + _PHILOX_W[1]) & _M32
    return c0, c1, c2, c3


def seeded_exponentials(seed, offset, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E ~ Exp(1) for each (row, token) of ``token_ids`` ([N, L] int64, or [1, L] for every row) as [N, L] of
    ``dtype``: a pure function of (the row's seed, its offset, the token id), never of the row's index or of where
    the token sits in ``token_ids``, so a row draws the same noise alone or in any batch.

    Philox4x32-10 with key (seed low, seed high) and counter (token id, 0, offset low, offset high); U = (24 or 52 bits
    + 0.5) / 2^bits in (0, 1), exactly representable; E = -log(U)."""
    n, device = token_ids.shape[0], token_ids.device
    if isinstance(seed, torch.Tensor):
        n = seed.shape[0]
    s = column(seed, n, torch.int64, device)
    o = column(offset, n, torch.int64, device)
    zero = torch.zeros((1, 1), dtype=torch.int64, device=device)
    w0, w1, _, _ = philox4x32((token_ids, zero, o & _M32, (o >> 32) & _M32), (s & _M32, (s >> 32) & _M32))
    if dtype == torch.float64:
        bits = (w0 << 20) | (w1 >> 12)  # 52 bits
        u = (bits.to(torch.float64) + 0.5) * 2.0 ** -52
    else:
        u = ((w0 >> 8).to(torch.float32) + 0.5) * 2.0 ** -24
    return -torch.log(u.to(dtype))
