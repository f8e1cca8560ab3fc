"""The pipeline demo's three nodes joined as a mesh (``mmmesh-demo --pipeline``;
``--no-mesh`` runs it without).

One real qosd per node namespace, started like a node's service would be
(``ip netns exec <ns> qosd --config <dir>/<node>/qosd.yaml``), the three
members of one mesh over gRPC with mutual TLS (docs/cluster.md)::

    sensors 10.202.1.1:7946 ── edge 10.202.1.2:7946 ── core 10.202.2.2:7946
    (the sensors and the core reach each other through the edge: the
     topology's routes, with forwarding on the edge)

* certificates for the three node ids come from ``mmmeshctl cluster certs``'s
  code (:func:`mmmeshctl.certs.issue_certs`) in the run's temporary
  directory; each node's seeds are the other two;
* each node's sidecars, and the sensors, report their SLA windows to their
  own node's qosd (``sla_socket``; the demo's children run as root, which
  may report any stage);
* the mesh-on phase applies the policy through the sensors node's qosd
  (``PUT /v1/policy``: store, reconcile, kernel);
* at the end :meth:`PipelineMesh.wait_global_view` reads ``GET
  /v1/cluster/sla`` (what ``mmmeshctl cluster sla`` shows) from one node
  once it holds every node's windows.

Timers are the LAN defaults but the push-pull, every 2 s instead of 30 s:
sketches (the global p99) travel by push-pull, and the demo is short.

The qosd processes run in their own session (Ctrl-C on the terminal reaches
the demo, which stops them in order); leaving the ``with`` block (normally,
on a failure, Ctrl-C, or SIGTERM, which the topology turns into
KeyboardInterrupt) stops them with SIGTERM (a graceful leave), then SIGKILL.  They run under ``ip netns exec``, so the
BPF pins of the dataplane the sensors' qosd loads live in a bpffs of its own,
gone with it; the qdiscs go with the namespaces.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import yaml

from mmmesh.errors import MeshError

QOSD_PORT = 7946
MAX_UNIX_PATH = 107  # sun_path holds 108 bytes with the NUL
PROTOCOL: dict[str, float] = {"push_pull_interval_s": 2.0}


class MeshDemoError(MeshError, RuntimeError):
    """A qosd of the demo did not start, join, or answer."""


@dataclass
class QosdNode:
    """One node's qosd: its node id, namespace, address and files."""

    name: str
    ns: str
    addr: str
    dir: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def sock(self) -> Path:
        """The admin API (what ``mmmeshctl --socket`` takes)."""
        return self.dir / "qosd.sock"

    @property
    def sla_sock(self) -> Path:
        """The report-only socket this node's sidecars post their windows to."""
        return self.dir / "sla.sock"

    @property
    def config(self) -> Path:
        return self.dir / "qosd.yaml"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self, tail: int = 3000) -> str:
        p = self.dir / "qosd.log"
        return p.read_text(errors="replace")[-tail:] if p.exists() else ""


def _qosd_argv() -> list[str]:
    script = Path(sys.executable).parent / "qosd"
    return [str(script)] if script.exists() else [sys.executable, "-m", "qosd.daemon"]


class PipelineMesh:
    """qosd on every node of the demo's topology; a context manager."""

    def __init__(self, nodes: list[tuple[str, str, str]], root: Path,
                 protocol: dict[str, float] | None = None,
                 config: dict[str, Any] | None = None) -> None:
        """``nodes``: (node id, namespace, address) each; ``root``: a directory
        of the run (certificates, configs, sockets, state, logs); ``config``:
        more qosd.yaml fields for every node (e.g. the SLA controller's)."""
        self.root = root
        self.protocol = dict(PROTOCOL if protocol is None else protocol)
        self.config = dict(config or {})
        self.nodes = {name: QosdNode(name, ns, addr, root / name) for name, ns, addr in nodes}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def node(self, name: str) -> QosdNode:
        return self.nodes[name]

    def sla_sockets(self) -> dict[str, str]:
        """Namespace -> the SLA socket of the qosd in it."""
        return {n.ns: str(n.sla_sock) for n in self.nodes.values()}

    # -- start and stop ---------------------------------------------------------
    def write_configs(self) -> None:
        """Certificates for every node id and each node's qosd.yaml."""
        from mmmeshctl.certs import issue_certs

        for n in self.nodes.values():
            if len(os.fsencode(n.sla_sock)) > MAX_UNIX_PATH:
                raise MeshDemoError(f"{n.sla_sock}: too long for a unix socket; use a shorter "
                                    "TMPDIR")
        certs = self.root / "certs"
        issue_certs(certs, list(self.nodes))
        for n in self.nodes.values():
            n.dir.mkdir(parents=True, exist_ok=True)
            seeds = [f"{o.addr}:{QOSD_PORT}" for o in self.nodes.values() if o is not n]
            n.config.write_text(yaml.safe_dump({
                "node_name": n.name, "state_dir": str(n.dir / "state"),
                "api_socket": str(n.sock), "sla_socket": str(n.sla_sock),
                "metrics_addr": None, "log_level": "INFO",
                "peers": {"listen": f"{n.addr}:{QOSD_PORT}", "seeds": seeds,
                          "cert_file": str(certs / f"{n.name}.pem"),
                          "key_file": str(certs / f"{n.name}.key"),
                          "ca_file": str(certs / "ca.pem"),
                          "rejoin_interval_s": 1.0, "leave_timeout_s": 1.0,
                          "protocol": self.protocol},
                **self.config,
            }))

    def start(self) -> None:
        """Configurations written and every qosd started (not waited for)."""
        self.write_configs()
        env = dict(os.environ)
        for n in self.nodes.values():
            with open(n.dir / "qosd.log", "ab") as log:
                n.proc = subprocess.Popen(
                    ["ip", "netns", "exec", n.ns, *_qosd_argv(), "--config", str(n.config)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    cwd=self.root, start_new_session=True)

    def close(self, timeout: float = 5.0) -> None:
        """SIGTERM to every qosd (each leaves the mesh), SIGKILL after ``timeout``."""
        running = [n for n in self.nodes.values() if n.running]
        for n in running:
            assert n.proc is not None
            with contextlib.suppress(ProcessLookupError):
                n.proc.terminate()
        deadline = time.monotonic() + timeout
        for n in running:
            assert n.proc is not None
            try:
                n.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                n.proc.kill()
                n.proc.wait(5)

    # -- talking to a qosd --------------------------------------------------------
    def request(self, node: str, method: str, path: str, timeout: float = 10.0,
                **kw: Any) -> Any:
        import httpx

        n = self.nodes[node]
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(n.sock)),
                              base_url="http://qosd", timeout=timeout) as c:
                r = c.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise MeshDemoError(f"qosd on {node}: {method} {path}: {e}") from e
        if r.status_code >= 300:
            raise MeshDemoError(f"qosd on {node}: {method} {path}: HTTP {r.status_code} "
                                f"{r.text[:500]}")
        return r.json()

    def _wait(self, what: str, ok: Callable[[], bool], timeout: float) -> float:
        t0 = time.monotonic()
        while True:
            for n in self.nodes.values():
                if not n.running:
                    raise MeshDemoError(f"qosd on {n.name} exited: {n.log()}")
            with contextlib.suppress(MeshDemoError, OSError):
                if ok():
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                logs = "\n".join(f"--- {n.name}\n{n.log(1500)}" for n in self.nodes.values())
                raise MeshDemoError(f"{what}: not within {timeout:g} s\n{logs}")
            time.sleep(0.1)

    def wait_joined(self, timeout: float = 60.0) -> float:
        """Until every qosd answers and sees every node alive; the seconds it took."""
        names = set(self.nodes)

        def joined() -> bool:
            for n in self.nodes.values():
                if not n.sock.exists():
                    return False
                view = self.request(n.name, "GET", "/v1/cluster/members", timeout=2.0)
                if {m["node"] for m in view["members"] if m["state"] == "alive"} != names:
                    return False
            return True

        return self._wait("the mesh to form", joined, timeout)

    def apply_policy(self, node: str, policy_yaml: str) -> dict[str, Any]:
        """``PUT /v1/policy`` on ``node``'s qosd: the version and its reconcile."""
        return self.request(node, "PUT", "/v1/policy", timeout=120.0,  # type: ignore[no-any-return]
                            json={"yaml": policy_yaml, "author": "mmmesh-demo"})

    def uplink_status(self, node: str, device: str) -> dict[str, Any]:
        """The dataplane on ``device`` as ``node``'s qosd reads it (``/v1/status``)."""
        return self.request(node, "GET", "/v1/status")["uplinks"].get(device, {})  # type: ignore[no-any-return]

    # -- the global view ------------------------------------------------------------
    def local_windows(self) -> dict[tuple[str, str, str, str], int]:
        """Every node's own board: (node, stage, class, modality) -> frames (> 0)."""
        out = {}
        for n in self.nodes.values():
            for row in self.request(n.name, "GET", "/v1/sla")["stages"]:
                if row.get("frames") and not row.get("stale"):
                    out[(n.name, row["stage"], row["sla_class"], row["modality"])] = \
                        int(row["frames"])
        return out

    def global_view(self, node: str) -> dict[str, Any]:
        """``GET /v1/cluster/sla`` with the per-node breakdown."""
        return self.request(node, "GET", "/v1/cluster/sla",  # type: ignore[no-any-return]
                            params={"nodes": "true"})

    def wait_global_view(self, node: str, timeout: float = 60.0) -> tuple[dict[str, Any], bool]:
        """``node``'s global view once it holds what every node's board holds
        (each stage window with the same frames) with every node's sketches
        (no row partial) and counts every one of those nodes as reporting;
        after ``timeout``, the view as it is.  Returns the
        view and whether it was complete."""
        want = self.local_windows()
        last: dict[str, Any] = {}

        def complete() -> bool:
            nonlocal last
            last = self.global_view(node)
            got = {(b["node"], r["stage"], r["sla_class"], r["modality"]): b["frames"]
                   for r in last["stages"] for b in r.get("breakdown") or []}
            rows = last["stages"] + last["classes"]
            # the census (who reports) is a record of its own, aggregated beside the
            # classes' (docs/cluster.md "Global SLA view"): it may come a round later
            reporting = len({k[0] for k in want})
            return all(got.get(k) == v for k, v in want.items()) and \
                not any(r.get("partial") for r in rows) and \
                int(last.get("nodes_reporting") or 0) >= reporting

        try:
            self._wait("the global SLA view", complete, timeout)
        except MeshDemoError:
            if not last:
                raise
            return last, False
        return last, True


def start_mesh(nodes: list[tuple[str, str, str]], root: Path,
               progress: Callable[[str], None], protocol: dict[str, float] | None = None,
               config: dict[str, Any] | None = None) -> PipelineMesh:
    """A started mesh of ``nodes`` whose members all see each other (stopped
    again if it does not get there); ``protocol``, ``config``: as for
    :class:`PipelineMesh`."""
    mesh = PipelineMesh(nodes, root, protocol, config)
    try:
        mesh.start()
        took = mesh.wait_joined()
    except BaseException:
        mesh.close()
        raise
    progress(f"mesh up: qosd on {', '.join(mesh.nodes)} joined in {took:.1f}s "
             f"(gRPC + mTLS on :{QOSD_PORT}; admin sockets under {root})")
    return mesh


def mesh_results(mesh: PipelineMesh, at: str, progress: Callable[[str], None]
                 ) -> dict[str, Any]:
    """The nodes and the global SLA view from ``at`` once it is complete
    (:meth:`PipelineMesh.wait_global_view`), for the results."""
    t = time.monotonic()
    view, complete = mesh.wait_global_view(at)
    took = time.monotonic() - t
    nodes = {n.name: {"ns": n.ns, "addr": f"{n.addr}:{QOSD_PORT}"} for n in mesh.nodes.values()}
    reporting = sorted({b["node"] for r in view.get("stages") or []
                        for b in r.get("breakdown") or []})
    progress(f"global SLA view from {at}: {len(view.get('stages') or [])} stage windows of "
             f"{', '.join(reporting) or 'no node'} in {took:.1f}s"
             + ("" if complete else " (incomplete: not every window or sketch arrived)"))
    return {"nodes": nodes, "view_from": at, "view_complete": complete,
            "view_wait_s": round(took, 2), "cluster_sla": view}


def render_view(view: dict[str, Any], width: int = 110) -> str:
    """The view as ``mmmeshctl cluster sla`` prints it (per class), then per
    stage and node (what ``-o json`` has under ``stages``)."""
    import io

    from rich.console import Console

    from mmmeshctl.cluster_sla import cluster_sla_view
    from mmmeshctl.render import plain_table

    t = plain_table("per stage and node")
    for col in ("STAGE", "CLASS", "MODALITY", "NODE", "FRAMES", "ATTAINMENT", "P99"):
        t.add_column(col, justify="right" if col in ("FRAMES", "ATTAINMENT", "P99") else "left")
    for r in view.get("stages") or []:
        for b in r.get("breakdown") or []:
            p99 = b.get("p99_ms")
            t.add_row(r["stage"], r["sla_class"], r["modality"], b["node"], str(b["frames"]),
                      f"{100 * float(b.get('attainment') or 0):.2f}%",
                      "-" if p99 is None else f"{p99:.1f} ms")
    buf = io.StringIO()
    console = Console(file=buf, width=width, highlight=False, soft_wrap=False,
                      color_system=None, force_terminal=False)
    console.print(cluster_sla_view(view, nodes=False))
    console.print()
    console.print(t)
    return "\n".join(line.rstrip() for line in buf.getvalue().rstrip().splitlines())


__all__ = ["PROTOCOL", "QOSD_PORT", "MeshDemoError", "PipelineMesh", "QosdNode", "mesh_results",
           "render_view", "start_mesh"]
