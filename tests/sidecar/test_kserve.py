"""The kserve-rest / kserve-grpc runners against real KServe v2 servers.

Two servers run from .venv-mlserver (made by scripts/mlserver-env.sh; MLServer
pins its own fastapi/pydantic/grpcio, so it does not live in .venv):

* MLServer 1.7 serving testkit/mlserver_model: "double" (x*2, any numeric
  datatype and shape; an input named "boom" fails) and "sleepy" (the same after
  3 s).  Its REST endpoint has no binary tensor data extension, so it covers
  REST JSON, gRPC, errors and timeouts.
* KServe's own Python model server (kserve 0.16, testkit/mlserver_model/
  kserve_server.py) serving "double": REST with the binary extension, JSON and
  gRPC.

Outside CI a missing or broken server environment skips; with CI set it fails.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from mmmesh.wire import Header, parse_modality
from sidecar.config import RunnerConfig
from sidecar.contract import StageInput, tensor_spec
from sidecar.runners.kserve import (
    KServeError,
    KServeGrpcRunner,
    KServeRestRunner,
    KServeTimeout,
    kserve_datatype,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "testkit" / "mlserver_model"
VENV = ROOT / ".venv-mlserver"
ENV_SCRIPT = ROOT / "scripts" / "mlserver-env.sh"
STAMP = VENV / ".mmmesh-mlserver-installed"
START_TIMEOUT_S = 60.0
# start() with timeout_s=0.5 gives up after 0.5 s of polling plus at most 0.5 s
# listing the server's models: about 1 s.  The bug this bound catches is a
# start() not bounded by timeout_s, one that goes on polling a model that will
# never be ready or a server that is down (until the test's HANG_S).  10 s, ten
# times the expected time, leaves room for a loaded 2-vCPU host.
GIVES_UP_WITHIN_S = 10.0
HANG_S = 60.0  # a call that has not returned by then fails the test instead of hanging it


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"KServe interop test cannot run in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ensure_venv() -> None:
    if STAMP.exists() and (VENV / "bin" / "mlserver").exists():
        return
    try:
        r = subprocess.run(["bash", str(ENV_SCRIPT)], capture_output=True, text=True,
                           timeout=900, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        _unavailable(f"{ENV_SCRIPT.name} did not finish: {e}")
        return
    if r.returncode != 0:
        _unavailable(f"{ENV_SCRIPT.name} failed ({r.returncode}): {r.stderr[-2000:]}")


class _Server:
    def __init__(self, name: str, argv: list[str], workdir: Path, http: int, grpc: int,
                 extra_env: dict[str, str]) -> None:
        self.name, self.http, self.grpc = name, http, grpc
        self.log = workdir / f"{name}.log"
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.update(extra_env)
        self._logf = open(self.log, "wb")
        self.proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=self._logf,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                               f"{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.rest_url}/v2/health/ready", timeout=1) as r:
                if r.status != 200:
                    return False
        except OSError:
            return False
        try:
            socket.create_connection(("127.0.0.1", self.grpc), timeout=1).close()
        except OSError:
            return False
        return True

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._logf.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    _ensure_venv()
    work = tmp_path_factory.mktemp("kserve-servers")
    started: list[_Server] = []
    try:
        ml_http, ml_grpc, ml_metrics = _free_port(), _free_port(), _free_port()
        started.append(_Server(
            "mlserver", [str(VENV / "bin" / "mlserver"), "start", str(MODEL_DIR)], work,
            ml_http, ml_grpc,
            {"MLSERVER_HTTP_PORT": str(ml_http), "MLSERVER_GRPC_PORT": str(ml_grpc),
             "MLSERVER_METRICS_PORT": str(ml_metrics),
             "MLSERVER_METRICS_DIR": str(work / "metrics")}))
        ks_http, ks_grpc = _free_port(), _free_port()
        started.append(_Server(
            "kserve", [str(VENV / "bin" / "python"), str(MODEL_DIR / "kserve_server.py"),
                       "--http_port", str(ks_http), "--grpc_port", str(ks_grpc)],
            work, ks_http, ks_grpc, {}))
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = list(started)
        while waiting:
            try:
                waiting = [s for s in waiting if not s.ready()]
            except RuntimeError as e:
                _unavailable(str(e))
            if waiting and time.monotonic() > deadline:
                logs = "; ".join(f"{s.name}:\n{s.log_tail()}" for s in waiting)
                _unavailable(f"not ready after {START_TIMEOUT_S:g}s: {logs}")
            time.sleep(0.2)
        yield {s.name: s for s in started}
    finally:
        for s in started:
            s.stop()


# -- helpers ---------------------------------------------------------------

def _inp(arr: np.ndarray) -> StageInput:
    hdr = Header(modality=parse_modality("tensor"), tensor=tensor_spec(arr))
    return StageInput(header=hdr, array=arr, received_ns=time.time_ns(), source="test:0")


def _cfg(kind: str, target: str, model: str = "double", **kw: object) -> RunnerConfig:
    kw.setdefault("timeout_s", 5.0)
    return RunnerConfig(kind=kind, target=target, model_name=model, **kw)  # type: ignore[arg-type]


def _runner(cfg: RunnerConfig) -> KServeRestRunner | KServeGrpcRunner:
    return KServeRestRunner(cfg) if cfg.kind == "kserve-rest" else KServeGrpcRunner(cfg)


ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5,  # FP32 2-D
    np.array([1, -2, 3, 1 << 40], dtype=np.int64),  # INT64 1-D
    np.arange(24, dtype=np.int32).reshape(2, 3, 4),  # INT32 3-D
    np.linspace(-1, 1, 7, dtype=np.float64),  # FP64 1-D
]


def _roundtrip(cfg: RunnerConfig, arrays: list[np.ndarray]) -> list[np.ndarray]:
    async def go() -> list[np.ndarray]:
        r = _runner(cfg)
        await r.start()
        try:
            return [await r.infer(_inp(a)) for a in arrays]
        finally:
            await r.close()

    return asyncio.run(go())


def _assert_doubled(arrays: list[np.ndarray], outs: list[np.ndarray]) -> None:
    for a, o in zip(arrays, outs, strict=True):
        assert o.dtype == a.dtype.newbyteorder("=") and o.shape == a.shape, (a, o)
        np.testing.assert_array_equal(o, a * 2)


def _expect_error(cfg: RunnerConfig, arr: np.ndarray | None = None,
                  exc: type[Exception] = KServeError) -> tuple[str, float]:
    """Start (and infer arr, if given) expecting exc; (message, seconds taken)."""
    async def go() -> tuple[str, float]:
        r = _runner(cfg)
        t0 = time.monotonic()
        try:
            await r.start()
            assert arr is not None, "start() should have failed"
            t0 = time.monotonic()
            await r.infer(_inp(arr))
        except exc as e:
            return str(e), time.monotonic() - t0
        finally:
            await r.close()
        raise AssertionError(f"no {exc.__name__} raised")

    return asyncio.run(asyncio.wait_for(go(), HANG_S))


# -- values through real servers --------------------------------------------

def test_rest_binary_kserve(servers) -> None:  # type: ignore[no-untyped-def]
    arrays = ARRAYS + [np.full((2, 2), 1.5, dtype=np.float16)]  # FP16 needs binary
    outs = _roundtrip(_cfg("kserve-rest", servers["kserve"].rest_url, binary_data=True),
                      arrays)
    _assert_doubled(arrays, outs)


def test_rest_binary_is_really_binary(servers) -> None:  # type: ignore[no-untyped-def]
    # MLServer's REST endpoint has no binary extension: a binary request must
    # fail there (proving the runner sent one) with a hint how to configure it
    msg, _ = _expect_error(_cfg("kserve-rest", servers["mlserver"].rest_url,
                                binary_data=True), ARRAYS[0])
    assert "500" in msg and "binary_data: false" in msg and "'double'" in msg


@pytest.mark.parametrize("server", ["mlserver", "kserve"])
def test_rest_json(servers, server: str) -> None:  # type: ignore[no-untyped-def]
    outs = _roundtrip(_cfg("kserve-rest", servers[server].rest_url, binary_data=False),
                      ARRAYS)
    _assert_doubled(ARRAYS, outs)


@pytest.mark.parametrize("server", ["mlserver", "kserve"])
def test_grpc(servers, server: str) -> None:  # type: ignore[no-untyped-def]
    arrays = ARRAYS + [np.full((1, 3), -0.25, dtype=np.float16),
                       np.array([[1, 2], [3, 4]], dtype=np.uint8)]
    outs = _roundtrip(_cfg("kserve-grpc", servers[server].grpc_url), arrays)
    _assert_doubled(arrays, outs)


@pytest.mark.parametrize("kind", ["kserve-rest", "kserve-grpc"])
def test_noncontiguous_and_big_endian_inputs(servers, kind: str) -> None:  # type: ignore[no-untyped-def]
    s = servers["kserve"]
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    arrays = [base.T, base[:, ::2], base.astype(">f4"), np.arange(5).astype(">i8")]
    outs = _roundtrip(_cfg(kind, s.rest_url if kind == "kserve-rest" else s.grpc_url),
                      arrays)
    _assert_doubled(arrays, outs)


@pytest.mark.parametrize("kind", ["kserve-rest", "kserve-grpc"])
def test_concurrent_requests(servers, kind: str) -> None:  # type: ignore[no-untyped-def]
    s = servers["mlserver"]
    cfg = _cfg(kind, s.rest_url if kind == "kserve-rest" else s.grpc_url,
               binary_data=False, concurrency=4)
    arrays = [np.full((2, 8), i, dtype=np.float32) for i in range(16)]

    async def go() -> list[np.ndarray]:
        r = _runner(cfg)
        await r.start()
        try:
            return list(await asyncio.gather(*(r.infer(_inp(a)) for a in arrays)))
        finally:
            await r.close()

    _assert_doubled(arrays, asyncio.run(go()))


def test_output_name_and_first_output(servers) -> None:  # type: ignore[no-untyped-def]
    s = servers["mlserver"]
    a = ARRAYS[0]
    for kind, url in (("kserve-rest", s.rest_url), ("kserve-grpc", s.grpc_url)):
        _assert_doubled([a], _roundtrip(_cfg(kind, url, binary_data=False,
                                             output_name="output"), [a]))
    # kserve's "double" declares no outputs in its metadata: the response's first
    ks = servers["kserve"]
    _assert_doubled([a], _roundtrip(_cfg("kserve-rest", ks.rest_url), [a]))
    msg, _ = _expect_error(_cfg("kserve-rest", s.rest_url, binary_data=False,
                                output_name="logits"), a)
    assert "'logits'" in msg and "output" in msg


# -- errors -------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["kserve-rest", "kserve-grpc"])
def test_wrong_model_name(servers, kind: str) -> None:  # type: ignore[no-untyped-def]
    s = servers["mlserver"]
    url = s.rest_url if kind == "kserve-rest" else s.grpc_url
    msg, took = _expect_error(_cfg(kind, url, model="no-such-model", timeout_s=0.5))
    assert "'no-such-model'" in msg and str(s.http if kind == "kserve-rest" else s.grpc) in msg
    assert "not ready" in msg
    assert took < GIVES_UP_WITHIN_S, took


@pytest.mark.parametrize("kind", ["kserve-rest", "kserve-grpc"])
def test_server_down(kind: str) -> None:
    port = _free_port()  # nothing listens there
    url = f"http://127.0.0.1:{port}" if kind == "kserve-rest" else f"127.0.0.1:{port}"
    msg, took = _expect_error(_cfg(kind, url, timeout_s=0.5))
    assert f"127.0.0.1:{port}" in msg and "'double'" in msg and "unreachable" in msg
    assert took < GIVES_UP_WITHIN_S, took


@pytest.mark.parametrize("server,kind,binary", [
    ("mlserver", "kserve-rest", False), ("mlserver", "kserve-grpc", False),
    ("kserve", "kserve-rest", True), ("kserve", "kserve-grpc", False)])
def test_server_error_message(servers, server: str, kind: str, binary: bool) -> None:  # type: ignore[no-untyped-def]
    s = servers[server]
    cfg = _cfg(kind, s.rest_url if kind == "kserve-rest" else s.grpc_url,
               input_name="boom", binary_data=binary)

    async def go() -> None:
        r = _runner(cfg)
        await r.start()
        try:
            for _ in range(2):  # the failure must not poison the next request
                with pytest.raises(KServeError, match="boom: this model was asked to fail") as ei:
                    await r.infer(_inp(ARRAYS[0]))
                assert ei.value.status and ei.value.model == "double"
        finally:
            await r.close()

    asyncio.run(go())


@pytest.mark.parametrize("kind", ["kserve-rest", "kserve-grpc"])
def test_timeout_honoured(servers, kind: str) -> None:  # type: ignore[no-untyped-def]
    """infer() gives up after timeout_s, before the server answers.  No upper
    bound in seconds (a loaded host stretches it): a witness request sent at
    the same time, with time enough to get the answer, must still be waiting
    when the bounded one gives up.  "sleepy" answers after 3 s: a runner that
    waited for the answer would finish after the witness (or return the
    doubled tensor instead of raising KServeTimeout)."""
    s = servers["mlserver"]
    url = s.rest_url if kind == "kserve-rest" else s.grpc_url
    cfg = _cfg(kind, url, model="sleepy", timeout_s=0.5, binary_data=False)
    patient = _cfg(kind, url, model="sleepy", timeout_s=30.0, binary_data=False)

    async def go() -> tuple[str, float, bool]:
        witness, bounded = _runner(patient), _runner(cfg)
        await witness.start()
        await bounded.start()
        try:
            answered = asyncio.create_task(witness.infer(_inp(ARRAYS[0])))
            t0 = time.monotonic()
            with pytest.raises(KServeTimeout) as ei:
                await bounded.infer(_inp(ARRAYS[0]))
            took = time.monotonic() - t0
            still_waiting = not answered.done()
            answered.cancel()
            await asyncio.gather(answered, return_exceptions=True)
            return str(ei.value), took, still_waiting
        finally:
            await bounded.close()
            await witness.close()

    msg, took, witness_still_waiting = asyncio.run(asyncio.wait_for(go(), HANG_S))
    assert took >= 0.45, took  # it waited its timeout (asyncio timers never fire early)
    assert witness_still_waiting, f"gave up after {took:.2f}s, not before the server answered"
    assert "'sleepy'" in msg and "0.5s" in msg
    assert issubclass(KServeTimeout, TimeoutError) and issubclass(KServeTimeout, KServeError)


# -- no server needed ---------------------------------------------------------

def test_config_and_datatypes() -> None:
    with pytest.raises(KServeError, match="model_name"):
        KServeRestRunner(RunnerConfig(kind="kserve-rest", target="127.0.0.1:1"))
    r = KServeRestRunner(_cfg("kserve-rest", "https://models.example:8443/"))
    assert r.url == "https://models.example:8443" and r.name == "kserve-rest:double"
    g = KServeGrpcRunner(_cfg("kserve-grpc", "grpc://10.0.0.1:8081"))
    assert g.url == "grpc://10.0.0.1:8081"
    with pytest.raises(KServeError, match="scheme"):
        KServeRestRunner(_cfg("kserve-rest", "ftp://x:1"))
    assert kserve_datatype(np.zeros(1, np.float32)) == "FP32"
    assert kserve_datatype(np.zeros(1, ">i8")) == "INT64"
    assert kserve_datatype(np.zeros(1, np.bool_)) == "BOOL"
    with pytest.raises(KServeError, match="complex"):
        kserve_datatype(np.zeros(1, np.complex64))
    with pytest.raises(KServeError, match="not started"):
        asyncio.run(r.infer(_inp(ARRAYS[0])))
