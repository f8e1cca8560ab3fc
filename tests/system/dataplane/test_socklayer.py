"""The socket layer on real sockets: loopback TCP inside a cgroup v2 of the
test's own, with mm_sockops attached to it and mm_sk_msg to its sockhash.

Registration (sockhash, socket storage and registry with the socket's
cookie; gone at close), accounting per modality, same-node redirect that
delivers byte-exact frames in order however the sender cuts them, the
weighted split across replicas, switching redirect off, and malformed or
foreign streams passing over TCP unredirected (fail open, counted).
Adoption after a kill -9 and ``down`` are in test_socklayer_adopt.py."""

from __future__ import annotations

import ctypes
import hashlib
import random
import socket
import threading
from collections.abc import Iterator
from typing import Self

import pytest

from mmmesh.abi import Modality
from mmmesh.dataplane import Endpoint, SocketLayer, _sock
from mmmesh.errors import DataplaneError
from mmmesh.wire import FrameReader, Header
from testkit.privileged import require_privileged
from testkit.socklayer_kit import (
    bytes_received,
    connect,
    frame,
    inside,
    listener,
    read_exactly,
    read_frames,
    scratch_cgroup,
    swrr_counts,
    wait_until,
)
from testkit.socklayer_spread import spread

pytestmark = pytest.mark.privileged

SO_COOKIE = 57
AUDIO, VIDEO, LIDAR, TENSOR = (int(Modality.AUDIO), int(Modality.VIDEO),
                               int(Modality.POINT_CLOUD), int(Modality.TENSOR))


@pytest.fixture(scope="module")
def cg() -> Iterator[tuple[str, SocketLayer]]:
    """One socket layer for the module (each test uses stages of its own)."""
    require_privileged()
    with scratch_cgroup("sl") as (path, rel):
        sl = SocketLayer(rel)
        sl.up([])
        try:
            yield path, sl
        finally:
            sl.down()


def mesh_pairs(cg: tuple[str, SocketLayer], stage: int, replicas: int = 1,
               conns: int = 1) -> list[tuple[socket.socket, socket.socket]]:
    """``conns`` connections to each of ``replicas`` listeners, all of them
    endpoints of ``stage``; made inside the cgroup.  [(client, server)]."""
    path, sl = cg
    out = []
    with inside(path):
        lss = [listener() for _ in range(replicas)]
        sl.set_endpoints([*sl.endpoints(), *(Endpoint("127.0.0.1", p, stage, r)
                                             for r, (_, p) in enumerate(lss))])
        for ls, port in lss:
            out += [connect(ls, port) for _ in range(conns)]
            ls.close()
    return out


def cookie(s: socket.socket) -> int:
    return int.from_bytes(s.getsockopt(socket.SOL_SOCKET, SO_COOKIE, 8), "little")


def delta(sl: SocketLayer, before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in sl.stats().events.items() if v != before.get(k)}


def test_registration_and_removal(cg: tuple[str, SocketLayer]) -> None:
    _, sl = cg
    before = sl.stats().events
    (c, s), = mesh_pairs(cg, stage=11)
    cport, sport = c.getsockname()[1], s.getsockname()[1]
    hashed = sl.sockhash()
    # the kernel answers a sockhash lookup with the socket's cookie
    assert hashed[("127.0.0.1", cport, "127.0.0.1", sport)] == cookie(c)
    assert hashed[("127.0.0.1", sport, "127.0.0.1", cport)] == cookie(s)
    sc, ss = sl.socket_state(c), sl.socket_state(s)
    assert sc is not None and ss is not None
    assert (sc.cookie, sc.role, sc.stage, sc.replica) == (cookie(c), "client", 11, 0)
    assert (ss.cookie, ss.role, ss.stage, ss.replica) == (cookie(s), "server", 11, 0)
    flows = {f.cookie: f for f in sl.flows()}
    assert flows[cookie(c)].lport == cport and flows[cookie(c)].in_sockhash
    assert flows[cookie(s)].role == "server" and flows[cookie(s)].stage == 11
    assert delta(sl, before)["registered"] == 2
    c.close()
    s.close()
    assert wait_until(lambda: not set(flows) & set(sl.sockhash().values()))
    assert wait_until(lambda: not set(flows) & {f.cookie for f in sl.flows()})
    assert delta(sl, before)["removed"] == 2


def test_non_mesh_socket_is_left_alone(cg: tuple[str, SocketLayer]) -> None:
    path, sl = cg
    before = sl.stats().events
    with inside(path):
        ls, port = listener()  # not an endpoint
        c, s = connect(ls, port)
    assert sl.socket_state(c) is None and sl.socket_state(s) is None
    assert all(k[1] != port and k[3] != port for k in sl.sockhash())
    c.sendall(b"hi")
    assert read_exactly(s, 2) == b"hi"
    assert delta(sl, before) == {"skipped": 2}


def test_ipv6_and_dual_stack_pairs_are_redirected(cg: tuple[str, SocketLayer]) -> None:
    """IPv6, and an IPv6 socket talking to an IPv4 listener (IPv4-mapped):
    both ends get mirrored keys, so the frames are redirected."""
    path, sl = cg
    f = frame(AUDIO, 300)
    with inside(path):
        ls6, p6 = listener("::1")
        ls4, p4 = listener("127.0.0.1")
        sl.set_endpoints([*sl.endpoints(), Endpoint("::1", p6, 14), Endpoint("127.0.0.1", p4, 15)])
        c6, s6 = connect(ls6, p6, "::1")
        c46 = socket.socket(socket.AF_INET6)
        c46.connect(("::ffff:127.0.0.1", p4))
        s46, _ = ls4.accept()
    assert ("::1", c6.getsockname()[1], "::1", p6) in sl.sockhash()
    for c, s in ((c6, s6), (c46, s46)):
        c.sendall(f)
        assert read_exactly(s, len(f)) == f and bytes_received(s) == 0
        st = sl.socket_state(c)
        assert st is not None and st.redirected == 1
    assert ("127.0.0.1", c46.getsockname()[1], "127.0.0.1", p4) in sl.sockhash()


def test_accounting_per_modality(cg: tuple[str, SocketLayer]) -> None:
    _, sl = cg
    (c, s), = mesh_pairs(cg, stage=12)
    before = sl.stats()
    audio = [frame(AUDIO, 320, cls=3, seq=i) for i in range(5)]
    video = [frame(VIDEO, 20000, cls=1, seq=i) for i in range(3)]
    lidar = [frame(LIDAR, 5000, cls=2, seq=i) for i in range(2)]
    for f in audio:  # one frame per send
        c.sendall(f)
    c.sendall(b"".join(video))  # several frames in one send
    blob = b"".join(lidar)
    for a, b in ((0, 5), (5, 30), (30, 4000), (4000, len(blob))):  # cut inside a header
        c.sendall(blob[a:b])
    sent = b"".join(audio + video) + blob
    assert read_exactly(s, len(sent)) == sent
    st = sl.socket_state(c)
    assert st is not None
    want = {AUDIO: (5, sum(map(len, audio))), VIDEO: (3, sum(map(len, video))),
            LIDAR: (2, sum(map(len, lidar)))}
    assert st.modalities == want
    assert (st.last_modality, st.last_class, st.redirected, st.passed) == (LIDAR, 2, 10, 0)
    after = sl.stats()
    for m, (fr, by) in want.items():
        b0 = before.modalities.get(m, (0, 0))
        assert (after.modalities[m][0] - b0[0], after.modalities[m][1] - b0[1]) == (fr, by)
    for cls, m in ((3, AUDIO), (1, VIDEO), (2, LIDAR)):
        assert after.classes[cls][0] - before.classes.get(cls, (0, 0))[0] == want[m][0]
    d = delta(sl, before.events)
    assert d["frames"] == 10 and d["frame_bytes"] == len(sent) and d["split_header"] >= 1


def _cut(blob: bytes, rng: random.Random) -> Iterator[bytes]:
    """``blob`` in pieces of random sizes, tiny ones (inside headers) included."""
    i = 0
    while i < len(blob):
        n = rng.choice((rng.randint(1, 11), rng.randint(12, 300), rng.randint(300, 70000),
                        len(blob)))
        yield blob[i:i + n]
        i += n


def test_redirect_is_byte_exact_and_in_order(cg: tuple[str, SocketLayer]) -> None:
    _, sl = cg
    (c, s), = mesh_pairs(cg, stage=13)
    rng = random.Random(13)
    sizes = [rng.choice((rng.randint(0, 64), rng.randint(64, 4096), rng.randint(4096, 65536)))
             for _ in range(1500)]
    sizes[100], sizes[700], sizes[1400] = 4 << 20, 1 << 20, 3 << 20
    frames = [frame(rng.choice((AUDIO, VIDEO, TENSOR)), n, seq=i) for i, n in enumerate(sizes)]
    before = sl.stats().events
    with Reader(s, sum(map(len, frames))) as rd:
        sent = hashlib.sha256()
        k = 0
        while k < len(frames):  # batches of 1..5 frames, cut anywhere
            n = rng.randint(1, 5)
            for piece in _cut(b"".join(frames[k:k + n]), rng):
                c.sendall(piece)
                sent.update(piece)
            k += n
    assert rd.digest() == sent.hexdigest()
    assert [h.sequence for h, _ in read_frames_from(rd.data)] == list(range(len(frames)))
    assert bytes_received(s) == 0  # nothing came over TCP
    d = delta(sl, before)
    assert d["frames"] == d["redirected"] == len(frames)
    assert "passed" not in d and d["split_header"] >= 1


def test_weighted_split_across_replicas(cg: tuple[str, SocketLayer]) -> None:
    """One sender with a connection to each of 3 replicas (its lanes) writes
    10k frames on one of them: they are spread 5:3:2, each replica getting
    its frames in order.  A changed weight takes effect on the next frame."""
    _, sl = cg
    pairs = mesh_pairs(cg, stage=21, replicas=3)
    sl.set_weights(21, [5, 3, 2])
    lead = pairs[0][0]
    before = sl.stats().events
    n = 10_000
    frames = [frame(TENSOR, 64, seq=i) for i in range(n)]
    got = spread(lead, [s for _, s in pairs], frames)
    want = swrr_counts([5, 3, 2], n)
    assert [len(g) for g in got] == want  # the kernel's pick is the reference model's
    for g, w in zip(got, (5, 3, 2)):
        assert abs(len(g) - n * w / 10) <= 0.05 * n * w / 10
        assert g == sorted(g)  # each replica gets its frames in order
    assert sorted(x for g in got for x in g) == list(range(n))
    st = sl.socket_state(lead)
    assert st is not None and "lead" in st.flags and st.redirected == n
    sl.set_weights(21, {0: 1, 2: 1})  # replica 1 out
    got = spread(lead, [s for _, s in pairs], [frame(TENSOR, 64, seq=i) for i in range(1000)])
    assert [len(g) for g in got] == [500, 0, 500]
    # another socket of the group writing is not the lead: its frames go over TCP
    c1, s1 = pairs[1]
    c1.sendall(frame(TENSOR, 64, seq=7))
    assert [h.sequence for h, _ in read_frames(s1, 1)] == [7] and bytes_received(s1) > 0
    d = delta(sl, before)
    assert d["redirected"] == n + 1000 and d["not_lead"] == 1 and d["passed"] == 1
    sl.set_weights(21, [])
    assert 21 not in sl.weights()


def test_switch_off_and_on(cg: tuple[str, SocketLayer]) -> None:
    _, sl = cg
    (c, s), = mesh_pairs(cg, stage=31)
    before = sl.stats().events
    frames = [frame(AUDIO, 100, seq=i) for i in range(30)]
    for f in frames[:10]:
        c.sendall(f)
    assert read_exactly(s, sum(map(len, frames[:10]))) == b"".join(frames[:10])
    assert bytes_received(s) == 0
    sl.set_redirect(False)
    try:
        for f in frames[10:20]:
            c.sendall(f)
        assert read_exactly(s, sum(map(len, frames[10:20]))) == b"".join(frames[10:20])
        assert bytes_received(s) == sum(map(len, frames[10:20]))  # over TCP
        assert sl.status().redirect is False
    finally:
        sl.set_redirect(True)
    # the order guard: this pair stays on TCP, a new one is redirected
    for f in frames[20:]:
        c.sendall(f)
    assert read_exactly(s, sum(map(len, frames[20:]))) == b"".join(frames[20:])
    (c2, s2), = mesh_pairs(cg, stage=31)
    c2.sendall(frames[0])
    assert read_exactly(s2, len(frames[0])) == frames[0] and bytes_received(s2) == 0
    d = delta(sl, before)
    assert (d["redirected"], d["passed"], d["off"], d["peer_tcp"]) == (11, 20, 10, 10)


def test_malformed_and_foreign_streams_pass_over_tcp(cg: tuple[str, SocketLayer]) -> None:
    _, sl = cg
    (c, s), (c2, s2), (c3, s3) = mesh_pairs(cg, stage=41, conns=3)
    before = sl.stats().events
    good = [frame(VIDEO, 1000, seq=i) for i in range(6)]
    bad = bytearray(frame(VIDEO, 10, seq=99))
    bad[13] = 200  # the STREAM_ID TLV's length now runs past hdr_len
    stream = b"".join(good[:3]) + bytes(bad) + b"".join(good[3:])
    for part in (b"".join(good[:3]), bytes(bad), good[3], b"".join(good[4:])):
        c.sendall(part)
    assert read_exactly(s, len(stream)) == stream  # byte-exact, in order
    assert bytes_received(s) == len(stream) - sum(map(len, good[:3]))
    st = sl.socket_state(c)
    assert st is not None and "unaligned" in st.flags and st.redirected == 3
    # not MMH at all: passes at once (a short message is not held back)
    c2.sendall(b"hi")
    assert read_exactly(s2, 2, timeout=2) == b"hi"
    c2.sendall(b"GET / HTTP/1.1\r\n\r\n" + good[0])
    assert read_exactly(s2, 18 + len(good[0])) == b"GET / HTTP/1.1\r\n\r\n" + good[0]
    # the right magic with another version is malformed
    c3.sendall(b"MMH\x02" + bytes(20))
    assert read_exactly(s3, 24) == b"MMH\x02" + bytes(20)
    d = delta(sl, before)
    assert (d["malformed"], d["not_mmh"], d["redirected"]) == (2, 1, 3)
    assert d["unaligned"] == 3 + 2 + 1  # one per message: bad + 2 later sends; hi, GET; MMH\x02
    assert d["unaligned_bytes"] == len(stream) - sum(map(len, good[:3])) + 2 + 18 + \
        len(good[0]) + 24


def test_kernel_facts_the_design_rests_on(cg: tuple[str, SocketLayer]) -> None:
    """Checked here rather than assumed (docs/socklayer.md, "Kernel facts")."""
    _, sl = cg
    (c, s), = mesh_pairs(cg, stage=61)
    key = next(k for k in sl.sockhash() if k[1] == s.getsockname()[1])
    with _sock.SockMaps(sl.pin_dir) as maps:
        raw = next(k for k in maps.hash.keys() if int(k.lport) == key[1])  # noqa: SIM118
        # a SOCKHASH value is a socket reference: user space can only put a socket fd in
        with pytest.raises(DataplaneError):
            maps.hash.update(raw, ctypes.c_uint64(0xFFFF))
        # ingress redirect has no flow control: far more than the receive
        # buffer is accepted while the receiver reads nothing
        rcvbuf = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        big = frame(TENSOR, 8 << 20)
        c.setblocking(False)
        assert c.send(big) == len(big) and len(big) > 16 * rcvbuf
        c.setblocking(True)
        assert read_exactly(s, len(big)) == big
        # taking a socket out of the sockhash drops what was redirected to it
        # and not read yet (why down() never does)
        c.sendall(frame(TENSOR, 100))
        assert maps.hash.delete(raw)
    s.settimeout(0.3)
    with pytest.raises(TimeoutError):
        s.recv(100)


# ----------------------------------------------------------------- helpers
class Reader:
    """Reads ``n`` bytes off ``sock`` in a thread while the test sends."""

    def __init__(self, sock: socket.socket, n: int) -> None:
        self.sock, self.n, self.data = sock, n, b""
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.data = read_exactly(self.sock, self.n, timeout=30)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(60)

    def digest(self) -> str:
        assert len(self.data) == self.n, (len(self.data), self.n)
        return hashlib.sha256(self.data).hexdigest()


def read_frames_from(data: bytes) -> list[tuple[Header, bytes]]:
    rd = FrameReader()
    rd.feed(data)
    return [(h, bytes(p)) for h, p in rd]


