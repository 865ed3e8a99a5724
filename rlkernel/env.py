"""The node record: what ran where (docs/contracts.md, section 7). ``python -m rlkernel.env`` prints it."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import torch

_ARCH = {(8, 0): "Ampere", (8, 6): "Ampere", (8, 7): "Ampere", (8, 9): "Ada Lovelace", (9, 0): "Hopper"}


def architecture(major: int, minor: int) -> str:
    if (major, minor) in _ARCH:
        return _ARCH[(major, minor)]
    if major in (10, 12):
        return "Blackwell"
    return f"unknown (sm_{major}{minor})"


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def _physical(index: int, visible: str | None, uuid: str | None) -> str:
    """The physical GPU a logical index maps to under CUDA_VISIBLE_DEVICES (an index or a UUID)."""
    if visible is None or visible.strip() == "":
        return str(index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index < len(entries):
        return entries[index]
    return uuid or str(index)


def _bandwidth(props) -> tuple[int | None, str]:
    """Theoretical DRAM bandwidth: 2 transfers per memory clock (DDR) x bus width."""
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:
        return int(2 * clock_khz * 1000 * bus_bits // 8), "device properties"
    return None, "unknown"


def cpu_device() -> dict:
    """The CPU's device entry (index -1): the only device on a CPU-only node, and what a --device cpu run records."""
    return {"index": -1, "physical_index": None, "uuid": None, "name": "CPU", "architecture": platform.machine(),
            "backend": "cpu", "compute_capability": None, "memory_bytes": None, "sm_count": None,
            "memory_bandwidth_bytes_per_s": None, "memory_bandwidth_source": "unknown"}


def _devices() -> list[dict]:
    if not torch.cuda.is_available():
        return [cpu_device()]
    backend = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        uuid = str(getattr(p, "uuid", "")) or None
        bw, source = _bandwidth(p)
        out.append({"index": i, "physical_index": _physical(i, visible, uuid), "uuid": uuid, "name": p.name,
                    "architecture": architecture(p.major, p.minor), "backend": backend,
                    "compute_capability": f"{p.major}.{p.minor}", "memory_bytes": int(p.total_memory),
                    "sm_count": int(p.multi_processor_count), "memory_bandwidth_bytes_per_s": bw,
                    "memory_bandwidth_source": source})
    return out


def extension_record(status: dict) -> dict:
    """The node record's ``extension`` block from ``rlkernel.fused_status()``: no paths (it goes into manifests
    and reports: docs/contracts.md, sections 7 and 9)."""
    return {"built": status["available"], "archs": status["archs"] if status["available"] else [],
            "reason": status["reason"], "source": status["source"]}


def extension_line(status: dict) -> str:
    """``python -m rlkernel.env``'s extension line: where it came from, or why not (paths allowed here)."""
    if status["available"]:
        where = "in-tree" if status["source"] == "in-tree" else "from the cache"
        return f"built for {','.join(status['archs']) or 'unknown targets'}, {where}: {status['path']}"
    return f"{status['reason']}: {status['detail']}" if status["detail"] else status["reason"]


def describe() -> dict:
    from rlkernel import _ext

    status = _ext.fused_status()  # builds nothing
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "driver": _driver() if torch.cuda.is_available() else None,
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "extension": extension_record(status),
        "devices": _devices(),
    }


def device_record(index: int | None = None) -> dict:
    """The record of one device: the current CUDA device, or the CPU entry."""
    devices = describe()["devices"]
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else -1
    for d in devices:
        if d["index"] == index:
            return d
    return cpu_device() if index == -1 else devices[0]


def device_line(d: dict) -> str:
    """One device of ``python -m rlkernel.env``'s text form: only the fields this device has (the CPU entry has no
    compute capability, SM count, memory size or bandwidth)."""
    where = f"device {d['index']:>2}"
    if d.get("physical_index") is not None:
        where += f" (physical {d['physical_index']})"
    parts = [d["name"], d["architecture"], d["backend"]]
    if d.get("compute_capability"):
        parts.append(f"cc {d['compute_capability']}")
    if d.get("sm_count"):
        parts.append(f"{d['sm_count']} SMs")
    if d.get("memory_bytes"):
        parts.append(f"{d['memory_bytes'] / 2**30:.1f} GiB")
    if d.get("memory_bandwidth_bytes_per_s"):
        parts.append(f"{d['memory_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s")
    return f"{where}: " + " | ".join(map(str, parts))


def main(argv=None) -> int:

    from rlkernel.cli import CliError, OneLineParser

    ap = OneLineParser(prog="python -m rlkernel.env", description="Print this node's record.")
    ap.add_argument("--json", action="store_true", help="print the record as JSON")
    try:
        args = ap.parse_args(argv)
    except CliError as exc:
        print(f"python -m rlkernel.env: {exc}", file=sys.stderr)
        return exc.code
    from rlkernel import _ext

    rec = describe()
    if args.json:
        print(json.dumps(rec, indent=2))
        return 0
    for key in ("python", "torch", "cuda_runtime", "hip", "driver", "device_count", "cuda_visible_devices"):
        if rec[key] is not None:  # a CPU node has no CUDA runtime, driver, ...: say nothing rather than "None"
            print(f"{key:22} {rec[key]}")
    print(f"{'extension':22} {extension_line(_ext.fused_status())}")
    for d in rec["devices"]:
        print(device_line(d))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
