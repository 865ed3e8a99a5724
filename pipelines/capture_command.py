"""``python -m pipelines.capture [options] -- CMD [ARGS...]``: the user's own job under nsys, into a run directory
(docs/contracts.md, section 6). Torch-free: nothing here, nor in what ``pipelines.capture`` imports for a command,
imports torch (the node record is taken by a subprocess).

nsys runs ``capture_exec.py`` (stdlib only), which runs CMD and writes its exit code or signal; nsys follows the
command's child processes (``torchrun``, ``accelerate launch``: one export, which ``analyze --ranks`` splits by
process, contract 10). The command's output goes to the terminal as it would without capture. ``--steps A:B`` adds
nsys's ``--capture-range=cudaProfilerApi --capture-range-end=stop`` and sets ``RLKERNEL_CAPTURE_STEPS=A:B`` for the
command, whose ``rlkernel.step_begin`` / ``step_end`` start and stop the profiler around those steps (contract 3).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import sqlite3
import subprocess
import sys
import time

from pipelines import procs, tools
from rlkernel import envflags, textsafe
from rlkernel.cli import EXIT_BLOCKED, EXIT_CHECK_FAILED, CliError

EXEC = pathlib.Path(__file__).resolve().with_name("capture_exec.py")
RECORD = "command-exit.json"  # the shim's record, read into the manifest's target and removed
TRACES = ("cuda", "nvtx", "osrt", "cublas", "cudnn", "mpi", "ucx", "openmp")
DEFAULT_TRACE = "cuda,nvtx,osrt"  # osrt: the host's blocking calls (locks, waits) beside the CUDA ones
# --workload's options: with -- CMD, the command is the workload
REGISTRY_ONLY = ("--workload", "--tool", "--batch-size", "--seq-len", "--vocab-size", "--dtype", "--top-k", "--top-p",
                 "--temperature", "--warmup", "--repeat", "--seed", "--ncu", "--keep-ncu-rep", "--device", "--ranks")
COMMAND_ONLY = ("steps", "name", "trace")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
_PYTHON = re.compile(r"python[0-9.]*(?:\.exe)?")
_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
NODE_TIMEOUT_S = 300.0


def registry_hints() -> dict[str, str]:
    return {f: "a --workload option; with -- CMD your command runs as it is, with its own settings"
            for f in REGISTRY_ONLY}


def validate(args) -> tuple[int, int] | None:
    """The command options; returns the --steps window. CliError (exit 2) for a bad one."""
    window = None
    if args.steps is not None:
        try:
            window = envflags.parse_steps(args.steps, "--steps")
        except envflags.EnvFlagError as e:
            raise CliError(str(e)) from None
    if args.name is not None and not NAME.fullmatch(args.name):
        raise CliError(f"--name {args.name!r}: use 1 to 64 letters, digits and . _ + - (starting with a letter or "
                       "digit): it becomes part of the run directory's name")
    trace = [t.strip() for t in args.trace.split(",")]
    unknown = [t for t in trace if t not in TRACES]
    if unknown:
        raise CliError(f"--trace: unknown {', '.join(repr(t) for t in unknown)}; known: {', '.join(TRACES)}")
    if "cuda" not in trace or "nvtx" not in trace:
        raise CliError("--trace must include cuda and nvtx: the analyzer reads the kernels and the phase ranges")
    args.trace = ",".join(dict.fromkeys(trace))
    return window


def run_name(cmd: list[str]) -> str:
    """The run's name for a command: a Python program's script stem or ``-m`` module; for a launcher (``torchrun``,
    ``accelerate launch``, ...) its name and the script's; else the program's name. Unsafe characters -> ``_``."""
    prog = os.path.basename(cmd[0])
    rest = cmd[1:]

    def target(args: list[str], python: bool) -> str | None:
        for i, a in enumerate(args):
            if a == "-m" and i + 1 < len(args):
                return args[i + 1]
            if a == "-c" and python:
                return "python-c"
            if a.endswith(".py") or (python and not a.startswith("-")):
                return pathlib.PurePath(a).stem
        return None

    if _PYTHON.fullmatch(prog):
        name = target(rest, True) or "python"
    else:
        stem = re.sub(r"\.(py|sh)$", "", prog)
        script = target(rest, False)
        name = f"{stem}-{script}" if script else stem
    name = re.sub(r"[^A-Za-z0-9._+-]", "_", name).lstrip("._+-")[:64]
    return name or "command"


def command_environ(environ, window: tuple[int, int] | None) -> dict:
    """The command's environment: the caller's as it is, RLKERNEL_CAPTURE_STEPS set for --steps and removed
    otherwise (a stray one would stop the profiler half-way through a whole-run capture)."""
    env = dict(environ)
    env.pop("RLKERNEL_CAPTURE_STEPS", None)
    if window is not None:
        env["RLKERNEL_CAPTURE_STEPS"] = f"{window[0]}:{window[1]}"
    return env


def nsys_argv(nsys: str, out_base: str, trace: str, window, record: str, cmd: list[str]) -> list[str]:
    # no CPU sampling or context switches (a 2 GB .qdstrm for a tiny program otherwise); children followed also when
    # they fork without exec (multiprocessing's fork start method: data loaders, some rollout engines)
    argv = [nsys, "profile", f"--trace={trace}", "--sample=none", "--cpuctxsw=none", "--cuda-graph-trace=node",
            "--trace-fork-before-exec=true"]
    if window is not None:
        argv += ["--capture-range=cudaProfilerApi", "--capture-range-end=stop"]
    return argv + ["-o", out_base, "--force-overwrite", "true", sys.executable, "-I", str(EXEC), record, "--", *cmd]


# ---- what the trace holds --------------------------------------------------------------------------------

PHASES_SQL = """
WITH ev AS (SELECT *, globalTid >> 24 AS proc FROM NVTX_EVENTS),
domains AS (
    SELECT ev.domainId, ev.proc, min(coalesce(s.value, ev.text)) AS domain
    FROM ev LEFT JOIN StringIds AS s ON s.id = ev.textId
    WHERE ev.eventType = 75 GROUP BY ev.domainId, ev.proc
),
phases AS (
    SELECT substr(coalesce(s.value, ev.text), 7) AS name, ev.proc, ev.start, {payload} AS payload
    FROM ev JOIN domains AS d ON d.domainId = ev.domainId AND d.proc = ev.proc
    LEFT JOIN StringIds AS s ON s.id = ev.textId
    WHERE ev.eventType IN (59, 60) AND d.domain = 'rlkernel' AND substr(coalesce(s.value, ev.text), 1, 6) = 'phase:'
)
SELECT name, count(*), count(DISTINCT proc), min(start), NULL FROM phases GROUP BY name
UNION ALL
SELECT NULL, NULL, NULL, NULL, payload FROM (SELECT DISTINCT payload FROM phases WHERE name = 'step' AND
                                             payload IS NOT NULL)
"""


def spans(values: list[int]) -> list[list[int]]:
    """Sorted integers as [first, last] runs: [0, 1, 2, 5] -> [[0, 2], [5, 5]]."""
    out: list[list[int]] = []
    for v in sorted(set(values)):
        if out and v == out[-1][1] + 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return out


def phases_seen(sqlite_path: pathlib.Path) -> tuple[list[dict], list[list[int]]]:
    """The ``rlkernel`` domain's ``phase:`` ranges of an nsys export: one record per phase (name, instances,
    processes), in order of first appearance, and the step indices (their payloads) as [first, last] runs. Plain
    sqlite3 (torch- and DuckDB-free); an export without NVTX (no NVTX_EVENTS table) has none."""
    con = sqlite3.connect(f"file:{sqlite_path}?mode=ro", uri=True)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not {"NVTX_EVENTS", "StringIds"} <= tables:
            return [], []
        columns = {r[1] for r in con.execute("PRAGMA table_info(NVTX_EVENTS)")}
        rows = con.execute(PHASES_SQL.format(payload="ev.int64Value" if "int64Value" in columns else "NULL"))
        rows = rows.fetchall()
    finally:
        con.close()
    phases = sorted((r for r in rows if r[0] is not None), key=lambda r: (r[3], r[0]))
    steps = spans([int(r[4]) for r in rows if r[0] is None])
    return [{"name": r[0], "instances": r[1], "processes": r[2]} for r in phases], steps


def summary(phases: list[dict], steps: list[list[int]]) -> str:
    if not phases:
        return ("no rlkernel phases in the trace (mark them with rlkernel.phase / rlkernel.step: "
                "docs/contracts.md, section 3)")
    names = ", ".join(f"{p['name']} x{p['instances']}" for p in phases)
    where = "; steps " + ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in steps) if steps else ""
    return f"phases seen: {names}{where}"


# ---- the run ---------------------------------------------------------------------------------------------

def _node(environ) -> subprocess.Popen:
    """``python -m rlkernel.env --json`` in a subprocess (torch is imported there, not here), in the command's
    environment (CUDA_VISIBLE_DEVICES), with this tree's rlkernel importable."""
    env = dict(environ, PYTHONPATH=os.pathsep.join(p for p in (_ROOT, environ.get("PYTHONPATH")) if p))
    return subprocess.Popen([sys.executable, "-m", "rlkernel.env", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _node_record(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=NODE_TIMEOUT_S)
    except BaseException:
        procs.end([proc], own_session=False, grace=1.0)
        raise
    try:
        rec = json.loads(out) if proc.returncode == 0 else None
    except ValueError:
        rec = None
    if isinstance(rec, dict):
        return rec
    why = next((ln for ln in reversed(err.splitlines()) if ln.strip()), f"exit {proc.returncode}")
    return {"error": f"python -m rlkernel.env --json: {why.strip()[:200]}"}


def profile(cap, args, cmd: list[str], nsys: tools.Tool, window) -> None:
    """nsys over the command, then its export; fills the manifest's ``target``. The command's failure is not an
    error here (its exit code is in ``target``: the caller decides); capture's own failures raise CliError."""
    d, m = cap.run.path, cap.run.manifest
    target = m["target"]
    record = d / RECORD
    argv = nsys_argv(nsys.path, str(d / "trace"), args.trace, window, str(record), cmd)
    cap.progress(f"nsys profile: {' '.join(textsafe.scrub_argv(cmd))}")
    t = time.monotonic()
    # a session of its own: Ctrl-C reaches capture alone, which ends the whole tree (procs.end) once
    proc = subprocess.Popen(argv, env=cap.environ, start_new_session=True)
    try:
        rc = proc.wait()
    except BaseException:
        procs.end([proc], own_session=True)
        raise
    m["steps"].append({"name": "nsys profile", "command": textsafe.scrub_argv(argv), "exit_code": rc,
                       "seconds": round(time.monotonic() - t, 3)})
    cap.progress(f"nsys profile: exit {rc} in {time.monotonic() - t:.1f} s")
    if record.exists():
        outcome = json.loads(record.read_text())
        record.unlink()
        target.update(exit_code=outcome["exit_code"], signal=outcome["signal"])
        if outcome.get("error"):
            raise CliError(f"the command could not start: {outcome['error']}", outcome["exit_code"])
    rep = d / "trace.nsys-rep"
    if not rep.exists():
        if (d / "trace.qdstrm").exists():
            raise CliError(tools.diagnose_qdstrm(nsys.path, str(d / "trace.qdstrm")), EXIT_BLOCKED)
        if target["exit_code"] is None:
            raise CliError(f"nsys profile exited {rc} before the command ran (its output is above)", EXIT_CHECK_FAILED)
        if window is not None:
            raise CliError(f"nsys wrote no trace.nsys-rep: with --steps {window[0]}:{window[1]} nothing is recorded "
                           "until a step in that window begins (rlkernel.step / rlkernel.step_begin, contract 3); "
                           "did the command reach it?", EXIT_CHECK_FAILED)
        raise CliError(f"nsys profile exited {rc} but wrote no trace.nsys-rep", EXIT_CHECK_FAILED)
    node = _node(cap.environ)  # side by side with the export
    try:
        erc, _ = cap.step("nsys export", [nsys.path, "export", "--type", "sqlite", "--force-overwrite", "true",
                                          "--output", str(d / "trace.sqlite"), str(rep)], "tools")
    except BaseException:
        procs.end([node], own_session=False, grace=1.0)
        raise
    m["steps"][-1]["command"] = textsafe.scrub_argv(m["steps"][-1]["command"])
    m["node"] = _node_record(node)
    if erc != 0:
        raise CliError(f"nsys export exited {erc}: {cap.last_error('tools')} (see tools.stderr)", EXIT_CHECK_FAILED)
    if not (d / "trace.sqlite").exists():
        raise CliError("nsys export exited 0 but wrote no trace.sqlite (see tools.stderr)", EXIT_CHECK_FAILED)
    try:
        target["phases"], target["step_indices"] = phases_seen(d / "trace.sqlite")
    except sqlite3.Error as e:
        raise CliError(f"trace.sqlite: cannot read its NVTX ranges ({e})", EXIT_CHECK_FAILED) from None
    cap.progress(summary(target["phases"], target["step_indices"]))
    if window is not None and not target["step_indices"]:
        cap.progress(f"note: --steps {window[0]}:{window[1]}: the trace holds no step range")


def outcome_error(target: dict) -> str | None:
    """What the run's error says when the command failed: exited N, or was killed by a signal; None on exit 0."""
    if target.get("signal"):
        return f"the command was killed by {target['signal']} (exit {target['exit_code']})"
    if target.get("exit_code"):
        return f"the command exited {target['exit_code']}"
    return None
