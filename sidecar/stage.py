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

With ``concurrency`` 1 the worker takes every frame already waiting (up to
``Stage.MAX_BATCH``) as one batch: a runner that is a ``contract.BatchRunner``
(and ``batchable`` once started) gets them in one ``infer_batch`` call (one
thread hop for a plain function); any other runner gets one ``infer`` call
per frame, and an ``async def`` that does not wait for anything runs to its
end on the spot (no task, no timer: a timeout only applies once it waits).
What a batch produces goes out together: the output frames of a batch are
handed to each sender in one ``send_nowait`` (one ``sendmsg`` when its lane
is idle) before the stage waits for anything, in frame order per output, and
the SLA samples are recorded after the sends, out of the frames' way.

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
from types import CoroutineType
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from collections.abc import Coroutine, Generator

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


class _Resume:
    """Awaits the rest of a coroutine that already ran to its first wait
    (``first``, what it yielded there): lets the stage run an ``async def``
    stage eagerly, as Python 3.12's eager tasks do, and put a timeout only
    around what is left when it waits for something."""

    __slots__ = ("coro", "first")

    def __init__(self, coro: Coroutine[Any, Any, Any], first: Any) -> None:
        self.coro = coro
        self.first = first

    def __await__(self) -> Generator[Any, None, Any]:
        coro, nxt = self.coro, self.first
        while True:
            try:
                yield nxt
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as e:  # noqa: BLE001 - thrown in by the task (a cancel): to the coroutine
                try:
                    nxt = coro.throw(e)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    nxt = coro.send(None)
                except StopIteration as done:
                    return done.value


async def _awaited(aw: Any) -> Any:
    return await aw


class _Pending:
    """A runner call that waits for something: its coroutine, what it yielded
    and when the stage's timeout ends (loop time)."""

    __slots__ = ("coro", "deadline", "f", "first", "span", "start")

    def __init__(self, f: InFrame, start: int, span: Any, coro: Coroutine[Any, Any, Any],
                 first: Any, deadline: float) -> None:
        self.f, self.start, self.span = f, start, span
        self.coro, self.first, self.deadline = coro, first, deadline


class _Out:
    """What a batch of frames produced: the output frames, in order, and the
    SLA samples, sent and recorded together (``Stage._flush``)."""

    __slots__ = ("rows", "sends")

    def __init__(self) -> None:
        self.sends: list[tuple[FrameSender, Header, Any]] = []
        self.rows: list[SlaSample] = []


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
        # per output: (Output, sender, modality, deadline offset ns or None)
        self._routes = [(o, sender, self._modality[o.name],
                         None if o.deadline_ms is None else int(o.deadline_ms * 1_000_000))
                        for o, sender in zip(cfg.outputs, self.senders, strict=True)]
        self._name = cfg.stage
        self._class = cfg.default_sla_class
        self._loop_time: Callable[[], float] = time.monotonic  # the loop's clock, from start()
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
        self._loop_time = loop.time
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
    MAX_BATCH = 64

    def _batch_runner(self) -> BatchRunner | None:
        """The runner when frames may go to it in batches (see the module)."""
        r = self.runner
        if self.concurrency == 1 and isinstance(r, BatchRunner) and r.batchable:
            return r
        return None

    async def _worker(self) -> None:
        q = self.queue
        batch_runner = self._batch_runner()
        whole = self.concurrency == 1  # (more workers share the frames instead)
        take = getattr(q, "take_nowait", None)  # a FrameQueue: the waiting frames at once
        done = getattr(q, "done", None)
        while True:
            items = [await q.get()]
            if whole and not q.empty():
                if take is not None:
                    items += take(self.MAX_BATCH - 1)
                else:
                    while len(items) < self.MAX_BATCH and not q.empty():
                        items.append(q.get_nowait())
            out = _Out()
            try:
                if batch_runner is not None and len(items) > 1:
                    try:
                        await self._batch(batch_runner, items, out)
                    except asyncio.CancelledError:
                        raise
                    except Exception:  # never die
                        log.exception("stage %s: unexpected error on a batch", self._name)
                else:
                    for f in items:
                        try:
                            pending = self._start(f, out)
                            if pending is not None:
                                await self._complete(pending, out)
                        except asyncio.CancelledError:
                            raise
                        except Exception:  # never die: the next frame is served
                            log.exception("stage %s: unexpected error on a frame", self._name)
                await self._flush(out)
            except asyncio.CancelledError:
                self._flush_nowait(out)
                raise
            except Exception:
                log.exception("stage %s: unexpected error sending a batch", self._name)
            finally:
                if done is not None:
                    done(len(items))
                else:
                    for _ in items:
                        q.task_done()

    # -- what a batch produced ---------------------------------------------------
    async def _flush(self, out: _Out) -> None:
        """Hands the output frames to their senders (each takes what it can at
        once, in order: written or queued), then waits for room where an
        output is full, then records the SLA samples."""
        sends = out.sends
        if sends:
            out.sends = []
            full = []
            for sender, frames in self._by_sender(sends):
                k = sender.send_nowait(frames)
                if k < len(frames):
                    full.append((sender, frames[k:]))
            for sender, frames in full:  # (the other outputs' frames went first)
                for h, p in frames:
                    await sender.send(h, p)
        rows = out.rows
        if rows:
            out.rows = []
            self._record(rows)

    def _by_sender(self, sends: list[tuple[FrameSender, Header, Any]]
                   ) -> list[tuple[FrameSender, list[tuple[Header, Any]]]]:
        if len(self.senders) == 1:
            return [(self.senders[0], [(h, p) for _, h, p in sends])]
        per: dict[int, tuple[FrameSender, list[tuple[Header, Any]]]] = {}
        for sender, h, p in sends:
            entry = per.get(id(sender))
            if entry is None:
                entry = per[id(sender)] = (sender, [])
            entry[1].append((h, p))
        return list(per.values())

    def _flush_nowait(self, out: _Out) -> None:
        """On the way out (cancelled): what can be sent without waiting is, the
        samples are recorded."""
        sends, out.sends = out.sends, []
        for sender, frames in self._by_sender(sends) if sends else ():
            sender.send_nowait(frames)
        rows, out.rows = out.rows, []
        if rows:
            self._record(rows)

    def _record(self, rows: list[SlaSample]) -> None:
        record = self.sink.record
        for s in rows:
            try:
                record(s)
            except Exception:
                log.exception("SLA sink failed")

    def _row(self, h: Header, queue_ns: int = 0, service_ns: int = 0, now: int | None = None,
             *, dropped: bool = False, error: bool = False,
             sla_class: str | None = None) -> SlaSample:
        if now is None:
            now = time.time_ns()
        ts = h.timestamp_ns
        return SlaSample(self._name, sla_class or self._class, h.modality_name,
                         max(queue_ns, 0), max(service_ns, 0),
                         None if ts is None else now - ts, past_deadline(h, now), dropped, error)

    def _sample(self, h: Header, *, queue_ns: int = 0, service_ns: int = 0,
                dropped: bool = False, error: bool = False, sla_class: str | None = None,
                done_ns: int | None = None) -> None:
        """One frame's SlaSample to the sink now (the transport's drop hooks)."""
        self._record([self._row(h, queue_ns, service_ns, done_ns, dropped=dropped, error=error,
                                sla_class=sla_class)])

    def record_inbound_drop(self, f: InFrame, reason: str) -> None:
        """FrameServer.on_drop hook: a frame dropped before reaching the stage."""
        self._sample(f.header, queue_ns=0, dropped=True)

    def record_outbound_drop(self, output: Output, h: Header, reason: str) -> None:
        """FrameSender.on_drop hook: a real-time output frame dropped after the stage."""
        self._sample(h, dropped=True, sla_class=output.sla_class)

    # -- one frame -------------------------------------------------------------
    async def process(self, f: InFrame) -> None:
        """Runs one frame through the stage and sends what it produced."""
        out = _Out()
        try:
            await self._one(f, out)
        finally:
            await self._flush(out)

    async def _one(self, f: InFrame, out: _Out) -> None:
        pending = self._start(f, out)
        if pending is not None:
            await self._complete(pending, out)

    def _start(self, f: InFrame, out: _Out) -> _Pending | None:
        """Runs ``f`` as far as it goes without waiting (see :meth:`_infer`):
        None when it is done (what it produced is in ``out``), else the call
        that waits for something, for :meth:`_complete`."""
        prep = self._prepare(f, out)
        if prep is None:
            return None
        array, start, span = prep
        res = self._infer(f, array, start, span, out)
        if type(res) is _Pending:
            return res
        if span is not None:
            span.end()
        if res is not None:
            self._finish(f, start, span, res, out)  # type: ignore[arg-type]
        return None

    async def _complete(self, p: _Pending, out: _Out) -> None:
        try:
            res = await self._infer_rest(p, out)
        finally:
            if p.span is not None:
                p.span.end()
        if res is not None:
            self._finish(p.f, p.start, p.span, res, out)

    async def _run_one(self, f: InFrame, array: np.ndarray, start: int, span: Any,
                       out: _Out) -> None:
        res = self._infer(f, array, start, span, out)
        if type(res) is _Pending:
            await self._complete(res, out)
            return
        if span is not None:
            span.end()
        if res is not None:
            self._finish(f, start, span, res, out)  # type: ignore[arg-type]

    def _prepare(self, f: InFrame, out: _Out) -> tuple[np.ndarray, int, Any] | None:
        """Everything before the runner; None when the frame is already dealt
        with (forwarded, refused, or dropped for its deadline)."""
        c = self.counters
        c.frames += 1
        h = f.header
        flags = h.flags
        if flags & _F_ERROR:
            c.errors[ErrorCode.UPSTREAM.name] += 1
            self._forward(h, out)
            now = time.time_ns()
            out.rows.append(self._row(h, now - f.received_ns, 0, now, error=True))
            return None
        if flags & _F_EOS and h.tensor is None and h.payload_len == 0:
            self._forward(h, out)
            now = time.time_ns()
            out.rows.append(self._row(h, now - f.received_ns, 0, now))
            return None
        try:
            array = tensor_from_frame(h, f.payload)
        except ValueError as e:
            self._fail(f, ErrorCode.BAD_INPUT, str(e), out)
            return None
        start = time.time_ns()
        if h.deadline_ns is not None and drop_late(  # (no deadline: never late)
                h, f.transport == "udp" or self._realtime(h), start):
            c.dropped_deadline += 1
            out.rows.append(self._row(h, start - f.received_ns, 0, start, dropped=True))
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

    def _finish(self, f: InFrame, start: int, span: Any,
                res: tuple[np.ndarray | None, TensorSpec | None, int], out: _Out) -> None:
        """Everything after the runner: the output frames and the SLA sample."""
        c = self.counters
        h = f.header
        result, spec, end = res
        traceparent = h.traceparent
        if span is not None:
            traceparent = _traceparent_of(span) or traceparent
        if result is None:
            c.no_output += 1
        else:
            c.outputs += 1
            self._fan_out(h, result, spec, traceparent, out)
        out.rows.append(self._row(h, start - f.received_ns, end - start, end))

    async def process_batch(self, runner: BatchRunner, items: list[InFrame]) -> None:
        """Frames that were waiting together go to ``runner`` in one call (see
        ``_batch``), and what they produced is sent together."""
        out = _Out()
        try:
            await self._batch(runner, items, out)
        finally:
            await self._flush(out)

    async def _batch(self, runner: BatchRunner, items: list[InFrame], out: _Out) -> None:
        """Frames that were waiting together go to ``runner`` in one call, in
        order (for a plain-function runner: ONE thread hop instead of one hop,
        two cross-CPU wake-ups, per frame).  Each frame keeps its own output,
        error frame and SLA sample, and they go out in the frames' order (a
        frame refused before the call, BAD_INPUT, between its neighbours'
        outputs).  If a frame hangs, the ones before it are delivered, it gets
        STAGE_TIMEOUT, and the ones after it are run one by one."""
        preps: list[tuple[InFrame, np.ndarray, int, Any]] = []
        dealt: dict[int, _Out] = {}  # position in preps -> what a frame dealt with produced
        for f in items:
            early = _Out()
            p = self._prepare(f, early)
            if p is not None:
                preps.append((f, *p))
            elif early.sends or early.rows:
                dealt[len(preps)] = early  # (before the prep that comes next)
        if not preps:
            for early in dealt.values():
                out.sends += early.sends
                out.rows += early.rows
            return
        c = self.counters
        c.in_flight += 1
        c.max_in_flight = max(c.max_in_flight, c.in_flight)
        inputs = [StageInput.of(f.header, a, f.received_ns, f.source) for f, a, _, _ in preps]
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

        def dealt_before(i: int) -> None:
            early = dealt.pop(i, None)
            if early is not None:
                out.sends += early.sends
                out.rows += early.rows

        for i, ((f, _, start, span), (ok, value, end)) in enumerate(zip(preps, done[:n])):
            dealt_before(i)
            if span is not None:
                span.end()
            if not ok:
                self._fail(f, ErrorCode.STAGE_FAILED, f"{type(value).__name__}: {value}", out,
                           start=start)
                continue
            checked = self._check_result(f, value, start, out)
            if checked is not None:
                self._finish(f, start, span, (checked[0], checked[1], end), out)
        if timed_out and n < len(preps):
            dealt_before(n)
            f, _, start, span = preps[n]
            if span is not None:
                span.end()
            self._fail(f, ErrorCode.STAGE_TIMEOUT, f"no answer within {self.timeout:g}s", out,
                       start=start)
            for i in range(n + 1, len(preps)):
                dealt_before(i)
                f, array, start, span = preps[i]
                await self._run_one(f, array, start, span, out)
        dealt_before(len(preps))  # frames dealt with after the last one run

    def _infer(self, f: InFrame, array: np.ndarray, start: int, span: Any, out: _Out
               ) -> tuple[np.ndarray | None, TensorSpec | None, int] | _Pending | None:
        """(result, its TENSOR spec, end ns); None after an error frame; or,
        when the runner waits for something (a thread, I/O), the
        :class:`_Pending` call for :meth:`_infer_rest`.

        The runner's coroutine runs at once, to its end when it never waits:
        only a coroutine that waits gets ``asyncio.timeout`` around what is
        left of it (one that never waits cannot be timed out by asyncio
        anyway: ``asyncio.timeout`` on it is a no-op that costs a timer,
        ~10 µs a frame with uvloop), and the batch's output goes out before
        it waits."""
        c = self.counters
        c.in_flight += 1
        c.max_in_flight = max(c.max_in_flight, c.in_flight)
        deadline = self._loop_time() + self.timeout
        try:
            coro = self.runner.infer(StageInput.of(f.header, array, f.received_ns, f.source))
            if type(coro) is not CoroutineType:  # any other awaitable: awaited as before
                coro = _awaited(coro)
            try:
                first = coro.send(None)
            except StopIteration as e:
                result = e.value
            else:
                return _Pending(f, start, span, coro, first, deadline)
        except TimeoutError:
            c.in_flight -= 1
            self._fail(f, ErrorCode.STAGE_TIMEOUT, f"no answer within {self.timeout:g}s", out,
                       start=start)
            return None
        except Exception as e:
            c.in_flight -= 1
            log.debug("stage %s: runner raised", self._name, exc_info=True)
            self._fail(f, ErrorCode.STAGE_FAILED, f"{type(e).__name__}: {e}", out, start=start)
            return None
        except BaseException:
            c.in_flight -= 1
            raise
        c.in_flight -= 1
        end = time.time_ns()
        checked = self._check_result(f, result, start, out)
        return None if checked is None else (checked[0], checked[1], end)

    async def _infer_rest(self, p: _Pending, out: _Out
                          ) -> tuple[np.ndarray | None, TensorSpec | None, int] | None:
        """The rest of a runner call that waits, under the stage's timeout."""
        c = self.counters
        f, start = p.f, p.start
        try:
            try:
                await self._flush(out)
            except BaseException:
                p.coro.close()
                raise
            # asyncio.timeout, not wait_for: no extra task per frame (~2x frames/s)
            async with asyncio.timeout_at(p.deadline):
                result = await _Resume(p.coro, p.first)
        except TimeoutError:
            c.in_flight -= 1
            self._fail(f, ErrorCode.STAGE_TIMEOUT, f"no answer within {self.timeout:g}s", out,
                       start=start)
            return None
        except asyncio.CancelledError:
            c.in_flight -= 1
            raise
        except Exception as e:
            c.in_flight -= 1
            log.debug("stage %s: runner raised", self._name, exc_info=True)
            self._fail(f, ErrorCode.STAGE_FAILED, f"{type(e).__name__}: {e}", out, start=start)
            return None
        c.in_flight -= 1
        end = time.time_ns()
        checked = self._check_result(f, result, start, out)
        return None if checked is None else (checked[0], checked[1], end)

    def _check_result(self, f: InFrame, result: Any, start: int, out: _Out
                      ) -> tuple[np.ndarray | None, TensorSpec | None] | None:
        """(array or None, its TENSOR spec) ready to frame, or None after a
        STAGE_FAILED frame."""
        if result is None:
            return (None, None)
        try:
            if type(result) is not np.ndarray:
                result = np.asarray(result)
            if result.dtype.byteorder == ">":
                result = result.astype(result.dtype.newbyteorder("<"))
            if not result.flags.c_contiguous:
                result = np.ascontiguousarray(result)  # (never for 0-d: it would make it 1-d)
            spec = tensor_spec(result)  # unsupported dtype -> ValueError
        except (ValueError, TypeError) as e:
            self._fail(f, ErrorCode.STAGE_FAILED, f"bad output: {e}", out, start=start)
            return None
        return (result, spec)

    # -- output framing --------------------------------------------------------
    def _out_header(self, o: Output, modality: int, dl_ns: int | None, h: Header,
                    spec: TensorSpec | None, traceparent: bytes | None, *, flags: int = 0,
                    error: tuple[int, str] | None = None) -> Header:
        timestamp = h.timestamp_ns
        deadline = h.deadline_ns
        if dl_ns is not None and timestamp is not None:
            deadline = timestamp + dl_ns
        same = modality == h.modality
        return Header.from_fields({
            "modality": modality,
            "sla_class": o.sla_class_id,
            "flags": flags | (h.flags & _F_EOS),
            "stream_id": h.stream_id,
            "sequence": h.sequence,
            "timestamp_ns": timestamp,
            "deadline_ns": deadline,
            "fps": h.fps if same else None,
            "bitrate": h.bitrate if same else None,
            "density": h.density if same else None,
            "tensor": spec,
            "traceparent": traceparent,
            "error": error,
        })

    def _fan_out(self, h: Header, result: np.ndarray, spec: TensorSpec | None,
                 traceparent: bytes | None, out: _Out) -> None:
        sends = out.sends
        for o, sender, modality, dl_ns in self._routes:
            sends.append((sender, self._out_header(o, modality, dl_ns, h, spec, traceparent),
                          result))

    def _forward(self, h: Header, out: _Out) -> None:
        """An error / end-of-stream frame: TLVs kept, link fields from the Output."""
        sends = out.sends
        for o, sender, modality, _ in self._routes:
            sends.append((sender, dataclasses.replace(h, modality=modality,
                                                      sla_class=o.sla_class_id, payload_len=0),
                          b""))

    def _fail(self, f: InFrame, code: ErrorCode, message: str, out: _Out, *,
              start: int | None = None) -> None:
        h = f.header
        c = self.counters
        c.errors[code.name] += 1
        now = time.time_ns()
        msg = f"{self.cfg.stage}: {code.name}: {message}"
        log.info("stage %s: stream %s seq %s: %s", self.cfg.stage, h.stream_id, h.sequence, msg)
        for o, sender, modality, dl_ns in self._routes:
            eh = self._out_header(o, modality, dl_ns, h, None, h.traceparent, flags=Flag.ERROR)
            eh = dataclasses.replace(eh, error=(int(code), _fit_message(eh, int(code), msg)))
            out.sends.append((sender, eh, b""))
        begin = start if start is not None else now
        out.rows.append(self._row(h, begin - f.received_ns, now - begin, now, error=True))


def _fit_message(h: Header, code: int, msg: str) -> str:
    """``msg`` shortened so the ERROR TLV fits (value <= 255, header <= 255 bytes)."""
    base = len(encode_header(dataclasses.replace(h, error=(code, ""))))
    budget = min(255 - 2, 255 - base)
    raw = msg.encode("utf-8")
    if len(raw) <= budget:
        return msg
    return raw[:max(budget, 0)].decode("utf-8", errors="ignore")
