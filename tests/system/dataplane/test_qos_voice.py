"""The voice sender's TX timestamps and the latency breakdown built on them
(demo/voice.py): real SO_TIMESTAMPING on a loopback UDP socket, and
the arithmetic of ``breakdown`` on a table of frames."""

from __future__ import annotations

import array
import socket
import time

import pytest

from demo.voice import (
    KERNEL_PARTS,
    PARTS,
    breakdown,
    enable_tx_timestamps,
    read_tx_timestamps,
)


def test_tx_timestamps_on_a_real_socket() -> None:
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.bind(("127.0.0.1", 0))
        enable_tx_timestamps(tx)
        tx.connect(rx.getsockname())
        n = 20
        user, sched, snd = [], array.array("q", bytes(8 * n)), array.array("q", bytes(8 * n))
        for _ in range(n):
            user.append(time.time_ns())
            tx.send(bytes(200))
        deadline = time.monotonic() + 2.0
        got = 0
        while got < 2 * n and time.monotonic() < deadline:
            got += read_tx_timestamps(tx, sched, snd)
            time.sleep(0.005)
        assert got == 2 * n  # a SCHED and a SND timestamp per datagram, numbered by OPT_ID
        for i in range(n):
            assert user[i] <= sched[i] <= snd[i], i
            assert snd[i] - user[i] < 1_000_000_000
        assert all(rx.recv(1024) for _ in range(n))
        assert read_tx_timestamps(tx, sched, snd) == 0  # drained, never blocks
    finally:
        rx.close()
        tx.close()


def _frames(rows: list[tuple[int, int, int, int]]) -> tuple[dict[str, list[int]],
                                                           dict[str, list[int]]]:
    """Sender and receiver results for frames with the given part latencies (ns)."""
    user, sched, snd, seqs, krx, urx = [], [], [], [], [], []
    t = 1_000_000_000_000
    for seq, (a, b, c, d) in enumerate(rows):
        user.append(t)
        sched.append(t + a)
        snd.append(t + a + b)
        seqs.append(seq)
        krx.append(t + a + b + c)
        urx.append(t + a + b + c + d)
        t += 10_000_000
    return ({"user_ns": user, "sched_ns": sched, "snd_ns": snd},
            {"rx_seq": seqs, "rx_kernel_ns": krx, "rx_user_ns": urx})


def test_breakdown_splits_and_attributes_the_tail() -> None:
    # 199 ordinary frames; one slow in the qdisc, one slow in the receiver
    rows = [(20_000, 10_000, 1_000, 100_000)] * 198
    rows += [(20_000, 500_000, 1_000, 100_000), (20_000, 10_000, 1_000, 900_000)]
    tx, rx = _frames(rows)
    b = breakdown(tx, rx)
    assert b is not None and b["frames"] == 200
    assert b["sender"]["p50_ms"] == pytest.approx(0.020)
    assert b["qdisc"]["max_ms"] == pytest.approx(0.5)
    assert b["receiver"]["max_ms"] == pytest.approx(0.9)
    # to the kernel timestamp the slowest 1 % (2 frames) is held in the qdisc
    tk = b["tail_kernel"]
    assert set(tk) == {*KERNEL_PARTS, "total", "frames"} and tk["frames"] == 2
    assert tk["qdisc"] == pytest.approx((0.5 + 0.01) / 2)
    assert tk["sender"] + tk["qdisc"] + tk["wire"] == pytest.approx(tk["total"])
    # to the reader, by the receiver
    ts = b["tail_socket"]
    assert set(ts) == {*PARTS, "total", "frames"}
    assert ts["receiver"] > ts["qdisc"]
    assert sum(ts[p] for p in PARTS) == pytest.approx(ts["total"])


def test_breakdown_skips_frames_without_every_timestamp() -> None:
    tx, rx = _frames([(20_000, 10_000, 1_000, 100_000)] * 10)
    tx["snd_ns"][3] = 0  # no SND timestamp came back
    rx["rx_kernel_ns"][5] = 0  # no receive timestamp
    rx["rx_seq"][7] = 99  # a sequence the sender never sent
    b = breakdown(tx, rx)
    assert b is not None and b["frames"] == 7
    assert breakdown({}, rx) is None
    assert breakdown(tx, {"rx_seq": [], "rx_kernel_ns": [], "rx_user_ns": []}) is None


@pytest.mark.privileged
def test_breakdown_of_real_voice_frames_between_namespaces() -> None:
    """Voice alone from a testbed node to the other (the uplink as the testbed
    leaves it, no dataplane): every frame gets its four parts, they add up to
    its socket-to-socket latency, and the slowest 1 % is attributed."""
    import os

    from demo.streams import TrafficSpec
    from demo.testbed import Testbed
    from demo.traffic import run_traffic
    from testkit.privileged import require_privileged

    require_privileged()
    spec = TrafficSpec(duration=1.5, video=False, lidar=False, voice_tx_ts=True, voice_cpu=0)
    with Testbed(prefix=f"mmqv{os.getpid()}-") as tb:
        res = run_traffic(tb, spec)
    v = res["voice"]
    b = v["breakdown"]
    assert v["received"] == v["sent"] >= 140
    assert b["frames"] == v["received"]  # every frame has every timestamp
    for p in PARTS:
        assert b[p]["n"] == b["frames"] and b[p]["p50_ms"] >= 0, p
    # the parts' means add up to the mean latency, socket to socket and to the kernel
    assert sum(b[p]["mean_ms"] for p in PARTS) == pytest.approx(v["mean_ms"], rel=1e-6)
    assert sum(b[p]["mean_ms"] for p in KERNEL_PARTS) == \
        pytest.approx(v["kernel_mean_ms"], rel=1e-6)
    assert b["tail_kernel"]["frames"] == b["tail_socket"]["frames"] == -(-b["frames"] // 100)
    assert b["tail_kernel"]["total"] >= v["kernel_p99_ms"]
