"""``python -m rlkernel.profiling``: the profile suite (the same CLI as ``scripts/run_profile_suite.py`` and the
``rlkernel-profile`` console script), reachable from an installed package, which ships no ``scripts/``."""
from rlkernel.profiling.cli import main

raise SystemExit(main())
