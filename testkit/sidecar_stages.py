"""Stage functions for the sidecar tests (python runner targets ``testkit.sidecar_stages:NAME``)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np


def double(x: np.ndarray) -> np.ndarray:
    return x * 2


def plus_one(x: np.ndarray) -> np.ndarray:
    return x + 1


def identity(x: np.ndarray) -> np.ndarray:
    return x


def nothing(x: np.ndarray) -> None:
    return None


def fail(x: np.ndarray) -> np.ndarray:
    if x.size and x.flat[0] == 13:
        raise ZeroDivisionError("unlucky input")
    return x


async def hang(x: np.ndarray) -> np.ndarray:
    """Never answers when the first element is 7 (else echoes)."""
    if x.size and x.flat[0] == 7:
        await asyncio.sleep(3600)
    return x


KEPT: list[np.ndarray] = []  # inputs kept by ``keep`` (tests clear it)


def keep(x: np.ndarray) -> np.ndarray:
    """Keeps every input, as a stateful stage (fusion, a reorder window) does."""
    KEPT.append(x)
    return x


RELEASE = threading.Event()  # set by tests to let hung sync calls finish


def hang_sync(x: np.ndarray) -> np.ndarray:
    """A plain function that blocks its thread when the first element is 7."""
    if x.size and x.flat[0] == 7:
        RELEASE.wait(60)
    return x


def slow(x: np.ndarray) -> np.ndarray:
    """50 ms of (thread-pool) work per frame; returns a small summary tensor."""
    time.sleep(0.05)
    return np.array([x.size], dtype=np.int64)


def slow_echo(x: np.ndarray) -> np.ndarray:
    time.sleep(0.2)
    return x


async def slow_async(x: np.ndarray) -> np.ndarray:
    await asyncio.sleep(0.1)
    return x


# --------------------------------------------------------------------------
# Test plumbing shared by tests/sidecar/test_sidecar_*.py
# --------------------------------------------------------------------------
import contextlib
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from mmmesh.wire import Header, frame
from sidecar.config import Limits, Listen, SidecarConfig
from sidecar.contract import SlaSample, tensor_spec
from sidecar.transport import FrameServer, InFrame

LOCAL = "127.0.0.1:0"


def run(coro: Awaitable[Any], timeout: float = 30.0) -> Any:
    async def guarded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(guarded())


def make_cfg(stage: str, fn: str, outputs: list[dict[str, Any]] | None = None, *,
             limits: dict[str, Any] | None = None, timeout_s: float = 5.0,
             concurrency: int = 1, udp: bool = False, **extra: Any) -> SidecarConfig:
    return SidecarConfig.model_validate({
        "stage": stage,
        "listen": {"tcp": LOCAL, "udp": LOCAL if udp else None},
        "runner": {"kind": "python", "target": f"testkit.sidecar_stages:{fn}",
                   "timeout_s": timeout_s, "concurrency": concurrency},
        "outputs": outputs or [],
        "limits": limits or {},
        "qosd": {"socket": None},
        **extra,
    })


def out(port: int, name: str = "next", **kw: Any) -> dict[str, Any]:
    return {"name": name, "address": f"127.0.0.1:{port}", "modality": "tensor",
            "sla_class": "video", **kw}


def tensor_header(arr: np.ndarray, stream_id: int = 1, seq: int = 0, **kw: Any) -> Header:
    kw.setdefault("modality", 7)
    kw.setdefault("timestamp_ns", time.time_ns())
    return Header(stream_id=stream_id, sequence=seq, tensor=tensor_spec(arr), **kw)


def frame_bytes(h: Header, payload: Any = b"") -> bytes:
    if isinstance(payload, np.ndarray) and payload.size == 0:
        payload = b""
    return b"".join(bytes(b) for b in frame(h, payload))


class ListSink:
    """An SlaSink that keeps every sample."""

    def __init__(self) -> None:
        self.samples: list[SlaSample] = []

    def record(self, s: SlaSample) -> None:
        self.samples.append(s)


class Sink:
    """A bare FrameServer that collects what a sidecar sends downstream."""

    def __init__(self, tcp: str | None = LOCAL, udp: str | None = None,
                 maxsize: int = 10_000, **limits: Any) -> None:
        self.queue: asyncio.Queue[InFrame] = asyncio.Queue(maxsize)
        self.server = FrameServer(Listen(tcp=tcp, udp=udp), Limits(**limits), self.queue,
                                  name="sink")

    async def start(self) -> Sink:
        await self.server.start()
        return self

    @property
    def port(self) -> int:
        assert self.server.port is not None
        return self.server.port

    async def get(self, timeout: float = 5.0) -> InFrame:
        return await asyncio.wait_for(self.queue.get(), timeout)

    async def get_n(self, n: int, timeout: float = 5.0) -> list[InFrame]:
        return [await self.get(timeout) for _ in range(n)]

    async def close(self) -> None:
        await self.server.close()


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    return r, w


async def wait_for(pred: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what or pred}")
        await asyncio.sleep(0.01)


async def closed_by_peer(reader: asyncio.StreamReader, timeout: float = 5.0) -> bool:
    """True once the peer closed (EOF or reset)."""
    try:
        data = await asyncio.wait_for(reader.read(65536), timeout)
        while data:
            data = await asyncio.wait_for(reader.read(65536), timeout)
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def vm_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)
