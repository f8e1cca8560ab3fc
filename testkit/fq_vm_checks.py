"""The egress-mode checks that need sch_fq, mq and a multiqueue NIC: run as
root inside testkit/fq_vm.py's VM (kernel 6.12, virtio-net with 4 queue
pairs at 1 Gbit/s on ``eth0``, the peer 10.231.0.1 a tap on the host) by
tests/system/dataplane/test_egress_vm.py, which asserts each one.

``python -m testkit.fq_vm_checks [name...]`` prints one line
``MMFQ-RESULTS {name: {"ok": bool, "detail": ...}}`` last; every check runs
even when one before it failed (each starts from what it needs).  The checks
share one dataplane (pins and programs compiled once: bcc is slow under
emulation) and run in this order:

* htb on the mq NIC: HTB replaces mq (one root, one lock), classifies;
* auto picks fq here; up in fq adopts the same programs, builds mq + one fq
  per TX queue with mmmesh's bands, and no drift;
* fq classifies: every frame's band, seen in the qdiscs (paced frames wait
  in their band: band_pkt_count), pacing holds a class's ceil over all TX
  queues and the qdisc drops what is past the horizon;
* drift is found (a queue's fq replaced, weights changed, a program
  detached) and up repairs it;
* kill -9 in the middle of an fq apply and after it: safe meanwhile, the
  next up adopts and converges;
* overrides in fq (a boost's band and pacer), the refusals (a boost that
  changes nothing; link.rate below the NIC's line rate);
* the SLA controller's writes (qosd's reconciler in egress mode fq, the
  law's decisions for a missing class and stage);
* a single-queue device in fq: one fq root (auto there: htb);
* back to htb, and down: the device's default mq again.

Nothing waits a fixed time: conditions are polled up to deadlines; a rate
is judged only against what the sender offered (emulated CPUs are slow).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmmesh import abi
from mmmesh.dataplane import Boost, Dataplane, Overrides, StageOverride
from mmmesh.errors import DataplaneError
from mmmesh.policy import Policy, load_policy, parse_policy
from mmmesh.policy.egress import fq_band
from mmmesh.wire import Header, encode_header

IFACE = "eth0"
ME, PEER = "10.231.0.2", "10.231.0.1"
ROOT = Path(__file__).resolve().parent.parent
RESULTS: dict[str, dict[str, Any]] = {}
CHECKS: list[tuple[str, Callable[[], str]]] = []


def check(fn: Callable[[], str]) -> Callable[[], str]:
    CHECKS.append((fn.__name__, fn))
    return fn


def policy(**changes: dict[str, Any]) -> Policy:
    """The example on eth0 at its line rate, with per-class changes."""
    doc = load_policy(ROOT / "examples" / "policy.yaml").model_dump(
        mode="json", by_alias=True, exclude_none=True)
    doc["link"] = {"device": IFACE, "rate": "1gbit"}
    for c in doc["classes"]:
        c.update(changes.get(c["name"], {}))
    return parse_policy(doc)


# voice may be boosted (a ceil to split); video, lidar and best-effort paced
# low enough that an emulated sender fills them
PACED = policy(voice={"ceil": "20mbit"},
               video={"rate": "100kbit", "ceil": "400kbit"},
               lidar={"rate": "100kbit", "ceil": "2mbit"},
               **{"best-effort": {"rate": "100kbit", "ceil": "400kbit"}})


def dp(egress: str = "fq") -> Dataplane:
    return Dataplane(IFACE, egress=egress)


def send(modality: int | None, n: int, size: int = 1000, sport: int = 40000,
         dport: int = 7000, secs: float | None = None) -> int:
    """UDP frames of ``modality`` (None: not MMH) from ME to PEER; returns how
    many were sent (``secs``: as many as fit in that time)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, 32, 4 << 20)  # SO_SNDBUFFORCE
    s.bind((ME, sport))
    body = (encode_header(Header(modality=modality, payload_len=size)) if modality is not None
            else b"x" * 12) + b"p" * size
    sent = 0
    end = time.monotonic() + secs if secs else None
    while (end is None and sent < n) or (end is not None and time.monotonic() < end):
        try:
            s.sendto(body, (PEER, dport))
            sent += 1
        except OSError:
            time.sleep(0.001)
    s.close()
    return sent


def send_until(stop: threading.Event, modality: int | None, sport: int) -> None:
    """Bursts of 4 frames of ``modality`` every 20 ms until ``stop`` is set."""
    while not stop.is_set():
        send(modality, 4, 1000, sport=sport)
        time.sleep(0.02)


def wait(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def qdiscs() -> str:
    return subprocess.run(["tc", "-s", "-d", "qdisc", "show", "dev", IFACE], capture_output=True,
                          text=True, check=False).stdout


def fq_totals() -> tuple[int, int, list[int]]:
    """(bytes, horizon drops, packets per queue) over egress mode fq's qdiscs."""
    qs = dp().fq_qdiscs()
    return sum(q.bytes for q in qs), sum(q.horizon_drops for q in qs), [q.packets for q in qs]


# --------------------------------------------------------------------------
@check
def htb_replaces_mq() -> str:
    d = dp("htb")
    d.down()
    assert "qdisc mq 0: root" in qdiscs(), qdiscs()
    t0 = time.monotonic()
    r = d.up(policy(), version=1)
    compile_s = time.monotonic() - t0
    st = d.status(policy())
    assert st.egress == "htb" and "qdisc htb 1: root" in qdiscs() and "mq" not in qdiscs()
    assert set(r.prog_ids) == {"egress", "ingress"}
    send(4, 40, 100)
    send(None, 10, 100)
    st = d.status(policy())
    by = {c.name: c for c in st.classes}
    assert by["voice"].egress_packets >= 40 and by["voice"].htb and by["voice"].htb.packets >= 40
    assert by["best-effort"].egress_packets >= 10
    assert d.drift(policy(), 1) == [], d.drift(policy(), 1)
    return f"compiled and up in {compile_s:.0f} s; one HTB root over the 4 queues; voice 1:b " \
           f"{by['voice'].htb.packets} packets"


@check
def auto_picks_fq_and_up_adopts() -> str:
    assert Dataplane(IFACE, egress="auto").egress_mode() == "fq"
    before = Dataplane(IFACE).status().programs
    r = dp().up(policy(), version=2)
    assert r.adopted, "the same programs serve both modes"
    assert {k: v["prog_id"] for k, v in before.items()} == r.prog_ids
    out = qdiscs()
    assert "qdisc mq 4d4d: root" in out, out
    qs = dp().fq_qdiscs()
    assert [q.queue for q in qs] == [0, 1, 2, 3], qs
    for q in qs:
        assert q.weights == (589824, 196608, 65536) and q.horizon_drop and q.priomap == (
            (2,) * 13 + (0, 1, 2)), q
    assert "bands 3 priomap 2 2 2 2 2 2 2 2 2 2 2 2 2 0 1 2 weights 589824 196608 65536" in out
    assert dp().drift(policy(), 2) == [], dp().drift(policy(), 2)
    assert dp().status(policy()).egress == "fq"
    return "mq 4d4d: with fq 4e00:..4e03: (bands 3, weights 589824 196608 65536); same program ids"


@check
def fq_classifies_into_bands() -> str:
    """Frames of a paced class wait in their band on whichever queue took
    them: band_pkt_count shows the priomap sending our slots to our bands."""
    d = dp()
    d.up(PACED, version=3)
    assert d.drift(PACED, 3) == [], d.drift(PACED, 3)
    seen: dict[str, tuple[int, ...]] = {}
    for name, mod, band in (("video", 3, 1), ("best-effort", None, 2)):
        # offered above the class's ceil for as long as the poll takes: its
        # backlog (at most its pacer's horizon) is there whenever the qdiscs
        # are read, however slowly this emulated CPU reads them
        stop = threading.Event()
        sender = threading.Thread(target=send_until, args=(stop, mod, 41000 + band))
        sender.start()

        def waiting(band: int = band) -> tuple[int, ...] | None:
            counts = [sum(q.band_pkt_count[b] for q in d.fq_qdiscs()) for b in range(3)]
            return tuple(counts) if counts[band] else None

        try:
            seen[name] = wait(waiting, 120, f"{name}'s frames waiting in band {band}")
        finally:
            stop.set()
            sender.join()
        assert all(c == 0 for b, c in enumerate(seen[name]) if b != band), seen
        wait(lambda: all(q.qlen == 0 for q in d.fq_qdiscs()), 60, "the paced frames to leave")
    st = {c.name: c for c in d.status(PACED).classes}
    assert st["video"].band == 1 and st["voice"].band == 0 and st["best-effort"].band == 2
    # voice (band 0) is not paced here: never queued behind its ceil
    send(4, 20, 100)
    assert st["voice"].egress_packets + 20 <= {c.name: c for c in d.status(PACED).classes}[
        "voice"].egress_packets
    return f"queued per band while paced: video {seen['video']}, unread {seen['best-effort']}"


@check
def pacing_holds_the_ceil_over_every_queue() -> str:
    """lidar (ceil 2 Mbit/s) from 8 flows spread over the TX queues: what the
    qdiscs send of it stays within its ceil; past the horizon the qdisc drops."""
    d = dp()
    d.up(PACED, version=3)
    wait(lambda: all(q.qlen == 0 for q in d.fq_qdiscs()), 60, "empty queues")
    b0, h0, p0 = fq_totals()
    t0 = time.monotonic()
    offered = 0
    for i in range(8):  # 8 flows, each its own socket: hashed over the 4 queues
        offered += send(5, 0, 1000, sport=42000 + i, secs=0.3)
    wait(lambda: all(q.qlen == 0 for q in d.fq_qdiscs()), 60, "lidar's frames to leave")
    elapsed = time.monotonic() - t0
    b1, h1, p1 = fq_totals()
    used = sum(1 for a, b in zip(p0, p1, strict=True) if b > a)
    sent_bits = (b1 - b0) * 8
    ceil = 2_000_000
    horizon_s = 100 * 1514 * 8 / ceil  # pace_horizon_us at 2 Mbit/s (0.6 s)
    assert used >= 2, f"lidar's 8 flows used {used} queue(s): {p0} -> {p1}"
    assert sent_bits <= ceil * (elapsed + horizon_s) + 8 * 1100 * 8, (sent_bits, elapsed)
    offered_bits = offered * 1054 * 8  # Ethernet + IP + UDP + MMH + 1000
    note = ""
    if offered_bits > 2 * ceil * elapsed:  # the sender filled it: the ceil is reached
        assert sent_bits >= 0.5 * ceil * elapsed, (sent_bits, elapsed)
        assert h1 > h0, "past the horizon the qdisc drops"
    else:
        note = " (the emulated sender offered less than twice the ceil: no lower bound)"
    return (f"{used} of 4 queues, {sent_bits / elapsed / 1e6:.2f} Mbit/s sent of "
            f"{offered_bits / elapsed / 1e6:.1f} offered in {elapsed:.1f} s, horizon drops "
            f"{h1 - h0}{note}")


@check
def drift_is_found_and_repaired() -> str:
    d = dp()
    d.up(PACED, version=3)
    from mmmesh.dataplane import _netlink  # the test kit's hand on the kernel (pyroute2)

    with _netlink.Netlink() as nl:
        idx = nl.ifindex(IFACE)
        q2 = next(q for q in dp().fq_qdiscs() if q.queue == 2)
        nl.ipr.tc("replace", "pfifo", idx, 0x77770000, parent=0x4D4D0002)  # queue 1
        nl.ipr.tc("replace", "fq", idx, q2.handle, parent=q2.parent, fq_attrs=[
            ["TCA_FQ_WEIGHTS", {"weights": [131072, 131072, 131072]}]])  # queue 2
        nl.detach_bpf(idx, "ingress")
    found = d.drift(PACED, 3)
    assert "TX queue 1 runs pfifo, not egress mode fq's fq" in found, found
    assert any(f.startswith("TX queue 2: fq band weights or priomap changed")
               for f in found), found
    assert "ingress program detached" in found, found
    d.up(PACED, version=3)
    assert d.drift(PACED, 3) == [], d.drift(PACED, 3)
    return "; ".join(found)


KILL = r"""
import sys
from mmmesh.dataplane import Dataplane
from testkit.fq_vm_checks import PACED, policy
pol = {"paced": PACED, "plain": policy()}[sys.argv[1]]
Dataplane("eth0", egress="fq").up(pol, version=int(sys.argv[2]))
"""


@check
def kill_9_during_and_after_an_fq_apply() -> str:
    d = dp()
    d.up(PACED, version=3)
    ids = d.status().programs
    notes = []
    for point, target, version in (("dataplane.up.maps_written", "plain", 4),
                                   ("dataplane.up.attached", "paced", 5)):
        r = subprocess.run([sys.executable, "-c", KILL, target, str(version)],
                           env={**os.environ, "MMMESH_FAILPOINTS": point}, capture_output=True,
                           text=True, timeout=600, check=False)
        assert r.returncode == -signal.SIGKILL, (point, r.stderr[-800:])
        # meanwhile: every fq of ours still there, every class in a band (never unclassified)
        st = d.status()
        assert st.egress == "fq" and len(st.fq) == 4, point
        assert all(c.band is not None and 0 <= c.band < 3 for c in st.classes), point
        pol = PACED if target == "paced" else policy()
        notes.append(f"{point}: drift {len(d.drift(pol, version))} item(s)")
        r2 = d.up(pol, version=version)
        assert r2.adopted and r2.prog_ids == {k: v["prog_id"] for k, v in ids.items()}
        assert d.drift(pol, version) == [], (point, d.drift(pol, version))
    return "; ".join(notes) + "; each adopted (same program ids) and converged"


@check
def overrides_take_their_band_and_pacer() -> str:
    d = dp()
    d.up(PACED, version=6)
    pol = PACED
    entries = d.set_overrides(Overrides(stages=(
        StageOverride("voice", f"{ME}/32", Boost(weight=8)),)), pol)
    (e,) = entries
    assert e.classid == abi.FQ_PRIO_BASE + fq_band(pol.class_named("voice").priority)
    pacers = {(p.class_id, p.level): p for p in d.pacers()}
    voice = pol.class_named("voice").id
    assert pacers[(voice, e.level)].rate_bps + pacers[(voice, 0)].rate_bps <= 20_000_000 + 16
    send(4, 30, 200)
    assert d.overrides(pol)[0].hits >= 30
    assert d.drift(pol, 6) == [], d.drift(pol, 6)
    try:
        d.set_overrides(Overrides(stages=(StageOverride("control", f"{ME}/32",
                                                        Boost(weight=2)),)), pol)
        raise AssertionError("a boost that changes nothing was accepted")
    except DataplaneError as err:
        refused = str(err)
        assert "stages[0]: egress mode fq" in refused and "split nothing" in refused
    assert d.set_overrides(Overrides(), pol) == []
    assert d.drift(pol, 6) == [], d.drift(pol, 6)
    return f"voice boost {e.level}: band {e.classid - abi.FQ_PRIO_BASE}, pacer " \
           f"{pacers[(voice, e.level)].rate_bps} bit/s; refused: {refused[:80]}"


@check
def fq_refuses_a_link_rate_below_the_line_rate() -> str:
    slow = policy()
    doc = slow.model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["link"]["rate"] = "500mbit"
    try:
        dp().up(parse_policy(doc), version=7)
        raise AssertionError("link.rate below the NIC's 1 Gbit/s was accepted in fq")
    except DataplaneError as e:
        assert "link.rate: egress mode fq does not shape the device" in str(e), e
        msg = str(e)
    assert dp("htb").check(parse_policy(doc)) == []  # htb shapes to it
    return msg[:120]


@check
def the_sla_controllers_writes_drive_fq() -> str:
    """qosd's reconciler in egress mode fq with the law's own decisions: a
    missing class is adapted (band weights, pacers) and a missing stage is
    boosted; drift stays empty."""
    from qosd.config import EgressConfig, QosdConfig
    from qosd.controller.core import effective_policy
    from qosd.controller.kernel import stage_overrides
    from qosd.model import PolicyVersion
    from qosd.reconciler import Reconciler
    from testkit.controller_cases import MISS, OKAY, Run

    tmp = tempfile.mkdtemp()
    cfg = QosdConfig(node_name="vm", state_dir=Path(tmp), api_socket=Path(tmp) / "s",
                     sla_socket=None, metrics_addr=None, uplinks=[IFACE],
                     egress=EgressConfig(mode="auto"))
    rec = Reconciler(cfg)
    pol = PACED
    rec.check_realizable(pol)
    rec.apply(PolicyVersion(8, pol, pol.to_yaml(), "", time.time()), "test")
    assert rec.dataplane(IFACE).egress_mode() == "fq"
    run = Run(pol)
    run.run(2, {"voice": OKAY}, stages={("voice", "asr"): MISS})
    d = run.decisions[-1]
    assert d.stage_weights, d.as_dict()
    wrote = rec.set_overrides(8, stage_overrides(d.stage_weights, {"asr": [f"{ME}/32"]}))
    assert wrote is True
    run.run(4, {"voice": MISS})
    d = run.decisions[-1]
    eff = effective_policy(pol, d.classes)
    res = rec.adapt(8, eff)
    assert res is not None and res.ok
    assert rec.drift() == [], rec.drift()
    voice = d.classes["voice"]
    weights = dp().fq_qdiscs()[0].weights
    rec.set_overrides(8, Overrides())
    return f"stage boost {d.stage_weights or 'written before'}; voice now rate {voice.rate} " \
           f"weight {voice.weight}; band weights {weights}; no drift"


@check
def one_queue_gets_one_fq_root() -> str:
    """A single-queue device in egress mode fq: one fq root, no mq."""
    subprocess.run(["modprobe", "veth"], check=False)
    subprocess.run(["ip", "link", "add", "mmq0", "type", "veth", "peer", "name", "mmq1"],
                   check=True)
    try:
        for dev in ("mmq0", "mmq1"):
            subprocess.run(["ip", "link", "set", dev, "up"], check=True)
        doc = policy().model_dump(mode="json", by_alias=True, exclude_none=True)
        doc["link"] = {"device": "mmq0", "rate": "10gbit"}  # a veth's line rate
        pol = parse_policy(doc)
        d = Dataplane("mmq0", egress="auto")
        assert d.egress_mode() == "htb", "auto: one TX queue is htb"
        d = Dataplane("mmq0", egress="fq")
        d.up(pol, version=1)
        out = subprocess.run(["tc", "qdisc", "show", "dev", "mmq0"], capture_output=True,
                             text=True, check=False).stdout
        assert "qdisc fq 4d4d: root" in out and "mq" not in out, out
        assert d.drift(pol, 1) == [], d.drift(pol, 1)
        d.down()
        return "fq 4d4d: root on a one-queue veth; auto there is htb"
    finally:
        subprocess.run(["ip", "link", "del", "mmq0"], check=False)


@check
def back_to_htb_and_down() -> str:
    d = dp("htb")
    d.up(policy(), version=9)
    out = qdiscs()
    assert "qdisc htb 1: root" in out and "4d4d" not in out, out
    assert d.drift(policy(), 9) == [], d.drift(policy(), 9)
    d.down()
    out = qdiscs()
    assert "qdisc mq 0: root" in out and "htb" not in out, out
    return "htb 1: replaced mq 4d4d:; after down the kernel's default mq"


def main(argv: list[str]) -> int:
    wanted = set(argv) or {n for n, _ in CHECKS}
    for name, fn in CHECKS:
        if name not in wanted:
            continue
        t0 = time.monotonic()
        try:
            detail = fn()
            RESULTS[name] = {"ok": True, "detail": detail}
        except Exception as e:  # noqa: BLE001 - every check reports, the next one runs
            RESULTS[name] = {"ok": False, "detail": f"{type(e).__name__}: {e}",
                             "trace": traceback.format_exc()[-3000:], "qdiscs": qdiscs()[-3000:]}
        RESULTS[name]["seconds"] = round(time.monotonic() - t0, 1)
        print(f"[{name}] {RESULTS[name]['ok']} {RESULTS[name]['seconds']} s: "
              f"{RESULTS[name]['detail']}", flush=True)
    print("MMFQ-RESULTS " + json.dumps(RESULTS), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
