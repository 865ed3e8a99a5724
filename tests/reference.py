"""Float64 references shared by the op tests: written independently of rlkernel's code paths."""
import math

import torch


def chi_square_pvalue(counts, probs):
    """Pearson chi-square p-value of observed ``counts`` against ``probs``, over the cells with expected count >= 5
    (the rest pooled into one cell)."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = max(int(keep.sum()) - 1, 1)
    # Wilson-Hilferty approximation of the chi-square survival function (good for dof >= 1 at these sizes)
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def logp_ref(logits, ids, temperature=1.0, ignore_index=-100):
    """(logp, entropy) in float64 from the logits as given (already rounded to their dtype)."""
    x = logits.double() / temperature
    logp_all = torch.log_softmax(x, dim=-1)
    valid = ids != ignore_index
    safe = torch.where(valid, ids, torch.zeros_like(ids)).long()
    lp = logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    ent = -torch.where(p > 0, p * logp_all, torch.zeros_like(p)).sum(-1)
    ent = torch.where(torch.isnan(logp_all).any(-1), torch.full_like(ent, float("nan")), ent)
    zero = torch.zeros_like(lp)
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero)


def logp_grad_ref(logits, ids, g_lp, g_ent=None, temperature=1.0, ignore_index=-100):
    """d(sum(g_lp*logp + g_ent*entropy))/d logits by float64 autograd of logp_ref."""
    x = logits.detach().double().requires_grad_(True)
    lp, ent = logp_ref(x, ids, temperature, ignore_index)
    loss = (g_lp.double() * lp).sum()
    if g_ent is not None:
        loss = loss + (g_ent.double() * ent).sum()
    (grad,) = torch.autograd.grad(loss, x)
    return grad


def filtered_distribution(logits_row, temperature, top_k, top_p):
    """The exact law of one row (float64, indexed by token id): softmax/T, top-k (ties: lower id), top-p."""
    v = logits_row.numel()
    x = logits_row.double()
    if temperature == 0:
        out = torch.zeros(v, dtype=torch.float64)
        out[int(torch.argmax(x))] = 1.0
        return out
    p = torch.softmax(x / temperature, -1).tolist()
    order = sorted(range(v), key=lambda i: (-p[i], i))
    if 0 < top_k < v:
        order = order[:top_k]
    mass = sum(p[i] for i in order)
    q = {i: p[i] / mass for i in order}
    kept, acc = [], 0.0
    for i in order:
        if acc >= top_p:
            break
        kept.append(i)
        acc += q[i]
    mass = sum(q[i] for i in kept)
    out = torch.zeros(v, dtype=torch.float64)
    for i in kept:
        out[i] = q[i] / mass
    return out
