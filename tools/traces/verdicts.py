# ruff: noqa: E702  -- `push; work; pop` on one line reads as the range it records
"""Fixture program: the project's own range shapes, for fused/fallback/native verdicts.

NVTX through the `nvtx` package in domain `rlkernel` (registered strings), as rlkernel does:
  * `logp-fused` repetition 1 runs ATen kernels inside `op.logp.forward` (a fallback),
    repetition 2 runs the `rlkernel_` kernel there (fused);
  * `logp-native` runs ATen inside `op.logp.forward` (native on purpose);
  * `grpo-step` x2: a GEMM, fused `op.logp.forward` and `op.logp.backward`, and a native `op.sample`;
  * `:bare-fused` (default domain, no op ranges) runs ATen only, as another program's range would.
With an argument, writes a contract manifest (docs/contracts.md section 6) describing this run there.

    usage: python tools/traces/verdicts.py [MANIFEST.json]   (under nsys, by tools/make_fixtures.sh; needs a GPU)
"""
from __future__ import annotations

import datetime
import json
import os
import sys

import nvtx
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _tricky import check, load  # noqa: E402

D = "rlkernel"


def main() -> None:
    lib = load()
    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    logits = torch.randn(64, 4096, device=dev)
    ids = torch.randint(0, 4096, (64, 1), device=dev)
    w = torch.randn(4096, 512, device=dev)
    flat = logits.view(-1)

    def native_logp():
        return torch.log_softmax(logits, -1).gather(-1, ids)

    def fused_logp():
        check(lib.tl_fused(flat.data_ptr(), flat.numel(), stream), "fused")

    def native_sample():
        return torch.multinomial(torch.softmax(logits, -1), 1)

    # Warm-up outside ranges.
    native_logp(); fused_logp(); native_sample(); logits @ w
    torch.cuda.synchronize()

    def op(name, fn):
        nvtx.push_range(name, domain=D); fn(); nvtx.pop_range(domain=D)

    nvtx.push_range("logp-fused", domain=D); op("op.logp.forward", native_logp); nvtx.pop_range(domain=D)
    nvtx.push_range("logp-fused", domain=D); op("op.logp.forward", fused_logp); nvtx.pop_range(domain=D)
    nvtx.push_range("logp-native", domain=D); op("op.logp.forward", native_logp); nvtx.pop_range(domain=D)
    for _ in range(2):
        nvtx.push_range("grpo-step", domain=D)
        logits @ w
        op("op.logp.forward", fused_logp)
        op("op.logp.backward", fused_logp)
        op("op.sample", native_sample)
        nvtx.pop_range(domain=D)
    lib.tl_push_inline(0, b"bare-fused"); native_logp(); lib.tl_pop(0)
    torch.cuda.synchronize()

    if len(sys.argv) > 1:
        write_manifest(sys.argv[1])
    print("verdicts done")


def write_manifest(path: str) -> None:
    shape = {"batch_size": 64, "seq_len": 1, "vocab_size": 4096, "top_k": 50, "top_p": 0.9, "temperature": 1.0}

    def wl(name, op_, path_, fused_ops):
        return {"name": name, "op": op_, "path": path_, "shape": shape, "dtype": "float32", "warmup": 1,
                "repeat": 1, "bytes": 64 * 4096 * 4, "flops": 0, "fused_patterns": ["rlkernel_*"],
                "fused_ops": fused_ops}

    rec = lambda op_, req, be, st, why, n: {"op": op_, "requested": req, "backend": be, "status": st,  # noqa: E731
                                            "reason": why, "count": n}
    manifest = {
        "schema": 1,
        "created_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "status": "complete", "error": None,
        "command": ["python", "tools/traces/verdicts.py"],
        "workloads": [wl("logp-fused", "logp", "fused", ["logp.forward"]),
                      wl("logp-native", "logp", "native", []),
                      wl("grpo-step", "grpo-step", "fused", ["logp.forward", "logp.backward"])],
        "node": {}, "tools": {}, "steps": [],
        "dispatch": [rec("logp.forward", "auto", "native", "fallback", "extension not built", 1),
                     rec("logp.forward", "auto", "fused", "fused", "", 3),
                     rec("logp.forward", "native", "native", "native", "", 1),
                     rec("logp.backward", "auto", "fused", "fused", "", 2),
                     rec("sample", "native", "native", "native", "", 2)],
        "env": {},
    }
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):  # help only: nothing built, traced or written
        sys.exit(print(__doc__.strip()))
    main()
