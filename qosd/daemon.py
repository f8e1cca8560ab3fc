"""``qosd``: the mmmesh node daemon.

    qosd [--config FILE]      run (under systemd: Type=notify, watchdog)
    qosd --cleanup            remove everything qosd installed in the kernel

Start-up: read the config, open the policy store, adopt the pinned dataplane
(or load it) for the current policy version, then serve the admin API on a
unix socket (0600) and optionally on TCP (bearer token), and Prometheus
metrics.  Every ``resync_interval_s`` the reconciler repairs drift.  Stopping
qosd leaves the dataplane running: the next qosd adopts it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

from mmmesh._errors import MeshError

from .config import QosdConfig, load_config

log = logging.getLogger("qosd")


def sd_notify(state: str) -> bool:
    """Sends a state line to systemd's notify socket (no-op without one)."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError as e:
        log.warning("sd_notify(%s) failed: %s", state, e)
        return False


async def run(cfg: QosdConfig) -> int:
    from starlette.concurrency import run_in_threadpool

    from .api import create_app, create_sla_app, serve, serve_uds
    from .metrics import Target, make_registry, serve_metrics
    from .service import QosdService

    service_box: dict[str, Any] = {}

    def targets() -> list[Target]:
        svc = service_box.get("svc")
        cur = svc.store.current() if svc else None
        if cur is None:
            return []
        return [Target(iface=cur.policy.link.device, netns=cfg.netns,
                       class_names={c.id: c.name for c in cur.policy.classes})]

    registry, qmetrics = make_registry(targets)
    svc = QosdService(cfg, metrics=qmetrics)
    service_box["svc"] = svc
    for problem in svc.store.problems:
        log.error("policy store: %s", problem)

    t0 = time.monotonic()
    try:
        res = await run_in_threadpool(svc.start)
    except MeshError as e:
        log.error("start-up reconcile failed: %s (serving the API anyway)", e)
        res = None
    if res is not None:
        log.info("dataplane %s for policy version %d in %.0f ms",
                 "adopted" if svc.reconciler.adopted else "loaded", res.version,
                 (time.monotonic() - t0) * 1000)

    metrics_server = serve_metrics(registry, cfg.metrics_addr) if cfg.metrics_addr else None
    tcp, app_tcp = cfg.api_tcp, None
    if tcp:
        token = cfg.token()
        if token:
            app_tcp = create_app(svc, token=token)
        else:
            log.error("api_tcp is set but no api_token/api_token_file: TCP API not started")
            tcp = None
    servers = await serve(create_app(svc), uds=str(cfg.api_socket), tcp=tcp, app_tcp=app_tcp)
    if cfg.sla_socket is not None:
        # model pods report here; they cannot reach the policy endpoints
        servers.append(await serve_uds(create_sla_app(svc), cfg.sla_socket, mode=0o666))
        log.info("SLA reports on unix:%s", cfg.sla_socket)
    log.info("admin API on unix:%s%s", cfg.api_socket,
             f" and tcp:{tcp} (bearer token required)" if tcp else "")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    def _on_signal(sig: signal.Signals) -> None:
        log.info("received %s", sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig)

    sd_notify(f"READY=1\nSTATUS=policy version {svc.store.version}\nMAINPID={os.getpid()}")

    async def resync_loop() -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=cfg.resync_interval_s)
            except asyncio.TimeoutError:
                pass
            if stop.is_set():
                return
            try:
                await run_in_threadpool(svc.resync)
            except Exception as e:  # keep the loop alive, report
                log.error("resync failed: %s", e)

    async def watchdog_loop() -> None:
        usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
        if usec <= 0:
            return
        while not stop.is_set():
            sd_notify("WATCHDOG=1")
            try:
                await asyncio.wait_for(stop.wait(), timeout=usec / 2e6)
            except asyncio.TimeoutError:
                pass

    tasks = [asyncio.create_task(resync_loop()), asyncio.create_task(watchdog_loop())]
    await stop.wait()
    log.info("stopping (the dataplane stays; the next qosd adopts it)")
    sd_notify("STOPPING=1")
    await asyncio.gather(*(srv.stop_async() for srv in servers), *tasks,
                         return_exceptions=True)
    if metrics_server is not None:
        try:
            metrics_server.shutdown()
        except Exception:  # pragma: no cover
            pass
    return 0


def cleanup(cfg: QosdConfig) -> int:
    """Removes programs, pins, classes from every device qosd may have used."""
    from .reconciler import Reconciler
    from .store import PolicyStore

    devices = set(cfg.uplinks)
    try:
        store = PolicyStore(cfg.state_dir, history_limit=cfg.history_limit)
        for pv in store.history():
            devices.add(pv.policy.link.device)
    except MeshError as e:
        log.warning("policy store: %s", e)
    Reconciler(cfg).cleanup(sorted(devices))
    try:
        cfg.api_socket.unlink()
    except FileNotFoundError:
        pass
    print(f"qosd: removed mmmesh from {', '.join(sorted(devices)) or 'no devices'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="qosd", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="config file (default /etc/mmmesh/qosd.yaml)")
    ap.add_argument("--cleanup", action="store_true",
                    help="remove everything qosd installed in the kernel, then exit")
    ap.add_argument("--log-level", default=None)
    a = ap.parse_args(argv)
    try:
        cfg = load_config(a.config)
    except Exception as e:
        print(f"qosd: bad configuration: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=(a.log_level or cfg.log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if a.cleanup:
        return cleanup(cfg)
    try:
        return asyncio.run(run(cfg))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
