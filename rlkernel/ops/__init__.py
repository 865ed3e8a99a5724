"""The ops: public entry points over two backends.

- ``logp.py``, ``sampling.py``, ``linear_logp.py``, ``linear_logp_loss.py``: the entry points behind ``rlkernel.logp``,
  ``rlkernel.sample``, ``rlkernel.linear_logp`` and ``rlkernel.linear_logp_loss`` (validate, then
  ``rlkernel.dispatch.resolve``, then one backend); ``linear_logp_loss_chunks.py`` holds that loss's fused and native
  passes over token chunks.
- ``native/``: the reference backends in plain PyTorch (``logp``, ``logp_processed``, ``linear_logp``, ``sampling``,
  and the shared ``filters`` and ``softmax`` pieces). Never imports ``fused/``.
- ``fused/``: the CUDA backends over ``rlkernel._C`` (``logp``, ``logp_processed``, ``linear_logp``, ``sampling``):
  fake kernels, autograd, and the calls the entry points make.
- ``rows.py``: how the fused backends hand tensors to the kernels (rows, flat ids, per-row settings, row gradients,
  the eager entry's condition). ``blas.py``: the batch-invariant cuBLAS settings both linear_logp backends use.
"""
