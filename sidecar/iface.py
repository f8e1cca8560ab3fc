"""The contract between the sidecar's parts (read this before writing any).

Data path of one sidecar (one model pod):

    upstream sidecars --MMH frames (TCP; UDP for real-time audio)--> transport.FrameServer
      -> bounded inbound queue -> Stage worker: runner.infer(array, header)
      -> outputs framed with MMH -> transport.FrameSender (one connection per
         downstream and SLA class) --> downstream sidecars
    every frame: sla.SlaRecorder.record(...)  ->  Prometheus + report to qosd

Tensor payload encoding (docs/wire-format.md): one tensor per frame; the
TENSOR TLV gives dtype (mmmesh._abi.DType, KServe v2 names) and shape; the
payload is the raw C-order bytes of the array (little-endian numeric types).
``tensor_from_frame`` / ``frame_for_tensor`` below are the one implementation.

Error frames: flags has Flag.ERROR, an ERROR TLV (code, message), empty
payload, same stream id and sequence as the input that failed.  Codes are
ErrorCode below.  A downstream sidecar forwards error frames (it does not run
its stage on them) so the end of the pipeline sees what failed where.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mmmesh import _abi
from mmmesh.wire import Header, TensorSpec

# mmmesh._abi.DType <-> numpy
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
    STAGE_FAILED = 1  # the runner raised
    STAGE_TIMEOUT = 2  # the runner did not answer within its timeout
    BAD_INPUT = 3  # frame readable but not a tensor the stage accepts
    OVERLOADED = 4  # dropped by backpressure policy
    UPSTREAM = 5  # forwarded error from an earlier stage


def tensor_from_frame(header: Header, payload: memoryview) -> np.ndarray:
    """A zero-copy numpy view of a frame's payload.  Raises ValueError
    (BAD_INPUT) when the TENSOR TLV is missing or does not match the size."""
    spec = header.tensor
    if spec is None:
        raise ValueError("frame has no TENSOR TLV")
    dt = DTYPE_TO_NUMPY.get(int(spec.dtype))
    if dt is None:
        raise ValueError(f"unsupported dtype {spec.dtype}")
    n = 1
    for d in spec.shape:
        n *= int(d)
    if n * dt.itemsize != len(payload):
        raise ValueError(f"payload has {len(payload)} bytes, shape {tuple(spec.shape)} of "
                         f"{dt} needs {n * dt.itemsize}")
    return np.frombuffer(payload, dtype=dt).reshape(tuple(int(d) for d in spec.shape))


def tensor_spec(array: np.ndarray) -> TensorSpec:
    dt = NUMPY_TO_DTYPE.get(array.dtype.newbyteorder("<") if array.dtype.byteorder == ">"
                            else array.dtype)
    if dt is None:
        raise ValueError(f"unsupported dtype {array.dtype}")
    return TensorSpec(dtype=dt, shape=tuple(int(d) for d in array.shape))


@dataclass(frozen=True)
class StageInput:
    header: Header  # the frame's header (modality, stream id, sequence, deadline, trace...)
    array: np.ndarray  # zero-copy view; valid only during infer()
    received_ns: int  # time.time_ns() when the whole frame had arrived
    source: str  # "host:port" of the upstream connection


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


@dataclass(frozen=True)
class SlaSample:
    """One frame's measurements, given to sla.SlaRecorder.record()."""

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
    def record(self, s: SlaSample) -> None: ...
