"""The fused paths' Python orchestration on CPU, in a process of its own (run by
tests/test_linear_logp_fused_orchestration.py): row blocks, vocabulary chunks, batch-invariant packing, the compute
dtype's casts, the float32 / input dW accumulation in each dH accumulation mode ("addmm", "mm+add", "dtype"), the
gradients' dtypes, masks, float32 logits (the 16-bit gradient tile by the grad op's ``out`` or by the cast op) and
linear_logp_loss's fused pass, against the native backend.

The CUDA kernels are the one edge a CPU process cannot reach: each ``torch.ops.rlkernel`` op the orchestration calls
gets a float64 CPU stand-in written here from its contract (fold: online softmax into (logp, entropy, lse); grad
tile: the logits' gradient in place, or rounded into its 16-bit ``out``; colsum, cast, pack, bias rows), and aten's
CUDA-only ``mm.dtype_out`` / ``addmm.dtype_out`` get CPU ones. So this checks what the Python does with the kernels
(shapes, slices, dtypes, which buffer is summed in what), not the kernels' arithmetic (the GPU tests do). Tolerance:
3e-2 of the largest element for bf16 compute (the two backends round the bf16 operands' products differently), 1e-4
for float32. Prints "ALL OK" at the end."""
import atexit
import math
import os
import shutil
import sys
import tempfile

import torch

# no cached build either (see _probe_tree below): an empty cache folder of this process's own
os.environ["RLKERNEL_CACHE_DIR"] = tempfile.mkdtemp(prefix="rlkernel-fused-on-cpu-")
atexit.register(shutil.rmtree, os.environ["RLKERNEL_CACHE_DIR"], True)

lib = torch.library.Library("rlkernel", "FRAGMENT")
lib.define("linear_logp_fold(Tensor tile, Tensor token_ids, Tensor(a!) state, Tensor(b!) logp, Tensor(c!) entropy, "
           "Tensor(d!) stats, int col0, int vocab, float temperature, int ignore_index, bool first, bool last, "
           "int row0=0, int error_record=0, int error_seq=0) -> ()")
lib.define("linear_logp_grad_tile(Tensor(a!) tile, Tensor token_ids, Tensor stats, Tensor? grad_logp, "
           "Tensor? grad_entropy, Tensor entropy, int col0, int vocab, float temperature, int ignore_index, "
           "Tensor(b!)? out=None) -> ()")
lib.define("linear_logp_colsum(Tensor tile, int n_rows, Tensor(a!) partial, Tensor(b!) out, bool accumulate) -> ()")
lib.define("linear_logp_cast(Tensor src, Tensor(a!) dst, bool accumulate=False) -> ()")
lib.define("linear_logp_pack(Tensor src, Tensor(a!) dst) -> ()")
lib.define("linear_logp_bias_rows(Tensor bias, Tensor(a!) tile) -> ()")


def fold(tile, ids, state, logp, entropy, stats, col0, vocab, T, ign, first, last, row0=0, rec=0, seq=0):
    rows = ids.shape[0]
    z = tile[:rows].double() / T
    st = state[: 4 * rows].view(rows, 4).double()
    if first:
        st[:, 0] = -math.inf
        st[:, 1] = 0
        st[:, 2] = 0
        st[:, 3] = 0
    m_new = torch.maximum(st[:, 0], z.max(1).values)
    scale = torch.exp(st[:, 0] - m_new)
    e = torch.exp(z - m_new[:, None])
    st[:, 1] = st[:, 1] * scale + e.sum(1)
    st[:, 2] = st[:, 2] * scale + (e * z).sum(1)
    c1 = col0 + tile.shape[1]
    inr = (ids >= col0) & (ids < c1)
    st[:, 3] = torch.where(inr, z.gather(1, (ids - col0).clamp(0, tile.shape[1] - 1)[:, None])[:, 0], st[:, 3])
    st[:, 0] = m_new
    state[: 4 * rows].copy_(st.reshape(-1).float())
    if last:
        lse = st[:, 0] + torch.log(st[:, 1])
        valid = ids != ign
        logp.copy_(torch.where(valid, st[:, 3] - lse, 0.0).float())
        if entropy.numel():
            entropy.copy_(torch.where(valid, lse - st[:, 2] / st[:, 1], 0.0).float())
        stats[:, 0] = lse.float()
        stats[:, 1] = 0


grad_outs = []  # the dtypes of grad_tile's `out` arguments (the 16-bit output of a float32 tile)


def grad_tile(tile, ids, stats, gl, ge, entropy, col0, vocab, T, ign, out=None):
    rows = ids.shape[0]
    z = tile[:rows].double() / T
    lse = stats[:, 0].double()
    logp_all = z - lse[:, None]
    p = logp_all.exp()
    cols = torch.arange(col0, col0 + tile.shape[1])
    onehot = (cols[None, :] == ids[:, None]).double()
    g = torch.zeros_like(z)
    if gl is not None:
        g += gl.double()[:, None] * (onehot - p)
    if ge is not None:
        g -= ge.double()[:, None] * p * (logp_all + entropy.double()[:, None])
    g = torch.where((ids != ign)[:, None], g / T, 0.0)
    # in place, or into `out` (the tile only read): the gradient in the tile's dtype, rounded once to out's
    dst = tile
    if out is not None:
        assert tile.dtype == torch.float32 and out.dtype in (torch.bfloat16, torch.float16) and out.shape == tile.shape
        grad_outs.append(out.dtype)
        dst = out
    dst[:rows].copy_(g.to(tile.dtype).to(dst.dtype))
    dst[rows:].zero_()


def colsum(tile, n_rows, partial, out, acc):
    s = tile[:n_rows].float().sum(0)
    if acc:
        out.add_(s)
    else:
        out.copy_(s)


def cast(src, dst, acc=False):
    s = src.reshape(-1)[: dst.numel()].view(dst.shape)
    if acc:
        dst.copy_((dst.float() + s.float()).to(dst.dtype))
    else:
        dst.copy_(s.float().to(dst.dtype) if src.dtype != dst.dtype else s)


def pack(src, dst):
    dst.zero_()
    dst[: src.shape[0]].copy_(src)


def bias_rows(bias, tile):
    tile.copy_(bias.expand_as(tile))


# the option kernels (csrc/linear_logp_options_op.cpp): a per-row temperature, the softcap, the extra statistics
lib.define("linear_logp_fold_rows(Tensor tile, Tensor token_ids, Tensor row_t, Tensor(a!) state, Tensor(b!) logp, "
           "Tensor(c!) entropy, Tensor(d!) stats, int col0, int vocab, int ignore_index, bool first, bool last, "
           "int row0=0, int error_record=0, int error_seq=0) -> ()")
lib.define("linear_logp_fold_extras(Tensor tile, Tensor token_ids, Tensor row_t, Tensor(a!) state, "
           "Tensor(b!) xstate, Tensor(c!) logp, Tensor(d!) entropy, Tensor(e!) stats, Tensor(f!) log_sum_sq, "
           "Tensor(g!) mean_logit, Tensor(h!) is_top1, int col0, int vocab, int ignore_index, bool first, bool last, "
           "int row0=0, int error_record=0, int error_seq=0) -> ()")
lib.define("linear_logp_grad_rows(Tensor(a!) tile, Tensor token_ids, Tensor row_t, Tensor stats, Tensor? grad_logp, "
           "Tensor? grad_entropy, Tensor entropy, int col0, int vocab, int ignore_index, float softcap, "
           "float logit_scale) -> ()")
lib.define("linear_logp_softcap(Tensor(a!) tile, float softcap, float logit_scale) -> ()")


rows_folds = []  # the tiles fold_rows folded (its calls: the option kernels ran)


def fold_rows(tile, ids, row_t, state, logp, entropy, stats, col0, vocab, ign, first, last, row0=0, rec=0, seq=0):
    rows_folds.append(tile.shape)
    fold(tile, ids, state, logp, entropy, stats, col0, vocab, row_t.double()[:, None], ign, first, last)


extras_folds = []  # the tiles fold_extras folded (its calls: the fused statistics ran)


def fold_extras(tile, ids, row_t, state, xstate, logp, entropy, stats, lss, mean, top1, col0, vocab, ign, first,
                last, row0=0, rec=0, seq=0):
    """fold_rows, then the statistics' running state (s2 relative to the running max, sum x, best x, its column;
    ties to the earlier column: the earlier chunk's best wins a tie, torch.argmax's first within the chunk)."""
    extras_folds.append(tile.shape)
    rows = ids.shape[0]
    t = row_t.double()[:, None]
    m_old = state[: 4 * rows].view(rows, 4)[:, 0].double() if not first else torch.full((rows,), -math.inf)
    fold_rows(tile, ids, row_t, state, logp, entropy, stats, col0, vocab, ign, first, last)
    m_new = state[: 4 * rows].view(rows, 4)[:, 0].double()  # z units (fold's stand-in state)
    x = tile[:rows].double()
    xs = xstate[: 4 * rows].view(rows, 4).double()
    if first:
        xs[:, 0], xs[:, 1], xs[:, 2], xs[:, 3] = 0.0, 0.0, -math.inf, 0.0
    s2 = xs[:, 0] * torch.exp(2 * (m_old - m_new)).nan_to_num(0.0) + torch.exp(2 * (x / t - m_new[:, None])).sum(1)
    best, where = x.max(1)
    later = best > xs[:, 2]
    xs[:, 0], xs[:, 1] = s2, xs[:, 1] + x.sum(1)
    xs[:, 3] = torch.where(later, (where + col0).double(), xs[:, 3])
    xs[:, 2] = torch.where(later, best, xs[:, 2])
    xstate[: 4 * rows].copy_(xs.reshape(-1).float())
    if last:
        valid = ids != ign
        lse = m_new + torch.log(state[: 4 * rows].view(rows, 4)[:, 1].double())
        lss.copy_(torch.where(valid, torch.log(s2) - 2 * (lse - m_new), 0.0).float())
        mean.copy_(torch.where(valid, xs[:, 1] / t[:, 0] / vocab, 0.0).float())
        top1.copy_(valid & (xs[:, 3].long() == ids))


def grad_rows(tile, ids, row_t, stats, gl, ge, entropy, col0, vocab, ign, cap, scale):
    rows = ids.shape[0]
    x = tile[:rows].double().clone()
    grad_tile(tile, ids, stats, gl, ge, entropy, col0, vocab, row_t.double()[:, None], ign)
    if cap > 0:  # through the softcap: d x / d z = scale (1 - (x / cap)^2)
        tile[:rows].copy_((tile[:rows].double() * scale * (1 - (x / cap) ** 2)).to(tile.dtype))


def softcap(tile, cap, scale):
    tile.copy_((cap * torch.tanh(tile.double() * scale / cap)).to(tile.dtype))


for name, fn in [("linear_logp_fold", fold), ("linear_logp_grad_tile", grad_tile), ("linear_logp_colsum", colsum),
                 ("linear_logp_cast", cast), ("linear_logp_pack", pack), ("linear_logp_bias_rows", bias_rows),
                 ("linear_logp_fold_rows", fold_rows), ("linear_logp_fold_extras", fold_extras),
                 ("linear_logp_grad_rows", grad_rows), ("linear_logp_softcap", softcap)]:
    lib.impl(name, fn, "CPU")

aten = torch.library.Library("aten", "IMPL")
aten.impl("mm.dtype_out", lambda a, b, dt, out: out.copy_((a.float() @ b.float()).to(dt)), "CPU")
aten.impl("addmm.dtype_out", lambda c, a, b, dt, beta=1, alpha=1, out=None: out.copy_(
    (c.float() + a.float() @ b.float()).to(dt)), "CPU")

import rlkernel  # noqa: E402
from rlkernel import _ext, errors  # noqa: E402
from rlkernel.ops.fused import epilogue_gemm  # noqa: E402
from rlkernel.ops.fused import linear_logp as F  # noqa: E402
from rlkernel.ops.native.linear_logp import linear_logp_native  # noqa: E402

# argv[1], if any: epilogue_gemm.ENABLED for the whole run ("False"; the default "auto" or "True": every call must
# still reach the cuBLAS path's stand-ins, the epilogue GEMM refusing CPU tensors with a reason, not querying a GPU)
if len(sys.argv) > 1:
    epilogue_gemm.ENABLED = {"False": False, "True": True, "auto": "auto"}[sys.argv[1]]

_ext.load = lambda: None
# a GPU machine's in-tree rlkernel._C would register the real ops over the stand-ins above: TORCH_LIBRARY aborts
# the process (it did on the H200), so this process sees no extension at all, as on a CPU machine
_ext._probe_tree = lambda: None
errors.begin = lambda *a, **k: (0, 0, False)
errors.after_call = lambda *a, **k: None


def run(backend, h, w, b, ids, gl, ge, **kw):
    h, w, b = (t.detach().clone().requires_grad_() if t is not None else None for t in (h, w, b))
    fn = F.linear_logp_fused if backend == "fused" else linear_logp_native
    cd = kw.pop("compute", None) or rlkernel.ops.precision.compute_dtype(h, w, b)
    lp, ent = fn(h, w, ids, bias=b, temperature=0.9, ignore_index=-100, return_entropy=True, compute=cd, **kw)
    (gl * lp + ge * ent).sum().backward()
    return lp, ent, h.grad, w.grad, None if b is None else b.grad


def compare(tag, a, b, tol):
    for name, x, y in zip(("lp", "ent", "dh", "dw", "db"), a, b, strict=True):
        if x is None and y is None:
            continue
        assert x.dtype == y.dtype, (tag, name, x.dtype, y.dtype)
        err = (x.double() - y.double()).abs().max().item()
        scale = y.double().abs().max().item() + 1e-12
        assert err <= tol * scale, (tag, name, err, scale)
    print("ok", tag)


torch.manual_seed(0)
n, H, V = 160, 24, 600
ids = torch.randint(0, V, (n,))
ids[3] = -100
gl, ge = torch.randn(n), torch.randn(n) * 0.2
for hd, wd in [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
               (torch.float64, torch.float32)]:
    h = torch.randn(n, H).to(hd)
    w = (torch.randn(V, H) / math.sqrt(H) * 3).to(wd)
    b = (torch.randn(V) * 0.3).to(wd)
    for mode in ("addmm", "mm+add", "dtype"):
        F._dh_modes.clear()
        cd = rlkernel.ops.precision.compute_dtype(h, w, b)
        F._dh_modes[(None, cd, False)] = mode
        F._dh_modes[(None, cd, True)] = mode
        for acc in ("float32", "input"):
            for chunk in [(48, 256), None]:
                for bi in (False, True):
                    if bi and (chunk is None or mode != "addmm"):
                        continue
                    ctx = F.chunking(*chunk) if chunk else __import__("contextlib").nullcontext()
                    with ctx:
                        got = run("fused", h, w, b, ids, gl, ge, accumulation=acc, batch_invariant=bi)
                    want = run("native", h, w, b, ids, gl, ge, accumulation=acc, batch_invariant=False)
                    tol = 3e-2 if cd == torch.bfloat16 else 1e-4
                    compare(f"{hd} {wd} {mode} {acc} {chunk} bi={bi}", got, want, tol)

# float32 logits of 16-bit inputs: the backward's 16-bit gradient tile written by the grad kernel (GRAD_INTO_16BIT,
# no bias gradient) or in place then by the cast kernel (with a bias gradient, or the switch off): the same values
F._dh_modes.clear()
for dt in (torch.bfloat16, torch.float16):
    h = torch.randn(n, H).to(dt)
    w = (torch.randn(V, H) / math.sqrt(H) * 3).to(dt)
    for b in (None, (torch.randn(V) * 0.3).to(dt)):
        got = {}
        for direct in (True, False):
            F.GRAD_INTO_16BIT = direct
            grad_outs.clear()
            with F.chunking(48, 256):
                got[direct] = run("fused", h, w, b, ids, gl, ge, logits32=True)
            # several row blocks and vocabulary chunks, each through the grad kernel's output without a bias
            assert grad_outs == ([dt] * 4 * 3 if direct and b is None else []), (dt, direct, grad_outs)
        F.GRAD_INTO_16BIT = True
        assert all(x is None and y is None or torch.equal(x, y) for x, y in zip(got[True], got[False], strict=True))
        compare(f"float32 logits {dt} bias={b is not None}", got[True],
                run("native", h, w, b, ids, gl, ge, logits32=True), 3e-2)

# the gradient epilogue (a float32-logits backward whose recompute GEMM writes the 16-bit gradient, issue 37): its
# stand-in forms the float32 logits of the chunk it is given and hands them to grad_tile's, so the orchestration's
# slices (weight and bias chunk, ids, stats and gradient rows, the output view) are what is checked, against the
# float32 tile path; grad_reason (which needs an sm_90 GPU) is patched to say yes
lib.define("linear_logp_grad_epilogue(Tensor hidden, Tensor weight, Tensor? bias, Tensor token_ids, Tensor stats, "
           "Tensor? grad_logp, Tensor? grad_entropy, Tensor entropy, int col0, int vocab, float temperature, "
           "int ignore_index, Tensor(a!) out, int config=0) -> ()")
grad_epi_calls = []  # (hidden rows, chunk columns, col0) of each call


def grad_epilogue(h, w, b, ids, stats, gl, ge, entropy, col0, vocab, T, ign, out, config=0):
    assert out.dtype == h.dtype and out.shape == (h.shape[0], w.shape[0]), (out.dtype, out.shape, h.shape, w.shape)
    grad_epi_calls.append((h.shape[0], w.shape[0], col0))
    tile = (h.double() @ w.double().t() + (b.double() if b is not None else 0.0)).float()
    grad_tile(tile, ids, stats, gl, ge, entropy, col0, vocab, T, ign, out)


lib.impl("linear_logp_grad_epilogue", grad_epilogue, "CPU")
real_grad_reason = epilogue_gemm.grad_reason
epilogue_gemm.grad_reason = lambda rows2d, weight, bias, bi, need_b, rows_opt: (
    "a bias gradient (summed from the float32 tile)" if need_b else None)
for dt in (torch.bfloat16, torch.float16):
    h = torch.randn(n, H).to(dt)
    w = (torch.randn(V, H) / math.sqrt(H) * 3).to(dt)
    b = (torch.randn(V) * 0.3).to(dt)
    for bi in (False, True):
        epilogue_gemm.reset_records()
        grad_epi_calls.clear()
        with F.chunking(48, 256):
            hh, ww = (t.detach().clone().requires_grad_() for t in (h, w))
            lp, ent = F.linear_logp_fused(hh, ww, ids, bias=b, temperature=0.9, ignore_index=-100,
                                          return_entropy=True, logits32=True, batch_invariant=bi)
            (gl * lp + ge * ent).sum().backward()
        # 4 row blocks x 3 vocabulary chunks (the last 88 columns), each block's rows (48, the last 16; batch-
        # invariant: every block padded to 48 rows)
        last = 48 if bi else n - 3 * 48
        want_calls = [(48 if r < 3 else last, 256 if c < 2 else V - 512, 256 * c) for r in range(4) for c in range(3)]
        assert grad_epi_calls == want_calls, (dt, bi, grad_epi_calls)
        assert epilogue_gemm.grad_records() == {("epilogue", ""): 1}, epilogue_gemm.grad_records()
        want = run("native", h, w, b, ids, gl, ge, logits32=True)[:4] + (None,)
        compare(f"gradient epilogue {dt} bi={bi}", (lp, ent, hh.grad, ww.grad, None), want, 3e-2)
    # a bias gradient keeps the float32 tile (its column sums), recorded with the reason
    epilogue_gemm.reset_records()
    grad_epi_calls.clear()
    run("fused", h, w, b, ids, gl, ge, logits32=True)
    assert not grad_epi_calls and list(epilogue_gemm.grad_records()) == [
        ("tile", "a bias gradient (summed from the float32 tile)")], epilogue_gemm.grad_records()

# the loss's fused pass vs native, mixed and accumulation modes, masks through the public entry with a patched
# dispatch
from rlkernel import dispatch  # noqa: E402
from rlkernel.ops.fused import logp as FL  # noqa: E402

lib.define("logp_backward_inplace(Tensor? grad_logp, Tensor? grad_entropy, Tensor(a!) logits, Tensor token_ids, "
           "Tensor stats, Tensor entropy, float temperature, int ignore_index) -> ()")
lib.impl("logp_backward_inplace", lambda gl, ge, logits, ids, stats, ent, T, ign: grad_tile(
    logits, ids, stats, gl, ge, ent, 0, logits.shape[1], T, ign), "CPU")


def fake_forward(logits, ids, T, ign, ent_flag, *rest):
    rows = ids.shape[0]
    state = torch.empty(4 * rows)
    logp, ent, stats = torch.empty(rows), torch.empty(rows), torch.empty(rows, 2)
    fold(logits, ids, state, logp, ent, stats, 0, logits.shape[1], T, ign, True, True)
    return logp, ent, stats


FL.forward_op = lambda: fake_forward

orig = dispatch.resolve


def fake_resolve(op, backend, require_fused, device, dtype):
    rec = orig(op, "native", False, device, dtype)
    return rec.__class__(rec.op, backend, "fused", "fused", "") if backend == "fused" else rec


dispatch.resolve = fake_resolve
# linear_logp_loss's backward with float32 logits and the gradient epilogue (grad_reason still patched above): one
# call per token chunk over the whole vocabulary, the bias gradient a GEMM of the 16-bit gradient (no float32 tile)
for dt in (torch.bfloat16, torch.float16):
    h = torch.randn(n, H).to(dt)
    w = (torch.randn(V, H) / math.sqrt(H) * 3).to(dt)
    b = (torch.randn(V) * 0.3).to(dt)
    grad_epi_calls.clear()
    res = {}
    for backend in ("fused", "native"):
        hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
        loss = rlkernel.linear_logp_loss(hh, ww, ids, lambda lp, en, sl: -lp * gl[sl] - 0.1 * en, bias=bb,
                                         chunk_size=48, backend=backend, logits_dtype=torch.float32)
        loss.backward()
        res[backend] = (loss, loss, hh.grad, ww.grad, bb.grad)
    assert grad_epi_calls == [(48, V, 0)] * 3 + [(n - 144, V, 0)], grad_epi_calls
    compare(f"loss gradient epilogue {dt}", res["fused"], res["native"], 3e-2)
epilogue_gemm.grad_reason = real_grad_reason
adv = torch.randn(n)
for hd, wd in [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]:
    h = torch.randn(n, H).to(hd)
    w = (torch.randn(V, H) / math.sqrt(H) * 3).to(wd)
    b = (torch.randn(V) * 0.3).to(wd)
    mask = torch.rand(n) > 0.3
    for mode in ("addmm", "mm+add", "dtype"):
        F._dh_modes.clear()
        cd = rlkernel.ops.precision.compute_dtype(h, w, b)
        F._dh_modes[(None, cd, False)] = mode
        for acc in ("float32", "input"):
            for m in (None, mask):
                res = {}
                for backend in ("fused", "native"):
                    hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
                    loss = rlkernel.linear_logp_loss(hh, ww, ids, lambda lp, en, sl: -lp * adv[sl] - 0.1 * en,
                                                     bias=bb, chunk_size=48, backend=backend, grad_accumulation=acc,
                                                     mask=m, reduction="mean")
                    loss.backward()
                    res[backend] = (loss, loss, hh.grad, ww.grad, bb.grad)
                tol = 3e-2 if cd == torch.bfloat16 else 1e-4
                compare(f"loss {hd} {wd} {mode} {acc} mask={m is not None}", res["fused"], res["native"], tol)
    for m in (None, mask):
        res = {}
        for backend in ("fused", "native"):
            hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
            lp, ent = rlkernel.linear_logp(hh, ww, ids, bias=bb, return_entropy=True, backend=backend, mask=m)
            (adv * lp + 0.1 * ent).sum().backward()
            res[backend] = (lp, ent, hh.grad, ww.grad, bb.grad)
        compare(f"public linear_logp {hd} {wd} mask={m is not None}", res["fused"], res["native"],
                3e-2 if cd == torch.bfloat16 else 1e-4)

# linear_logp_loss's fused pass with a per-row temperature and the softcap (the option kernels' stand-ins on its
# [chunk, V] logits), against the native pass
t_loss = torch.rand(n) + 0.5
for hd, wd in [(torch.bfloat16, torch.float32), (torch.float32, torch.float32)]:
    h = torch.randn(n, H).to(hd)
    w = (torch.randn(V, H) / math.sqrt(H) * 3).to(wd)
    b = (torch.randn(V) * 0.3).to(wd)
    cd = rlkernel.ops.precision.compute_dtype(h, w, b)
    F._dh_modes.clear()
    F._dh_modes[(None, cd, False)] = "addmm"
    for kw in (dict(temperature=t_loss), dict(temperature=0.8, softcap=4.0, logit_scale=0.5),
               dict(temperature=t_loss, softcap=10.0)):
        for m in (None, mask):
            res = {}
            for backend in ("fused", "native"):
                hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
                rows_folds.clear()
                loss = rlkernel.linear_logp_loss(hh, ww, ids, lambda lp, en, sl: -lp * adv[sl] - 0.1 * en, bias=bb,
                                                 chunk_size=48, backend=backend, mask=m, reduction="mean", **kw)
                kept = n if m is None else int(mask.sum())
                assert len(rows_folds) == (-(-kept // 48) if backend == "fused" else 0), (backend, rows_folds)
                loss.backward()
                res[backend] = (loss, loss, hh.grad, ww.grad, bb.grad)
            tol = 3e-2 if cd == torch.bfloat16 else 1e-4  # bf16 softcap: fused float32 logits, native bf16 ones
            compare(f"loss options {sorted(kw)} {hd} mask={m is not None}", res["fused"], res["native"], tol)

# linear_logp's options through the public entry, fused (the stand-ins above) vs native: a per-row temperature, the
# softcap and logit_scale, and the extra statistics of outputs (fold_extras), over several row blocks and vocabulary
# chunks, with a mask, ignored rows, ids-less calls and argmax ties (duplicated weight rows, one in each chunk)
h32 = torch.randn(n, H)
w32 = torch.randn(V, H) / math.sqrt(H) * 3
w32[400] = w32[100]  # a tie across chunks: column 100 is the first argmax, 400 never
w32[101] = w32[100]  # and within a chunk: 100 before 101
h32[:8] = w32[100] * 8  # rows whose argmax is the tie (|w|^2 ~ 9: logits ~ 72, the others' std ~ 15)
ids_t = ids.clone()
ids_t[:8] = torch.tensor([100, 101, 400, 100, 101, 400, 100, -100])
b32 = torch.randn(V) * 0.3
b32[[101, 400]] = b32[100].item()
t_rows = torch.rand(n) + 0.5
stats_names = ("log_sum_sq_probs", "mean_logit", "is_top1")
cases = [dict(temperature=t_rows), dict(temperature=0.8, softcap=5.0, logit_scale=0.5), dict(temperature=1.3),
         dict(temperature=t_rows, softcap=20.0)]
for kw in cases:
    for m in (None, mask):
        for ids_case in (ids_t, None):
            outputs = ("entropy",) + (stats_names if ids_case is not None else stats_names[:2])
            res = {}
            for backend in ("fused", "native"):
                hh, ww, bb = (t.clone().requires_grad_() for t in (h32, w32, b32))
                extras_folds.clear()
                with F.chunking(48, 256):
                    out = rlkernel.linear_logp(hh, ww, ids_case, bias=bb, outputs=outputs, backend=backend, mask=m,
                                               **kw)
                rows_kept = n if m is None else int(mask.sum())
                want_folds = -(-rows_kept // 48) * -(-V // 256) if backend == "fused" else 0  # blocks x chunks
                assert len(extras_folds) == want_folds, (backend, len(extras_folds), want_folds)
                assert all(not getattr(out, f).requires_grad for f in stats_names if getattr(out, f) is not None)
                lp_term = (adv * out.logp).sum() if ids_case is not None else 0.0
                (lp_term + 0.1 * out.entropy.sum()).backward()
                res[backend] = (out, hh.grad, ww.grad, bb.grad)
            tag = f"options {sorted(kw)} mask={m is not None} ids={ids_case is not None}"
            (fo, *fg), (no, *ng) = res["fused"], res["native"]
            for name in ("logp", "entropy", "log_sum_sq_probs", "mean_logit", "is_top1"):
                a, b_ = getattr(fo, name), getattr(no, name)
                assert (a is None) == (b_ is None), (tag, name)
                if a is None:
                    continue
                assert a.dtype == b_.dtype and a.shape == b_.shape, (tag, name, a.dtype, b_.dtype)
                if name == "is_top1":
                    assert torch.equal(a, b_), (tag, a.nonzero(), b_.nonzero())
                    continue
                err = (a.double() - b_.double()).abs().max().item()
                assert err <= 1e-4 * (b_.double().abs().max().item() + 1), (tag, name, err)
            if ids_case is not None:
                top = fo.is_top1 if m is None else fo.is_top1 & mask
                assert bool(top[[0, 3, 6]].all() if m is None else True) and not bool(top[[1, 2, 4, 5, 7]].any()), tag
            compare(tag, (None, None, *fg), (None, None, *ng), 1e-4)
print("ALL OK")
sys.exit(0)
