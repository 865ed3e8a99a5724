"""A mark for torch.compile that costs nothing at import.

``torch.compiler.assume_constant_result`` imports ``torch._dynamo`` (about a second) only to set one attribute on
the function, which dynamo reads when it traces a call to it. rlkernel marks its few trace-time constants (the
environment's flags, the dispatch decision, the error record's address) the same way without that import, so
``import rlkernel`` stays cheap. ``tests/test_errors.py`` checks that the mark is the one torch sets.
"""
from __future__ import annotations


def constant_when_traced(fn):
    """What ``torch.compiler.assume_constant_result(fn)`` does: dynamo calls ``fn`` once while tracing and bakes
    its (constant) result into the graph."""
    fn._dynamo_marked_constant = True
    return fn
