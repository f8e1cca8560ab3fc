"""What the parts of the sidecar agree on: the frame's tensor encoding, the
error codes, what a runner implements, the deadline rule and what the SLA
recorder receives.  Read this before writing a runner or a part of the sidecar.

Why ``contract`` (this module was ``iface.py``): everywhere else in mmmesh an
"iface" is a network device (``mmmesh dataplane up --iface eth0``); what lives
here is the agreement between the sidecar's parts, with the one
implementation of each shared rule.

Data path of one sidecar (one model pod):

    upstream --MMH frames (TCP; UDP for real-time audio)--> transport.FrameServer
      -> bounded inbound queue -> stage.Stage workers: runner.infer(StageInput)
         (a BatchRunner gets the frames already waiting in one infer_batch call)
      -> the result framed once per Output -> transport.FrameSender (one per
         Output: one connection per downstream and class) --> downstream sidecars
    every frame: one SlaSample to the SlaSink (sla.SlaRecorder: Prometheus + qosd)

Tensor payload encoding (docs/wire-format.md): one tensor per frame; the
TENSOR TLV gives dtype (mmmesh.abi.DType, KServe v2 names) and shape; the
payload is the raw C-order bytes of the array (little-endian numeric types).
:func:`tensor_from_frame` (frame -> array) and :func:`tensor_spec` (array ->
TENSOR TLV) below are the one implementation.

Error frames: flags has Flag.ERROR, an ERROR TLV (code, message), empty
payload, same stream id and sequence as the input that failed.  Codes are
:class:`ErrorCode`.  A downstream sidecar forwards error frames (it does not
run its stage on them) so the end of the pipeline sees what failed where.

Deadlines: :func:`drop_late` is the rule, :func:`past_deadline` what "late"
means.  A real-time frame already past its deadline is dropped instead of
being run or sent; every other frame is delivered, a late one recorded as a
missed deadline.
"""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from mmmesh import abi as _abi
from mmmesh.wire import Header, TensorSpec

# mmmesh.abi.DType <-> numpy
DTYPE_TO_NUMPY: dict[int, np.dtype] = {
    _abi.DType.BOOL: np.dtype(np.bool_),
    _abi.DType.UINT8: np.dtype("<u1"),
    _abi.DType.UINT16: np.dtype("<u2"),
    _abi.DType.UINT32: np.dtype("<u4"),
    _abi.DType.UINT64: np.dtype("<u8"),
    _abi.DType.INT8: np.dtype("<i1"),
    _abi.DType.INT16: np.dtype("<i2"),
    _abi.DType.INT32: np.dtype("<i4"),
    _abi.DType.INT64: np.dtype("<i8"),
    _abi.DType.FP16: np.dtype("<f2"),
    _abi.DType.FP32: np.dtype("<f4"),
    _abi.DType.FP64: np.dtype("<f8"),
}
NUMPY_TO_DTYPE: dict[np.dtype, int] = {v: int(k) for k, v in DTYPE_TO_NUMPY.items()}
KSERVE_NAMES: dict[int, str] = {int(d): d.name for d in _abi.DType}  # "FP32", "INT64", ...


class ErrorCode(enum.IntEnum):
    """The code of an ERROR TLV (docs/sidecar.md, "Error frames")."""

    STAGE_FAILED = 1  # the runner raised, or returned something that is not a tensor
    STAGE_TIMEOUT = 2  # the runner did not answer within its timeout
    BAD_INPUT = 3  # frame readable but not a tensor the stage accepts
    OVERLOADED = 4  # reserved: the sidecar never sends it (overload drops are counted)
    UPSTREAM = 5  # counted when forwarding an error frame from an earlier stage


def tensor_from_frame(header: Header, payload: memoryview) -> np.ndarray:
    """A zero-copy numpy view of a frame's payload.  Raises ValueError
    (BAD_INPUT) when the TENSOR TLV is missing or does not match the size."""
    spec = header.tensor
    if spec is None:
        raise ValueError("frame has no TENSOR TLV")
    dt = DTYPE_TO_NUMPY.get(spec.dtype)
    if dt is None:
        raise ValueError(f"unsupported dtype {spec.dtype}")
    shape = spec.shape
    n = 1
    for d in shape:
        n *= d
    if n * dt.itemsize != len(payload):
        raise ValueError(f"payload has {len(payload)} bytes, shape {tuple(shape)} of "
                         f"{dt} needs {n * dt.itemsize}")
    a = np.frombuffer(payload, dtype=dt)
    return a if len(shape) == 1 else a.reshape(shape)


# tensor_spec per (dtype, shape): a stage's outputs have few shapes, and a
# TensorSpec is immutable (bounded: cleared when full)
_SPECS: dict[tuple[np.dtype, tuple[int, ...]], TensorSpec] = {}
_SPECS_MAX = 1024


def tensor_spec(array: np.ndarray) -> TensorSpec:
    """The TENSOR TLV of ``array``.  Raises ValueError for a dtype MMH has no code for."""
    key = (array.dtype, array.shape)
    spec = _SPECS.get(key)
    if spec is not None:
        return spec
    dt = NUMPY_TO_DTYPE.get(array.dtype.newbyteorder("<") if array.dtype.byteorder == ">"
                            else array.dtype)
    if dt is None:
        raise ValueError(f"unsupported dtype {array.dtype}")
    spec = TensorSpec(dtype=dt, shape=tuple(int(d) for d in array.shape))
    if len(_SPECS) >= _SPECS_MAX:
        _SPECS.clear()
    _SPECS[key] = spec
    return spec


@dataclass(frozen=True)
class StageInput:
    header: Header  # the frame's header (modality, stream id, sequence, deadline, trace...)
    array: np.ndarray  # zero-copy view; valid only during infer()
    received_ns: int  # time.time_ns() when the whole frame had arrived
    source: str  # "host:port" of the upstream connection

    @classmethod
    def of(cls, header: Header, array: np.ndarray, received_ns: int, source: str) -> StageInput:
        """``StageInput(header, array, received_ns, source)`` without the frozen
        dataclass ``__init__`` (the stage makes one per frame; ~3x cheaper)."""
        inp = object.__new__(cls)
        d = inp.__dict__
        d["header"] = header
        d["array"] = array
        d["received_ns"] = received_ns
        d["source"] = source
        return inp


class Runner(Protocol):
    """A model stage behind the sidecar.  One instance per sidecar; infer()
    may be called concurrently up to the configured concurrency."""

    name: str

    async def start(self) -> None: ...

    async def infer(self, inp: StageInput) -> np.ndarray | None:
        """The stage's output tensor, or None for "no output for this input"
        (e.g. a fusion stage still waiting for other modalities).  Raising is
        a STAGE_FAILED error frame; the sidecar applies the timeout."""
        ...

    async def close(self) -> None: ...


class BatchResult(NamedTuple):
    """What :meth:`BatchRunner.infer_batch` reports for one input."""

    ok: bool  # False: ``value`` is the exception infer() would have raised
    value: Any  # ok: the output tensor (or None: no output), else the exception
    end_ns: int  # time.time_ns() when this input was done


class BatchRunner(abc.ABC):
    """The batch protocol.  A Runner that can run several queued inputs in one
    call declares it by subclassing this class (``class PythonRunner(BatchRunner)``).

    A sidecar whose runner has ``concurrency == 1`` checks, once its workers
    start (after ``runner.start()``), ``isinstance(runner, BatchRunner) and
    runner.batchable``; then each worker hands the frames already waiting in
    the inbound queue (up to ``Stage.MAX_BATCH``) to one ``infer_batch`` call
    instead of one ``infer`` call each.  Each input keeps its own output, error
    frame and SLA sample."""

    @property
    @abc.abstractmethod
    def batchable(self) -> bool:
        """Whether this runner, as started, takes batches (a runner class may
        batch some targets and not others)."""

    @abc.abstractmethod
    async def infer_batch(self, inputs: Sequence[StageInput], done: list[BatchResult]) -> None:
        """Runs ``inputs`` in order, appending one :class:`BatchResult` per
        input to ``done`` as each finishes, so a caller that gives up (timeout,
        cancellation) keeps what was finished; inputs not started by then are
        never started.  One input's failure is its result, not an exception."""


def past_deadline(header: Header, now_ns: int | None = None) -> bool:
    """True when ``header.deadline_ns`` (unix ns) is before ``now_ns`` (default:
    now).  A frame without a deadline is never past it."""
    deadline = header.deadline_ns
    if deadline is None:
        return False
    return (time.time_ns() if now_ns is None else now_ns) > deadline


def drop_late(header: Header, realtime: bool, now_ns: int | None = None) -> bool:
    """The deadline rule: True when the frame is to be dropped instead of run
    or sent, because it is real-time and already :func:`past_deadline`.

    The one place it is written; checked before the stage runs a frame and
    whenever a sender is about to write one (``FrameSender.send``, the writer
    taking it from the queue, a resend after a reconnect).  Frames that are
    not real-time are always delivered; a late one is recorded as a missed
    deadline (``SlaSample.deadline_missed``), as is a dropped one."""
    return realtime and past_deadline(header, now_ns)


class SlaSample(NamedTuple):
    """One frame's measurements, given to ``SlaSink.record()`` (sla.SlaRecorder).

    Immutable, built by keyword (or in this order).  A NamedTuple rather than
    a frozen dataclass: one is built for every frame, and a frozen
    dataclass's ``__init__`` costs ~1.6 µs of a 1 KiB frame's ~15 µs in the
    sidecar, a NamedTuple ~0.3 µs (docs/sidecar.md, "Where a frame's time
    goes")."""

    stage: str
    sla_class: str  # class name from the sidecar config ("voice", "video", ...)
    modality: str
    queue_ns: int  # arrival -> runner start
    service_ns: int  # runner time
    e2e_ns: int | None  # now - header.timestamp_ns (None when the header has none)
    deadline_missed: bool  # past header.deadline_ns when done (or dropped for it)
    dropped: bool = False  # dropped for its deadline / overload instead of delivered
    error: bool = False


class SlaSink(Protocol):
    """Receives one SlaSample per frame, from the stage's worker tasks and the
    transport's drop hooks (on the event loop); must not block."""

    def record(self, s: SlaSample) -> None: ...
