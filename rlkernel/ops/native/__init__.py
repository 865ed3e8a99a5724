"""The native (reference) backends, in plain PyTorch: logp, processed logp, linear_logp, sample, and the shared
filters and softmax pieces. Nothing here imports ``rlkernel.ops.fused``: a reference must not lean on the code it
checks."""
