"""A sidecar-only install (issue 17): ``pip install mmmesh[sidecar]`` into an
empty virtualenv carries none of the node's dependencies (pyroute2, scapy,
fastapi, the etcd client's generated stubs) and still runs
``mmmesh-sidecar --help`` and relays an MMH frame through a python stage.

The wheels come from the wheelhouse ``scripts/bootstrap.sh test`` builds
(``.cache/wheelhouse``), installed with ``--no-index``: the test itself needs
no registry.  The checkout is installed as it is now (not the wheel built at
bootstrap time)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from mmmesh.wire import FrameReader
from testkit import ROOT
from testkit.sidecar_stages import frame_bytes, free_port, tensor_header

WHEELS = ROOT / ".cache" / "wheelhouse"
BASE_PYTHON = Path(getattr(sys, "_base_executable", sys.executable))
NOT_THERE = ("pyroute2", "scapy", "fastapi", "qosd.store.etcd.client.pb.rpc_pb2", "bcc",
             "grpc", "onnxruntime", "tritonclient", "httpx")

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (WHEELS / ".stamp").is_file():
        msg = f"no wheelhouse at {WHEELS}: run scripts/bootstrap.sh test"
        if os.environ.get("CI"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    d = tmp_path_factory.mktemp("sidecar-venv") / "venv"
    subprocess.run([str(BASE_PYTHON), "-m", "venv", str(d)], check=True, timeout=120)
    # the checkout as it is now, copied (the build writes build/ and *.egg-info);
    # the build's own setuptools comes from the wheelhouse too
    src = d.parent / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / f, src / f)
    for pkg in ("mmmesh", "qosd", "sidecar", "mmmeshctl", "demo"):
        # (not a compiled module built in the checkout: the install builds its own)
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    r = subprocess.run([str(d / "bin" / "pip"), "install", "-q", "--no-index", "--find-links",
                        str(WHEELS), f"{src}[sidecar]"],
                       capture_output=True, text=True, timeout=480)
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def test_the_sidecar_install_has_none_of_the_node_side(venv: Path) -> None:
    code = textwrap.dedent(f"""
        import importlib, json
        out = {{}}
        for name in {NOT_THERE!r}:
            try:
                importlib.import_module(name)
                out[name] = "imported"
            except ImportError as e:
                out[name] = "missing"
        print(json.dumps(out))
    """)
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True,
                       text=True, timeout=60, check=True, cwd="/")
    import json

    assert set(json.loads(r.stdout).values()) == {"missing"}, r.stdout
    # and what it does carry is what the sidecar needs
    r = subprocess.run([str(venv / "bin" / "python"), "-c",
                        "import numpy, pydantic, prometheus_client, ddsketch, sidecar.main"],
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr


def test_mmmesh_sidecar_help_runs(venv: Path) -> None:
    r = subprocess.run([str(venv / "bin" / "mmmesh-sidecar"), "--help"], capture_output=True,
                       text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    assert "--config" in r.stdout


def test_the_install_built_the_compiled_codec_and_can_do_without(venv: Path) -> None:
    """pyproject's optional ext-module: with a C compiler and the Python headers
    (scripts/bootstrap.sh installs both) the install builds mmmesh.wire._cwire;
    MMMESH_WIRE=python (or an install without it) runs the pure-Python codec."""
    code = "import mmmesh.wire._codec as c; print(c.IMPLEMENTATION)"
    env = {k: v for k, v in os.environ.items() if k != "MMMESH_WIRE"}
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True,
                       text=True, timeout=60, cwd="/", env=env, check=False)
    assert r.returncode == 0, r.stderr
    want = "c" if shutil.which("cc") and Path(sysconfig_include(), "Python.h").is_file() \
        else "python"
    assert r.stdout.strip() == want
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True,
                       text=True, timeout=60, cwd="/", env={**env, "MMMESH_WIRE": "python"},
                       check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "python"


def sysconfig_include() -> str:
    import sysconfig

    return sysconfig.get_paths()["include"]


@pytest.mark.parametrize("codec", ["compiled", "python"])
def test_it_relays_an_mmh_frame_through_a_python_stage(venv: Path, tmp_path: Path,
                                                       codec: str) -> None:
    (tmp_path / "stage_ident.py").write_text("def identity(x):\n    return x\n")
    sink = socket.create_server(("127.0.0.1", 0))
    sink.settimeout(60)
    port_in = free_port()
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(textwrap.dedent(f"""
        stage: relay
        listen: {{tcp: "127.0.0.1:{port_in}"}}
        runner: {{kind: python, target: "stage_ident:identity", timeout_s: 5}}
        outputs:
          - {{name: next, address: "127.0.0.1:{sink.getsockname()[1]}", modality: tensor,
             sla_class: video}}
        qosd: {{socket: null}}
    """))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("VIRTUAL_ENV", None)
    env.pop("MMMESH_WIRE", None)
    if codec == "python":
        env["MMMESH_WIRE"] = "python"
    proc = subprocess.Popen([str(venv / "bin" / "mmmesh-sidecar"), "--config", str(cfg)],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        arr = np.arange(256, dtype=np.float32)
        data = frame_bytes(tensor_header(arr, seq=7), arr)
        deadline = time.monotonic() + 60
        while True:  # until the sidecar listens
            try:
                up = socket.create_connection(("127.0.0.1", port_in), timeout=5)
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()[-3000:] \
                    if proc.stdout else ""
                assert time.monotonic() < deadline, "the sidecar did not listen within 60 s"
                time.sleep(0.1)
        with up:
            up.sendall(data)
            conn, _ = sink.accept()
            with conn:
                conn.settimeout(60)
                reader = FrameReader()
                got = None
                while got is None:
                    chunk = conn.recv(65536)
                    assert chunk, "the sidecar closed the downstream connection"
                    reader.feed(chunk)
                    got = reader.next_frame()
        hdr, payload = got
        assert hdr.sequence == 7
        assert np.array_equal(np.frombuffer(bytes(payload), dtype=np.float32), arr)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        sink.close()
