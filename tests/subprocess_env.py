"""The PYTHONPATH of the subprocesses the tests start (CLIs, examples, stand-in processes): this checkout first, then
whatever PYTHONPATH already holds. Replacing it with the checkout alone hid the packages a GPU node's kit puts there
(duckdb, nvtx, trl's datasets): those tests failed on the H200 only."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pythonpath(first: str | os.PathLike = ROOT) -> str:
    """``first`` (default: the checkout), then the current PYTHONPATH's entries."""
    return os.pathsep.join(p for p in (str(first), os.environ.get("PYTHONPATH")) if p)
