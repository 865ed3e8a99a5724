"""Fixture program: a small GRPO-shaped training loop whose phases are rlkernel.phase / rlkernel.step ranges.

Each of --steps steps (rlkernel.step, index 0, 1, ...): `rollout` (rlkernel.sample of a few tokens from a small
policy), `old_logprob` and `reference_logprob` (rlkernel.logp without grad, of the policy and a frozen copy),
`loss` holding `policy_forward` (rlkernel.logp with grad), `backward`, `optimizer`, and, when it runs as one rank
of a torch.distributed job (WORLD_SIZE > 1, e.g. under torchrun), `weight_sync` (a gloo all_reduce of the
gradients' norms, on the host: the ranks share one GPU, which NCCL refuses). The rlkernel op ranges open inside
the phases. Runs on the GPU (cuda:LOCAL_RANK modulo the device count) or, without one, on the CPU.

    usage: python tools/traces/phases_job.py [--steps N]
           torchrun --standalone --nproc-per-node 2 tools/traces/phases_job.py [--steps N]
           (under `python -m pipelines.capture -- ...`, by tools/make_capture_fixtures.sh)
"""
from __future__ import annotations

import os
import sys


def main(steps: int) -> None:
    import warnings

    import torch

    import rlkernel

    warnings.simplefilter("ignore", rlkernel.FallbackWarning)  # without the extension the ops run native: fine here
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist = None
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.manual_seed(1234 + int(os.environ.get("RANK", "0")))
    rows, hidden, vocab = 64, 256, 4096
    policy = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, vocab))
    policy = policy.to(device)
    reference = [p.detach().clone() for p in policy.parameters()]
    opt = torch.optim.SGD(policy.parameters(), lr=1e-3)
    states = torch.randn(rows, hidden, device=device)
    for _ in range(steps):
        with rlkernel.step():
            with rlkernel.phase("rollout"), torch.no_grad():
                ids = rlkernel.sample(policy(states), temperature=1.0, top_k=50)
            with rlkernel.phase("old_logprob"), torch.no_grad():
                old = rlkernel.logp(policy(states), ids)
            with rlkernel.phase("reference_logprob"), torch.no_grad():
                w1, b1, w2, b2 = reference
                ref = rlkernel.logp(torch.nn.functional.gelu(states @ w1.T + b1) @ w2.T + b2, ids)
            with rlkernel.phase("loss"):
                with rlkernel.phase("policy_forward"):
                    new = rlkernel.logp(policy(states), ids)
                loss = -(torch.exp(new - old) * (new - old).detach()).mean() + 0.04 * (new - ref).pow(2).mean()
            with rlkernel.phase("backward"), torch.autograd.set_multithreading_enabled(False):
                loss.backward()  # on this thread, so the op ranges of the backward nest in its phase
            if dist is not None:
                with rlkernel.phase("weight_sync"):
                    norms = torch.stack([p.grad.norm() for p in policy.parameters()]).cpu()
                    dist.all_reduce(norms)
            with rlkernel.phase("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rank = f"rank {dist.get_rank()} of {world}: " if dist is not None else ""
    print(f"phases_job: {rank}{steps} steps on {device}, last loss {loss.item():.6f}", flush=True)
    if dist is not None:
        # both ranks past their last collective before either tears gloo down: a rank that destroyed its group while
        # its peer still held the connection aborted in gloo's teardown ("terminate called without an active
        # exception", once in a CPU tox run)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):  # help only: nothing imported, run or written
        sys.exit(print(__doc__.strip()))
    args = sys.argv[1:]
    n = int(args[args.index("--steps") + 1]) if "--steps" in args else 3
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # this tree's rlkernel
    main(n)
