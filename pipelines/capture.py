"""python -m pipelines.capture: run registry workloads, or a command of your own, under Nsight into one run directory.

The child (``pipelines.capture_child``) warms each workload up outside any NVTX range, then runs ``--repeat``
repetitions inside the workload's range ``rlkernel:<workload>``. nsys traces CUDA and NVTX and its export
(``trace.sqlite``) is what ``python -m pipelines.analyze`` reads; ncu measures a fixed metric list for the
kernels inside each workload range (one ncu pass per workload) into the long-format ``ncu.csv``. Progress
goes to stderr; the run directory's path is the last line on stdout. The manifest's ``dispatch`` is the
traced (nsys) child's dispatch history; every child step also keeps its own under ``steps``.

``--ranks N`` runs N children side by side as one ``torch.distributed`` job (env:// rendezvous on this host:
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each under its own nsys: ``trace_rank<N>.sqlite`` per rank beside
one manifest, the layout ``python -m pipelines.analyze --ranks RUN`` reads.

``-- CMD [ARGS...]`` (``pipelines.capture_command``) runs your own job under nsys instead: its output and exit code
come through, its ``rlkernel.phase`` / ``rlkernel.step`` ranges are listed in the manifest, ``--steps A:B`` keeps
only those training steps. No torch is imported for it.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import pathlib
import socket
import subprocess
import sys
import time

from pipelines import capture_command, ncu_csv, procs, runs, tools
from pipelines.manifest import allowed_env
from rlkernel import textsafe
from rlkernel.cli import (
    EXIT_BLOCKED,
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    INT64_MAX,
    OUTPUT_DIR_HINTS,
    CliError,
    OneLineParser,
    check_env_flags,
    fail,
    message_prefix,
    prog_name,
)

MODULE = "pipelines.capture"
PROG = MODULE  # what its lines start with: main sets the name the user typed (rlkernel-capture, ...)
HEARTBEAT_S = 30.0  # a progress line at least this often while a profiler runs
POLL_S = 0.5  # how often side-by-side ranks are checked for one that failed
_KEYS = ("op", "requested", "backend", "status", "reason")  # a dispatch record's identity
_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)

EPILOG = """\
your own command: {prog} [--steps A:B] [--name NAME] [--trace LIST] [--output-dir DIR]
  [--nsys PATH] [--require-fused] -- CMD [ARGS...]
  runs CMD under nsys (--trace, default cuda,nvtx,osrt; child processes followed: torchrun, accelerate launch)
  into <UTC timestamp>-<name>/; CMD's output comes through and its exit code is capture's (nonzero: the run is
  kept as <name>-failed/). The --workload options do not apply.
exit codes (docs/contracts.md, section 5):
  0  the run is complete (and, with --require-fused, every fused workload ran fused)
  1  a check you asked for failed: the capture itself (the run is kept as <name>-failed/ with the error in
     its manifest), or --require-fused: a fused workload did not run fused, or the new trace could not be
     analysed (the analyzer's exit 2: the line says why; the run is kept either way)
  2  bad arguments
  3  this machine lacks something: no CUDA device, no nsys/ncu, nsys's importer cannot start, the nvtx
     package, or what the analyzer needs for --require-fused (its exit 3: the DuckDB sqlite extension)
  N  with -- CMD: the command's own nonzero exit code (128 + S when signal S ended it)
  130, 143, 129  SIGINT, SIGTERM or SIGHUP ended the capture (the run is kept as -failed, its children ended)
nsys not found: install Nsight Systems (or Nsight Compute, which bundles it) or pass --nsys PATH."""


def build_parser(command: bool = False, prog: str = f"python -m {MODULE}") -> argparse.ArgumentParser:
    """The registry parser, or with ``command`` the one for ``-- CMD`` (torch-free: it lists no workload, and the
    --workload options are answered as such)."""
    hints = dict(OUTPUT_DIR_HINTS, **(capture_command.registry_hints() if command else {}))
    ap = OneLineParser(prog=prog, description=__doc__.splitlines()[0].split(": ", 1)[1],
                       epilog=EPILOG.format(prog=prog), formatter_class=argparse.RawDescriptionHelpFormatter,
                       hints=hints)
    if not command:
        registry_options(ap)
    ap.add_argument("--output-dir", default="runs",
                    help="parent folder: each capture makes a new run directory in it, <UTC timestamp>-<workload>"
                         "[+n]/ (<UTC timestamp>-<name>/ for a command), holding manifest.json, trace.nsys-rep, "
                         "trace.sqlite, ncu.csv, the logs and, once analyzed, report/ (default runs)")
    ap.add_argument("--nsys", metavar="PATH", help="nsys to use (else $NSYS, PATH, $CUDA_HOME/bin, /opt/nvidia)")
    ap.add_argument("--require-fused", action="store_true",
                    help="after the capture, run the analyzer's verdict on it: exit 1 when a fused workload did not "
                         "run fused or the trace could not be analysed (analyzer exit 1 or 2), 3 when the analyzer "
                         "is blocked (its exit 3); the run is kept either way")
    ap.add_argument("--steps", metavar="A:B",
                    help="with -- CMD: record only training steps A to B (or N), marked by rlkernel.step / "
                         "step_begin in the command (nsys's cudaProfilerApi capture range; contract 3)")
    ap.add_argument("--name", metavar="NAME",
                    help="with -- CMD: the run's name after the timestamp (default: from the command, e.g. the "
                         "script's name)")
    ap.add_argument("--trace", metavar="LIST", default=None if not command else capture_command.DEFAULT_TRACE,
                    help=f"with -- CMD: what nsys traces (default {capture_command.DEFAULT_TRACE}; any of "
                         f"{', '.join(capture_command.TRACES)}, with cuda and nvtx)")
    return ap


def registry_options(ap: argparse.ArgumentParser) -> None:
    # the catalog, not rlkernel.workloads: --help must not pay torch's start-up (5-10 s)
    from rlkernel import workload_catalog

    ap.add_argument("--workload", action="append", metavar="NAME",
                    help=f"registry workload, repeatable: {', '.join(workload_catalog.names())}")
    ap.add_argument("--tool", choices=("nsys", "ncu", "all"), default="nsys", help="profiler(s) to run (default nsys)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences (default 8)")
    ap.add_argument("--seq-len", type=int, default=512,
                    help="tokens per sequence, ignored by sampling workloads (one row per sequence) (default 512)")
    ap.add_argument("--vocab-size", type=int, default=128256, help="vocabulary size (default 128256)")
    ap.add_argument("--dtype", choices=workload_catalog.DTYPE_NAMES, default="bfloat16",
                    help="logits dtype (default bfloat16)")
    ap.add_argument("--top-k", type=int, default=50, help="sampling: keep the k most probable, 0 = all (default 50)")
    ap.add_argument("--top-p", type=float, default=0.9, help="sampling: nucleus mass, in (0, 1] (default 0.9)")
    ap.add_argument("--temperature", type=float, default=1.0, help="the logits are divided by it, > 0 (default 1.0)")
    ap.add_argument("--warmup", type=int, default=3, help="runs per workload outside any range (default 3)")
    ap.add_argument("--repeat", type=int, default=5, help="repetitions per workload, each in its range (default 5)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--ncu", metavar="PATH", help="ncu to use (else $NCU, PATH, $CUDA_HOME/bin, /opt/nvidia)")
    ap.add_argument("--keep-ncu-rep", action="store_true",
                    help="keep ncu's reports ncu-<workload>.ncu-rep in the run (for ncu-ui; they embed the kernels' "
                         "modules, ~100 MB each for PyTorch's kernels); by default only ncu.csv is kept")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu runs the workloads on the CPU to test the pipeline itself: its trace holds no kernels")
    ap.add_argument("--ranks", type=int, metavar="N",
                    help="run N processes as one torch.distributed job (NCCL with a GPU per rank, else gloo; an "
                         "all_reduce after each repetition), each under its own nsys: trace_rank<N>.sqlite per rank "
                         "beside one manifest; analyse with `python -m pipelines.analyze --ranks RUN`")


def validate(args) -> None:
    from rlkernel import workloads

    for flag in capture_command.COMMAND_ONLY:
        if getattr(args, flag) is not None:
            raise CliError(f"--{flag} goes with -- CMD (a command of your own), not with --workload")
    if not args.workload:
        raise CliError("give --workload NAME (a registry workload, repeatable) or -- CMD [ARGS...] (a command of "
                       "your own) (see --help)")
    for name in args.workload:
        if name not in workloads.REGISTRY:
            raise CliError(f"unknown workload {name!r}; known: {', '.join(workloads.names())}")
    if len(set(args.workload)) != len(args.workload):
        raise CliError("a workload is named twice")
    for flag in ("batch_size", "seq_len", "vocab_size", "repeat"):
        if getattr(args, flag) < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("warmup", "top_k", "seed"):
        if getattr(args, flag) < 0:
            raise CliError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    for flag in ("batch_size", "seq_len", "vocab_size", "repeat", "warmup", "top_k", "seed"):
        if getattr(args, flag) > INT64_MAX:  # torch takes sizes and seeds as int64: past it, a failed run, not exit 2
            raise CliError(f"--{flag.replace('_', '-')} {getattr(args, flag)} does not fit a 64-bit integer")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise CliError(f"--top-p must be in (0, 1], got {args.top_p}")
    shape = workloads.Shape(args.batch_size, args.seq_len, args.vocab_size, args.top_k, args.top_p, args.temperature)
    for name in args.workload:
        error = workloads.get(name).shape_error(shape)
        if error:
            raise CliError(error)
    logp_ops = [n for n in args.workload if workloads.get(n).op != "sample"]
    if not math.isfinite(args.temperature) or args.temperature < 0 or (logp_ops and args.temperature == 0):
        raise CliError(f"--temperature must be a finite number > 0 (>= 0 for sampling only), got {args.temperature}")
    if args.ranks is not None:
        if args.ranks < 1:
            raise CliError(f"--ranks must be >= 1, got {args.ranks}")
        if args.tool != "nsys":
            raise CliError(f"--ranks traces with nsys only (one trace per rank), not --tool {args.tool}")
    if args.tool == "nsys" and (args.ncu is not None or args.keep_ncu_rep):
        raise CliError("--ncu and --keep-ncu-rep go with --tool ncu or --tool all (this capture runs nsys only)")
    check_output_dir(args.output_dir)


def check_output_dir(path) -> None:
    """The nearest existing part of --output-dir must be a folder (it is created later, only once the tools are
    found): a file there would otherwise end the run with a traceback."""
    for part in (pathlib.Path(path), *pathlib.Path(path).parents):
        if part.exists():
            if not part.is_dir():
                where = "" if part == pathlib.Path(path) else f"{part} "
                raise CliError(f"--output-dir {path}: {where}is not a directory")
            return


# ---- command lines ---------------------------------------------------------------------------------------

def child_argv(args, names: list[str], record: str, backend: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "pipelines.capture_child"]
    for n in names:
        argv += ["--workload", n]
    for flag in ("batch_size", "seq_len", "vocab_size", "top_k", "top_p", "temperature", "dtype", "warmup",
                 "repeat", "seed", "device"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv + ["--record", record] + (["--dist-backend", backend] if backend else [])


def dist_backend(device: str, world_size: int) -> str:
    """NCCL when every rank can have a GPU of its own; gloo otherwise (the CPU, several ranks on one GPU: NCCL
    refuses two ranks on one device)."""
    import torch
    import torch.distributed as dist

    if device == "cuda" and torch.cuda.device_count() >= world_size and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def free_port() -> int:
    # the OS picks a free port; closed again at once, for rank 0's TCPStore to bind (a small race, on one host)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environ(environ: dict, rank: int, world_size: int, port: int) -> dict:
    """What torchrun sets for a rank on one host (the child's env:// rendezvous reads it)."""
    env = dict(environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
               LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform.startswith("linux"):  # gloo would otherwise pick the interface of the host name, maybe none
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def nsys_profile_argv(nsys: str, out_base: str, child: list[str]) -> list[str]:
    # no CPU sampling or context switches: without them even a tiny program writes a 2 GB .qdstrm
    return [nsys, "profile", "--trace=cuda,nvtx", "--sample=none", "--cpuctxsw=none", "--cuda-graph-trace=node",
            "-o", out_base, "--force-overwrite", "true", *child]


def nsys_export_argv(nsys: str, rep: str, sqlite: str) -> list[str]:
    return [nsys, "export", "--type", "sqlite", "--force-overwrite", "true", "--output", sqlite, rep]


def ncu_profile_argv(ncu: str, workload: str, out_base: str, child: list[str]) -> list[str]:
    # push/pop ranges of domain D are named "D@range/"; --clock-control none keeps the GPU's own clocks
    return [ncu, "--nvtx", "--nvtx-include", f"rlkernel@{workload}/", "--clock-control", "none",
            "--metrics", ",".join(ncu_csv.METRICS), "-o", out_base, "--force-overwrite", *child]


def ncu_import_argv(ncu: str, rep: str) -> list[str]:
    return [ncu, "--import", rep, "--csv", "--page", "raw", "--print-units", "base", "--print-kernel-base", "function"]


def read_child_record(path: pathlib.Path, step_name: str) -> dict:
    """The child's record (``dispatch`` list, ``node`` object, timings); one-line CliError (exit 2) when the file
    is not one: unreadable, not JSON, nested deeper than the parser's stack, or the wrong shape."""
    import json

    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0][:160]
        raise CliError(f"{step_name}: the child's record {path.name} is not readable JSON ({why})") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("dispatch"), list) or not isinstance(rec.get("node"), dict):
        raise CliError(f"{step_name}: the child's record {path.name} is not an object with a dispatch list and a "
                       "node object")
    return rec


# ---- running steps ---------------------------------------------------------------------------------------

class Capture:
    def __init__(self, args, run: runs.RunDir, environ: dict):
        self.args, self.run, self.environ = args, run, environ
        self.t0 = time.monotonic()
        self.node_from_child = False

    def progress(self, msg: str) -> None:
        print(f"[capture {time.monotonic() - self.t0:7.1f} s] {msg}", file=sys.stderr, flush=True)

    def step(self, name: str, argv: list[str], log: str, capture_stdout=False) -> tuple[int, str]:
        """Run one command; its output is appended to ``log``.stdout/.stderr in the run (stdout kept in memory
        with ``capture_stdout``). Recorded in the manifest's steps whatever its exit code."""
        return self.steps([(name, argv, log, self.environ)], capture_stdout)[0]

    def steps(self, items: list[tuple], capture_stdout=False) -> list[tuple[int, str]]:
        """Run (name, argv, log, environ) commands side by side, as ``step`` does one. Several run in sessions of
        their own: when one fails, or on an interrupt, the others' whole process trees (nsys and its child) are
        ended, since a rank waiting for a dead peer would wait out gloo's 30-minute timeout. An interrupt or a
        SIGTERM (``procs.Terminated``) ends every command's tree before it goes on up."""
        d = self.run.path
        with contextlib.ExitStack() as stack:
            started = []
            try:
                for name, argv, log, environ in items:
                    self.progress(f"{name}: {' '.join(argv[:2])} ...")
                    out = stack.enter_context(open(d / f"{log}.stdout", "a"))
                    err = stack.enter_context(open(d / f"{log}.stderr", "a"))
                    for f in (out, err):
                        f.write(f"== {name}: {' '.join(argv)}\n")
                        f.flush()
                    started.append((subprocess.Popen(argv, stdout=subprocess.PIPE if capture_stdout else out,
                                                     stderr=err, env=environ, text=True,
                                                     start_new_session=len(items) > 1), time.monotonic()))
                text = started[0][0].communicate()[0] if capture_stdout else ""
                ended = self._wait([p for p, _ in started], [it[0] for it in items])
            except BaseException:
                procs.end([p for p, _ in started], own_session=len(items) > 1)
                raise
        results = []
        for (name, argv, _, _), (proc, t), end in zip(items, started, ended, strict=True):
            seconds = round(end - t, 3)
            self.run.manifest["steps"].append({"name": name, "command": argv, "exit_code": proc.returncode,
                                               "seconds": seconds})
            self.progress(f"{name}: exit {proc.returncode} in {seconds:.1f} s")
            results.append((proc.returncode, text))
        return results

    def _wait(self, children: list, names: list[str]) -> list[float]:
        """Wait for every command, ending the others once one has failed; returns when each was seen to end (the
        first failure is the one to name: the ranks ended because of it may exit nonzero too)."""
        ended: list[float | None] = [None] * len(children)
        beat = time.monotonic()
        while True:
            for i, p in enumerate(children):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.monotonic()
            running = [p for p, e in zip(children, ended, strict=True) if e is None]
            if not running:
                return ended
            if any(p.returncode not in (None, 0) for p in children):
                procs.end(children, own_session=len(children) > 1)
                continue
            try:
                running[0].wait(timeout=POLL_S if len(children) > 1 else HEARTBEAT_S)
            except subprocess.TimeoutExpired:
                if time.monotonic() - beat >= HEARTBEAT_S or len(children) == 1:
                    beat = time.monotonic()
                    for p, name in zip(children, names, strict=True):
                        if p.poll() is None:
                            self.progress(f"{name}: still running")

    def last_error(self, log: str) -> str:
        lines = [ln.strip() for ln in (self.run.path / f"{log}.stderr").read_text().splitlines() if ln.strip()]
        child = [ln for ln in lines if ln.startswith("pipelines.capture_child:")]
        tail = [ln for ln in lines if not ln.startswith("==")]
        return (child or tail or ["no error output"])[-1]

    def check(self, name: str, rc: int, log: str) -> None:
        if rc != 0:
            why = self.last_error(log)
            code = EXIT_BLOCKED if "capture_child: blocked" in why else EXIT_CHECK_FAILED
            raise CliError(f"{name} exited {rc}: {why} (see {log}.stderr)", code)

    def read_record(self, path: pathlib.Path, step_name: str, step: int = -1, log: str = "child") -> dict:
        """The child's record, its dispatch kept in its step (``step``: an index into the manifest's steps)."""
        if not path.exists():
            raise CliError(f"{step_name}: the child wrote no record (see {log}.stderr)", EXIT_CHECK_FAILED)
        rec = read_child_record(path, step_name)
        path.unlink()
        self.run.manifest["steps"][step]["dispatch"] = rec["dispatch"]
        if not self.node_from_child:  # the first (traced) child's node record, taken in its environment
            self.run.manifest["node"], self.node_from_child = rec["node"], True
        return rec

    def nsys(self, nsys: tools.Tool) -> None:
        d = self.run.path
        record = d / "child-nsys.json"
        rc, _ = self.step("nsys profile", nsys_profile_argv(nsys.path, str(d / "trace"),
                                                            child_argv(self.args, self.args.workload, str(record))),
                          "child")
        self.check("nsys profile", rc, "child")
        if not (d / "trace.nsys-rep").exists():
            if (d / "trace.qdstrm").exists():
                raise CliError(tools.diagnose_qdstrm(nsys.path, str(d / "trace.qdstrm")), EXIT_BLOCKED)
            raise CliError("nsys profile exited 0 but wrote no trace.nsys-rep (see child.stdout)", EXIT_CHECK_FAILED)
        self.run.manifest["dispatch"] = self.read_record(record, "nsys profile")["dispatch"]
        rc, _ = self.step("nsys export", nsys_export_argv(nsys.path, str(d / "trace.nsys-rep"),
                                                          str(d / "trace.sqlite")), "tools")
        self.check("nsys export", rc, "tools")
        if not (d / "trace.sqlite").exists():
            raise CliError("nsys export exited 0 but wrote no trace.sqlite (see tools.stderr)", EXIT_CHECK_FAILED)

    def nsys_ranks(self, nsys: tools.Tool) -> None:
        """--ranks N: the N ranks side by side, each under its own nsys; then each rank's export. The manifest's
        ``dispatch`` holds every rank's records, each with its ``rank``; its node is rank 0's."""
        d, n = self.run.path, self.args.ranks
        backend, port = dist_backend(self.args.device, n), free_port()
        self.run.manifest["ranks"] = {"world_size": n, "backend": backend}
        first = len(self.run.manifest["steps"])
        items = [(f"nsys profile rank {r}",
                  nsys_profile_argv(nsys.path, str(d / f"trace_rank{r}"),
                                    child_argv(self.args, self.args.workload, str(d / f"child-nsys-rank{r}.json"),
                                               backend)),
                  f"child_rank{r}", rank_environ(self.environ, r, n, port)) for r in range(n)]
        results = self.steps(items)
        # the rank that failed first is the one to name, not the ranks ended because of it
        steps = self.run.manifest["steps"][first:]
        for r in sorted(range(n), key=lambda r: (results[r][0] == 0, steps[r]["seconds"])):
            self.check(f"nsys profile rank {r}", results[r][0], f"child_rank{r}")
        for r in range(n):
            if not (d / f"trace_rank{r}.nsys-rep").exists():
                raise CliError(f"nsys profile rank {r} exited 0 but wrote no trace_rank{r}.nsys-rep (see "
                               f"child_rank{r}.stdout)", EXIT_CHECK_FAILED)
            rec = self.read_record(d / f"child-nsys-rank{r}.json", f"nsys profile rank {r}", first + r,
                                   f"child_rank{r}")
            self.run.manifest["dispatch"] += [{"rank": r, **x} for x in rec["dispatch"]]
        for r in range(n):
            name, rep, out = f"nsys export rank {r}", d / f"trace_rank{r}.nsys-rep", d / f"trace_rank{r}.sqlite"
            rc, _ = self.step(name, nsys_export_argv(nsys.path, str(rep), str(out)), "tools")
            self.check(name, rc, "tools")
            if not out.exists():
                raise CliError(f"{name} exited 0 but wrote no {out.name} (see tools.stderr)", EXIT_CHECK_FAILED)

    def ncu(self, ncu: tools.Tool) -> None:
        d, rows, merged = self.run.path, [], {}
        for w in self.args.workload:
            record = d / f"child-ncu-{w}.json"
            rc, _ = self.step(f"ncu profile {w}", ncu_profile_argv(ncu.path, w, str(d / f"ncu-{w}"),
                                                                   child_argv(self.args, [w], str(record))), "child")
            self.check(f"ncu profile {w}", rc, "child")
            for rec in self.read_record(record, f"ncu profile {w}")["dispatch"]:
                key = tuple(rec[k] for k in _KEYS)
                merged[key] = merged.get(key, 0) + rec["count"]
            if not (d / f"ncu-{w}.ncu-rep").exists():
                raise CliError(f"ncu profiled no kernel inside rlkernel@{w}/ (see child.stderr)", EXIT_CHECK_FAILED)
            rc, text = self.step(f"ncu import {w}", ncu_import_argv(ncu.path, str(d / f"ncu-{w}.ncu-rep")), "tools",
                                 capture_stdout=True)
            self.check(f"ncu import {w}", rc, "tools")
            try:
                long, notes = ncu_csv.to_long(text, w, self.args.repeat)
            except ncu_csv.NcuCsvError as e:
                raise CliError(f"ncu import {w}: {e}", EXIT_CHECK_FAILED) from None
            self.run.manifest["steps"][-1]["notes"] = notes
            for n in notes:
                self.progress(f"note: {n}")
            rows += long
            if not self.args.keep_ncu_rep:
                (d / f"ncu-{w}.ncu-rep").unlink()
        ncu_csv.write_long(d / "ncu.csv", rows)
        if not self.run.manifest["dispatch"]:  # no nsys pass: the ncu children's histories are the record
            self.run.manifest["dispatch"] = [dict(zip(_KEYS, k, strict=True), count=n)
                                             for k, n in merged.items()]


# ---- preconditions and main ------------------------------------------------------------------------------

def preflight(args, environ) -> dict:
    """Everything this machine must have, checked before any run directory exists; returns the tools."""
    found = {}
    if args.tool in ("nsys", "all"):
        found["nsys"] = tools.find("nsys", args.nsys, environ)
    if args.tool in ("ncu", "all"):
        found["ncu"] = tools.find("ncu", args.ncu, environ)
    if importlib.util.find_spec("nvtx") is None:
        raise CliError("the nvtx Python package is missing (pip install nvtx): without it the trace "
                       "has no workload ranges", EXIT_BLOCKED)
    if args.require_fused and importlib.util.find_spec("pipelines.analyze") is None:
        raise CliError("--require-fused needs pipelines.analyze, which is not in this tree yet; "
                       "capture without --require-fused", EXIT_BLOCKED)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise CliError(f"no CUDA device visible (torch {torch.__version__}, {build}); run on a machine with "
                           "a GPU and a CUDA build of torch, or --device cpu to test the pipeline", EXIT_BLOCKED)
    return found


def analyze_verdict(argv: list[str]) -> tuple[int, str]:
    """The analyzer's exit code on the finished run with --require-fused, and its reason for a 2 or 3
    (``analyze.verdict``); an analyzer bug is a 2 with the exception's line: the run is complete, the verdict not."""
    from pipelines import analyze

    try:
        rc, why = analyze.verdict(argv)
    except Exception as e:  # noqa: BLE001 - see above
        rc, why = EXIT_USAGE, f"{type(e).__name__}: {e}"
    return rc, why or "no reason given"


def require_fused(final: pathlib.Path, manifest: dict, ranks: bool = False) -> tuple[int, str]:
    """The analyzer's verdict on the finished run, recorded as a step of the run's manifest (with the analyzer's
    own exit code), mapped to capture's: analyzer 0 -> 0; 1 (not fused) -> 1; 2 (the trace could not be
    analysed) -> 1, a check asked for failed; 3 (blocked: no sqlite extension) -> 3. Returns (code, message).
    A --ranks run is judged by ``analyze --ranks``, its report written into the run's report/ as for one trace."""
    t = time.monotonic()
    argv = (["--ranks", str(final), "--out", str(final / "report")] if ranks else [str(final)]) + ["--require-fused"]
    rc, why = analyze_verdict(argv)
    manifest["steps"].append({"name": "analyze --require-fused", "command": ["python", "-m", "pipelines.analyze",
                              *argv], "exit_code": rc, "seconds": round(time.monotonic() - t, 3)})
    runs.write_json_atomic(final / "manifest.json", manifest)
    if rc == EXIT_OK:
        return EXIT_OK, ""
    if rc == EXIT_CHECK_FAILED:
        return EXIT_CHECK_FAILED, "--require-fused: a fused workload did not run fused (the lines above say which)"
    if rc == EXIT_BLOCKED:
        return EXIT_BLOCKED, f"--require-fused: the analyzer is blocked on this machine: {why}"
    return EXIT_CHECK_FAILED, f"--require-fused: the new trace could not be analysed: {why}"


def main(argv=None) -> int:
    global PROG  # one CLI run per process: its lines name the command as typed, a caller's argv the module
    prog = prog_name(MODULE, sys.argv[0] if argv is None else None)
    PROG = message_prefix(prog)
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else None
    try:
        if command is not None:
            return main_command(argv, argv[:argv.index("--")], command, prog)
        args = build_parser(prog=prog).parse_args(argv)
        validate(args)
        check_env_flags()  # before any run directory: a bad value would fail the child, and keep a -failed run
        environ = dict(os.environ, PYTHONUNBUFFERED="1",
                       PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
        found = preflight(args, environ)
    except CliError as e:
        return fail(PROG, str(e), e.code)
    say_tools(found)
    with procs.signals_raise():  # SIGTERM / SIGHUP end the capture as Ctrl-C does: children ended, run -failed
        return capture(args, argv, found, environ)


def say_tools(found: dict) -> None:
    for t in found.values():
        print(f"{PROG}: {t.name} {t.version} at {t.path} ({t.source})", file=sys.stderr)


def guarded(run: runs.RunDir, body) -> int | None:
    """``body()``; None when it finished. A capture failure (CliError), an interrupt or a signal renames the run
    ``-failed`` with why, prints its path (the last line on stdout) and the one-line error, and returns the exit
    code; anything unforeseen still leaves a -failed run, never a half one, and goes on up."""
    try:
        body()
    except CliError as e:
        final = run.fail(str(e))
        print(str(final))
        return fail(PROG, f"{e} [run kept as {final}]", e.code)
    except (KeyboardInterrupt, procs.Terminated) as e:  # Ctrl-C, or SIGTERM / SIGHUP (timeout, CI, Slurm)
        final = run.fail(procs.describe(e))  # the children's trees are ended by now (Capture.steps, procs.end)
        print(str(final))
        return fail(PROG, f"{procs.describe(e)} [run kept as {final}]", procs.exit_code(e))
    except Exception as e:
        run.fail(f"{type(e).__name__}: {e}")
        raise
    return None


def finish(run: runs.RunDir, cap, args, ranks: bool = False) -> int:
    """The run complete: renamed, its path printed, then --require-fused's verdict."""
    try:
        final = run.complete()
    except OSError as e:  # the manifest or the rename failed (a full disk, a folder gone): say so, in one line
        return fail(PROG, f"--output-dir {args.output_dir}: cannot finish the run ({e.strerror or e}); "
                          f"what it wrote is in {run.path}", EXIT_USAGE)
    cap.progress(f"complete: {final}")
    print(str(final))
    if args.require_fused:
        try:
            rc, msg = require_fused(final, run.manifest, ranks=ranks)
        except (KeyboardInterrupt, procs.Terminated) as e:  # the run is whole: only its verdict is missing
            return fail(PROG, f"{procs.describe(e)} during --require-fused (the run is complete: {final})",
                        procs.exit_code(e))
        if rc != EXIT_OK:
            return fail(PROG, f"{msg} (run kept at {final})", rc)
    return EXIT_OK


def capture(args, argv, found, environ) -> int:
    import torch

    from rlkernel import env, workloads

    try:
        run = runs.RunDir(args.output_dir, args.workload)
    except OSError as e:  # e.g. a folder without write permission
        return fail(PROG, f"--output-dir {args.output_dir}: {e.strerror or e}", EXIT_USAGE)
    shape = workloads.Shape(args.batch_size, args.seq_len, args.vocab_size, args.top_k, args.top_p, args.temperature)
    run.manifest.update(command=[sys.executable, "-m", MODULE, *argv], node=env.describe(), env=allowed_env(environ),
                        tools={n: t.record() for n, t in found.items()},
                        workloads=[workloads.get(n).manifest_entry(shape, getattr(torch, args.dtype), args.warmup,
                                                                   args.repeat) for n in args.workload])
    cap = Capture(args, run, environ)

    def body():
        if "nsys" in found:
            cap.nsys_ranks(found["nsys"]) if args.ranks else cap.nsys(found["nsys"])
        if "ncu" in found:
            cap.ncu(found["ncu"])

    rc = guarded(run, body)
    return rc if rc is not None else finish(run, cap, args, ranks=bool(args.ranks))


# ---- -- CMD: a command of your own -----------------------------------------------------------------------

def main_command(argv: list[str], options: list[str], command: list[str], prog: str = f"python -m {MODULE}") -> int:
    """``capture [options] -- CMD ...``: no torch is imported on this path (test_capture_command checks it)."""
    if not command:
        raise CliError("-- must be followed by the command to capture (see --help)")
    args = build_parser(command=True, prog=prog).parse_args(options)
    window = capture_command.validate(args)
    check_output_dir(args.output_dir)
    check_env_flags()
    found = {"nsys": tools.find("nsys", args.nsys, os.environ)}
    if args.require_fused and importlib.util.find_spec("pipelines.analyze") is None:
        raise CliError("--require-fused needs pipelines.analyze, which is not in this tree yet; "
                       "capture without --require-fused", EXIT_BLOCKED)
    name = args.name or capture_command.run_name(command)
    try:
        run = runs.RunDir(args.output_dir, [name])
    except OSError as e:
        raise CliError(f"--output-dir {args.output_dir}: {e.strerror or e}") from None
    say_tools(found)
    environ = capture_command.command_environ(os.environ, window)
    run.manifest.update(command=textsafe.scrub_argv([sys.executable, "-m", MODULE, *argv]),
                        env=allowed_env(environ), tools={n: t.record() for n, t in found.items()},
                        target={"argv": textsafe.scrub_argv(command), "name": name,
                                "steps": list(window) if window else None, "exit_code": None, "signal": None,
                                "phases": [], "step_indices": []})
    cap = Capture(args, run, environ)
    with procs.signals_raise():
        rc = guarded(run, lambda: capture_command.profile(cap, args, command, found["nsys"], window))
        if rc is not None:
            return rc
        why = capture_command.outcome_error(run.manifest["target"])
        if why:  # the command's own failure: its trace is kept, and its exit code is capture's
            final = run.fail(why)
            print(str(final))
            return fail(PROG, f"{why} [run kept as {final}]", run.manifest["target"]["exit_code"])
        return finish(run, cap, args)


if __name__ == "__main__":
    sys.exit(main())
