"""What nsys runs for ``pipelines.capture -- CMD``: ``python -I capture_exec.py RECORD -- CMD [ARGS...]``.

It runs CMD as given (its stdio, environment and working directory), passes on a SIGINT, SIGTERM or SIGHUP it
receives, and writes RECORD, ``{"exit_code", "signal", "error"}``: the command's own outcome, whatever nsys's
exit code says (nsys may be the one that failed). It exits with the command's code (128 + N for signal N; 127 for
a command not found, 126 for one that cannot run). Standard library only, run by its path with ``-I``: the
command's ``sys.path`` and environment are not touched, and no project module is imported into the trace.
"""
import json
import os
import signal
import subprocess
import sys


def write(path: str, record: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -I capture_exec.py RECORD -- CMD [ARGS...]", file=sys.stderr)
        return 2
    record, cmd = argv[0], argv[2:]
    try:
        proc = subprocess.Popen(cmd)
    except OSError as e:  # not found (127) or not runnable (126), as a shell says
        code = 127 if isinstance(e, FileNotFoundError) else 126
        why = f"cannot run {cmd[0]!r}: {e.strerror or e}"
        write(record, {"exit_code": code, "signal": None, "error": why})
        print(f"pipelines.capture: {why}", file=sys.stderr)
        return code
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # sent to this process alone: the command gets it too
        signal.signal(s, lambda signum, frame: proc.send_signal(signum))
    rc = proc.wait()
    name = None
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:  # a real-time signal has no name
            name = f"signal {-rc}"
    code = 128 - rc if rc < 0 else rc
    write(record, {"exit_code": code, "signal": name, "error": None})
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
