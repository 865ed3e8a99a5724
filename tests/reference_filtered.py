"""Float64 references for the filtered distribution (per-row temperature, top-k, top-p, min-p), the processed
log-probs and their gradient: row by row in plain Python/float64, written independently of rlkernel's code."""
import torch

NEG_INF = float("-inf")


def kept_set(row, temperature, top_k, top_p, min_p):
    """(kept: sorted list of ids, q: float64 [V] the filtered law, margin: distance of the nearest top-p / min-p
    decision from its threshold, in renormalised-mass / p-ratio units; 1.0 when no decision is close to call)."""
    v = row.numel()
    x = row.double()
    if temperature == 0:
        top = int(torch.argmax(x))  # first maximal index
        q = torch.zeros(v, dtype=torch.float64)
        q[top] = 1.0
        return [top], q, 1.0
    p = torch.softmax(x / temperature, -1).tolist()
    xs = x.tolist()
    order = sorted(range(v), key=lambda i: (-xs[i], i))
    if 0 < top_k < v:
        order = order[:top_k]
    mass = sum(p[i] for i in order)
    margin = 1.0
    kept, acc = [], 0.0
    for i in order:
        if top_p < 1.0:
            margin = min(margin, abs(acc / mass - top_p))
            if acc / mass >= top_p:
                break
        kept.append(i)
        acc += p[i]
    pmax = max(p)
    if min_p > 0:
        margin = min([margin] + [abs(p[i] / pmax - min_p) for i in kept])
        kept = [i for i in kept if p[i] >= min_p * pmax]
    s = sum(p[i] for i in kept)
    q = torch.zeros(v, dtype=torch.float64)
    for i in kept:
        q[i] = p[i] / s
    return sorted(kept), q, margin


def processed_ref(logits, ids, settings):
    """(logp, entropy, margin) float64 per row of logits [N, V] (as given, already rounded to their dtype), ids [N],
    settings: a list of (T, k, p, min_p) per row."""
    lps, ents, margins = [], [], []
    for r in range(logits.shape[0]):
        kept, q, margin = kept_set(logits[r], *settings[r])
        i = int(ids[r])
        lp = float(torch.log(q[i])) if q[i] > 0 else NEG_INF
        if settings[r][0] == 0:
            lp = 0.0 if i in kept else NEG_INF
        qq = q[q > 0]
        lps.append(lp)
        ents.append(float(-(qq * qq.log()).sum()))
        margins.append(margin)
    return torch.tensor(lps, dtype=torch.float64), torch.tensor(ents, dtype=torch.float64), margins


def processed_grad_ref(logits, ids, settings, g_lp, g_ent):
    """d(sum(g_lp * logp + g_ent * entropy)) / d logits in float64 with each row's kept set held fixed: logp =
    z_i / T - logsumexp over the kept set (no term when i is not kept), entropy of softmax over the kept set."""
    x = logits.detach().double().requires_grad_(True)
    loss = x.new_zeros(())
    for r in range(x.shape[0]):
        t = settings[r][0]
        if t == 0:
            continue
        kept, _, _ = kept_set(logits[r], *settings[r])
        z = x[r, kept] / t
        logq = z - torch.logsumexp(z, 0)
        i = int(ids[r])
        if i in kept:
            loss = loss + g_lp[r].double() * logq[kept.index(i)]
        loss = loss + g_ent[r].double() * -(logq.exp() * logq).sum()
    (grad,) = torch.autograd.grad(loss, x)
    return grad
