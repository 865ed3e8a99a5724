"""Whether a process still runs: one answer for the extension build's lock (stale temporary folders) and for
pipelines.capture's ending of a command's process tree. Torch-free, standard library only."""
from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, ended but not yet reaped by its parent, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
