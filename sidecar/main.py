"""``mmmesh-sidecar --config FILE``: one sidecar in front of one model stage.

In-process (tests, embedding)::

    async with Sidecar(cfg) as sc:      # or: await sc.start() ... await sc.stop()
        print(sc.port)                  # bound TCP port (listen "127.0.0.1:0")
        print(sc.counters.snapshot())

Start order: runner, senders, stage workers, then the server (nothing is
accepted before the stage can take it).  Stop order (graceful drain, bounded
by ``limits.drain_timeout_s``): stop accepting; connections finish the frame
they are in; the stage finishes every queued and in-flight frame; senders
flush; everything closes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, Self

from pydantic import ValidationError

from .config import SidecarConfig, load_config
from .contract import Runner, SlaSink
from .runners import make_runner
from .sla import SlaRecorder
from .stage import NullSink, Stage, StageCounters, realtime_predicate
from .transport import (
    FrameSender,
    FrameServer,
    InFrame,
    SenderCounters,
    ServerCounters,
    inframe_queue,
)

__all__ = ["Sidecar", "SidecarCounters", "main"]

log = logging.getLogger("mmmesh.sidecar")


@dataclass
class SidecarCounters:
    """Live counters of one sidecar (read them at scrape time)."""

    server: ServerCounters = field(default_factory=ServerCounters)
    stage: StageCounters = field(default_factory=StageCounters)
    senders: dict[str, SenderCounters] = field(default_factory=dict)

    def snapshot(self) -> dict[str, Any]:
        return {
            "server": self.server.snapshot(),
            "stage": self.stage.snapshot(),
            "senders": {k: v.snapshot() for k, v in self.senders.items()},
        }


class Sidecar:
    """Server + stage + senders for one ``SidecarConfig``.

    ``runner`` overrides ``make_runner(cfg.runner)``; ``sink`` receives an
    ``SlaSample`` per frame (default: discarded); ``tracer`` is an OpenTelemetry
    tracer (default: the global one when ``cfg.otel``).  ``backoff_max`` caps
    the senders' reconnect backoff.
    """

    def __init__(
        self,
        cfg: SidecarConfig,
        *,
        runner: Runner | None = None,
        sink: SlaSink | None = None,
        tracer: Any = None,
        backoff_max: float = 5.0,
    ) -> None:
        self.cfg = cfg
        self.sink: SlaSink = sink if sink is not None else NullSink()
        self._runner = runner
        self._tracer = tracer
        self._backoff_max = backoff_max
        self.runner: Runner | None = None
        self.queue: asyncio.Queue[InFrame] | None = None
        self.server: FrameServer | None = None
        self.stage: Stage | None = None
        self.senders: dict[str, FrameSender] = {}
        self.counters = SidecarCounters()
        self._started = False

    @property
    def port(self) -> int | None:
        """The bound TCP port (useful with ``listen: {tcp: "127.0.0.1:0"}``)."""
        return self.server.port if self.server else None

    @property
    def udp_port(self) -> int | None:
        return self.server.udp_port if self.server else None

    async def start(self) -> None:
        cfg = self.cfg
        try:
            self.runner = self._runner or make_runner(cfg.runner)
            await self.runner.start()
            self.queue = inframe_queue(cfg.limits)
            for o in cfg.outputs:
                s = FrameSender(o, cfg.limits, backoff_max=self._backoff_max,
                                on_drop=self._on_out_drop)
                await s.start()
                self.senders[o.name] = s
                self.counters.senders[o.name] = s.counters
            self.stage = Stage(cfg, self.runner, self.queue, list(self.senders.values()),
                               self.sink, tracer=self._tracer)
            self.counters.stage = self.stage.counters
            await self.stage.start()
            self.server = FrameServer(cfg.listen, cfg.limits, self.queue,
                                      realtime=realtime_predicate(cfg),
                                      on_drop=self.stage.record_inbound_drop, name=cfg.stage)
            self.counters.server = self.server.counters
            await self.server.start()
        except BaseException:
            await self._close_all()
            raise
        self._started = True
        log.info("sidecar %s: tcp=%s udp=%s runner=%s outputs=%s", cfg.stage, self.port,
                 self.udp_port, cfg.runner.kind, [o.name for o in cfg.outputs])

    def _on_out_drop(self, output: Any, header: Any, reason: str) -> None:
        if self.stage is not None:
            self.stage.record_outbound_drop(output, header, reason)

    async def stop(self, timeout: float | None = None) -> bool:
        """Graceful drain, then close.  True if everything in flight was delivered."""
        if not self._started:
            await self._close_all()
            return True
        self._started = False
        loop = asyncio.get_running_loop()
        budget = self.cfg.limits.drain_timeout_s if timeout is None else timeout
        end = loop.time() + budget

        def left() -> float:
            return max(end - loop.time(), 0.0)

        clean = True
        if self.server is not None:
            await self.server.close(grace=left())
        if self.stage is not None:
            clean = await self.stage.drain(left()) and clean
        for s in self.senders.values():
            clean = await s.flush(left()) and clean
        if not clean:
            log.warning("sidecar %s: drain timed out after %.1fs; dropping what is left",
                        self.cfg.stage, budget)
        await self._close_all()
        return clean

    async def _close_all(self) -> None:
        if self.server is not None:
            await self.server.close(grace=0)
        if self.stage is not None:
            await self.stage.stop()
        for s in self.senders.values():
            await s.close()
        if self.runner is not None:
            try:
                await self.runner.close()
            except Exception:
                log.exception("runner close failed")

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


# --------------------------------------------------------------------------
# Console entry
# --------------------------------------------------------------------------
_ENV_PREFIX = "MMMESH_SIDECAR_"


def _load(path: str) -> SidecarConfig:
    """The YAML file plus ``MMMESH_SIDECAR_<FIELD>`` overrides of top-level scalars."""
    cfg = load_config(path)
    overrides: dict[str, Any] = {}
    for name, info in SidecarConfig.model_fields.items():
        value = os.environ.get(_ENV_PREFIX + name.upper())
        if value is None:
            continue
        if info.annotation is bool:
            overrides[name] = value.strip().lower() in ("1", "true", "yes", "on")
        elif isinstance(getattr(cfg, name), str | type(None)):
            overrides[name] = value or None
    if overrides:
        cfg = SidecarConfig.model_validate({**cfg.model_dump(), **overrides})
    return cfg


def _setup_otel(cfg: SidecarConfig) -> None:
    """An SDK TracerProvider exporting with OTLP when the exporter is installed
    (OTEL_* variables configure it), to the console with
    OTEL_TRACES_EXPORTER=console, else spans get ids but are not exported."""
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        log.warning("otel: opentelemetry-sdk is not installed; spans are not created")
        return
    service = os.environ.get("OTEL_SERVICE_NAME", f"mmmesh-sidecar-{cfg.stage}")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter: Any = None
    if os.environ.get("OTEL_TRACES_EXPORTER", "").lower() == "console":
        exporter = ConsoleSpanExporter()
    else:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found,unused-ignore]
                OTLPSpanExporter,
            )

            exporter = OTLPSpanExporter()
        except ImportError:
            log.warning("otel: no OTLP exporter installed; spans are propagated, not exported")
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)


async def _serve(cfg: SidecarConfig) -> int:
    recorder = SlaRecorder(cfg)
    await recorder.start()
    sc = Sidecar(cfg, sink=recorder)
    recorder.bind_counters(sc.counters)
    stop = asyncio.Event()
    clean = False
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await sc.start()
        await stop.wait()
        log.info("sidecar %s: stopping (draining up to %.1fs)", cfg.stage,
                 cfg.limits.drain_timeout_s)
        clean = await sc.stop()
    finally:
        if sc._started:
            await sc.stop(timeout=0)
        await recorder.stop()
    return 0 if clean else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mmmesh-sidecar",
                                description="mmmesh sidecar: runs a model stage on MMH streams")
    p.add_argument("--config", "-c", required=True, help="sidecar YAML config")
    p.add_argument("--log-level", default=os.environ.get("MMMESH_LOG_LEVEL", "info"),
                   choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = _load(args.config)
    except (OSError, ValidationError, ValueError) as e:
        print(f"mmmesh-sidecar: bad config {args.config}: {e}", file=sys.stderr)
        return 2
    if cfg.otel:
        _setup_otel(cfg)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_serve(cfg))
    return uvloop.run(_serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
