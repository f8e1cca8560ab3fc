"""The report endpoint (``POST /v1/sla`` of sla.sock) fuzzed with schemathesis,
as tests/qosd/test_api_serving.py fuzzes the admin API: valid and invalid bodies
from an allowed sender (root) and from a refused one (uid 65534), never a
5xx, every answer as documented, and a refused request changes nothing."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

from qosd import api
from qosd.config import QosdConfig
from qosd.daemon import build_controller, build_node, build_service, open_store
from qosd.service import QosdService
from qosd.sla.board import SlaBoard
from qosd.sla.quota import SlaLimits
from testkit.cgroups import process
from testkit.qosd_fake import with_peer


def board_state(board: SlaBoard) -> Any:
    """What a request may change: the kept windows (and the bytes they take)."""
    rows = {k: {f: v for f, v in r.entry.items()} for k, r in board._rows.items()}
    return rows, board.stats()["bytes"]


def fuzz(svc: QosdService, board: SlaBoard, app: Any) -> dict[int, int]:
    """Runs every operation of ``app``'s document; returns the statuses of
    ``POST /v1/sla`` (GET /healthz is checked, not counted)."""
    import hypothesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.core.result import Ok
    from schemathesis.openapi import from_asgi
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = from_asgi("/openapi.json", app)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]
    seen: dict[int, int] = {}

    def check(case: Any) -> None:
        before = board_state(board)
        response = case.call_and_validate(checks=checks)
        if case.method.upper() == "POST":
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
        if response.status_code >= 400:
            assert board_state(board) == before, (response.status_code, response.text)
        assert svc.sla()["skipped"] == 0  # a read never fails, whatever was taken

    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result
        operation = result.ok()
        strategies = [
            *((3, st) for st in schema.get_strategies_from_examples(operation)),
            (40, operation.as_strategy(generation_mode=GenerationMode.POSITIVE)),
            (40, operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)),
        ]
        for examples, strategy in strategies:
            test = given(case=strategy)(check)
            test = settings(max_examples=examples, deadline=None, database=None,
                            derandomize=True, phases=[Phase.explicit, Phase.generate],
                            suppress_health_check=list(HealthCheck))(test)
            with contextlib.suppress(hypothesis.errors.Unsatisfiable):
                test()
    return seen


def service(tmp_path: Path, **limits: Any) -> tuple[QosdService, SlaBoard]:
    """qosd's facade over its own parts (qosd/daemon.py builds them), and the board."""
    cfg = QosdConfig(state_dir=tmp_path / "state", api_socket=tmp_path / "a.sock",
                     sla_socket=None, metrics_addr=None, sla_limits=SlaLimits(**limits))
    node = build_node(cfg, open_store(cfg))
    return build_service(cfg, node, build_controller(cfg, node)), node.board


def test_fuzz_the_report_endpoint_as_an_allowed_sender(tmp_path: Path) -> None:
    """Root (this process): bodies within the schema are taken until the rate
    limit answers 429 (burst 10 here); the rest are 422 or 429, unchanged."""
    svc, board = service(tmp_path, sender_burst=10, sender_rate=0.001, sender_rows=16)
    seen = fuzz(svc, board, with_peer(api.create_sla_app(svc)))
    print(f"\nstatuses: {seen}")
    assert seen.get(200, 0) == 10 and seen.get(422, 0) >= 20 and seen.get(429, 0) >= 1
    assert set(seen) <= {200, 422, 429}
    assert 0 < len(svc.sla()["instances"]) <= 16


def test_fuzz_the_report_endpoint_as_a_refused_sender(tmp_path: Path) -> None:
    """uid 65534 may report nothing by default: every request is refused
    (403, or 422 for a body that is not JSON) and nothing is kept."""
    svc, board = service(tmp_path)
    with process(65534) as nobody:
        seen = fuzz(svc, board, with_peer(api.create_sla_app(svc), pid=nobody.pid, uid=65534,
                                   gid=65534))
    print(f"\nstatuses: {seen}")
    assert seen.get(403, 0) >= 20 and set(seen) <= {403, 422}
    assert svc.sla()["instances"] == []
    stats = board.stats()
    assert stats["refused:not_allowed"] == seen[403] and stats.get("accepted", 0) == 0


@pytest.mark.parametrize("frames", [10**400, -1, 1.5, "1", None, True])
def test_odd_counts_never_reach_the_board(tmp_path: Path, frames: Any) -> None:
    from fastapi.testclient import TestClient

    svc, _ = service(tmp_path)
    c = TestClient(with_peer(api.create_sla_app(svc)))
    r = c.post("/v1/sla", json={"stage": "asr", "reports": [
        {"sla_class": "voice", "modality": "audio", "window_s": 5.0, "frames": frames,
         "deadline_misses": 0, "drops": 0, "errors": 0, "attainment": 1.0}]})
    assert r.status_code in (200, 422), r.text
    if r.status_code == 200:  # lax numbers pydantic takes as exact ints ("1", True)
        assert isinstance(svc.sla()["instances"][0]["frames"], int)
    else:
        assert r.json()["errors"][0][0] == "body.reports[0].frames"
        assert svc.sla()["instances"] == []
