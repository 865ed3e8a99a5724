"""The profile suite behind ``scripts/run_profile_suite.py`` (issue 5).

``timing``: per-repetition device timing with the caches flushed between repetitions; ``suite``: the
loop over workloads x shapes with honest statuses; ``rows``: the report's columns; ``writers``: the
atomic CSV/JSON files; ``summary``: the terminal table; ``cli``: the flags.
"""
