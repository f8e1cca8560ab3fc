"""SLA windows for a real qosd (a report, a reporter thread, a metric read),
for the controller and socket-layer system tests (tests/system/qosd/)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import yaml

from testkit.qosd_node import Node


def report(stage: str, frames: int, attainment: float, p99: float | None = None
           ) -> dict[str, Any]:
    """A window; without ``p99`` (a sketch of ``frames`` latencies of ``p99`` ms)
    the p99 is unmeasured, so voice as a whole has no verdict while a stage
    whose attainment misses does."""
    from mmmesh.sla.sketch import encode_sketch, new_sketch

    sketch = None
    if p99 is not None:
        sk = new_sketch()
        sk.add(p99, frames)
        sketch = encode_sketch(sk)
    return {"stage": stage, "instance": f"{stage}-0", "reports": [{
        "sla_class": "voice", "modality": "audio", "window_s": PERIOD_S, "frames": frames,
        "deadline_misses": int(frames * (1 - attainment)), "drops": 0, "errors": 0,
        "attainment": attainment, "sketch_e2e": sketch}]}


@contextmanager
def reporting(node: Node, *bodies: dict[str, Any]) -> Iterator[None]:
    """Posts ``bodies`` every half window in a thread for the block."""
    stop = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        while not stop.is_set():
            try:
                post(node, *bodies)
            except BaseException as e:  # noqa: BLE001 - raised in the test's thread
                failed.append(e)
                return
            stop.wait(PERIOD_S / 2)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(10)
    assert not failed, failed


def metric(node: Node, name: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    addr = yaml.safe_load(node.cfg.read_text())["metrics_addr"]
    for fam in text_string_to_metric_families(httpx.get(f"http://{addr}/metrics",
                                                        timeout=10).text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


PERIOD_S = 1.0


def post(node: Node, *bodies: dict[str, Any]) -> None:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(node.sock)),
                      base_url="http://qosd", timeout=10) as c:
        for body in bodies:
            assert c.post("/v1/sla", json=body).status_code == 200
