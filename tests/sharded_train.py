"""One training step of a tiny model through rlkernel.linear_logp with a sharded LM head, in a process of its own
(one rank, gloo, CPU), and the same step unsharded; prints JSON: the largest gradient differences and the step's
losses. Run by tests/test_linear_logp_sharded.py:
``python tests/sharded_train.py fsdp2|zero3 PORT [linear_logp|linear_logp_loss]``.

The model: hidden = tanh(proj(x)), logp = linear_logp(hidden, lm_head.weight, ids, bias=lm_head.bias), loss =
-(logp * adv).sum() (+ 0.1 entropy); the head's parameters are used directly, never through lm_head's forward, so a
ZeRO-3 head stays partitioned unless the op gathers it, and an FSDP2 head is handed over as a DTensor.
"""
from __future__ import annotations

import json
import os
import sys

import torch

import rlkernel

N, H, V = 12, 16, 40


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(H, H)
        self.lm_head = torch.nn.Linear(H, V)

    def forward(self, x):
        return torch.tanh(self.proj(x))


OP = "linear_logp"  # or linear_logp_loss (argv[3])


def loss_of(model, hidden, ids, adv):
    """Outside the model's forward, as TRL's fused head runs: a ZeRO-3 head is partitioned here."""
    w, b = model.lm_head.weight, model.lm_head.bias
    if OP == "linear_logp_loss":
        return rlkernel.linear_logp_loss(hidden, w, ids, lambda lp, en, sl: -lp * adv[sl] - 0.1 * en, bias=b,
                                         chunk_size=5, backend="native")
    logp, ent = rlkernel.linear_logp(hidden, w, ids, bias=b, return_entropy=True, backend="native")
    return -(logp * adv).sum() - 0.1 * ent.sum()


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, H, generator=g)
    ids = torch.randint(0, V, (N,), generator=g)
    ids[2] = -100
    return x, ids, torch.randn(N, generator=g)


def reference():
    torch.manual_seed(0)
    model = Tiny()
    x, ids, adv = data()
    loss = loss_of(model, model(x), ids, adv)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def init(port: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def fsdp2():
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Tiny()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model.lm_head.weight, DTensor)
    x, ids, adv = data()
    loss = loss_of(model, model(x), ids, adv)
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    dist.destroy_process_group()
    return loss.item(), grads, {"head_is_dtensor": True}


def zero3():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import safe_get_full_grad

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Tiny()
    # persistence threshold 0: ZeRO-3 keeps params below it whole, and this model's are all small
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    head = engine.module.lm_head.weight
    x, ids, adv = data()
    hidden = engine(x)
    partitioned = head.ds_status == ZeroParamStatus.NOT_AVAILABLE  # after the model's forward: the op must gather
    loss = loss_of(engine.module, hidden, ids, adv)
    engine.backward(loss)
    grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
    engine.step()
    released = head.ds_status == ZeroParamStatus.NOT_AVAILABLE  # the backward's gather did not leak the head
    return loss.item(), grads, {"head_partitioned": bool(partitioned), "head_released_after_step": bool(released)}


def main():
    global OP
    kind, port = sys.argv[1], sys.argv[2]
    OP = sys.argv[3] if len(sys.argv) > 3 else OP
    init(port)
    ref_loss, ref = reference()
    loss, grads, info = {"fsdp2": fsdp2, "zero3": zero3}[kind]()
    diffs = {n: (grads[n].double() - ref[n].double()).abs().max().item() for n in ref}
    scale = max(g.abs().max().item() for g in ref.values())
    print(json.dumps({"loss": loss, "ref_loss": ref_loss, "diffs": diffs, "scale": scale, **info}))


if __name__ == "__main__":
    main()
