"""Text made safe for where people read it. Torch-free and dependency-free: the analyzer, the profile suite and
tools/traces/strip_export.py share it.

- :func:`scrub_paths`: absolute paths -> ``<path>/<basename>`` (what the stripped fixtures hold, and what a report
  shows of a run's command line: no user names or home directories).
"""
from __future__ import annotations

import re

# An absolute path token: "/" then non-separators, at the start of the value or after a space, quote, "=", ":",
# "(", "," or "[" (so "a/b", "<path>/x" and "kworker/0:1" are not paths).
PATH_TOKEN = re.compile(r"""(?:^|(?<=[\s"'=:(,\[]))/[^\s"'`,;()\[\]{}<>|]+""")


def _basename(m: re.Match) -> str:
    parts = [p for p in m.group(0).split("/") if p]
    return f"<path>/{parts[-1]}" if parts else m.group(0)


def scrub_paths(value):
    """Every absolute path token of a string -> ``<path>/<basename>``; anything else is returned as is."""
    if not isinstance(value, str) or "/" not in value:
        return value
    return PATH_TOKEN.sub(_basename, value)
