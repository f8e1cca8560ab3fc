"""A multi-node testbed on one machine: network namespaces joined by veth links.

Two nodes by default::

    [tx]  up0 10.201.1.1/24  <-- veth -->  eth0 10.201.1.2/24  [rx]

``tx`` is the sending inference node (the model stages' traffic leaves it on
its uplink ``up0``, the device that is shaped and where the classifier sits),
``rx`` the receiving node.  With ``nodes=3`` the model pods live in a third
namespace behind ``tx``, which forwards their traffic to the uplink, as a node
forwards its pods' traffic::

    [pod] eth0 10.201.0.2/24 <-> pod0 10.201.0.1/24 [tx] up0 10.201.1.1 <-> eth0 10.201.1.2 [rx]

Namespace names start with a per-process prefix (``mmd<pid>-``); the testbed
removes them, and stops every process it started in them, when the ``with``
block ends: normally, on an exception, on Ctrl-C (SIGINT) and on SIGTERM.
Namespaces and links are built with :mod:`demo.netlab`; the
dataplane is read through :class:`mmmesh.dataplane.Dataplane`.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any, Self

from mmmesh.dataplane import Dataplane, HtbClassStats
from mmmesh.errors import DataplaneError

from . import netlab
from .netlab import Lab

UPLINK = "up0"
RX_IF = "eth0"
POD_IF = "eth0"
POD_GW_IF = "pod0"
UPLINK_NET = "10.201.1"
POD_NET = "10.201.0"


@dataclass(frozen=True)
class Node:
    role: str  # "tx", "rx", "pod"
    ns: str  # network namespace name
    addr: str  # the node's address on its link towards the others


class ChildError(RuntimeError):
    """A process started in a node failed; carries its traceback text."""


class Ctl:
    """What a child function gets as its first argument: a way to say 'ready'."""

    def __init__(self, conn: multiprocessing.connection.Connection) -> None:
        self._conn = conn

    def ready(self, info: Any = None) -> None:
        self._conn.send(("ready", info))


def _child_main(ns: str | None, fn: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any], conn: multiprocessing.connection.Connection) -> None:
    # The parent owns Ctrl-C and SIGTERM handling; a child just stops when told.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        if ns:
            netlab.enter_netns(ns)
        result = fn(Ctl(conn), *args, **kwargs)
        conn.send(("result", result))
    except BaseException:  # report everything to the parent, then exit
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        conn.close()


class Child:
    """A process running ``fn(ctl, *args)`` inside a node's namespace."""

    def __init__(self, ns: str | None, name: str, fn: Callable[..., Any], *args: Any,
                 **kwargs: Any) -> None:
        ctx = multiprocessing.get_context("fork")
        self.name = name
        self._conn, child_conn = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_child_main, name=name, daemon=True,
                                args=(ns, fn, args, kwargs, child_conn))
        self.proc.start()
        child_conn.close()
        self._ready: Any = None
        self._result: Any = None
        self._done = False

    def _recv(self, timeout: float) -> tuple[str, Any]:
        if not self._conn.poll(max(0.0, timeout)):
            raise ChildError(f"{self.name}: no answer within {timeout:.1f}s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self.proc.join(1.0)
            raise ChildError(
                f"{self.name}: exited (code {self.proc.exitcode}) without a result"
            ) from None
        if kind == "error":
            self._done = True
            raise ChildError(f"{self.name} failed:\n{value}")
        return kind, value

    def wait_ready(self, timeout: float = 10.0) -> Any:
        kind, value = self._recv(timeout)
        if kind == "result":  # finished before saying ready
            self._result, self._done = value, True
            return None
        self._ready = value
        return value

    def result(self, timeout: float = 30.0) -> Any:
        if not self._done:
            while True:
                kind, value = self._recv(timeout)
                if kind == "result":
                    self._result, self._done = value, True
                    break
        self.proc.join(5.0)
        return self._result

    def stop(self) -> None:
        """Terminates the process if it still runs (SIGTERM, then SIGKILL)."""
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(2.0)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(2.0)
        self._conn.close()


def _write_sysctls(_ctl: Ctl, values: dict[str, str]) -> None:
    """Runs inside a namespace: /proc/sys/net is per network namespace."""
    for path, value in values.items():
        try:
            with open(os.path.join("/proc/sys", path), "w") as f:
                f.write(value)
        except FileNotFoundError:  # e.g. IPv6 disabled in the kernel
            pass


NO_IPV6 = {"net/ipv6/conf/all/disable_ipv6": "1", "net/ipv6/conf/default/disable_ipv6": "1"}


class NetnsLab:
    """What every namespace testbed of the demo shares: creating and removing
    its namespaces, the processes it starts in them, turning SIGTERM/SIGHUP
    into KeyboardInterrupt while it is up, and shaping its uplink.

    Subclasses call :meth:`_init_lab`, give ``namespaces`` and ``uplink``, and
    build links in ``create()`` after :meth:`_create_namespaces`.  Use as a
    context manager: everything is removed when the block ends."""

    def _init_lab(self) -> None:
        self._owner = os.getpid()
        self._created: list[str] = []
        self._children: list[Child] = []
        self._old_handlers: dict[int, Any] = {}
        self._closed = False

    @property
    def namespaces(self) -> list[str]:
        raise NotImplementedError

    @property
    def uplink(self) -> tuple[str, str]:
        """(namespace, device) of the shaped uplink."""
        raise NotImplementedError

    def create(self) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------- lifecycle
    def __enter__(self) -> Self:
        self._install_signal_handlers()
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _install_signal_handlers(self) -> None:
        owner = self._owner

        def on_term(signum: int, _frame: FrameType | None) -> None:
            if os.getpid() != owner:
                # A forked helper (pyroute2 forks to open sockets in a netns)
                # inherited this handler: die as if it were not there.
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            raise KeyboardInterrupt(f"signal {signum}")

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, on_term)
            except ValueError:  # not the main thread: the caller handles signals
                break

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):
                pass
        self._old_handlers.clear()

    def _create_namespaces(self, sysctls: dict[str, dict[str, str]]) -> None:
        """Creates ``namespaces`` (refusing ones that exist) and writes each
        namespace's sysctls (``sysctls[ns]``, default: IPv6 off, which keeps
        router and neighbour solicitations out of the counters)."""
        existing = set(netlab.list_netns())
        for ns in self.namespaces:
            if ns in existing:
                raise DataplaneError(17, f"netns {ns} already exists (a testbed of this "
                                         "process is still up?)")
        for ns in self.namespaces:
            netlab.create_netns(ns)
            self._created.append(ns)
        for ns in self.namespaces:
            self.run(ns, "sysctl", _write_sysctls, sysctls.get(ns, NO_IPV6), timeout=10.0)

    def close(self) -> None:
        """Stops our processes and removes our namespaces (idempotent)."""
        if self._closed or os.getpid() != self._owner:
            return  # already done, or a forked copy of us: the creator cleans up
        self._closed = True
        try:
            for child in self._children:
                child.stop()
            self._children.clear()
            for ns in reversed(self._created):
                netlab.remove_netns(ns)
            self._created.clear()
        finally:
            self._restore_signal_handlers()

    # ---------------------------------------------------------- processes
    def spawn(self, ns: str, name: str, fn: Callable[..., Any], *args: Any,
              **kwargs: Any) -> Child:
        """Starts ``fn(ctl, *args, **kwargs)`` in a new process inside ``ns``."""
        child = Child(ns, name, fn, *args, **kwargs)
        self._children.append(child)
        return child

    def reap(self, child: Child) -> None:
        child.stop()
        if child in self._children:
            self._children.remove(child)

    def run(self, ns: str, name: str, fn: Callable[..., Any], *args: Any,
            timeout: float = 30.0, **kwargs: Any) -> Any:
        """``spawn`` and wait for the result."""
        child = self.spawn(ns, name, fn, *args, **kwargs)
        try:
            return child.result(timeout)
        finally:
            self.reap(child)

    # ------------------------------------------------------------ shaping
    def shape_uplink_fifo(self, rate_bps: int, limit: int) -> None:
        """'Mesh off': the uplink shaped to ``rate_bps``, one class, one FIFO."""
        ns, dev = self.uplink
        with Lab(ns) as nl:
            nl.apply_fifo(dev, rate_bps, limit)

    def unshape(self) -> None:
        """Removes the uplink's root qdisc (the FIFO baseline)."""
        ns, dev = self.uplink
        with Lab(ns) as nl:
            nl.remove_root_qdisc(dev)

    def htb_classes(self) -> dict[int, HtbClassStats]:
        ns, dev = self.uplink
        return Dataplane(dev, ns).htb_classes()


@dataclass
class Testbed(NetnsLab):
    """Nodes in network namespaces; use as a context manager.

    ``rate_bps`` is the uplink rate the demo shapes ``tx``'s uplink to (the
    testbed itself leaves the device unshaped: see :meth:`shape_fifo` and
    :meth:`mmmesh.dataplane.Dataplane.up`).
    """

    rate_bps: int = 300_000_000
    nodes: int = 2
    prefix: str = field(default_factory=lambda: f"mmd{os.getpid()}-")
    tx: Node = field(init=False)
    rx: Node = field(init=False)
    pod: Node | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._init_lab()
        if self.nodes not in (2, 3):
            raise ValueError(f"nodes must be 2 or 3, got {self.nodes}")
        self.tx = Node("tx", f"{self.prefix}tx", f"{UPLINK_NET}.1")
        self.rx = Node("rx", f"{self.prefix}rx", f"{UPLINK_NET}.2")
        if self.nodes == 3:
            self.pod = Node("pod", f"{self.prefix}pod", f"{POD_NET}.2")

    # ----------------------------------------------------------- topology
    @property
    def sender(self) -> Node:
        """Where the model stages' senders run (the pod node if there is one)."""
        return self.pod or self.tx

    @property
    def receiver(self) -> Node:
        return self.rx

    @property
    def uplink(self) -> tuple[str, str]:
        return self.tx.ns, UPLINK

    @property
    def namespaces(self) -> list[str]:
        return [n.ns for n in (self.tx, self.rx, self.pod) if n is not None]

    def create(self) -> None:
        # tx forwards for the pod node
        sysctls = {}
        if self.pod is not None:
            sysctls[self.tx.ns] = {**NO_IPV6, "net/ipv4/ip_forward": "1"}
        self._create_namespaces(sysctls)

        with Lab(self.tx.ns) as nl:
            nl.add_veth(UPLINK, RX_IF, self.rx.ns)
            nl.loopback_up()
            nl.configure(UPLINK, f"{self.tx.addr}/24")
            if self.pod is not None:
                nl.add_veth(POD_GW_IF, POD_IF, self.pod.ns)
                nl.configure(POD_GW_IF, f"{POD_NET}.1/24")
        with Lab(self.rx.ns) as nl:
            nl.loopback_up()
            nl.configure(RX_IF, f"{self.rx.addr}/24")
            if self.pod is not None:
                nl.add_route(f"{POD_NET}.0/24", self.tx.addr)
        if self.pod is not None:
            with Lab(self.pod.ns) as nl:
                nl.loopback_up()
                nl.configure(POD_IF, f"{self.pod.addr}/24")
                nl.add_route(f"{UPLINK_NET}.0/24", f"{POD_NET}.1")

    def shape_fifo(self, limit: int = 1000) -> None:
        """'Mesh off': the uplink shaped to the same rate, one class, one FIFO."""
        self.shape_uplink_fifo(self.rate_bps, limit)


__all__ = ["Child", "ChildError", "Ctl", "NetnsLab", "Node", "Testbed", "UPLINK"]
