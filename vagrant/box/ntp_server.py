#!/usr/bin/python3
"""A minimal SNTP server (RFC 4330) serving this host's clock to the testbed's
VMs, which can reach no NTP server of their own here (vagrant/box/README.md,
"What does not work"): vagrant/box/host.sh starts it, provision.sh points each
VM's chrony at the host.  Answers only clients in --allow networks; never sets
or reads anything but the host's clock (it is a server, not a client).

    ntp_server.py [--bind 0.0.0.0] [--port 123] [--allow 192.168.56.0/21]

Standard library only (it runs with the host's /usr/bin/python3).
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import struct
import time

NTP_EPOCH = 2_208_988_800  # 1900-01-01 -> 1970-01-01
PACKET = struct.Struct("!BBbb11I")  # li/vn/mode, stratum, poll, precision, 11 words
REFID_LOCL = int.from_bytes(b"LOCL", "big")


def ntp_ts(t: float) -> tuple[int, int]:
    sec = int(t) + NTP_EPOCH
    frac = int((t % 1.0) * (1 << 32)) & 0xFFFFFFFF
    return sec & 0xFFFFFFFF, frac


def answer(req: bytes, rx: float) -> bytes | None:
    if len(req) < 48:
        return None
    first = req[0]
    version, mode = (first >> 3) & 7, first & 7
    if mode != 3 or not 1 <= version <= 4:  # client requests only
        return None
    orig_sec, orig_frac = struct.unpack_from("!II", req, 40)  # the client's transmit time
    ref = ntp_ts(rx - 1.0)
    rxs = ntp_ts(rx)
    txs = ntp_ts(time.time())
    # leap 0 (synchronised), the client's version, mode 4 (server); stratum 2;
    # poll as asked; precision 2^-20 s; root delay and dispersion ~1 ms
    return PACKET.pack((0 << 6) | (version << 3) | 4, 2, req[2], -20,
                       0x0000_0041, 0x0000_0041, REFID_LOCL,
                       ref[0], ref[1], orig_sec, orig_frac, rxs[0], rxs[1], txs[0], txs[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bind", default="0.0.0.0")
    p.add_argument("--port", type=int, default=123)
    p.add_argument("--allow", action="append", default=None,
                   help="client networks (default 192.168.56.0/21 and 192.168.121.0/24)")
    a = p.parse_args()
    nets = [ipaddress.ip_network(n) for n in (a.allow or ["192.168.56.0/21", "192.168.121.0/24"])]
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((a.bind, a.port))
    while True:
        req, addr = s.recvfrom(512)
        rx = time.time()
        if not any(ipaddress.ip_address(addr[0]) in n for n in nets):
            continue
        out = answer(req, rx)
        if out is not None:
            s.sendto(out, addr)


if __name__ == "__main__":
    raise SystemExit(main())
