"""``qosd``: the mmmesh node daemon.

    qosd [--config FILE]      run (under systemd: Type=notify, watchdog)
    qosd --cleanup            remove everything qosd installed in the kernel

Start-up: read the config, open the policy store, adopt the pinned dataplane
(or load it) for the current policy version, then serve the admin API on a
unix socket (0600) and optionally on TCP (bearer token), the report socket
(0666) and Prometheus metrics, each listener with its own connection cap
(qosd/httpd/serve.py).  Every ``resync_interval_s`` the reconciler repairs
drift.  Log lines at WARNING and above are limited to one per call site per
10 s (qosd/logs.py).  Under systemd, a thread pings the watchdog while the
event loop proves it runs (:class:`Watchdog`).  Stopping qosd leaves the
dataplane running: the next qosd adopts it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmmesh.errors import MeshError
from mmmesh.net import parse_hostport

from .config import QosdConfig, load_config
from .logs import RateLimitFilter, install_rate_limit

if TYPE_CHECKING:  # built in the functions below (imported there: qosd --cleanup stays light)
    from prometheus_client import CollectorRegistry

    from qosd.applier import PolicyApplier
    from qosd.controller.core import Law
    from qosd.controller.host import ClusterSlaInput, SlaController
    from qosd.controller.kernel import KernelWriter
    from qosd.metrics import QosdMetrics
    from qosd.service import QosdService
    from qosd.sla.board import SlaBoard
    from qosd.store.cluster import Cluster
    from qosd.store.local import PolicyStore

    from .identity import SenderResolver
    from .reconciler import Reconciler
    from .socklayer import SocketLayerHost

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


class Watchdog:
    """systemd's watchdog, pinged from a thread only while the event loop runs.

    The loop proves it runs by :meth:`heartbeat` (a task that beats every
    ``beat_s``); the thread pings ``WATCHDOG=1`` every ``interval_s`` when the
    last beat is at most ``stale_s`` old.  A loop that is busy (a flood of
    connections) still beats, so the pings go on; a wedged loop stops
    beating, the pings stop, and systemd restarts qosd ``WatchdogSec`` after
    the last ping: at most ``stale_s + WatchdogSec`` after the loop's last beat.
    """

    def __init__(self, interval_s: float, *, beat_s: float = 1.0, stale_s: float | None = None,
                 notify: Callable[[str], object] = sd_notify,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.interval_s = interval_s
        self.beat_s = min(beat_s, interval_s / 2)
        self.stale_s = stale_s if stale_s is not None else max(interval_s, 2 * self.beat_s)
        self._notify, self._clock = notify, clock
        self._last_beat = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pings = 0
        self.skipped = 0

    @classmethod
    def from_env(cls) -> Watchdog | None:
        """Pings at half of ``WATCHDOG_USEC`` (systemd's WatchdogSec), or None without it."""
        usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
        pid = os.environ.get("WATCHDOG_PID")
        if usec <= 0 or (pid and pid != str(os.getpid())):
            return None
        return cls(usec / 2e6)

    def alive(self) -> bool:
        """Has the loop beaten within ``stale_s``?"""
        return self._clock() - self._last_beat <= self.stale_s

    async def heartbeat(self) -> None:
        """The loop's side: beats until cancelled."""
        while True:
            self._last_beat = self._clock()
            await asyncio.sleep(self.beat_s)

    def start(self) -> None:
        self._last_beat = self._clock()
        self._thread = threading.Thread(target=self._run, name="qosd-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while True:
            if self.alive():
                self.pings += 1
                self._notify("WATCHDOG=1")
            else:
                self.skipped += 1
                log.error("the event loop has not run for %.1f s: not pinging the watchdog",
                          self._clock() - self._last_beat)
            if self._stop.wait(self.interval_s):
                return


def metrics_app(registry: CollectorRegistry) -> Any:
    """Prometheus's text exposition of ``registry`` as an ASGI app (any path,
    like prometheus_client's own server); collected in a worker thread, since
    reading the BPF maps must not hold up the event loop."""
    from prometheus_client.exposition import choose_encoder

    async def app(scope: Any, receive: Any, send: Any) -> None:
        accept = b",".join(v for k, v in scope["headers"] if k == b"accept").decode("latin-1")
        encoder, content_type = choose_encoder(accept)
        body = await asyncio.to_thread(encoder, registry)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type.encode()),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return app


# ------------------------------------------------------------------ the parts
@dataclass(frozen=True)
class Node:
    """qosd's node-local parts, wired by :func:`build_node`; nothing started."""

    store: PolicyStore  # the versions (qosd/store/local.py)
    reconciler: Reconciler  # version -> kernel, drift repair
    applier: PolicyApplier  # store + reconciler under one write lock: every apply
    socket_layer: SocketLayerHost  # off unless socket_layer.enabled
    board: SlaBoard  # the sidecars' windows
    senders: SenderResolver  # who is reporting on sla.sock
    law: Law  # the SLA controller's law (its period: sla_controller_period_s)
    kernel: KernelWriter  # the controller's stage overrides and replica weights


def open_store(cfg: QosdConfig) -> PolicyStore:
    """The node's policy store (``state_dir``, ``history_limit``)."""
    from qosd.store.local import PolicyStore

    return PolicyStore(cfg.state_dir, history_limit=cfg.history_limit)


def build_node(cfg: QosdConfig, store: PolicyStore, metrics: QosdMetrics | None = None) -> Node:
    """The parts of one node around ``store``; ``metrics`` (qosd's own) hears
    every reconcile and how the dataplane was found at start."""
    from qosd.applier import PolicyApplier
    from qosd.controller.core import Law
    from qosd.controller.kernel import KernelWriter
    from qosd.sla.board import SlaBoard

    from .identity import SenderResolver
    from .reconciler import Reconciler
    from .socklayer import SocketLayerHost

    reconciler = Reconciler(
        cfg, on_result=metrics.observe_reconcile if metrics is not None else None,
        on_adoption=metrics.adoption if metrics is not None else None)
    socket_layer = SocketLayerHost(cfg.socket_layer)
    board = SlaBoard(cfg.sla_limits, cfg.sla_reporters)
    law = Law(period_s=float(cfg.sla_controller_period_s))
    kernel = KernelWriter(cfg.socket_layer.stages, law, overrides=reconciler, host=socket_layer,
                          policy=store, board=board)
    return Node(store=store, reconciler=reconciler,
                applier=PolicyApplier(store, reconciler, initial_policy=cfg.initial_policy),
                socket_layer=socket_layer, board=board, senders=SenderResolver(), law=law,
                kernel=kernel)


def build_controller(cfg: QosdConfig, node: Node,
                     cluster: ClusterSlaInput | None = None) -> SlaController:
    """The SLA controller of ``node``: judged from ``cluster``'s global view
    in a mesh (the cluster store), else from the node's board."""
    from qosd.controller.host import SlaController

    return SlaController(node.law, policy=node.store, adapter=node.reconciler,
                         kernel=node.kernel, board=node.board, cluster=cluster,
                         state_dir=cfg.state_dir, enabled=cfg.sla_controller_enabled)


def build_service(cfg: QosdConfig, node: Node, controller: SlaController,
                  cluster: Cluster | None = None, *,
                  started_at: float | None = None) -> QosdService:
    """The admin API's facade over ``node``, its controller and ``cluster``
    (None: this node runs alone)."""
    from .service import QosdService

    return QosdService(node_name=cfg.node_name, store=node.store, reconciler=node.reconciler,
                       applier=node.applier, board=node.board, senders=node.senders,
                       controller=controller, socket_layer=node.socket_layer,
                       cluster=cluster.store if cluster is not None else None,
                       peers=cluster.peers if cluster is not None else None,
                       started_at=started_at)


async def run(cfg: QosdConfig, log_filter: RateLimitFilter | None = None) -> int:
    """Runs qosd until SIGTERM/SIGINT (``log_filter``: flushed every interval).

    The composition root: every part is built here (or by the functions
    above) and handed the narrow interfaces it needs, in an order that needs
    no part attached to another after it is built: the store, the metrics
    registry over it, the node's parts, the start-up reconcile, the cluster
    store (handed the applier, the store and the board), then the SLA
    controller (handed the cluster store's global view) and the API's facade
    (handed everything it answers from)."""
    from starlette.concurrency import run_in_threadpool

    from qosd.api import create_app, create_sla_app, serve_tcp, serve_uds
    from qosd.httpd.serve import (
        ADMIN_MAX_CONNECTIONS,
        METRICS_MAX_CONNECTIONS,
        SLA_MAX_CONNECTIONS,
        ApiServer,
        serve,
    )

    from .metrics import SlaBoardCollector, SocketLayerCollector, Target, make_registry

    started_at = time.time()
    store = open_store(cfg)

    def targets() -> list[Target]:
        cur = store.current()
        if cur is None:
            return []
        return [Target(iface=cur.policy.link.device, netns=cfg.netns,
                       class_names={c.id: c.name for c in cur.policy.classes})]

    registry, qmetrics = make_registry(targets, node=cfg.node_name,
                                       resync_interval_s=cfg.resync_interval_s, policy=store)
    node = build_node(cfg, store, qmetrics)
    registry.register(SlaBoardCollector(node.board))
    registry.register(SocketLayerCollector(node.socket_layer, node.kernel))
    for problem in store.problems:
        log.error("policy store: %s", problem)

    t0 = time.monotonic()
    try:
        res = await run_in_threadpool(node.applier.start)
    except MeshError as e:
        log.error("start-up reconcile failed: %s (serving the API anyway)", e)
        res = None
    if res is not None:
        log.info("dataplane %s for policy version %d in %.0f ms",
                 "adopted" if node.reconciler.adopted else "loaded", res.version,
                 (time.monotonic() - t0) * 1000)

    # load or adopt (a failure is retried at every resync); disabled: a layer
    # still pinned on the configured cgroup is taken down
    await run_in_threadpool(node.socket_layer.start)

    from qosd.store.cluster import start_cluster_store  # gossip (peers:) or etcd (cluster.etcd)
    cluster = await start_cluster_store(cfg, applier=node.applier, policy=store,
                                        board=node.board, registry=registry)
    if cluster is not None:  # mmmesh_rollout_*, mmmesh_cluster_sla_*: the apps the store started
        from qosd.metrics.cluster_apps import ClusterAppsCollector
        registry.register(ClusterAppsCollector(cluster.rollout_app, cluster.sla_app))
    controller = build_controller(cfg, node, cluster.store if cluster is not None else None)
    svc = build_service(cfg, node, controller, cluster, started_at=started_at)
    servers: list[ApiServer] = []
    if cfg.metrics_addr:
        host, port = parse_hostport(cfg.metrics_addr, default_host="0.0.0.0",
                                    what="metrics address")
        servers.append(await serve_tcp(metrics_app(registry), host, port,
                                       max_connections=METRICS_MAX_CONNECTIONS))
    tcp, app_tcp = cfg.api_tcp, None
    if tcp:
        token = cfg.token()
        if token:
            app_tcp = create_app(svc, token=token)
        else:
            log.error("api_tcp is set but no api_token/api_token_file: TCP API not started")
            tcp = None
    servers += await serve(create_app(svc), uds=str(cfg.api_socket), tcp=tcp, app_tcp=app_tcp,
                           max_connections=ADMIN_MAX_CONNECTIONS)
    if cfg.sla_socket is not None:
        # model pods report here; they cannot reach the policy endpoints
        servers.append(await serve_uds(create_sla_app(svc), cfg.sla_socket, mode=0o666,
                                       max_connections=SLA_MAX_CONNECTIONS))
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

    sd_notify(f"READY=1\nSTATUS=policy version {store.version}\nMAINPID={os.getpid()}")

    async def resync_loop() -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=cfg.resync_interval_s)
            except TimeoutError:
                pass
            if stop.is_set():
                return
            try:
                # the socket layer up again if it failed, was unpinned or detached
                await run_in_threadpool(node.socket_layer.ensure)
                await run_in_threadpool(node.applier.resync)
                if qmetrics is not None:
                    qmetrics.resync_ran()  # the heartbeat, drift or not
            except Exception as e:  # noqa: BLE001 - keep the loop alive, report
                log.error("resync failed: %s", e)

    async def controller_loop() -> None:
        """The SLA controller: a window as soon as it is in, woken by the board's
        new windows (docs/controller.md, "The loop's delay")."""
        await controller.run(stop, run_in_threadpool, node.board)

    async def flush_logs() -> None:
        while log_filter is not None:
            await asyncio.sleep(log_filter.limiter.interval_s)
            log_filter.flush()

    tasks = [asyncio.create_task(resync_loop()), asyncio.create_task(controller_loop())]
    background = [asyncio.create_task(flush_logs())]
    watchdog = Watchdog.from_env()
    if watchdog is not None:
        background.append(asyncio.create_task(watchdog.heartbeat()))
        watchdog.start()
    await stop.wait()
    log.info("stopping (the dataplane stays; the next qosd adopts it)")
    sd_notify("STOPPING=1")
    if cluster is not None:
        await cluster.store.stop()  # a graceful leave: members mark this node left, not dead
    await asyncio.gather(*(srv.stop_async() for srv in servers), *tasks,
                         return_exceptions=True)
    if watchdog is not None:
        watchdog.stop()
    for t in background:
        t.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    return 0


def cleanup(cfg: QosdConfig) -> int:
    """Removes programs, pins, classes from every device qosd may have used."""
    from .reconciler import Reconciler

    devices = set(cfg.uplinks)
    try:
        store = open_store(cfg)
        for pv in store.history():
            devices.add(pv.policy.link.device)
    except MeshError as e:
        log.warning("policy store: %s", e)
    Reconciler(cfg).cleanup(sorted(devices))
    sock = ""
    from .socklayer import SocketLayerHost

    try:  # enabled or not: what qosd.yaml's cgroup holds pinned
        if SocketLayerHost(cfg.socket_layer).down():
            sock = f"; the socket layer from cgroup {cfg.socket_layer.cgroup or '/'}"
    except MeshError as e:
        log.warning("socket layer: %s", e)
    try:
        cfg.api_socket.unlink()
    except FileNotFoundError:
        pass
    print(f"qosd: removed mmmesh from {', '.join(sorted(devices)) or 'no devices'}{sock}")
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
    except Exception as e:  # noqa: BLE001 - any bad config is exit 2 with its message
        print(f"qosd: bad configuration: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=(a.log_level or cfg.log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if a.cleanup:
        return cleanup(cfg)
    log_filter = install_rate_limit()  # one line per call site per 10 s, with a count
    try:
        return asyncio.run(run(cfg, log_filter))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
