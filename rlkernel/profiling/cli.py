"""Flags of the profile suite: ``scripts/run_profile_suite.py`` (the hardware-profiling guide's commands use them as
written), ``python -m rlkernel.profiling`` and the ``rlkernel-profile`` console script, one CLI."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import torch

from rlkernel import env, validate, workloads
from rlkernel.cli import (
    EXIT_BLOCKED,
    EXIT_CHECK_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    INT64_MAX,
    OUTPUT_DIR_HINTS,
    CliError,
    OneLineParser,
    check_env_flags,
    fail,
    message_prefix,
    prog_name,
)
from rlkernel.profiling import rows as rows_mod
from rlkernel.profiling.suite import SuiteConfig, exit_status, fused_rows, plan, run_suite
from rlkernel.profiling.summary import progress_line, table
from rlkernel.profiling.writers import write_reports

PROG = "run_profile_suite.py"  # what its lines start with: main sets the name the user typed (rlkernel-profile, ...)
SMOKE = {"batch_sizes": (2,), "seq_lens": (4,), "vocab_sizes": (32,), "dtype": "float32", "warmup": 0, "repeat": 1}
DEFAULTS = {"batch_sizes": (8, 16, 32), "seq_lens": (128, 512), "vocab_sizes": (4096, 128256), "warmup": 3,
            "repeat": 10}
BUILD_HINT = "build the extension: python -m rlkernel.build (python -m rlkernel.env says why it is not there)"


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    if any(v > INT64_MAX for v in values):  # torch takes sizes as int64: past it a failed row, not a usage error
        raise argparse.ArgumentTypeError(f"expected integers that fit 64 bits, got {text!r}")
    return tuple(dict.fromkeys(values))  # a repeated value would only give a duplicate row


def _nonneg(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    if v > INT64_MAX:  # a seed or a count torch takes as int64
        raise argparse.ArgumentTypeError(f"expected an integer that fits 64 bits, got {v}")
    return v


def _positive(text: str) -> int:
    v = _nonneg(text)
    if v == 0:
        raise argparse.ArgumentTypeError("expected an integer >= 1, got 0")
    return v


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def parser(prog: str = PROG) -> argparse.ArgumentParser:
    ap = OneLineParser(hints=OUTPUT_DIR_HINTS, prog=prog, description=(
        "Time registry workloads over shapes and write a profile_<UTC timestamp>.csv/.json report. Each row has "
        "a status (pass, blocked, oom, fail) and the dispatch the ops recorded (native, fused, fallback, blocked). "
        "Exit 0 when every row is pass/blocked/oom; 1 when a row failed, or under --require-fused a fused row ran "
        "but not fused or ran out of memory; 2 on bad flags; 3 when the device is missing or --require-fused cannot "
        "be met here."))
    ap.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    ap.add_argument("--dtype", choices=list(workloads.DTYPES),
                    help="logits dtype (default: float16 on cuda, float32 on cpu)")
    ap.add_argument("--batch-sizes", type=_int_list, help="comma-separated (default 8,16,32)")
    ap.add_argument("--seq-lens", type=_int_list,
                    help="comma-separated (default 128,512); sampling workloads ignore it (seq_len 1)")
    ap.add_argument("--vocab-sizes", type=_int_list, help="comma-separated (default 4096,128256)")
    ap.add_argument("--workloads", help=f"comma-separated registry names (default all: {','.join(workloads.names())})")
    ap.add_argument("--top-k", type=_nonneg, default=50, help="sampling top-k, 0 = all (default 50)")
    ap.add_argument("--top-p", type=_float, default=0.9, help="sampling top-p in (0, 1] (default 0.9)")
    ap.add_argument("--temperature", type=_float, default=1.0,
                    help="the logits are divided by it: > 0; sampling workloads also take 0 (argmax) (default 1.0)")
    ap.add_argument("--seed", type=_nonneg, default=0, help="input seed (default 0)")
    ap.add_argument("--warmup", type=_nonneg, help="untimed repetitions per row (default 3)")
    ap.add_argument("--repeat", type=_positive, help="timed repetitions per row (default 10)")
    ap.add_argument("--output-dir", type=Path, default=Path("reports"),
                    help="parent folder: each run adds a new profile_<UTC timestamp>.csv/.json pair to it and "
                         "never overwrites one (default reports)")
    ap.add_argument("--csv", action="store_true", help="write the CSV report (both when neither flag is given)")
    ap.add_argument("--json", action="store_true", help="write the JSON report (both when neither flag is given)")
    ap.add_argument("--smoke", action="store_true",
                    help="batch 2, seq 4, vocab 32, float32, warmup 0, repeat 1 (not combinable with those flags)")
    ap.add_argument("--require-fused", action="store_true",
                    help="fused workloads must run fused: blocked (exit 3) where they cannot, exit 1 if one fell back "
                    "or ran out of memory (nothing proved at that shape)")
    ap.add_argument("--no-summary", action="store_true", help="skip the table at the end")
    return ap


def _device(text: str | None) -> torch.device:
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise CliError(f"--device: expected cpu, cuda or cuda:N, got {text!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise CliError(f"--device: expected cpu, cuda or cuda:N, got {text!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise CliError(f"--device {text}: no CUDA device here (torch {torch.__version__}, "
                           f"CUDA build {torch.version.cuda}); run on a GPU machine or use --device cpu", EXIT_BLOCKED)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise CliError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) visible", EXIT_BLOCKED)
        torch.cuda.set_device(index)  # the node columns describe the current device
        dev = torch.device("cuda", index)
    return dev


def config(args) -> SuiteConfig:
    if args.smoke:
        given = [k for k in SMOKE if getattr(args, k) is not None]
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise CliError(f"--smoke sets {flags}; give one or the other")
        for k, v in SMOKE.items():
            setattr(args, k, v)
    for k, v in DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    dev = _device(args.device)
    dtype = workloads.DTYPES[args.dtype or ("float16" if dev.type == "cuda" else "float32")]
    names = [n.strip() for n in args.workloads.split(",")] if args.workloads is not None else workloads.names()
    if not all(names):
        raise CliError(f"--workloads: empty name in {args.workloads!r}")
    unknown = [n for n in names if n not in workloads.REGISTRY]
    if unknown:
        raise CliError(f"--workloads: unknown {', '.join(unknown)}; known: {', '.join(workloads.names())}")
    chosen = tuple(workloads.get(n) for n in dict.fromkeys(names))
    if not 0.0 < args.top_p <= 1.0:
        raise CliError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.temperature == 0.0 and any(w.op != "sample" for w in chosen):
        raise CliError("--temperature 0 (argmax) applies only to sampling workloads; log-probs need > 0")
    try:  # the ops' own rule (a finite, float32-representable scale), or every row would fail after the run
        validate.check_temperature(args.temperature, allow_zero=True)
    except ValueError as exc:
        raise CliError(f"--temperature: {exc}") from None
    cfg = SuiteConfig(device=dev, dtype=dtype, batch_sizes=args.batch_sizes, seq_lens=args.seq_lens,
                      vocab_sizes=args.vocab_sizes, workloads=chosen, top_k=args.top_k, top_p=args.top_p,
                      temperature=args.temperature, seed=args.seed, warmup=args.warmup, repeat=args.repeat,
                      require_fused=args.require_fused)
    for w, shape in plan(cfg):  # a shape a workload cannot run is a usage error before any row runs
        error = w.shape_error(shape)
        if error:
            raise CliError(error)
        s = w.effective_shape(shape)
        if s.rows * s.vocab_size * dtype.itemsize > INT64_MAX:  # the logits' bytes: torch sizes them in int64
            raise CliError(f"{w.name}: {s.rows} rows x {s.vocab_size} vocabulary {rows_mod.dtype_name(dtype)} "
                           "logits are more bytes than 64 bits count")
    return cfg


def run(argv: list[str], command: str, prog: str = PROG) -> int:
    args = parser(prog).parse_args(argv)
    check_env_flags()  # before any row: RLKERNEL_REQUIRE_FUSED=bogus would fail every row (issue 29 item 20)
    cfg = config(args)
    try:  # before the run, not after it: a long run must not end in an unwritable folder
        args.output_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(args.output_dir, os.W_OK):
            raise PermissionError("not writable")
    except OSError as exc:
        raise CliError(f"--output-dir {args.output_dir}: {exc.strerror or exc}") from None
    node = env.describe()
    index = cfg.device.index if cfg.device.type == "cuda" else -1
    # --device cpu on a GPU node: the CPU entry, which describe() lists only on a CPU-only node
    device = next((d for d in node["devices"] if d["index"] == index), None) or env.cpu_device()
    context = rows_mod.context_columns(node, device, command, rows_mod.git_commit())
    generated_at = rows_mod.utc_now()
    print(f"{PROG}: {device['name']} ({device['backend']}), {rows_mod.dtype_name(cfg.dtype)}, "
          f"warmup {cfg.warmup}, repeat {cfg.repeat}", file=sys.stderr)
    rows = run_suite(cfg, context, device["memory_bandwidth_bytes_per_s"],
                     on_row=lambda i, n, row: print(progress_line(i, n, row), file=sys.stderr, flush=True))
    want_csv, want_json = (args.csv, args.json) if (args.csv or args.json) else (True, True)
    try:  # e.g. a full disk: write_reports leaves nothing partial, so one line says it all
        paths = write_reports(args.output_dir, rows, csv_out=want_csv, json_out=want_json, command=command,
                              node=node, generated_at=generated_at)
    except OSError as exc:
        raise CliError(f"--output-dir {args.output_dir}: could not write the report: {exc.strerror or exc}") from None
    if not args.no_summary:
        print(table(rows))
    for p in paths:
        print(f"wrote {p}")
    verdict = exit_status(rows, cfg)
    if verdict == "failed":
        bad = [r for r in rows if r["status"] == "fail"]
        oom = [r["workload"] for r in fused_rows(rows, cfg) if r["status"] == "oom"]
        what = (f"{len(bad)} row(s) failed" if bad else
                f"--require-fused: {oom[0]} ran out of memory, so nothing proved it fused at that shape" if oom else
                "--require-fused: a fused workload ran without the fused path")
        return fail(PROG, what, EXIT_CHECK_FAILED)
    if verdict == "blocked":
        reason = next(r["notes"] for r in rows if r["status"] == "blocked")
        where = "" if cfg.device.type == "cuda" else "run with --device cuda on a GPU machine and "
        return fail(PROG, f"--require-fused: {reason}; {where}{BUILD_HINT}", EXIT_BLOCKED)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    global PROG  # one CLI run per process: its lines name the command as typed (a caller's argv: the script)
    full = sys.argv if argv is None else ["scripts/run_profile_suite.py", *argv]
    prog = prog_name("rlkernel.profiling", full[0])
    PROG = message_prefix(prog)
    # the command as typed, to run again (a row's `command`): `python -m ...` rather than the module file's path
    command = shlex.join(full) if not prog.startswith("python -m ") else f"{prog} {shlex.join(full[1:])}".rstrip()
    try:
        return run(full[1:], command, prog)
    except CliError as exc:
        return fail(PROG, str(exc), exc.code)
    except KeyboardInterrupt:  # write_reports replaces its files whole: none of this run's, or all of them
        return fail(PROG, "interrupted (Ctrl-C)", EXIT_INTERRUPTED)


if __name__ == "__main__":
    raise SystemExit(main())
