"""The fused CUDA backends: fake kernels, autograd and the calls into ``rlkernel._C`` for logp, processed logp,
linear_logp and sample. Each module registers its ops' Python side once the extension loads (``rlkernel._ext``)."""
