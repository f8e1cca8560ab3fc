"""A mesh of real qosd processes, one per network namespace, on one bridge.

    with Mesh(5, tmp_path) as mesh:          # namespaces, bridge, certificates, qosd x 5
        mesh.wait_converged()                # every node sees every other alive
        mesh.nodes[3].kill()                 # SIGKILL; pause() / resume(): SIGSTOP / SIGCONT
        mesh.partition([0, 1], [2, 3, 4]); mesh.heal()
        mesh.set_loss(0.01)                  # each frame to a node dropped with p = 1 %

Layout (``prefix`` is unique per mesh, so runs do not collide): namespace
``<prefix>b`` holds bridge ``br0`` (and ``br1`` for partitions); node i lives
in namespace ``<prefix>n<i>`` with ``eth0`` = ``10.79.<k>.<i+1>/24``, whose peer
``p<i>`` is a port of the bridge.  A partition moves the ports of the second
group onto ``br1``; healing moves them back.  Loss is a six-instruction TC
program (``bpf_get_prandom_u32() % 10000 < p``: TC_ACT_SHOT) on the egress of
every bridge port, so each frame towards a node has one chance to be dropped
(netem is absent here).  Every node also resolves the name ``mesh-seeds`` to
the first three nodes (``/etc/netns/<ns>/hosts``, bind-mounted by ``ip netns
exec``): the seed list is that DNS name.

The qosd processes run with ``ip netns exec`` (which execs, so the pid is
qosd's) and short protocol timers (:data:`PROTOCOL`); each answers its admin
API on a unix socket in the test's directory.  Everything is removed on
exit, also when set-up or the test fails: processes killed, namespaces and
``/etc/netns`` entries deleted.

``Mesh(n, root, backend="etcd")`` runs the same nodes on the etcd back end
instead of gossip: a 3-member etcd (testkit/etcd_cluster.py) lives in the
bridge's namespace, listening on ``br0``'s address ``<subnet>.254`` (one port
per member, 23790-23792), with TLS and client certificates from the mesh's
CA; every node resolves ``etcd`` to that address and has a ``cluster:``
section (lease TTL :data:`ETCD_LEASE_TTL_S`) instead of ``peers:``.
``mesh.etcd`` is the cluster (kill its leader, stop it, compact it).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Self

import yaml

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

# Short timers for tests (docs/cluster.md "Failure model" states the bounds):
# 5 members: suspicion min 5 x 1 x 0.5 = 2.5 s, max 4 x that = 10 s, k = 3.
PROTOCOL: dict[str, float] = {
    "probe_interval_s": 0.5, "probe_timeout_s": 0.25, "indirect_nack_s": 0.2,
    "gossip_interval_s": 0.1, "suspicion_mult": 5, "suspicion_max_timeout_mult": 4,
    "push_pull_interval_s": 5, "reconnect_interval_s": 2, "join_retry_s": 0.5,
    "gossip_to_the_dead_s": 10, "dead_node_reclaim_s": 5,
}
PORT = 7946
SEEDS_NAME = "mesh-seeds"
ETCD_NAME = "etcd"
ETCD_LEASE_TTL_S = 3
_counter = itertools.count()


def _ns_exec(ns: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


class MeshNode:
    """One qosd in its namespace."""

    def __init__(self, mesh: Mesh, index: int, name: str, certs: Path) -> None:
        self.mesh, self.index, self.name = mesh, index, name
        self.ns = f"{mesh.prefix}n{index}"
        self.ip = f"{mesh.subnet}.{index + 1}"
        self.addr = f"{self.ip}:{PORT}"
        self.dir = mesh.root / name
        self.sock = self.dir / "qosd.sock"
        self.cfg = self.dir / "qosd.yaml"
        self.certs = certs
        self.proc: subprocess.Popen[bytes] | None = None

    def write_config(self, **peers: Any) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.mesh.backend == "etcd":
            self._write({"cluster": {"backend": "etcd", "etcd": {
                "endpoints": [f"{ETCD_NAME}:{p}" for p in self.mesh.etcd_ports],
                "cert_file": str(self.certs / f"{self.name}.pem"),
                "key_file": str(self.certs / f"{self.name}.key"),
                "ca_file": str(self.certs / "ca.pem"), "lease_ttl_s": ETCD_LEASE_TTL_S,
                "advertise": self.addr, **peers}}})
            return
        section = {
            "listen": self.addr, "seeds": [f"{SEEDS_NAME}:{PORT}"],
            "cert_file": str(self.certs / f"{self.name}.pem"),
            "key_file": str(self.certs / f"{self.name}.key"),
            "ca_file": str(self.certs / "ca.pem"), "rejoin_interval_s": 1.0,
            "protocol": self.mesh.protocol, **peers,
        }
        self._write({"peers": section})

    def _write(self, store: dict[str, Any]) -> None:
        self.cfg.write_text(yaml.safe_dump({
            "node_name": self.name, "state_dir": str(self.dir / "state"),
            "api_socket": str(self.sock), "sla_socket": None,
            "metrics_addr": f"{self.ip}:9464", "resync_interval_s": 60.0, **store,
        }))

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.sock.unlink()
        log = open(self.dir / "qosd.log", "ab")  # noqa: SIM115 (the child keeps it)
        self.proc = subprocess.Popen(
            _ns_exec(self.ns, str(VENV_BIN / "qosd"), "--config", str(self.cfg)),
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        log.close()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited: {self.log()}")
            if self.sock.exists():
                with contextlib.suppress(Exception):
                    self.get("/v1/cluster/members")
                    return
            time.sleep(0.1)
        raise AssertionError(f"{self.name} did not come up: {self.log()}")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.running:
            self.signal(signal.SIGKILL)
            assert self.proc is not None
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (a graceful leave), then SIGKILL after ``timeout``."""
        if not self.running:
            return None
        assert self.proc is not None
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def log(self) -> str:
        p = self.dir / "qosd.log"
        return p.read_text(errors="replace")[-4000:] if p.exists() else ""

    def get(self, path: str, timeout: float = 5.0) -> Any:
        import httpx

        with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.sock)),
                          base_url="http://qosd", timeout=timeout) as c:
            r = c.get(path)
        r.raise_for_status()
        return r.json()

    def members(self) -> dict[str, str]:
        """This node's view: member -> state ("alive", "suspect", ...)."""
        return {m["node"]: m["state"] for m in self.get("/v1/cluster/members")["members"]}


class Mesh:
    """``n`` qosd nodes in namespaces on a bridge; see the module docstring."""

    def __init__(self, n: int, root: Path, *, protocol: dict[str, float] | None = None,
                 start: bool = True, backend: str = "gossip") -> None:
        self.prefix = f"mm{os.getpid() % 100000}x{next(_counter)}"
        self.subnet = f"10.79.{(os.getpid() + next(_counter)) % 250}"
        self.root = root
        self.protocol = dict(PROTOCOL if protocol is None else protocol)
        self.bridge_ns = f"{self.prefix}b"
        self.names = [f"node-{i}" for i in range(n)]
        self.certs = root / "certs"
        self.nodes: list[MeshNode] = []
        self._namespaces: list[str] = []
        self._loss_fd: int | None = None
        self._start = start
        self.backend = backend
        self.etcd: Any = None  # testkit.etcd_cluster.EtcdCluster (backend "etcd")
        self.etcd_ports = [23790, 23791, 23792]

    # -- set-up and clean-up ----------------------------------------------------------
    def __enter__(self) -> Self:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        from demo import netlab
        from mmmeshctl.certs import issue_certs

        issue_certs(self.certs, self.names + ([ETCD_NAME] if self.backend == "etcd" else []))
        netlab.create_netns(self.bridge_ns)
        self._namespaces.append(self.bridge_ns)
        with netlab.Lab(self.bridge_ns) as lab:
            lab.loopback_up()
            for br in ("br0", "br1"):
                lab.ipr.link("add", ifname=br, kind="bridge")
                lab.configure(br, f"{self.subnet}.254/24" if br == "br0" else None)
        if self.backend == "etcd":
            from testkit.etcd_cluster import EtcdCluster

            self.etcd = EtcdCluster(self.root / "etcd", host=f"{self.subnet}.254",
                                    netns=self.bridge_ns, certs=self.certs,
                                    ports=self.etcd_ports + [23800, 23801, 23802])
            self.etcd.start_all()
        for i, name in enumerate(self.names):
            self.add_node(name, self.certs, start=False, index=i)
        if self._start:
            for node in self.nodes:
                node.start()
            for node in self.nodes:
                node.wait_ready()

    def add_node(self, name: str, certs: Path, *, start: bool = True, index: int | None = None,
                 **peers: Any) -> MeshNode:
        """A namespace on the bridge and a qosd in it (``certs``: its CA and files)."""
        from demo import netlab

        node = MeshNode(self, len(self.nodes) if index is None else index, name, certs)
        netlab.create_netns(node.ns)
        self._namespaces.append(node.ns)
        hosts = Path("/etc/netns") / node.ns / "hosts"
        hosts.parent.mkdir(parents=True, exist_ok=True)
        hosts.write_text("127.0.0.1 localhost\n" + "".join(
            f"{self.subnet}.{i + 1} {SEEDS_NAME}\n" for i in range(3))
            + f"{self.subnet}.254 {ETCD_NAME}\n")
        with netlab.Lab(self.bridge_ns) as lab:
            lab.add_veth(f"p{node.index}", "eth0", node.ns)
            lab.ipr.link("set", index=lab.ifindex(f"p{node.index}"),
                         master=lab.ifindex("br0"), state="up")
        with netlab.Lab(node.ns) as lab:
            lab.loopback_up()
            lab.configure("eth0", f"{node.ip}/24")
        node.write_config(**peers)
        self.nodes.append(node)
        if start:
            node.start()
            node.wait_ready()
        return node

    def close(self) -> None:
        from demo import netlab

        for node in self.nodes:
            with contextlib.suppress(Exception):
                if node.running:
                    node.signal(signal.SIGCONT)
                node.kill()
        if self.etcd is not None:
            self.etcd.close()
        for ns in reversed(self._namespaces):
            netlab.remove_netns(ns)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self._namespaces.clear()
        if self._loss_fd is not None:
            os.close(self._loss_fd)
            self._loss_fd = None

    # -- the network ------------------------------------------------------------------
    def partition(self, *groups: Iterable[int]) -> None:
        """Cuts the mesh: the ports of the second and later groups go onto br1
        (nodes in no group stay on br0 with the first)."""
        from demo import netlab

        with netlab.Lab(self.bridge_ns) as lab:
            br1 = lab.ifindex("br1")
            for group in list(groups)[1:]:
                for i in group:
                    lab.ipr.link("set", index=lab.ifindex(f"p{i}"), master=br1)

    def heal(self) -> None:
        from demo import netlab

        with netlab.Lab(self.bridge_ns) as lab:
            br0 = lab.ifindex("br0")
            for node in self.nodes:
                lab.ipr.link("set", index=lab.ifindex(f"p{node.index}"), master=br0)

    def set_loss(self, fraction: float) -> None:
        """Drops each frame towards any node with probability ``fraction``
        (0 removes the program)."""
        from demo import netlab

        fd = _loss_program(round(fraction * 10000)) if fraction > 0 else None
        with netlab.Lab(self.bridge_ns) as lab:
            for node in self.nodes:
                idx = lab.ifindex(f"p{node.index}")
                with contextlib.suppress(Exception):
                    lab.ipr.tc("del", "clsact", idx)
                if fd is not None:
                    lab.ipr.tc("add", "clsact", idx)
                    lab.ipr.tc("add-filter", "bpf", idx, ":1", fd=fd, name="mmloss",
                               parent=0xFFFFFFF3, classid=1, direct_action=True)
        if self._loss_fd is not None:
            os.close(self._loss_fd)
        self._loss_fd = fd

    # -- observation -------------------------------------------------------------------
    def running(self) -> list[MeshNode]:
        return [n for n in self.nodes if n.running]

    def views(self, nodes: Iterable[MeshNode] | None = None) -> dict[str, dict[str, str]]:
        return {n.name: n.members() for n in (self.running() if nodes is None else nodes)}

    def wait(self, cond: Callable[[], bool], timeout: float, what: str,
             every: float = 0.1) -> float:
        """Polls ``cond`` until it holds; returns the seconds it took (fails after
        ``timeout`` with the views and the nodes' logs)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            with contextlib.suppress(Exception):
                if cond():
                    return time.monotonic() - t0
            time.sleep(every)
        raise AssertionError(f"{what}: not within {timeout} s; views {self._safe_views()}\n"
                             + "\n".join(f"--- {n.name}\n{n.log()[-1500:]}" for n in self.nodes))

    def _safe_views(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for n in self.running():
            try:
                out[n.name] = n.members()
            except Exception as e:  # noqa: BLE001 (a diagnostic: show whatever went wrong)
                out[n.name] = repr(e)
        return out

    def converged(self, names: Iterable[str] | None = None) -> bool:
        """Every running node in ``names`` sees exactly those nodes alive."""
        want = set(names) if names is not None else set(self.names)
        nodes = [n for n in self.running() if n.name in want]
        for view in self.views(nodes).values():
            if {m for m, s in view.items() if s == "alive"} != want:
                return False
        return bool(nodes)

    def wait_converged(self, timeout: float = 30.0, names: Iterable[str] | None = None) -> float:
        return self.wait(lambda: self.converged(names), timeout, "full membership")


def _loss_program(per_10k: int) -> int:
    """A SCHED_CLS program: TC_ACT_SHOT when prandom % 10000 < per_10k (fd)."""
    insns = [
        (0x85, 0, 0, 0, 7),          # call bpf_get_prandom_u32
        (0x94, 0, 0, 0, 10000),      # w0 %= 10000
        (0xA5, 0, 0, 2, per_10k),    # if r0 < per_10k goto +2
        (0xB7, 0, 0, 0, 0),          # r0 = TC_ACT_OK
        (0x95, 0, 0, 0, 0),          # exit
        (0xB7, 0, 0, 0, 2),          # r0 = TC_ACT_SHOT
        (0x95, 0, 0, 0, 0),          # exit
    ]
    raw = b"".join(code.to_bytes(1, "little") + ((src << 4) | dst).to_bytes(1, "little")
                   + off.to_bytes(2, "little", signed=True)
                   + imm.to_bytes(4, "little", signed=True)
                   for code, dst, src, off, imm in insns)
    lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
    lib.bpf_prog_load.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p,
                                  ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = lib.bpf_prog_load(3, b"mmloss", b"GPL", raw, len(insns), None)  # BPF_PROG_TYPE_SCHED_CLS
    if fd < 0:
        raise OSError(-fd, f"loading the loss program: {os.strerror(-fd)}")
    return int(fd)
