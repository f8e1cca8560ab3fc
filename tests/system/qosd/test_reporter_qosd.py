"""The sidecar's SLA reporter (sidecar/sla/reporter.py: h11 over an asyncio
unix stream) against a real qosd's report socket: reports are taken on one
kept-alive connection, a refusal is counted as a failure with qosd's reason,
and a connection qosd closed while idle costs nothing but a new one."""

from __future__ import annotations

import asyncio
import json

from sidecar.sla.reporter import KEEPALIVE_S, QosdReporter
from testkit.hostile_target import SLA_REPORT, Target
from testkit.privileged import require_privileged

REPORT = json.loads(SLA_REPORT)


def test_the_reporter_against_a_real_qosd() -> None:
    require_privileged()
    target = Target.start(nofile=1024)
    try:
        rep = QosdReporter(target.sla_socket, interval_s=1.0)

        async def main() -> tuple[list[bool], bool, bool]:
            rep.open()
            try:
                took = [await rep.post(REPORT) for _ in range(20)]
                refused = await rep.post({"stage": "x", "reports": [{"sla_class": "voice"}]})
                # past KEEPALIVE_S the reporter dials anew, whatever qosd did meanwhile
                await asyncio.sleep(KEEPALIVE_S + 0.2)
                again = await rep.post(REPORT)
                return took, refused, again
            finally:
                await rep.aclose()

        took, refused, again = asyncio.run(asyncio.wait_for(main(), 120))
        assert all(took) and again, (took, again)
        assert not refused
        assert (rep.sent, rep.failed) == (21, 1)
        assert rep.retried == 0  # no connection was closed under a request
    finally:
        target.stop()
