"""qosd/mesh/membership, the host around the membership core: on a fake clock with an
in-memory wire (the host's own logic, deterministic), then in-process over
real gRPC with mutual TLS on loopback (the transport's checks)."""

from __future__ import annotations

import asyncio
import heapq
import random
import socket
from pathlib import Path
from typing import Any

import grpc
import pytest

from mmmeshctl.certs import issue_certs
from qosd.config import PeersConfig
from qosd.mesh.membership._identity import load_credentials
from qosd.mesh.membership._limits import PeerLimiter
from qosd.mesh.membership._rtt import RttRecorder
from qosd.mesh.membership._wire import decode, encode
from qosd.mesh.membership.core import (
    AppMessage,
    AppStateReceived,
    Event,
    Joined,
    MemberChanged,
    State,
)
from qosd.mesh.membership.peers import Peers, PeersCollector, PeersError

FAST = {"probe_interval_s": 0.5, "probe_timeout_s": 0.2, "indirect_nack_s": 0.15,
        "gossip_interval_s": 0.1, "push_pull_interval_s": 5, "join_retry_s": 0.5,
        "suspicion_mult": 4, "suspicion_max_timeout_mult": 4}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    issue_certs(d, ["node-a", "node-b", "node-c", "node-d"])
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(certs: Path, node: str, port: int, seeds: list[str], **kw: Any) -> PeersConfig:
    return PeersConfig(listen=f"127.0.0.1:{port}", seeds=seeds, cert_file=certs / f"{node}.pem",
                       key_file=certs / f"{node}.key", ca_file=certs / "ca.pem",
                       protocol=FAST, rejoin_interval_s=0.5, **kw)


# -- on a fake clock ---------------------------------------------------------------------
class Wire:
    """Delivers what each host's pool is given, 1 ms later, on a virtual clock;
    nothing to or from an address in ``cut``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.hosts: dict[str, Peers] = {}
        self.queue: list[tuple[float, int, str, bytes]] = []
        self.seq = 0
        self.cut: set[str] = set()

    def add(self, peers: Peers) -> None:
        self.hosts[peers.addr] = peers
        wire = self

        class Pool:
            channels = 0

            def send(self, addr: str, node: str, data: bytes, lane: str) -> None:
                assert node in ("", wire.hosts[addr].node_id) if addr in wire.hosts else True
                if peers.addr in wire.cut or addr in wire.cut:
                    return
                wire.seq += 1
                heapq.heappush(wire.queue, (wire.now + 0.001, wire.seq, addr, data))

        peers._pool = Pool()  # type: ignore[assignment]

    def run(self, until: float) -> None:
        while True:
            due = min([h.core.next_deadline() for h in self.hosts.values()]
                      + [self.queue[0][0] if self.queue else until])
            if due >= until:
                self.now = until
                return
            self.now = max(self.now, due)
            if self.queue and self.queue[0][0] <= self.now:
                _, _, addr, data = heapq.heappop(self.queue)
                if addr in self.hosts:
                    self.hosts[addr]._receive(decode(data))  # what the server hands over
                continue
            for h in self.hosts.values():
                if h.core.next_deadline() <= self.now:
                    h._tick()


def fake_mesh(certs: Path, n: int) -> tuple[Wire, list[Peers]]:
    wire = Wire()
    hosts = []
    for i, node in enumerate(["node-a", "node-b", "node-c", "node-d"][:n]):
        cfg = config(certs, node, 7000 + i, ["127.0.0.1:7000"])
        h = Peers(cfg, node, rng=random.Random(i), clock=lambda: wire.now)
        wire.add(h)
        hosts.append(h)
    return wire, hosts


def test_the_host_drives_the_core_and_routes_events(certs: Path) -> None:
    wire, hosts = fake_mesh(certs, 3)
    a, _b, c = hosts
    batches: dict[str, list[Event]] = {"sla": [], "rollout": [], "none": []}
    c.subscribe(batches["sla"].extend, section="sla")
    c.subscribe(batches["rollout"].extend, section="rollout")
    c.subscribe(batches["none"].extend)

    def boom(_: list[Event]) -> None:
        raise RuntimeError("a broken subscriber")

    c.subscribe(boom)  # logged; the others still get everything
    a.set_app_state("sla", b"sketches of a")
    a.section("rollout").set_app_state(b"policy of a")
    for h in hosts:
        h._after(h.core.join(["127.0.0.1:7000"], wire.now))
    wire.run(3.0)
    for h in hosts:
        assert {m.node: m.state for m in h.members()} == {
            "node-a": State.ALIVE, "node-b": State.ALIVE, "node-c": State.ALIVE}
    # the join's push-pull: each subscriber saw its own section of a's state only
    assert AppStateReceived("node-a", b"sketches of a", True) in batches["sla"]
    assert AppStateReceived("node-a", b"policy of a", True) in batches["rollout"]
    assert not any(isinstance(e, AppStateReceived) for e in batches["none"])
    assert any(isinstance(e, Joined) for e in batches["none"])
    assert {e.node for e in batches["none"] if isinstance(e, MemberChanged)} >= {"node-a", "node-b"}
    seq = a.section("sla").broadcast("sla/node-a", b"digest")
    wire.run(4.0)
    assert AppMessage("node-a", "sla/node-a", seq, b"digest") in batches["sla"]
    # probes ran: the host measured round trips from pings and their acks
    assert a.rtt.samples > 0 and a.core.stats.probes > 0
    # a cut member is suspected, then dead; it comes back by refuting
    wire.cut.add(c.addr)
    wire.run(4.0 + a.config.suspicion_max_s(3) + 2)
    assert a.core.member("node-c").state == State.DEAD  # type: ignore[union-attr]
    wire.cut.clear()
    wire.run(wire.now + 40)  # reconnect (30 s) finds it
    assert a.core.member("node-c").state == State.ALIVE  # type: ignore[union-attr]


def test_seeds_resolve_names_to_every_record(certs: Path) -> None:
    asked: list[tuple[str, int]] = []

    async def resolver(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return [f"10.0.0.{i}:{port}" for i in (1, 2, 3)] + ["[fd00::1]:7946"]

    cfg = config(certs, "node-b", 7001, ["seeds.mesh.svc:7946", "10.0.0.2:7946",
                                         "[fd00:0::2]:7946", "127.0.0.1:7001"])
    p = Peers(cfg, "node-b", resolver=resolver)
    got = asyncio.run(p.resolve_seeds())
    assert asked == [("seeds.mesh.svc", 7946)]
    assert got == ["10.0.0.1:7946", "10.0.0.2:7946", "10.0.0.3:7946", "[fd00::1]:7946",
                   "[fd00::2]:7946"]  # literals canonical, duplicates and this node dropped


def test_rate_limiter_on_a_fake_clock() -> None:
    lim = PeerLimiter(10, 5, 1000, 2000, max_peers=2)
    assert all(lim.allow("a", 100, 0.0) for _ in range(5))
    assert not lim.allow("a", 100, 0.0) and lim.refused == 1  # burst of 5 packets spent
    assert lim.allow("b", 100, 0.0)  # by identity: b has its own buckets
    assert lim.allow("a", 100, 0.1)  # 0.1 s x 10/s = one packet back
    assert not lim.allow("a", 1800, 0.3)  # bytes: 2000 - 600 (+100 +200 refilled) < 1800
    assert lim.limited_peers(0.3) == 1 and lim.limited_peers(100.0) == 0
    lim.allow("c", 1, 1.0)  # a third identity evicts the longest idle
    assert len(lim._buckets) == 2


def test_rtt_is_measured_only_from_the_pinged_node() -> None:
    from qosd.mesh.membership.core import Ack, Packet, Ping

    r = RttRecorder()
    r.sent(Packet("a", "x:1", (Ping(7, "b"),)), "b", 1.0)
    r.sent(Packet("a", "x:1", (Ping(8, "c"),)), "c", 1.0)
    r.received(Packet("relay", "y:1", (Ack(8),)), 1.5)  # relayed: not a sample
    r.received(Packet("b", "y:1", (Ack(7),)), 1.003)
    buckets, total, count = r.histogram()
    assert count == 1 and abs(total - 0.003) < 1e-9
    assert dict(buckets)[0.005] == 1 and dict(buckets)[0.0025] == 0


def test_credentials_are_checked_at_start(certs: Path, tmp_path: Path) -> None:
    ca = certs / "ca.pem"
    ok = load_credentials(certs / "node-a.pem", certs / "node-a.key", ca, "mmmesh", "node-a")
    assert ok.node == "node-a"
    issue_certs(tmp_path, ["node-a"], ca_name="another CA")
    cases = {
        "is the certificate of node 'node-a'": (certs / "node-a.pem", certs / "node-a.key", ca,
                                                 "mmmesh", "node-b"),
        "is not the key of": (certs / "node-a.pem", certs / "node-b.key", ca, "mmmesh", "node-a"),
        "was not issued by a CA in": (tmp_path / "node-a.pem", tmp_path / "node-a.key", ca,
                                      "mmmesh", "node-a"),
        "must carry exactly one URI SAN spiffe://other/node/": (
            certs / "node-a.pem", certs / "node-a.key", ca, "other", "node-a"),
        "cannot read": (certs / "missing.pem", certs / "node-a.key", ca, "mmmesh", "node-a"),
    }
    for message, args in cases.items():
        with pytest.raises(PeersError, match=message.replace(".", r"\.")):
            load_credentials(*args)  # type: ignore[arg-type]
    with pytest.raises(PeersError, match="DNS-1123"):
        Peers(config(certs, "node-a", 1, []), "Node_A")


# -- over real gRPC --------------------------------------------------------------------
async def until(cond: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.05)


def all_alive(hosts: list[Peers]) -> bool:
    return all(sum(m.state == State.ALIVE for m in h.members()) == len(hosts) for h in hosts)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_grpc_join_fetch_leave_and_metrics(certs: Path) -> None:
    async def main() -> None:
        ports = [free_port() for _ in range(3)]
        hosts = [Peers(config(certs, n, port, [f"127.0.0.1:{ports[0]}"]), n)
                 for n, port in zip(["node-a", "node-b", "node-c"], ports, strict=True)]
        for h in hosts:
            await h.start()
        try:
            await until(lambda: all_alive(hosts))
            a, b, c = hosts
            a.serve_fetch("rollout", lambda peer, key: f"{key} for {peer}".encode()
                          if key == "v1" else None)
            assert await b.fetch("node-a", "rollout", "v1") == b"v1 for node-b"
            assert await b.fetch("node-a", "rollout", "v2") is None
            assert await b.fetch("node-a", "nobody", "v1") is None
            assert await b.fetch("node-x", "rollout", "v1") is None
            # the collector reads a consistent snapshot from another thread
            from prometheus_client import CollectorRegistry, generate_latest

            reg = CollectorRegistry()
            reg.register(PeersCollector(a))
            text = (await asyncio.to_thread(generate_latest, reg)).decode()
            for line in ('mmmesh_cluster_members{state="alive"} 3.0',
                         'mmmesh_cluster_dropped_packets_total{reason="impersonation"} 0.0',
                         "mmmesh_cluster_probe_rtt_seconds_bucket", "mmmesh_cluster_probes_total",
                         "mmmesh_cluster_cert_expiry_timestamp_seconds",
                         'mmmesh_cluster_bytes_total{direction="in"}'):
                assert line in text, line
            await c.stop()  # a graceful leave
            await until(lambda: a.core.member("node-c").state == State.LEFT)  # type: ignore[union-attr]
            assert b.core.member("node-c").state in (State.LEFT, State.ALIVE)  # type: ignore[union-attr]
        finally:
            for h in hosts:
                await h.stop(leave=False)

    run(main())


def test_grpc_refusals_are_counted(certs: Path) -> None:
    """Wrong sender, garbage, a gossip packet over the limit and a flood over
    the rate limit are refused with their status and counted by reason."""
    async def main() -> None:
        port = free_port()
        a = Peers(config(certs, "node-a", port, [], rate_burst_packets=20, rate_packets_per_s=1,
                         max_gossip_bytes=4096), "node-a")
        await a.start()
        r = lambda p: (certs / p).read_bytes()
        creds = grpc.ssl_channel_credentials(r("ca.pem"), r("node-d.key"), r("node-d.pem"))
        try:
            async with grpc.aio.secure_channel(
                    f"127.0.0.1:{port}", creds,
                    options=[("grpc.ssl_target_name_override", "node-a")]) as ch:
                call = ch.unary_unary("/mmmesh.peer.v1.Peer/Gossip")
                from qosd.mesh.membership.core import Alive, Packet

                async def code(data: bytes) -> str:
                    try:
                        await call(data, timeout=5)
                    except grpc.aio.AioRpcError as e:
                        return f"{e.code().name} {e.details()}"
                    return "OK"

                mine = encode(Packet("node-d", "127.0.0.1:1", (Alive("node-d", "127.0.0.1:1", 0),)))
                assert await code(mine) == "OK"
                assert (await code(encode(Packet("node-b", "127.0.0.1:1", ())))).startswith(
                    "PERMISSION_DENIED impersonation")
                assert (await code(b"\xff\xff")).startswith("INVALID_ARGUMENT malformed")
                assert (await code(b"\x0a\x01x" + b"\x12\x01y" * 3000)).startswith(
                    "RESOURCE_EXHAUSTED too_large")
                results = [await code(mine) for _ in range(30)]
                assert "OK" not in results[-5:]
                assert any(x.startswith("RESOURCE_EXHAUSTED rate_limited") for x in results)
            snap = a.snapshot()
            assert snap["dropped"]["impersonation"] == 1 and snap["dropped"]["malformed"] == 1
            assert snap["dropped"]["too_large"] == 1 and snap["dropped"]["rate_limited"] > 5
            assert snap["rate_limited_peers"] == 1
            assert {m.node for m in snap["members"]} == {"node-a", "node-d"}  # only its own news
        finally:
            await a.stop(leave=False)

    run(main())
