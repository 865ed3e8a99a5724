#!/usr/bin/env python
"""Profile registry workloads over shapes into CSV/JSON reports (see --help; the logic is rlkernel.profiling)."""
import sys
from pathlib import Path

# run from a checkout (python scripts/run_profile_suite.py): import this tree's rlkernel, with its built extension
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlkernel.profiling.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
