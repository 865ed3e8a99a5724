"""rlkernel's Nsight pipelines: capture (pipelines.capture) and analysis (pipelines.analyze).

The exit codes are the contract's (docs/contracts.md, section 5), the same values as ``rlkernel.cli``; they are
repeated here so that the analyzer of a bare trace does not import rlkernel, and with it torch (seconds of
start-up). tests/test_analyze_cli.py checks that the two agree.
"""
EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_BLOCKED = 3
