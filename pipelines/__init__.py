"""rlkernel's Nsight pipelines: capture (pipelines.capture) and analysis (pipelines.analyze).

The exit codes are the contract's (docs/contracts.md, section 5), defined once in ``rlkernel.cli``, which
imports neither torch nor the rest of rlkernel: the analyzer of a bare trace starts without torch.
"""
