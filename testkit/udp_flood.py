"""Floods a link with MMH frames over UDP, one thread per flow, for the
traffic tests: ``python testkit/udp_flood.py SECS SRC DST MODALITY:SPORT:DPORT...``
(run inside the sending namespace).  A large SO_SNDBUF lets the senders fill
the qdisc instead of their socket buffers (ENVIRONMENT.md)."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mmmesh.wire import Header, encode_header  # noqa: E402

SO_SNDBUFFORCE = 32


def send_until(deadline: float, src: str, dst: tuple[str, int], sport: int, modality: int) -> None:
    frame = encode_header(Header(modality=modality, payload_len=1300)) + b"x" * 1300
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 8 << 20)
        s.bind((src, sport))
        while time.time() < deadline:
            try:
                s.sendto(frame, dst)
            except OSError:  # ENOBUFS: the qdisc is full
                time.sleep(0.0005)


def main(argv: list[str]) -> None:
    secs, src, dst, *flows = argv
    deadline = time.time() + float(secs)
    threads = []
    for spec in flows:
        modality, sport, dport = (int(x) for x in spec.split(":"))
        threads.append(threading.Thread(target=send_until,
                                        args=(deadline, src, (dst, dport), sport, modality)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main(sys.argv[1:])
