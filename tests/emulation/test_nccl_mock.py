"""The mock NCCL (ffi/cuda_emu/nccl) between 1, 2 and 4 processes, against NumPy; the CUDA
backend's own NCCL code on it; jaxcomm's ops through it under JAXCOMM_EMULATE_CUDA=1.

Most tests start their ranks as processes running this file (``python test_nccl_mock.py
SCENARIO RANK NRANKS ...``). A rank drives the mock through ctypes the way jaxcomm's CUDA
backend does (ffi/cuda/nccl_comm.cc, nccl_ops.cc): non-blocking ncclCommInitRankConfig
polled with ncclCommGetAsyncError, collectives on a stream, all_to_all and ppermute as
groups of ncclSend/ncclRecv. Its CUDA runtime is the emulated one (ffi/cuda_emu/runtime:
streams are worker threads, device memory is poisoned), device d of every process the
same emulated GPU. Every wait has a deadline: the mock's own
(JAXCOMM_NCCL_MOCK_TIMEOUT_S), each rank's polling loop, and the processes'.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

SUCCESS, UNHANDLED_CUDA, SYSTEM_ERROR, INTERNAL, INVALID_ARGUMENT, INVALID_USAGE, REMOTE, IN_PROGRESS = range(8)
INT32, FLOAT32, BFLOAT16 = 2, 7, 9
SUM, PROD, MAX, MIN = range(4)
POLL_DEADLINE_S = 60.0  # a rank's own polling loops; far above any wait that succeeds
PROCESS_DEADLINE_S = 120.0


def _library_dir() -> Path | None:
    """The installed jaxcomm package's folder (without importing jax)."""
    spec = importlib.util.find_spec("jaxcomm")
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / "libjaxcomm_nccl_mock.so").exists():
            return Path(root)
    return None


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class Config(ctypes.Structure):
    """ncclConfig_t of NCCL 2.17 (ffi/cuda/nccl.h)."""
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int),
                ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p), ("splitShare", ctypes.c_int)]


def config(blocking: int) -> Config:
    undef = -(2**31)
    return Config(ctypes.sizeof(Config), 0xCAFEBEEF, 21700, blocking, undef, undef, undef, None, undef)


# The emulated runtime's functions have C++ linkage (a real cuda_runtime_api.h declares
# them extern "C"): their mangled names, where the plain ones are not exported.
_MANGLED = {
    "cudaSetDevice": "_Z13cudaSetDevicei",
    "cudaStreamCreate": "_Z16cudaStreamCreatePP11CUstream_st",
    "cudaStreamSynchronize": "_Z21cudaStreamSynchronizeP11CUstream_st",
    "cudaMalloc": "_Z10cudaMallocPPvm",
    "cudaMemcpy": "_Z10cudaMemcpyPvPKvm14cudaMemcpyKind",
}


class _Runtime:
    """The few CUDA runtime functions a rank calls, by name."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(self._lib, name)
        except AttributeError:
            return getattr(self._lib, _MANGLED[name])


class Rank:
    """One rank's NCCL and CUDA (emulated) entry points, and its device buffers."""

    def __init__(self, device: int):
        libdir = _library_dir()
        assert libdir is not None, "the mock NCCL is not installed (pip install .)"
        self.nccl = ctypes.CDLL(str(libdir / "libjaxcomm_nccl_mock.so"))
        # The runtime the mock loaded (one instance per process).
        self.cuda = _Runtime(ctypes.CDLL(str(libdir / "libjaxcomm_cuda_emu_runtime.so")))
        self.nccl.ncclGetErrorString.restype = ctypes.c_char_p
        self.nccl.ncclGetLastError.restype = ctypes.c_char_p
        self.nccl.ncclGetLastError.argtypes = [ctypes.c_void_p]
        for name in ("ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast", "ncclSend",
                     "ncclRecv", "ncclCommGetAsyncError", "ncclCommDestroy", "ncclCommAbort",
                     "ncclCommFinalize"):
            getattr(self.nccl, name).restype = ctypes.c_int
        self.check_cuda(self.cuda.cudaSetDevice(device))
        self.stream = ctypes.c_void_p()
        self.check_cuda(self.cuda.cudaStreamCreate(ctypes.byref(self.stream)))
        self.comm = ctypes.c_void_p()

    @staticmethod
    def check_cuda(err: int) -> None:
        assert err == 0, f"CUDA error {err}"

    def check(self, r: int, what: str) -> None:
        assert r == SUCCESS, f"{what}: {r} {self.last_error()}"

    def last_error(self) -> str:
        return self.nccl.ncclGetLastError(self.comm).decode()

    # --- communicator
    def init(self, nranks: int, uid: bytes, rank: int, blocking: int = 0) -> int:
        cfg = config(blocking)
        return self.nccl.ncclCommInitRankConfig(ctypes.byref(self.comm), nranks, UniqueId.from_buffer_copy(uid),
                                                rank, ctypes.byref(cfg))

    def async_error(self) -> int:
        state = ctypes.c_int(-1)
        self.check(self.nccl.ncclCommGetAsyncError(self.comm, ctypes.byref(state)), "ncclCommGetAsyncError")
        return state.value

    def wait_while_in_progress(self, r: int) -> int:
        """Polls as jaxcomm does (nccl_comm.cc's WaitWhileInProgress), with a deadline."""
        deadline = time.monotonic() + POLL_DEADLINE_S
        while r == IN_PROGRESS:
            assert time.monotonic() < deadline, "ncclInProgress past the rank's deadline"
            time.sleep(0.001)
            r = self.async_error()
        return r

    def sync(self) -> None:
        self.check_cuda(self.cuda.cudaStreamSynchronize(self.stream))

    # --- device memory (the emulated runtime's)
    def to_device(self, a: np.ndarray) -> ctypes.c_void_p:
        p = ctypes.c_void_p()
        self.check_cuda(self.cuda.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(max(a.nbytes, 1))))
        self.check_cuda(self.cuda.cudaMemcpy(p, a.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(a.nbytes), 1))
        return p

    def empty(self, n: int, dtype: Any) -> ctypes.c_void_p:
        return self.to_device(np.full(n, 0, dtype))

    def from_device(self, p: ctypes.c_void_p, n: int, dtype: Any) -> np.ndarray:
        out = np.empty(n, dtype)
        self.sync()
        self.check_cuda(self.cuda.cudaMemcpy(out.ctypes.data_as(ctypes.c_void_p), p, ctypes.c_size_t(out.nbytes), 2))
        return out


# ----------------------------------------------------------------------------------------
# Ranks (run as `python test_nccl_mock.py SCENARIO RANK NRANKS IDFILE DEVICE`)

def _share_unique_id(rank: Rank, me: int, idfile: Path) -> bytes:
    """Rank 0 makes the id and writes it (atomically); the others read it, with a deadline."""
    if me == 0:
        uid = UniqueId()
        rank.check(rank.nccl.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        tmp = idfile.with_suffix(".tmp")
        tmp.write_bytes(bytes(uid))  # all 128 bytes (the field itself would stop at a NUL)
        tmp.rename(idfile)
        return bytes(uid)
    deadline = time.monotonic() + POLL_DEADLINE_S
    while not idfile.exists():
        assert time.monotonic() < deadline, "rank 0 never wrote the unique id"
        time.sleep(0.01)
    return idfile.read_bytes()


def _data(me: int, n: int, dtype: Any, seed: int) -> np.ndarray:
    """Rank `me`'s input: small integers (exact in bfloat16, products stay small)."""
    rng = np.random.default_rng(1000 * seed + me)
    return rng.integers(-3, 4, n).astype(np.float32).astype(dtype)


def _reduce(parts: list[np.ndarray], op: int) -> np.ndarray:
    """The mock's rule: in rank order, half precision accumulated in float32, rounded once."""
    acc_type = np.float32 if parts[0].dtype.itemsize == 2 else parts[0].dtype
    fn = {SUM: np.add, PROD: np.multiply, MAX: np.fmax, MIN: np.fmin}[op]
    acc = parts[0].astype(acc_type)
    for p in parts[1:]:
        acc = fn(acc, p.astype(acc_type))
    return acc.astype(parts[0].dtype)


def _scenario_collectives(rank: Rank, me: int, R: int, uid: bytes) -> None:
    import ml_dtypes

    r = rank.init(R, uid, me)
    assert r == IN_PROGRESS, f"non-blocking init returned {r}, not ncclInProgress"
    rank.check(rank.wait_while_in_progress(r), "init")
    nccl, s, c = rank.nccl, rank.stream, rank.comm
    seed = 0
    for dtype, code in ((np.float32, FLOAT32), (ml_dtypes.bfloat16, BFLOAT16), (np.int32, INT32)):
        for n in (0, 1, 37, 1000):
            seed += 1
            mine = _data(me, n * R, dtype, seed)
            every = [_data(p, n * R, dtype, seed) for p in range(R)]
            x = rank.to_device(mine)
            for op in (SUM, PROD, MAX, MIN):
                y = rank.empty(n * R, dtype)
                rank.check(nccl.ncclAllReduce(x, y, ctypes.c_size_t(n * R), code, op, c, s), "ncclAllReduce")
                np.testing.assert_array_equal(rank.from_device(y, n * R, dtype), _reduce(every, op),
                                              err_msg=f"all_reduce op {op} {dtype} n={n}")
                y = rank.empty(n, dtype)
                rank.check(nccl.ncclReduceScatter(x, y, ctypes.c_size_t(n), code, op, c, s), "ncclReduceScatter")
                np.testing.assert_array_equal(rank.from_device(y, n, dtype),
                                              _reduce(every, op)[me * n:(me + 1) * n],
                                              err_msg=f"reduce_scatter op {op} {dtype} n={n}")
            # In place: the output is the input buffer.
            inplace = rank.to_device(mine)
            rank.check(nccl.ncclAllReduce(inplace, inplace, ctypes.c_size_t(n * R), code, SUM, c, s), "in place")
            np.testing.assert_array_equal(rank.from_device(inplace, n * R, dtype), _reduce(every, SUM))
            y = rank.empty(n * R * R, dtype)
            rank.check(nccl.ncclAllGather(x, y, ctypes.c_size_t(n * R), code, c, s), "ncclAllGather")
            np.testing.assert_array_equal(rank.from_device(y, n * R * R, dtype), np.concatenate(every))
            root = R - 1
            y = rank.empty(n * R, dtype)
            rank.check(nccl.ncclBroadcast(x, y, ctypes.c_size_t(n * R), code, root, c, s), "ncclBroadcast")
            np.testing.assert_array_equal(rank.from_device(y, n * R, dtype), every[root])
            # all_to_all as nccl_ops.cc does it: one group, a send and a receive per peer
            # (itself included), in bytes.
            item = np.dtype(dtype).itemsize
            y = rank.empty(n * R, dtype)
            assert nccl.ncclGroupStart() == SUCCESS
            for p in range(R):
                rank.check(nccl.ncclSend(ctypes.c_void_p(x.value + p * n * item), ctypes.c_size_t(n * item), 1, p,
                                         c, s), "ncclSend")
                rank.check(nccl.ncclRecv(ctypes.c_void_p(y.value + p * n * item), ctypes.c_size_t(n * item), 1, p,
                                         c, s), "ncclRecv")
            r = nccl.ncclGroupEnd()
            assert r == IN_PROGRESS, f"a non-blocking group returned {r}"
            rank.check(rank.wait_while_in_progress(r), "ncclGroupEnd")
            expected = np.concatenate([every[p][me * n:(me + 1) * n] for p in range(R)])
            np.testing.assert_array_equal(rank.from_device(y, n * R, dtype), expected)
            # ppermute: a ring, one send and one receive of typed elements.
            y = rank.empty(n * R, dtype)
            assert nccl.ncclGroupStart() == SUCCESS
            rank.check(nccl.ncclSend(x, ctypes.c_size_t(n * R), code, (me + 1) % R, c, s), "ncclSend")
            rank.check(nccl.ncclRecv(y, ctypes.c_size_t(n * R), code, (me - 1) % R, c, s), "ncclRecv")
            rank.check(rank.wait_while_in_progress(nccl.ncclGroupEnd()), "ncclGroupEnd")
            np.testing.assert_array_equal(rank.from_device(y, n * R, dtype), every[(me - 1) % R])
    # max and min drop a NaN (fmax/fmin, as NCCL's kernels): rank 0's NaNs lose.
    for dtype, code in ((np.float32, FLOAT32), (ml_dtypes.bfloat16, BFLOAT16)):
        every = [_data(p, 8, dtype, 99) for p in range(R)]
        every[0][::2] = np.nan
        x = rank.to_device(every[me])
        for op in (MAX, MIN):
            y = rank.empty(8, dtype)
            rank.check(nccl.ncclAllReduce(x, y, ctypes.c_size_t(8), code, op, c, s), "ncclAllReduce")
            got, want = rank.from_device(y, 8, dtype), _reduce(every, op)
            assert (R == 1) == np.isnan(want.astype(np.float32)).any()
            np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32),  # NaN == NaN
                                          err_msg=f"op {op} {dtype} with NaNs")
    _group_semantics(rank, me, R)
    rank.check(rank.wait_while_in_progress(nccl.ncclCommFinalize(c)), "ncclCommFinalize")
    rank.check(nccl.ncclCommDestroy(c), "ncclCommDestroy")


def _group_semantics(rank: Rank, me: int, R: int) -> None:
    """Nothing of a group runs before its outermost ncclGroupEnd; a failed call fails the
    group, which then runs nothing; the communicator stays usable."""
    nccl, s, c = rank.nccl, rank.stream, rank.comm
    x = rank.to_device(np.full(4, me + 1, np.float32))
    y = rank.to_device(np.full(4, -7, np.float32))
    assert nccl.ncclGroupStart() == SUCCESS
    assert nccl.ncclGroupStart() == SUCCESS
    rank.check(nccl.ncclAllReduce(x, y, ctypes.c_size_t(4), FLOAT32, SUM, c, s), "ncclAllReduce")
    assert nccl.ncclGroupEnd() == SUCCESS  # inner: nothing enqueued yet
    np.testing.assert_array_equal(rank.from_device(y, 4, np.float32), np.full(4, -7, np.float32))
    rank.check(rank.wait_while_in_progress(nccl.ncclGroupEnd()), "outer ncclGroupEnd")
    np.testing.assert_array_equal(rank.from_device(y, 4, np.float32), np.full(4, R * (R + 1) / 2, np.float32))

    z = rank.to_device(np.full(4, -7, np.float32))
    assert nccl.ncclGroupStart() == SUCCESS
    rank.check(nccl.ncclAllReduce(x, z, ctypes.c_size_t(4), FLOAT32, SUM, c, s), "ncclAllReduce")
    assert nccl.ncclSend(x, ctypes.c_size_t(4), FLOAT32, R, c, s) == INVALID_ARGUMENT
    assert rank.nccl.ncclGetLastError(None).decode() == \
        f"ncclSend on rank {me} of {R}: peer {R} is not a rank of the communicator"
    assert nccl.ncclGroupEnd() == INVALID_ARGUMENT
    np.testing.assert_array_equal(rank.from_device(z, 4, np.float32), np.full(4, -7, np.float32))
    assert nccl.ncclGroupEnd() == INVALID_USAGE  # no group open
    assert rank.async_error() == SUCCESS


def _scenario_blocking(rank: Rank, me: int, R: int, uid: bytes) -> None:
    """A blocking communicator: init and groups return ncclSuccess, never ncclInProgress."""
    rank.check(rank.init(R, uid, me, blocking=1), "blocking init")
    x = rank.to_device(np.arange(8, dtype=np.int32) * (me + 1))
    y = rank.empty(8, np.int32)
    assert rank.nccl.ncclGroupStart() == SUCCESS
    rank.check(rank.nccl.ncclAllReduce(x, y, ctypes.c_size_t(8), INT32, SUM, rank.comm, rank.stream), "ar")
    assert rank.nccl.ncclGroupEnd() == SUCCESS
    np.testing.assert_array_equal(rank.from_device(y, 8, np.int32), np.arange(8) * (R * (R + 1) // 2))
    rank.check(rank.nccl.ncclCommFinalize(rank.comm), "ncclCommFinalize")
    rank.check(rank.nccl.ncclCommDestroy(rank.comm), "ncclCommDestroy")


def _scenario_init_result(rank: Rank, me: int, R: int, uid: bytes) -> None:
    """Prints the non-blocking init's outcome: result code and last error."""
    r = rank.wait_while_in_progress(rank.init(R, uid, me))
    print(f"RESULT {r} {rank.last_error()}", flush=True)
    rank.check(rank.nccl.ncclCommDestroy(rank.comm), "ncclCommDestroy")  # an abort would tell the others


def _scenario_peer_never_calls(rank: Rank, me: int, R: int, uid: bytes) -> None:
    """Every rank joins; the last never calls the all_reduce: the others' fails at the
    mock's deadline with the communicator's asynchronous error."""
    rank.check(rank.wait_while_in_progress(rank.init(R, uid, me)), "init")
    if me == R - 1:
        rank.check(rank.nccl.ncclCommDestroy(rank.comm), "ncclCommDestroy")
        return
    x = rank.to_device(np.ones(4, np.float32))
    rank.check(rank.nccl.ncclAllReduce(x, x, ctypes.c_size_t(4), FLOAT32, SUM, rank.comm, rank.stream), "enqueue")
    rank.sync()
    print(f"RESULT {rank.async_error()} {rank.last_error()}", flush=True)
    # Every later call fails with the error.
    assert rank.nccl.ncclAllReduce(x, x, ctypes.c_size_t(4), FLOAT32, SUM, rank.comm, rank.stream) == SYSTEM_ERROR
    rank.nccl.ncclCommAbort(rank.comm)


def _scenario_peer_aborts(rank: Rank, me: int, R: int, uid: bytes) -> None:
    """The last rank aborts instead of calling the all_reduce: the others fail at once with
    ncclRemoteError (their deadline is far: JAXCOMM_NCCL_MOCK_TIMEOUT_S is large here)."""
    rank.check(rank.wait_while_in_progress(rank.init(R, uid, me)), "init")
    if me == R - 1:
        rank.check(rank.nccl.ncclCommAbort(rank.comm), "ncclCommAbort")
        return
    x = rank.to_device(np.ones(4, np.float32))
    rank.check(rank.nccl.ncclAllReduce(x, x, ctypes.c_size_t(4), FLOAT32, SUM, rank.comm, rank.stream), "enqueue")
    rank.sync()
    print(f"RESULT {rank.async_error()} {rank.last_error()}", flush=True)
    rank.nccl.ncclCommAbort(rank.comm)


def _scenario_local_abort(rank: Rank, me: int, R: int, uid: bytes) -> None:
    """Rank 0 enqueues an all_reduce that no peer joins, then aborts its communicator: the
    stream's wait ends (the mock's deadline is far: JAXCOMM_NCCL_MOCK_TIMEOUT_S)."""
    rank.check(rank.wait_while_in_progress(rank.init(R, uid, me)), "init")
    if me != 0:
        rank.check(rank.nccl.ncclCommDestroy(rank.comm), "ncclCommDestroy")
        return
    x = rank.to_device(np.ones(4, np.float32))
    rank.check(rank.nccl.ncclAllReduce(x, x, ctypes.c_size_t(4), FLOAT32, SUM, rank.comm, rank.stream), "enqueue")
    rank.check(rank.nccl.ncclCommAbort(rank.comm), "ncclCommAbort")
    rank.sync()
    print("RESULT synchronized", flush=True)


def _scenario_mismatch(rank: Rank, me: int, R: int, uid: bytes) -> None:
    """Rank 0 all-reduces while the others all-gather: the mock names both calls."""
    rank.check(rank.wait_while_in_progress(rank.init(R, uid, me)), "init")
    x = rank.to_device(np.ones(4, np.float32))
    y = rank.empty(4 * R, np.float32)
    if me == 0:
        r = rank.nccl.ncclAllReduce(x, y, ctypes.c_size_t(4), FLOAT32, SUM, rank.comm, rank.stream)
    else:
        r = rank.nccl.ncclAllGather(x, y, ctypes.c_size_t(4), FLOAT32, rank.comm, rank.stream)
    rank.check(r, "enqueue")
    rank.sync()
    print(f"RESULT {rank.async_error()} {rank.last_error()}", flush=True)
    rank.nccl.ncclCommAbort(rank.comm)


def _scenario_early_use(rank: Rank, me: int, R: int, uid: bytes) -> None:
    """Rank 0 uses its communicator before the others joined: refused with
    ncclInvalidUsage, while ncclCommGetAsyncError says ncclInProgress. The others start
    joining only once rank 0 is done with that (a file it writes)."""
    marker = Path(os.environ["NCCL_MOCK_TEST_MARKER"])
    if me == 0:
        assert rank.init(R, uid, me) == IN_PROGRESS
        assert rank.async_error() == IN_PROGRESS
        x = rank.to_device(np.ones(4, np.float32))
        assert rank.nccl.ncclAllReduce(x, x, ctypes.c_size_t(4), FLOAT32, SUM, rank.comm, rank.stream) == INVALID_USAGE
        assert rank.nccl.ncclGetLastError(None).decode() == (
            f"ncclAllReduce: mock NCCL: rank 0 of {R}: the communicator is still being initialized (poll "
            "ncclCommGetAsyncError until it returns ncclSuccess before using it)")
        marker.write_text("done")
    else:
        deadline = time.monotonic() + POLL_DEADLINE_S
        while not marker.exists():
            assert time.monotonic() < deadline, "rank 0 never finished"
            time.sleep(0.01)
        assert rank.init(R, uid, me) == IN_PROGRESS
    rank.check(rank.wait_while_in_progress(IN_PROGRESS), "init")
    rank.check(rank.nccl.ncclCommDestroy(rank.comm), "ncclCommDestroy")


def _scenario_threads(rank: Rank, me: int, R: int, uid: bytes) -> None:
    """All R ranks in this process, one thread each on its own device, as the CUDA backend
    runs the GPUs of one process: every thread creates its communicator and all-reduces."""
    import threading

    errors: list[BaseException] = []

    def one(r: int) -> None:
        try:
            t = Rank(r)  # this thread's device and stream
            t.check(t.wait_while_in_progress(t.init(R, uid, r)), "init")
            x = t.to_device(np.full(16, r + 1, np.float32))
            t.check(t.nccl.ncclAllReduce(x, x, ctypes.c_size_t(16), FLOAT32, SUM, t.comm, t.stream), "ar")
            np.testing.assert_array_equal(t.from_device(x, 16, np.float32), np.full(16, R * (R + 1) / 2))
            t.check(t.nccl.ncclCommDestroy(t.comm), "ncclCommDestroy")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(R)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(POLL_DEADLINE_S)
    assert not any(t.is_alive() for t in threads), "a rank's thread outlived its deadline"
    assert not errors, errors


SCENARIOS: dict[str, Callable[[Rank, int, int, bytes], None]] = {
    "early_use": _scenario_early_use,
    "threads": _scenario_threads,
    "collectives": _scenario_collectives,
    "blocking": _scenario_blocking,
    "init_result": _scenario_init_result,
    "peer_never_calls": _scenario_peer_never_calls,
    "peer_aborts": _scenario_peer_aborts,
    "local_abort": _scenario_local_abort,
    "mismatch": _scenario_mismatch,
}


def _jax_route_main() -> None:
    """jaxcomm's collectives under JAXCOMM_EMULATE_CUDA=1 on 4 devices of this process take
    the CUDA backend's NCCL route (routes.h: groups of this process's GPUs, ops without own
    kernels), i.e. this mock, and equal jax.lax's; stats() names the route."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JAXCOMM_EMULATE_CUDA"] = "1"
    import jax
    import ml_dtypes
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxcomm

    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))

    def ops(m: Any) -> Callable[[Any], tuple[Any, ...]]:
        return lambda v: (m.psum(v, "x") if m is jax.lax else m.all_reduce(v, "x"),
                          m.all_gather(v, "x", tiled=True),
                          (m.psum_scatter if m is jax.lax else m.reduce_scatter)(v, "x", scatter_dimension=1,
                                                                                 tiled=True),
                          m.all_to_all(v, "x", 1, 1, tiled=True))

    for dtype in (np.float32, ml_dtypes.bfloat16, np.int32):
        x = jax.device_put(_data(0, 4 * 8 * 3, dtype, 7).reshape(4 * 3, 8), NamedSharding(mesh, P("x")))
        got, want = (jax.jit(jax.shard_map(ops(m), mesh=mesh, in_specs=P("x"), out_specs=(P("x"),) * 4))(x)
                     for m in (jaxcomm, jax.lax))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=str(dtype))
    routes = {(s.op, s.algorithm) for s in jaxcomm.stats()}
    assert routes == {(op, "cuda (emulated): nccl")
                      for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}, routes
    print("OK", flush=True)


def _rank_main(argv: list[str]) -> None:
    scenario, me, R, idfile, device = argv[0], int(argv[1]), int(argv[2]), Path(argv[3]), int(argv[4])
    rank = Rank(device)
    uid = _share_unique_id(rank, me, idfile)
    SCENARIOS[scenario](rank, me, R, uid)


# ----------------------------------------------------------------------------------------
# Tests

import pytest  # noqa: E402

pytestmark = pytest.mark.skipif(_library_dir() is None, reason="jaxcomm's mock NCCL is not installed")


def _run_ranks(tmp_path: Path, scenario: str, R: int, devices: list[int] | None = None,
               env: dict[str, str] | None = None, ranks: list[int] | None = None,
               rank_prefix: list[list[str]] | None = None) -> list[str]:
    """Runs `ranks` (default: all R) of `scenario` as processes, rank r on `devices[r]`
    (default r) with `env` added, its command after `rank_prefix[r]`; returns each one's
    stdout. Fails with a rank's stderr if it failed, or if any outlives PROCESS_DEADLINE_S."""
    devices = list(range(R)) if devices is None else devices
    idfile = tmp_path / f"{scenario}.id"
    full_env = {**os.environ, "JAXCOMM_NCCL_MOCK_TIMEOUT_S": "60", **(env or {})}
    procs = [subprocess.Popen([*(rank_prefix[r] if rank_prefix else []), sys.executable, __file__, scenario, str(r),
                               str(R), str(idfile), str(devices[r])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env)
             for r in (range(R) if ranks is None else ranks)]
    outs = []
    deadline = time.monotonic() + PROCESS_DEADLINE_S
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, f"{scenario}: a rank failed (rc {p.returncode}):\n{err}"
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def _results(outs: list[str]) -> list[tuple[int, str]]:
    found = []
    for out in outs:
        m = re.search(r"^RESULT (\d+) (.*)$", out, re.M)
        assert m is not None, f"no RESULT line in {out!r}"
        found.append((int(m.group(1)), m.group(2)))
    return found


def _leftover_segments(idfile: Path) -> list[str]:
    """The shared-memory segments left of the job whose unique id is in ``idfile``: those
    named by its nonce (ffi/cuda_emu/nccl/comm.cc PrefixOf). Other jobs' (tests running at
    the same time, on other workers or other checkouts) are not this job's."""
    nonce = int.from_bytes(idfile.read_bytes()[8:16], "little")
    prefix = f"jxnccl_{nonce:016x}"
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix)) if os.path.isdir("/dev/shm") else []


@pytest.mark.parametrize("R", [1, 2, 4])
def test_collectives_and_send_recv_match_numpy(tmp_path, R):
    _run_ranks(tmp_path, "collectives", R)
    assert _leftover_segments(tmp_path / "collectives.id") == [], "the mock left shared memory segments behind"


def test_ranks_as_threads_of_one_process(tmp_path):
    _run_ranks(tmp_path, "threads", 4, ranks=[0])


def test_use_before_init_finished_is_refused(tmp_path):
    _run_ranks(tmp_path, "early_use", 2, env={"NCCL_MOCK_TEST_MARKER": str(tmp_path / "rank0_checked")})


def test_blocking_communicator(tmp_path):
    _run_ranks(tmp_path, "blocking", 2)


@pytest.mark.parametrize("R", [2, 4])
def test_two_ranks_on_one_device_are_refused_at_init(tmp_path, R):
    # Ranks 0 and 1 on device 1 (the others on devices of their own), as NCCL refuses; the
    # device is named by NCCL's number for its PCI bus id (0000:01:00.0: 1000).
    devices = [1] + list(range(1, R))
    results = _results(_run_ranks(tmp_path, "init_result", R, devices=devices))
    assert results[0] == (INVALID_USAGE, "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 1000")
    assert results[1] == (INVALID_USAGE, "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000")
    assert all(r == (SUCCESS, "") for r in results[2:])


def test_one_device_on_two_hosts_is_allowed(tmp_path):
    # Each rank in a UTS namespace of its own with its own host name: two hosts, so device 1
    # of each is another GPU (NCCL tells hosts apart by their names).
    if subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --uts is not permitted here")
    on_host = [["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host] for host in ("host-a", "host-b")]
    outs = _run_ranks(tmp_path, "init_result", 2, devices=[1, 1], rank_prefix=on_host)
    assert _results(outs) == [(SUCCESS, ""), (SUCCESS, "")]


def test_rank_that_never_joins_times_out(tmp_path):
    # Ranks 0-2 of 4 start; rank 3 never does: init fails at the mock's deadline.
    outs = _run_ranks(tmp_path, "init_result", 4, ranks=[0, 1, 2], env={"JAXCOMM_NCCL_MOCK_TIMEOUT_S": "1"})
    for me, (r, msg) in enumerate(_results(outs)):
        assert r == SYSTEM_ERROR
        assert re.fullmatch(rf"mock NCCL: rank {me} of 4: waited \d+ ms for the other ranks to join "
                            r"\(ncclCommInitRankConfig\) and gave up \(JAXCOMM_NCCL_MOCK_TIMEOUT_S: 1000 ms\) "
                            r"\(ranks that never joined: 3\)", msg), msg
    assert _leftover_segments(tmp_path / "init_result.id") == []


def test_rank_that_never_calls_the_collective_times_out(tmp_path):
    outs = _run_ranks(tmp_path, "peer_never_calls", 2, env={"JAXCOMM_NCCL_MOCK_TIMEOUT_S": "1"})
    (r, msg), = _results(outs[:1])
    assert r == SYSTEM_ERROR
    assert re.fullmatch(r"mock NCCL: rank 0 of 2: waited \d+ ms for rank 1's part of ncclAllReduce #0 "
                        r"\(4 x float32, sum\) and gave up \(JAXCOMM_NCCL_MOCK_TIMEOUT_S: 1000 ms\)", msg), msg


def test_peer_abort_fails_the_waiting_ranks(tmp_path):
    outs = _run_ranks(tmp_path, "peer_aborts", 3, env={"JAXCOMM_NCCL_MOCK_TIMEOUT_S": "600"})
    for me, (r, msg) in enumerate(_results(outs[:2])):
        # (Waiting for rank 2's part, or for the other rank's, which stopped because of rank 2.)
        assert r == REMOTE
        assert re.fullmatch(rf"mock NCCL: rank {me} of 3: rank 2 aborted its communicator \(ncclCommAbort\) "
                            rf"while rank {me} was waiting for rank [{1 - me}2]'s part of ncclAllReduce #0 "
                            r"\(4 x float32, sum\)", msg), msg


def test_abort_ends_a_waiting_stream(tmp_path):
    # The mock's deadline (600 s) is far beyond the processes' (PROCESS_DEADLINE_S): only
    # the abort can end the wait in time.
    outs = _run_ranks(tmp_path, "local_abort", 2, env={"JAXCOMM_NCCL_MOCK_TIMEOUT_S": "600"})
    assert "RESULT synchronized" in outs[0]


def test_mismatched_collectives_are_named(tmp_path):
    results = _results(_run_ranks(tmp_path, "mismatch", 2))
    calls = ["ncclAllReduce #0 (4 x float32, sum)", "ncclAllGather #0 (4 x float32)"]
    mismatch = [(INVALID_USAGE, f"mock NCCL: rank {me} of 2: {calls[me]} met rank {1 - me}'s {calls[1 - me]}: the "
                                "ranks' calls do not match (real NCCL would hang or corrupt data)") for me in (0, 1)]
    # The rank that finds the mismatch first stops; the other finds it too, or (when the
    # first removed its part before the other read it) that rank's failure.
    stopped = [(REMOTE, f"mock NCCL: rank {me} of 2: rank {1 - me}'s communicator failed while rank {me} was "
                        f"waiting for rank {1 - me}'s part of {calls[me]}") for me in (0, 1)]
    assert all(results[me] in (mismatch[me], stopped[me]) for me in (0, 1)), results
    assert mismatch[0] in results or mismatch[1] in results, results


@pytest.fixture(scope="module")
def backend_check(tmp_path_factory) -> Path:
    """ffi/cuda_emu/nccl/backend_check.cc with the backend's ffi/cuda/nccl.cc and
    nccl_comm.cc, built as the emulation builds them, on the installed runtime and mock."""
    import shutil

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    import jax.ffi

    root, libdir = Path(__file__).resolve().parents[2], _library_dir()
    out = tmp_path_factory.mktemp("nccl_mock") / "backend_check"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread", "-DJAXCOMM_CUDA_EMULATION",
                    f"-I{root / 'ffi/cuda_emu/runtime/include'}", f"-I{root / 'ffi'}", "-isystem",
                    jax.ffi.include_dir(), str(root / "ffi/cuda_emu/nccl/backend_check.cc"),
                    str(root / "ffi/cuda/nccl.cc"), str(root / "ffi/cuda/nccl_comm.cc"), "-o", str(out),
                    str(libdir / "libjaxcomm_cuda_emu_runtime.so"), f"-Wl,-rpath,{libdir}", "-ldl"],
                   check=True)
    return out


def test_backend_nccl_code_on_the_mock(backend_check):
    # The backend's loader finds the mock by its default name (JAXCOMM_CUDA_EMULATION);
    # its registry creates 4 communicators non-blocking from 4 threads; Run polls them.
    r = subprocess.run([str(backend_check), "all_reduce", "4"], capture_output=True, text=True,
                       timeout=PROCESS_DEADLINE_S, env={**os.environ, "JAXCOMM_NCCL_MOCK_TIMEOUT_S": "60"})
    assert (r.returncode, r.stdout) == (0, "OK\n"), r.stderr


def test_backend_reports_a_rank_that_never_joins(backend_check):
    # Ranks 0 and 1 of 3: the backend's deadline (1 s) ends the creation and aborts the
    # half-made communicator (the mock's own deadline, 60 s, is far).
    r = subprocess.run([str(backend_check), "absent", "3"], capture_output=True, text=True,
                       timeout=PROCESS_DEADLINE_S, env={**os.environ, "JAXCOMM_NCCL_MOCK_TIMEOUT_S": "60"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines.pop() == "OK"

    def timed_out(k: int) -> str:
        return (f"backend_check rank {k}: creating the NCCL communicator of group check (rank {k} of 3) did not "
                "finish within 1000 ms (timeout_s / JAXCOMM_TIMEOUT_S): some rank of the group never joined")

    def saw_abort(k: int) -> str:  # the other rank's deadline came first, and it aborted
        return (f"backend_check rank {k}: creating the NCCL communicator of group check (rank {k} of 3) failed: "
                "remote process exited or there was a network error (ncclResult_t 6): mock NCCL: rank "
                f"{k} of 3: rank {1 - k} aborted its communicator (ncclCommAbort) while rank {k} was waiting for "
                "the other ranks to join (ncclCommInitRankConfig) (ranks that never joined: 2)")

    assert sorted(lines) in ([timed_out(0), timed_out(1)], [timed_out(0), saw_abort(1)],
                             [saw_abort(0), timed_out(1)]), lines


def test_jaxcomm_ops_take_the_nccl_route_on_the_mock():
    if not list(_library_dir().glob("_jaxcomm_emu*")):
        pytest.skip("this build has no CUDA emulation module")
    r = subprocess.run([sys.executable, __file__, "jax_route"], capture_output=True, text=True,
                       timeout=PROCESS_DEADLINE_S, cwd=Path(__file__).parent,
                       env={**os.environ, "JAXCOMM_NCCL_MOCK_TIMEOUT_S": "60"})
    assert (r.returncode, r.stdout.splitlines()[-1:]) == (0, ["OK"]), r.stderr


if __name__ == "__main__":
    _jax_route_main() if sys.argv[1:] == ["jax_route"] else _rank_main(sys.argv[1:])
