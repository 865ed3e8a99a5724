"""The device error record: bad input found on the GPU, reported without a host sync (docs/contracts.md, section 1).

On CUDA an op never reads its results back to check them. A token id outside ``[0, V)`` or a row without a
distribution gives NaN (logp) or -1 (sample) for that row, and the error goes into a small record on the device:
the fused kernels write it themselves (``csrc/include/rlkernel/error_record.cuh``), the native path with device-side
tensor ops (``note_native``). ``check_errors(device)`` synchronises, reads the record (one copy), clears it and
raises what the CPU path raises at once.

Record layout (int64[4], one per device, shared by every thread and stream): ``key, op, value, lock``.
``key = (call sequence number << 32) | flat position`` (``EMPTY`` when clear): the lowest key is kept, so the record
holds the first error of the earliest call. The host keeps each recent call's op, shape and V by sequence number in
a bounded ring, so the error can be named later.
"""
from __future__ import annotations

import itertools
import threading

import torch

from rlkernel import envflags
from rlkernel.traced import constant_when_traced
from rlkernel.validate import ARGUMENTS, bad_arg_error, bad_id_error, no_distribution_error, position_in

EMPTY = (1 << 63) - 1
ERR_LOGP_BAD_ID = 1  # kErrOpLogpBadId (csrc/include/rlkernel/error_record.h)
ERR_SAMPLE_NO_DIST = 2  # kErrOpSampleNoDist
ERR_BAD_ARG = 3  # kErrOpBadArg: a per-row setting out of range; value = its code (validate.ARGUMENTS)
COMPILED_SEQ = 0  # calls traced by torch.compile: one number for all (a changing one would recompile every call)
RING = 4096  # recent calls whose shape the host remembers
_SEQ_LIMIT = 1 << 31  # the kernels keep 31 bits of the sequence number (key = seq << 32 | position)

_records: dict[int, torch.Tensor] = {}  # device index -> the record
_addresses: dict[int, int] = {}  # device index -> its data_ptr (read while torch.compile traces: a plain int)
_ring: list = [None] * RING  # seq % RING -> (seq, op, shape, vocab, offset)
_counter = itertools.count(1)
_lock = threading.Lock()


@constant_when_traced
def _mode_for_trace() -> str:  # read once when torch.compile traces: a compiled graph bakes the mode in
    return envflags.validate_mode()


def _fresh_record(device: torch.device) -> torch.Tensor:
    # Outside any inference_mode (an inference tensor could not be written outside it later); fills with Python
    # numbers (kernel arguments: no host-to-device copy); the key is EMPTY before the other fields are zeroed.
    with torch.inference_mode(False), torch.no_grad():
        rec = torch.full((4,), EMPTY, dtype=torch.int64, device=device)
        rec[1:].zero_()
    return rec


def _clear(rec: torch.Tensor, key: int) -> None:
    """Empty the record if it still holds ``key`` (an error another stream wrote since is kept). The lock word is
    never touched: a kernel on another stream may hold it."""
    with torch.inference_mode(False), torch.no_grad():
        head = rec[:1]
        head.copy_(torch.where(head == key, torch.full_like(head, EMPTY), head))


def record(device: torch.device) -> torch.Tensor:
    """The device's record, made on first use (an eager call or ``check_errors`` makes it before any capture)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    rec = _records.get(index)
    if rec is None:
        with _lock:
            rec = _records.get(index)
            if rec is None:
                rec = _make_record(torch.device("cuda", index))
                _records[index] = rec
                _addresses[index] = rec.data_ptr()
    return rec


@constant_when_traced
def _address_for_trace(index: int | None) -> int:
    """The device's record address, made if need be, when torch.compile traces: a constant of the graph."""
    return record(torch.device("cuda", index)).data_ptr()


def _make_record(device: torch.device) -> torch.Tensor:
    if torch.cuda.is_current_stream_capturing():
        # made inside the graph, its fill would run at every replay (clearing it) and its memory would be the
        # graph's: the capture needs a record made before it
        raise RuntimeError(f"rlkernel: no error record on {device} yet, and a CUDA graph is being captured: make one "
                           f"eager rlkernel call (or call rlkernel.check_errors({str(device)!r})) before capturing")
    return _fresh_record(device)


def begin(op: str, device: torch.device, shape, vocab: int, offset: int = 0) -> tuple[int, int, bool]:
    """(record address, sequence number, raise after the call) for one op call on a CUDA device; address 0 reports
    nothing (RLKERNEL_VALIDATE=0). The environment is read once per call, here. ``offset``: the flat position in
    ``shape`` of the kernel's first row (a chunked op registers each chunk, so positions name the whole call)."""
    if torch.compiler.is_compiling():
        if _mode_for_trace() == "0":
            return 0, 0, False
        return _address_for_trace(device.index), COMPILED_SEQ, False
    mode = envflags.validate_mode()
    if mode == "0":
        return 0, 0, False
    address = _addresses.get(device.index)
    if address is None:  # the first call on this device (or a device given without its index)
        address = record(device).data_ptr()
    seq = next(_counter) % (_SEQ_LIMIT - 1) + 1  # 1 .. 2^31 - 1: 0 belongs to compiled calls
    _ring[seq % RING] = (seq, op, shape, vocab, offset)  # shape: a torch.Size (immutable)
    return address, seq, mode == "sync"


def after_call(device: torch.device, sync: bool) -> None:
    """RLKERNEL_VALIDATE=sync (``begin``'s third answer): raise inside the call, a host sync, skipped while a CUDA
    graph is captured."""
    if sync and not torch.cuda.is_current_stream_capturing():
        check_errors(device)


def note_native(op_code: int, seq: int, address: int, device: torch.device, bad: torch.Tensor,
                values: torch.Tensor | None) -> None:
    """The native path's report, with device-side tensor ops (no sync): the first ``bad`` position (flattened) and
    its value go into the device's record if they come before what it holds. Ordered on the current stream."""
    if address != 0:
        note(record(device), op_code, seq, bad, values)


def note(rec: torch.Tensor, op_code: int, seq: int, bad: torch.Tensor, values: torch.Tensor | None) -> None:
    """Keep (key of the first ``bad`` position of call ``seq``, op_code, its value) in ``rec`` if that key is below
    the one ``rec`` holds; tensor ops only, on any device."""
    flat = bad.reshape(-1)
    n = flat.numel()
    if n == 0:
        return
    positions = torch.arange(n, device=flat.device, dtype=torch.int64) + (seq << 32)
    keys = torch.where(flat, positions, torch.full_like(positions, EMPTY))
    key, first = keys.min(0)
    # index_select, not values[first]: indexing by a 0-dim tensor reads it back to the host
    value = values.reshape(-1).index_select(0, first.view(1)).view(()).to(torch.int64) if values is not None \
        else torch.full_like(key, -1)
    new = torch.stack([key, torch.full_like(key, op_code), value])
    # a read-modify-write ordered on the current stream (not atomic against another stream's writer)
    with torch.inference_mode(False), torch.no_grad():
        rec[:3] = torch.where(key < rec[0], new, rec[:3])


def describe(key: int, op_code: int, value: int) -> Exception:
    """The exception the CPU path raises for this record entry, naming the op, the call and the position."""
    seq, flat = key >> 32, key & 0xFFFFFFFF
    call = _ring[seq % RING] if seq != COMPILED_SEQ else None
    if call is not None and call[0] == seq:
        _, op, shape, vocab, *offset = call
        where, which = position_in(flat + sum(offset), shape), f"call #{seq}"
    else:
        op = "sample" if op_code == ERR_SAMPLE_NO_DIST else "logp.forward"
        shape, vocab = None, None
        where = flat
        which = "a torch.compile'd call" if seq == COMPILED_SEQ else f"call #{seq}, no longer remembered"
        which += ", flat position"
    if op_code == ERR_SAMPLE_NO_DIST:  # rows are counted flat, as the CPU path names them
        return no_distribution_error(flat, f" [{which}]")
    if op_code == ERR_BAD_ARG:
        if call is None or call[0] != seq:
            op = "sample or logp.forward"
        argument = ARGUMENTS[value] if 0 <= value < len(ARGUMENTS) else f"argument #{value}"
        if argument not in ARGUMENTS:
            return ValueError(f"{op}: {argument} of row {flat} is out of range [{which}]")
        row = flat + sum(offset) if call is not None and call[0] == seq else flat  # a chunk's rows: the call's
        return bad_arg_error(op, argument, row, note=f" [{which}]")
    return bad_id_error(where, value, vocab, op, f" [{which}]")


def check_errors(device=None) -> None:
    """Synchronise ``device`` (default: the current CUDA device), read its error record, clear it, and raise the
    first error it holds: ``IndexError`` (a bad token id) or ``ValueError`` (a row without a distribution, or a
    per-row setting out of range).
    A no-op on CPU (the CPU path raises at once) and where CUDA is absent."""
    if not torch.cuda.is_available():  # whatever device is named ("cuda", 0): no CUDA, no record to read
        return
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    rec = record(device)
    torch.cuda.synchronize(device)
    key, op_code, value, _ = rec.tolist()
    if key == EMPTY:
        return
    _clear(rec, key)
    raise describe(key, op_code, value)
