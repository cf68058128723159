"""Reads the flight recorder's file-backed rings (``jaxcomm-ring-p<I>-<pid>.bin``; a second
recorder of the process, the CUDA emulation's, writes ``jaxcomm-ring-p<I>-<pid>-<tag>.bin``).

With ``JAXCOMM_TRACE_DIR`` set, each process keeps its rings in a shared mapping of that
file (ffi/core/trace_file.h), which the kernel keeps however the process ends: SIGKILL,
``os._exit``, an abort by JAX's coordination service. :func:`read` turns one into the same
document as a JSON dump (``reason`` ``"ring file"``, ``dumped_at_us`` the last time the
process was seen alive), so the analyzer treats both alike. Pure Python: no jaxcomm
extension needed.

Example::

    doc = ringfile.read("/tmp/traces/jaxcomm-ring-p2-4711.bin")
    pending = [e for e in doc["entries"] if e["state"] == "pending"]
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

_MAGIC = b"JXCRING\0"
VERSION = 1
# ffi/core/trace_file.cc pins these offsets with static_asserts.
_HEADER = struct.Struct("<8sIIQqqqqII Q QQQQ II QQ 64s Q")
_DIR_ENTRY = struct.Struct("<qQ")
_ENTRY = struct.Struct("<Qqqqqqqq Q I i B B 14x")
_ERROR_HEAD = struct.Struct("<QqI")
_STATES = ("pending", "active", "done", "failed")
# Values of XLA_FFI_DataType, as ffi/core/flight_recorder.cc names them.
_DTYPES = {1: "bool", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "uint8", 7: "uint16",
           8: "uint32", 9: "uint64", 10: "float16", 11: "float32", 12: "float64",
           15: "complex64", 16: "bfloat16", 18: "complex128"}


def is_ring_file(path: str) -> bool:
    """Whether ``path`` is named like a flight recorder ring file."""
    name = os.path.basename(path)
    return name.startswith("jaxcomm-ring-p") and name.endswith(".bin")


def recorder_tag(path: str | os.PathLike[str]) -> str:
    """The recorder a ring file belongs to: ``""`` for the process's own
    (``jaxcomm-ring-p<I>-<pid>.bin``), else the tag of a second recorder of the same process
    (``jaxcomm-ring-p<I>-<pid>-<tag>.bin``: ``cuda-emu``, the CUDA emulation's module)."""
    stem = os.path.basename(os.fspath(path))[len("jaxcomm-ring-p"):-len(".bin")]
    parts = stem.split("-", 2)
    return parts[2] if len(parts) == 3 else ""


def read(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The records of one ring file as a dump document, or None when it is not one (yet).

    Entries being rewritten while the process ran (or at the moment it died) are
    skipped, as a live dump skips them.
    """
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _HEADER.size or data[:8] != _MAGIC:
        return None
    (_, version, entry_bytes, entries_per_ring, pid, process, _created, heartbeat, rings,
     _max_rings, site_bytes, dir_offset, sites_offset, _sites_cap, errors_offset,
     error_slots, error_slot_bytes, rings_offset, ring_stride, host, _error_count) = \
        _HEADER.unpack_from(data, 0)
    if version != VERSION or entry_bytes != _ENTRY.size:
        raise ValueError(f"{path}: ring file version {version} (entries of {entry_bytes} B); "
                         f"this jaxcomm reads version {VERSION}: use the jaxcomm that wrote it")
    sites = _sites(data, sites_offset, site_bytes)
    errors = _errors(data, errors_offset, error_slots, error_slot_bytes)
    ranks, entries = [], []
    for k in range(rings):
        partition, calls = _DIR_ENTRY.unpack_from(data, dir_offset + k * _DIR_ENTRY.size)
        ranks.append(dict(partition=partition, calls=calls))
        base = rings_offset + k * ring_stride
        first = max(1, calls - entries_per_ring + 1)
        for seq in range(first, calls + 1):
            at = base + ((seq - 1) % entries_per_ring) * _ENTRY.size
            if at + _ENTRY.size > len(data):
                break
            (eseq, run_id, execution, elements, nbytes, enq, start, end, left_out, site_id,
             rank, dtype, state) = _ENTRY.unpack_from(data, at)
            site = sites.get(site_id)
            if eseq != seq or site is None or state >= len(_STATES):
                continue  # being rewritten, or its site was never described
            entries.append(dict(
                partition=partition, seq=seq, op=site["op"], axis=site["axis"],
                call_site=site["call_site"], instruction=site["instruction"],
                group_index=site["group_index"], group=site["group"],
                processes=site["processes"], rank=rank, execution=execution, run_id=run_id,
                dtype=_DTYPES.get(dtype, "other"), elements=elements, bytes=nbytes,
                algorithm=site["algorithm"],
                left_out=[r for r in range(64) if left_out >> r & 1],
                state=_STATES[state], error=errors.get((partition, seq)),
                enqueue_us=enq, start_us=start or None, end_us=end or None))
    doc = {"format": "jaxcomm-trace", "version": 1, "reason": "ring file"}
    tag = recorder_tag(path)
    if tag:
        doc["recorder"] = tag
    return {**doc,
            "process_index": process, "pid": pid,
            "host": host.split(b"\0", 1)[0].decode("utf-8", "replace"),
            "dumped_at_us": heartbeat, "entries_per_rank": entries_per_ring, "enabled": True,
            "ranks": ranks, "entries": entries}


def _sites(data: bytes, offset: int, used: int) -> dict[int, dict[str, Any]]:
    sites, at, end = {}, offset, offset + used
    while at + 8 <= end:
        length, site_id = struct.unpack_from("<II", data, at)
        try:
            sites[site_id] = json.loads(data[at + 8:at + 8 + length])
        except ValueError:
            pass
        at += (8 + length + 7) // 8 * 8
    return sites


def _errors(data: bytes, offset: int, slots: int, slot_bytes: int) -> dict[tuple[int, int], str]:
    errors = {}
    for k in range(slots):
        at = offset + k * slot_bytes
        seq, partition, length = _ERROR_HEAD.unpack_from(data, at)
        if seq == 0:
            continue
        text = data[at + _ERROR_HEAD.size:at + _ERROR_HEAD.size + min(length, slot_bytes - 20)]
        errors[(partition, seq)] = text.decode("utf-8", "replace")
    return errors
