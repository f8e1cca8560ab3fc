#!/usr/bin/env python3
"""Cost of the TC classifier per packet, measured with BPF_PROG_TEST_RUN.

Every packet kind is run ``--repeat`` times in one BPF_PROG_TEST_RUN call (the
kernel reports the average ns per repetition, in whole ns), ``--rounds`` times,
the kinds interleaved round by round; the median round is reported, and the
ratio is the median of the per-round ratios to the empty program.  The
yardstick is an EMPTY SCHED_CLS program that returns TC_ACT_OK, timed the same
way: its cost (~10 ns) is the test-run loop itself, so the ratio is "how many
empty programs one classifier run costs".

What is measured, kind by kind (all through the real ``mm_egress``):

  udp_mmh          UDP, MMH audio header with 4 TLVs, source outside every
                   source rule (parse + TLV walk + policy lookup + LPM lookup)
  udp_mmh_clamped  same from 10.0.99.7: the source rule clamps voice to video
  tcp_hdr          TCP segment starting with an MMH header, on a flow already
                   learnt with the same class: the steady-state cost of header
                   segments (header parse + flow lookup, no flow insert).  The
                   first segment of a new flow also pays one LRU insert, which
                   repetitions of a test run cannot measure.
  tcp_flow_hit     TCP segment without a header on a learnt flow
  udp_not_mesh     UDP, payload without the MMH magic
  tcp_not_mesh     TCP, no header, no flow (flow-table miss)
  malformed        UDP, valid preamble but a duplicate STREAM_ID TLV at the end
                   (the whole TLV walk runs before the header is refused)
  ipv6_udp_mmh     IPv6 UDP with the audio header

BPF_PROG_TEST_RUN runs the repetitions on the same skb, so a DSCP rewrite
would happen only in the first one; every frame here already carries its
class's DSCP, so all repetitions do the same work (no rewrite).

Targets (ratio to the empty program): <= 3.5x for header-parsing packets,
<= 2.5x for flow hits, <= 1.5x for non-mesh packets.  ``--strict`` exits 1
when a target is missed.  Results go to out/bench/classifier.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import struct
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mmmesh.dataplane import testing  # noqa: E402
from mmmesh.dataplane.classify import Classifier  # noqa: E402
from mmmesh.files import write_json  # noqa: E402
from mmmesh.policy import load_policy  # noqa: E402
from mmmesh.wire import Header, encode_header  # noqa: E402

EMPTY_PROG = b"""
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>
int mm_empty(struct __sk_buff *skb)
{
	return TC_ACT_OK;
}
"""

TARGETS = {"header": 3.5, "flow": 2.5, "not_mesh": 1.5}
# kind -> (target group, expected reason)
KINDS: dict[str, tuple[str, str]] = {
    "udp_mmh": ("header", "parsed"),
    "udp_mmh_clamped": ("header", "parsed"),
    "tcp_hdr": ("header", "parsed"),
    "tcp_flow_hit": ("flow", "flow_hit"),
    "udp_not_mesh": ("not_mesh", "not_mesh"),
    "tcp_not_mesh": ("not_mesh", "not_mesh"),
    "malformed": ("header", "malformed"),
    "ipv6_udp_mmh": ("header", "parsed"),
}


# --------------------------------------------------------------------------
# Frames, built by hand
# --------------------------------------------------------------------------
def _csum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _eth(ethertype: int) -> bytes:
    return bytes.fromhex("020000000002" "020000000001") + struct.pack("!H", ethertype)


def _ipv4(src: str, dst: str, proto: int, l4: bytes, dscp: int) -> bytes:
    s = bytes(int(x) for x in src.split("."))
    d = bytes(int(x) for x in dst.split("."))
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, dscp << 2, 20 + len(l4), 1, 0, 64, proto, 0, s, d)
    hdr = hdr[:10] + struct.pack("!H", _csum(hdr)) + hdr[12:]
    return _eth(0x0800) + hdr + l4


def _ipv6(src: bytes, dst: bytes, proto: int, l4: bytes, dscp: int) -> bytes:
    tc = dscp << 2
    vtf = (6 << 28) | (tc << 20)
    return _eth(0x86DD) + struct.pack("!IHBB16s16s", vtf, len(l4), proto, 64, src, dst) + l4


def _udp(payload: bytes, sport: int = 40000, dport: int = 7000) -> bytes:
    return struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload


def _tcp(payload: bytes, sport: int = 40001, dport: int = 7001) -> bytes:
    # 20-byte header + 12 bytes of options (NOP NOP timestamps), as Linux sends
    opts = b"\x01\x01\x08\x0a" + struct.pack("!II", 1, 2)
    return struct.pack("!HHIIBBHHH", sport, dport, 1, 1, (8 << 4), 0x18, 512, 0, 0) + opts + payload


def build_frames(policy) -> dict[str, bytes]:  # type: ignore[no-untyped-def]
    voice = policy.class_named("voice").dscp or 0
    video = policy.class_named("video").dscp or 0
    be = policy.default.dscp or 0
    body = b"\0" * 160
    hdr = encode_header(
        Header(modality=4, payload_len=len(body), stream_id=7, sequence=1000,
               timestamp_ns=1_700_000_000_123_456_789, bitrate=1_536_000)
    )
    bad = hdr + b"\x01\x04" + b"\0\0\0\x07"  # duplicate STREAM_ID, last TLV
    bad = bad[:4] + bytes([len(bad)]) + bad[5:]
    src6 = bytes.fromhex("fd000000000000000000000000000001")
    dst6 = bytes.fromhex("fd000000000000000000000000000002")
    return {
        "udp_mmh": _ipv4("10.0.1.5", "10.0.2.9", 17, _udp(hdr + body), voice),
        "udp_mmh_clamped": _ipv4("10.0.99.7", "10.0.2.9", 17, _udp(hdr + body), video),
        "tcp_hdr": _ipv4("10.0.1.5", "10.0.2.9", 6, _tcp(hdr + body), voice),
        "tcp_flow_hit": _ipv4("10.0.1.5", "10.0.2.9", 6, _tcp(b"\x55" * 1200), voice),
        "udp_not_mesh": _ipv4("10.0.1.5", "10.0.2.9", 17, _udp(b"\x17\x03\x03" + body), be),
        "tcp_not_mesh": _ipv4("10.0.1.5", "10.0.2.9", 6, _tcp(b"GET / HTTP/1.1\r\n" + body,
                                                               sport=40002), be),
        "malformed": _ipv4("10.0.1.5", "10.0.2.9", 17, _udp(bad + body), be),
        "ipv6_udp_mmh": _ipv6(src6, dst6, 17, _udp(hdr + body), voice),
    }


# --------------------------------------------------------------------------
# Verifier statistics (struct bpf_prog_info, up to verified_insns)
# --------------------------------------------------------------------------
# --------------------------------------------------------------------------
def load_empty() -> tuple[int, object]:
    import bcc  # noqa: PLC0415 - bench only: the product loads nothing like this

    b = bcc.BPF(text=EMPTY_PROG)
    fn = b.load_func(b"mm_empty", bcc.BPF.SCHED_CLS)
    return fn.fd, b


def time_all(progs: dict[str, tuple[int, bytes]], repeat: int, rounds: int) -> dict[str, list[int]]:
    """ns/pkt of every (prog fd, frame), ``rounds`` times, interleaved: a round
    times every kind once, so load changes on the machine hit all kinds alike."""
    for fd, frame in progs.values():  # warm up (caches, branch predictors, JIT pages)
        testing.prog_test_run(fd, frame, repeat=max(1, repeat // 20))
    out: dict[str, list[int]] = {k: [] for k in progs}
    for _ in range(rounds):
        for k, (fd, frame) in progs.items():
            out[k].append(testing.prog_test_run(fd, frame, repeat=repeat).duration_ns)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=500_000, help="repetitions per test run")
    ap.add_argument("--rounds", type=int, default=7, help="test runs per kind (median taken)")
    ap.add_argument("--policy", default=str(ROOT / "examples" / "policy.yaml"))
    ap.add_argument("--out", default=str(ROOT / "out" / "bench" / "classifier.json"))
    ap.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--no-pin", action="store_true", help="do not pin to one CPU")
    args = ap.parse_args(argv)

    if os.geteuid() != 0:
        print("bench/classifier.py: needs root (BPF_PROG_TEST_RUN)", file=sys.stderr)
        return 2
    cpu = None
    if not args.no_pin:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})

    t0 = time.monotonic()
    policy = load_policy(args.policy)
    frames = build_frames(policy)
    empty_fd, empty_obj = load_empty()
    clf = Classifier(policy)
    try:
        eg = clf.prog_fd("egress")
        # Sanity: each frame takes the path it is meant to measure; learn the TCP flow.
        clf.run(frames["tcp_hdr"])
        for kind, (_, want) in KINDS.items():
            v = clf.run(frames[kind])
            if v.verdict != "pass" or v.reason != want or v.dscp_rewritten:
                print(f"{kind}: unexpected verdict {v.reason}/{v.verdict} "
                      f"(dscp rewritten: {v.dscp_rewritten}), wanted {want}", file=sys.stderr)
                return 2
            if kind == "udp_mmh_clamped" and not v.clamped:
                print("udp_mmh_clamped: not clamped", file=sys.stderr)
                return 2
            if kind == "tcp_hdr" and v.flow_learnt:
                print("tcp_hdr: flow not learnt before the timing", file=sys.stderr)
                return 2

        progs = {"empty": (empty_fd, frames["udp_mmh"])}
        progs.update({k: (eg, frames[k]) for k in KINDS})
        timed = time_all(progs, args.repeat, args.rounds)
        empty = timed["empty"]
        base = statistics.median(empty)
        results = []
        for kind, (group, reason) in KINDS.items():
            ns = timed[kind]
            med = statistics.median(ns)
            # Ratio: median over rounds of (kind / empty in the same round).
            ratio = statistics.median(n / e for n, e in zip(ns, empty, strict=True) if e) \
                if all(empty) else float("inf")
            target = TARGETS[group]
            results.append({
                "kind": kind, "group": group, "reason": reason, "ns_per_pkt": med,
                "min_ns_per_pkt": min(ns), "rounds_ns": ns, "ratio": round(ratio, 3),
                "target_ratio": target,
                "pass": ratio <= target, "frame_len": len(frames[kind]),
            })
        stats = {"mm_egress": testing.prog_stats(eg),
                 "mm_ingress": testing.prog_stats(clf.prog_fd("ingress"))}
    finally:
        clf.close()
        empty_obj.cleanup()  # type: ignore[attr-defined]
    elapsed = time.monotonic() - t0

    print(f"empty SCHED_CLS program: {base:.0f} ns/pkt (rounds {empty}); "
          f"repeat {args.repeat} x {args.rounds} rounds, median"
          + (f", pinned to CPU {cpu}" if cpu is not None else ""))
    print(f"{'kind':<17} {'ns/pkt':>7} {'ratio':>6} {'target':>7}  result")
    for r in results:
        print(f"{r['kind']:<17} {r['ns_per_pkt']:>7.0f} {r['ratio']:>5.2f}x "
              f"{'<=' + str(r['target_ratio']) + 'x':>7}  {'PASS' if r['pass'] else 'FAIL'}")
    for name, s in stats.items():
        if s["xlated_insns"] is not None:
            print(f"{name}: {s['xlated_insns']} insns, {s['jited_bytes']} JIT bytes, "
                  f"verifier processed {s['verified_insns'] if s['verified_insns'] else 'n/a'}")
    failed = [r["kind"] for r in results if not r["pass"]]
    print(f"{len(results) - len(failed)}/{len(results)} within target ({elapsed:.1f} s)")

    write_json(Path(args.out), {
        "tool": "bench/classifier.py",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "pinned_cpu": cpu,
        "repeat": args.repeat,
        "rounds": args.rounds,
        "policy": args.policy,
        "empty_ns_per_pkt": base,
        "empty_rounds_ns": empty,
        "targets": TARGETS,
        "results": results,
        "programs": stats,
        "failed": failed,
        "elapsed_s": round(elapsed, 2),
    })
    print(f"wrote {args.out}")
    return 1 if (args.strict and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
