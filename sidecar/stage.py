"""The stage worker: inbound frames -> runner.infer() -> outbound frames.

``concurrency`` worker tasks take frames from the inbound queue (so at most
that many ``infer()`` calls are in flight).  Per frame:

* ERROR frames are forwarded to every output without running the stage (their
  ERROR TLV is kept as is, so the end of the pipeline sees the original code
  and the stage that failed; the stage counts them as ``UPSTREAM``).
* END_OF_STREAM frames without a tensor are forwarded as they are.
* The payload becomes a zero-copy numpy view (``contract.tensor_from_frame``);
  a frame that is not a valid tensor -> BAD_INPUT error frame.
* Real-time frames already past ``deadline_ns`` are dropped and counted
  (``contract.drop_late``).
* ``runner.infer()`` under ``asyncio.timeout(timeout_s)``: an exception ->
  STAGE_FAILED, a timeout -> STAGE_TIMEOUT error frame; the worker goes on.
* The output tensor is framed for every Output: same stream id and sequence,
  the ORIGINAL timestamp (end-to-end latency), the deadline (input's, or
  timestamp + ``deadline_ms`` when the output sets one), the trace context
  (a child span per stage when ``otel`` is on), modality and class byte from
  the Output, TENSOR TLV from the array.

With ``concurrency`` 1 and a runner that is a ``contract.BatchRunner`` (and
``batchable`` once started), a worker hands every frame already waiting to one
``infer_batch`` call.

Every frame yields one ``contract.SlaSample`` for the sink.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmmesh.abi import Flag
from mmmesh.wire import Header, TensorSpec, encode_header, parse_modality

from .config import Output, SidecarConfig
from .contract import (
    BatchResult,
    BatchRunner,
    ErrorCode,
    Runner,
    SlaSample,
    SlaSink,
    StageInput,
    drop_late,
    past_deadline,
    tensor_from_frame,
    tensor_spec,
)
from .transport import FrameSender, InFrame
from .transport.frames import joined

__all__ = ["NullSink", "Stage", "StageCounters", "realtime_predicate"]

log = logging.getLogger("mmmesh.sidecar.stage")

# plain ints: ``int & IntFlag`` builds a Flag object, measurable per frame
_F_ERROR = int(Flag.ERROR)
_F_EOS = int(Flag.END_OF_STREAM)


class NullSink:
    """An SlaSink that forgets everything."""

    def record(self, s: SlaSample) -> None:
        pass


@dataclass
class StageCounters:
    frames: int = 0  # frames taken from the inbound queue
    outputs: int = 0  # tensors produced (before fan-out to outputs)
    no_output: int = 0  # infer() returned None
    errors: Counter[str] = field(default_factory=Counter)  # ErrorCode name -> frames
    dropped_deadline: int = 0  # real-time frames past their deadline before the stage ran
    in_flight: int = 0
    max_in_flight: int = 0

    def snapshot(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["errors"] = dict(self.errors)
        return d


def realtime_predicate(cfg: SidecarConfig) -> Callable[[Header], bool]:
    """Which inbound frames get the real-time policy (dropped rather than queued
    late): all of them when every output is real-time; else those whose class
    byte is the ``sla_class_id`` of a real-time output."""
    rt = [o for o in cfg.outputs if o.realtime]
    if not rt:
        return lambda h: False
    if len(rt) == len(cfg.outputs):
        return lambda h: True
    ids = frozenset(o.sla_class_id for o in rt if o.sla_class_id)
    return lambda h: h.sla_class in ids


def _traceparent_of(span: Any) -> bytes | None:
    sc = span.get_span_context()
    if not sc.is_valid:
        return None
    trace_id: int = sc.trace_id
    span_id: int = sc.span_id
    return (b"\x00" + trace_id.to_bytes(16, "big") + span_id.to_bytes(8, "big")
            + bytes([int(sc.trace_flags) & 0xFF]))


class Stage:
    """Runs ``runner`` on frames from ``queue`` and sends results to ``senders``
    (one per ``cfg.outputs`` entry, same order)."""

    def __init__(
        self,
        cfg: SidecarConfig,
        runner: Runner,
        queue: asyncio.Queue[InFrame],
        senders: Sequence[FrameSender],
        sink: SlaSink | None = None,
        *,
        tracer: Any = None,
    ) -> None:
        self.cfg = cfg
        self.runner = runner
        self.queue = queue
        self.senders = list(senders)
        self.sink: SlaSink = sink if sink is not None else NullSink()
        self.counters = StageCounters()
        self.timeout = cfg.runner.timeout_s
        self.concurrency = cfg.runner.concurrency
        self._realtime = realtime_predicate(cfg)
        self._modality = {o.name: parse_modality(o.modality) for o in cfg.outputs}
        self._workers: list[asyncio.Task[None]] = []
        self._tracer = tracer
        if tracer is None and cfg.otel:
            from opentelemetry import trace

            self._tracer = trace.get_tracer("mmmesh.sidecar")
        self._propagator: Any = None
        if self._tracer is not None:
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            self._propagator = TraceContextTextMapPropagator()

    # -- lifecycle -----------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._workers = [loop.create_task(self._worker(), name=f"stage-{self.cfg.stage}-{i}")
                         for i in range(self.concurrency)]

    async def drain(self, timeout: float) -> bool:
        """Wait until the inbound queue is empty and nothing is in flight."""
        return await joined(self.queue, timeout)

    async def stop(self) -> None:
        for t in self._workers:
            t.cancel()
        for t in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._workers = []

    # -- the work --------------------------------------------------------------
    MAX_BATCH = 32

    def _batch_runner(self) -> BatchRunner | None:
        """The runner when frames may go to it in batches (see the module)."""
        r = self.runner
        if self.concurrency == 1 and isinstance(r, BatchRunner) and r.batchable:
            return r
        return None

    async def _worker(self) -> None:
        q = self.queue
        batch_runner = self._batch_runner()
        while True:
            items = [await q.get()]
            while batch_runner is not None and len(items) < self.MAX_BATCH and not q.empty():
                items.append(q.get_nowait())
            try:
                if batch_runner is None or len(items) == 1:
                    await self.process(items[0])
                else:
                    await self.process_batch(batch_runner, items)
            except asyncio.CancelledError:
                raise
            except Exception:  # never die
                log.exception("stage %s: unexpected error on a frame", self.cfg.stage)
            finally:
                for _ in items:
                    q.task_done()

    def _sample(self, h: Header, *, queue_ns: int = 0, service_ns: int = 0,
                dropped: bool = False, error: bool = False, sla_class: str | None = None,
                done_ns: int | None = None) -> None:
        now = time.time_ns() if done_ns is None else done_ns
        s = SlaSample(
            stage=self.cfg.stage,
            sla_class=sla_class or self.cfg.default_sla_class,
            modality=h.modality_name,
            queue_ns=max(queue_ns, 0),
            service_ns=max(service_ns, 0),
            e2e_ns=None if h.timestamp_ns is None else now - h.timestamp_ns,
            deadline_missed=past_deadline(h, now),
            dropped=dropped,
            error=error,
        )
        try:
            self.sink.record(s)
        except Exception:
            log.exception("SLA sink failed")

    def record_inbound_drop(self, f: InFrame, reason: str) -> None:
        """FrameServer.on_drop hook: a frame dropped before reaching the stage."""
        self._sample(f.header, queue_ns=0, dropped=True)

    def record_outbound_drop(self, output: Output, h: Header, reason: str) -> None:
        """FrameSender.on_drop hook: a real-time output frame dropped after the stage."""
        self._sample(h, dropped=True, sla_class=output.sla_class)

    async def process(self, f: InFrame) -> None:
        prep = await self._prepare(f)
        if prep is None:
            return
        await self._run_one(f, *prep)

    async def _run_one(self, f: InFrame, array: np.ndarray, start: int, span: Any) -> None:
        try:
            out = await self._infer(f, array, start)
        finally:
            if span is not None:
                span.end()
        await self._finish(f, start, span, out)

    async def _prepare(self, f: InFrame) -> tuple[np.ndarray, int, Any] | None:
        """Everything before the runner; None when the frame is already dealt
        with (forwarded, refused, or dropped for its deadline)."""
        c = self.counters
        c.frames += 1
        h = f.header
        if h.flags & _F_ERROR:
            c.errors[ErrorCode.UPSTREAM.name] += 1
            await self._fan_out(h, None, forward=True)
            self._sample(h, queue_ns=time.time_ns() - f.received_ns, error=True)
            return None
        if h.flags & _F_EOS and h.tensor is None and h.payload_len == 0:
            await self._fan_out(h, None, forward=True)
            self._sample(h, queue_ns=time.time_ns() - f.received_ns)
            return None
        try:
            array = tensor_from_frame(h, f.payload)
        except ValueError as e:
            await self._fail(f, ErrorCode.BAD_INPUT, str(e))
            return None
        start = time.time_ns()
        if drop_late(h, f.transport == "udp" or self._realtime(h), start):
            c.dropped_deadline += 1
            self._sample(h, queue_ns=start - f.received_ns, dropped=True, done_ns=start)
            return None

        span = None
        if self._tracer is not None:
            ctx = None
            if h.traceparent is not None:
                ctx = self._propagator.extract({"traceparent": h.traceparent_text})
            span = self._tracer.start_span(self.cfg.stage, context=ctx, attributes={
                "mmmesh.stage": self.cfg.stage,
                "mmmesh.modality": h.modality_name,
                "mmmesh.stream_id": h.stream_id or 0,
                "mmmesh.sequence": h.sequence or 0,
            })
        return array, start, span

    async def _finish(self, f: InFrame, start: int, span: Any,
                      out: tuple[np.ndarray | None, int] | None) -> None:
        """Everything after the runner: the output frames and the SLA sample."""
        if out is None:
            return
        c = self.counters
        h = f.header
        result, end = out
        traceparent = h.traceparent
        if span is not None:
            traceparent = _traceparent_of(span) or traceparent
        if result is None:
            c.no_output += 1
        else:
            c.outputs += 1
            await self._fan_out(h, result, traceparent=traceparent)
        self._sample(h, queue_ns=start - f.received_ns, service_ns=end - start, done_ns=end)

    async def process_batch(self, runner: BatchRunner, items: list[InFrame]) -> None:
        """Frames that were waiting together go to ``runner`` in one call, in
        order (for a plain-function runner: ONE thread hop instead of one hop,
        two cross-CPU wake-ups, per frame).  Each frame keeps its own output,
        error frame and SLA sample.  If a frame hangs, the ones before it are
        delivered, it gets STAGE_TIMEOUT, and the ones after it are run one by
        one."""
        preps: list[tuple[InFrame, np.ndarray, int, Any]] = []
        for f in items:
            p = await self._prepare(f)
            if p is not None:
                preps.append((f, *p))
        if not preps:
            return
        c = self.counters
        c.in_flight += 1
        c.max_in_flight = max(c.max_in_flight, c.in_flight)
        inputs = [StageInput(header=f.header, array=a, received_ns=f.received_ns,
                             source=f.source) for f, a, _, _ in preps]
        done: list[BatchResult] = []  # filled by the runner as each input finishes, in order
        timed_out = False
        try:
            async with asyncio.timeout(self.timeout * len(preps)):
                await runner.infer_batch(inputs, done)
        except TimeoutError:
            timed_out = True
        finally:
            c.in_flight -= 1
        n = len(done)
        for (f, _, start, span), (ok, value, end) in zip(preps, done[:n]):
            if span is not None:
                span.end()
            if not ok:
                await self._fail(f, ErrorCode.STAGE_FAILED,
                                 f"{type(value).__name__}: {value}", start=start)
                continue
            checked = await self._check_result(f, value, start)
            await self._finish(f, start, span, None if checked is None else (checked[0], end))
        if timed_out and n < len(preps):
            f, _, start, span = preps[n]
            if span is not None:
                span.end()
            await self._fail(f, ErrorCode.STAGE_TIMEOUT, f"no answer within {self.timeout:g}s",
                             start=start)
            for f, array, start, span in preps[n + 1:]:
                await self._run_one(f, array, start, span)

    async def _infer(self, f: InFrame, array: np.ndarray,
                     start: int) -> tuple[np.ndarray | None, int] | None:
        """(result, end ns), or None after sending an error frame."""
        c = self.counters
        c.in_flight += 1
        c.max_in_flight = max(c.max_in_flight, c.in_flight)
        try:
            inp = StageInput(header=f.header, array=array, received_ns=f.received_ns,
                             source=f.source)
            # asyncio.timeout, not wait_for: no extra task per frame (~2x frames/s)
            async with asyncio.timeout(self.timeout):
                result = await self.runner.infer(inp)
        except TimeoutError:
            c.in_flight -= 1
            await self._fail(f, ErrorCode.STAGE_TIMEOUT,
                             f"no answer within {self.timeout:g}s", start=start)
            return None
        except asyncio.CancelledError:
            c.in_flight -= 1
            raise
        except Exception as e:
            c.in_flight -= 1
            log.debug("stage %s: runner raised", self.cfg.stage, exc_info=True)
            await self._fail(f, ErrorCode.STAGE_FAILED, f"{type(e).__name__}: {e}", start=start)
            return None
        c.in_flight -= 1
        end = time.time_ns()
        checked = await self._check_result(f, result, start)
        return None if checked is None else (checked[0], end)

    async def _check_result(self, f: InFrame, result: Any,
                            start: int) -> tuple[np.ndarray | None] | None:
        """(array or None,) ready to frame, or None after a STAGE_FAILED frame."""
        if result is None:
            return (None,)
        try:
            result = np.asarray(result)
            if result.dtype.byteorder == ">":
                result = result.astype(result.dtype.newbyteorder("<"))
            if not result.flags.c_contiguous:
                result = np.ascontiguousarray(result)  # (never for 0-d: it would make it 1-d)
            tensor_spec(result)  # unsupported dtype -> ValueError
        except (ValueError, TypeError) as e:
            await self._fail(f, ErrorCode.STAGE_FAILED, f"bad output: {e}", start=start)
            return None
        return (result,)

    # -- output framing --------------------------------------------------------
    def _out_header(self, o: Output, h: Header, result: np.ndarray | None,
                    traceparent: bytes | None, *, flags: int = 0,
                    error: tuple[int, str] | None = None,
                    spec: TensorSpec | None = None) -> Header:
        modality = self._modality[o.name]
        timestamp = h.timestamp_ns
        deadline = h.deadline_ns
        if o.deadline_ms is not None and timestamp is not None:
            deadline = timestamp + int(o.deadline_ms * 1_000_000)
        same = modality == h.modality
        return Header(
            modality=modality,
            sla_class=o.sla_class_id,
            flags=flags | (h.flags & _F_EOS),
            stream_id=h.stream_id,
            sequence=h.sequence,
            timestamp_ns=timestamp,
            deadline_ns=deadline,
            fps=h.fps if same else None,
            bitrate=h.bitrate if same else None,
            density=h.density if same else None,
            tensor=spec if spec is not None or result is None else tensor_spec(result),
            traceparent=traceparent,
            error=error,
        )

    async def _fan_out(self, h: Header, result: np.ndarray | None, *,
                       traceparent: bytes | None = None, forward: bool = False) -> None:
        spec = None if forward or result is None else tensor_spec(result)  # once, not per output
        for o, sender in zip(self.cfg.outputs, self.senders, strict=True):
            if forward:  # error / end-of-stream frame: TLVs kept, link fields from the Output
                out = dataclasses.replace(h, modality=self._modality[o.name],
                                          sla_class=o.sla_class_id, payload_len=0)
                await sender.send(out, b"")
            else:
                await sender.send(self._out_header(o, h, result, traceparent, spec=spec),
                                  result)

    async def _fail(self, f: InFrame, code: ErrorCode, message: str, *,
                    start: int | None = None) -> None:
        h = f.header
        c = self.counters
        c.errors[code.name] += 1
        now = time.time_ns()
        msg = f"{self.cfg.stage}: {code.name}: {message}"
        log.info("stage %s: stream %s seq %s: %s", self.cfg.stage, h.stream_id, h.sequence, msg)
        for o, sender in zip(self.cfg.outputs, self.senders, strict=True):
            out = self._out_header(o, h, None, h.traceparent, flags=Flag.ERROR)
            out = dataclasses.replace(out, error=(int(code), _fit_message(out, int(code), msg)))
            await sender.send(out, b"")
        begin = start if start is not None else now
        self._sample(h, queue_ns=begin - f.received_ns, service_ns=now - begin, error=True,
                     done_ns=now)


def _fit_message(h: Header, code: int, msg: str) -> str:
    """``msg`` shortened so the ERROR TLV fits (value <= 255, header <= 255 bytes)."""
    base = len(encode_header(dataclasses.replace(h, error=(code, ""))))
    budget = min(255 - 2, 255 - base)
    raw = msg.encode("utf-8")
    if len(raw) <= budget:
        return msg
    return raw[:max(budget, 0)].decode("utf-8", errors="ignore")
