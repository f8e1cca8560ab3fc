"""The socket layer outlives its loader and is adopted, replaced and taken down:

* a loader killed with SIGKILL leaves both programs attached and everything
  pinned; a new loader adopts them (same program ids) and redirect works;
* ``down`` detaches, releases the sockets (bytes already redirected stay
  readable, the connection carries on over TCP) and unpins;
* another build replaces the pinned one and detaches the old programs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mmmesh.abi import Modality
from mmmesh.dataplane import Endpoint, SocketLayer
from testkit import socklayer_kit as kit
from testkit.privileged import require_privileged

pytestmark = pytest.mark.privileged

ROOT = Path(__file__).resolve().parents[3]
LOADER = """
import json, sys, time
from mmmesh.dataplane import SocketLayer
r = SocketLayer(sys.argv[1]).up([])
print(json.dumps({"adopted": r.adopted, "prog_ids": r.prog_ids}), flush=True)
time.sleep(120)
"""


def cgroup_prog_ids(path: str) -> list[int]:
    from mmmesh.dataplane import _bpf

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return _bpf.prog_query(fd, _bpf.BPF_CGROUP_SOCK_OPS)
    finally:
        os.close(fd)


def redirected_pair(path: str, sl: SocketLayer, stage: int) -> tuple[socket.socket, socket.socket]:
    with kit.inside(path):
        ls, port = kit.listener()
        sl.set_endpoints([Endpoint("127.0.0.1", port, stage)])
        c, s = kit.connect(ls, port)
        ls.close()
    return c, s


def test_adopted_after_kill9_then_down() -> None:
    require_privileged()
    with kit.scratch_cgroup("adopt") as (path, rel):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        child = subprocess.Popen([sys.executable, "-c", LOADER, rel], stdout=subprocess.PIPE,
                                 text=True, cwd=ROOT, env=env)
        sl = SocketLayer(rel)
        try:
            assert child.stdout is not None
            first = json.loads(child.stdout.readline())
            assert first["adopted"] is False
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        try:
            st = sl.status()  # the loader is gone: still pinned and attached
            assert st.loaded and st.attached == {"sockops": True, "sk_msg": True}
            assert st.prog_ids == first["prog_ids"]
            assert st.prog_ids["sockops"] in cgroup_prog_ids(path)
            r = sl.up()
            assert r.adopted and r.prog_ids == first["prog_ids"]
            assert cgroup_prog_ids(path).count(r.prog_ids["sockops"]) == 1  # not attached twice

            c, s = redirected_pair(path, sl, stage=51)
            f1, f2, f3 = (kit.frame(int(Modality.TEXT), 500, seq=i) for i in range(3))
            c.sendall(f1)
            assert kit.read_exactly(s, len(f1)) == f1
            assert kit.bytes_received(s) == 0
            c.sendall(f2)  # redirected, not read yet
        finally:
            sl.down()
        assert not sl.loaded() and not os.path.exists(sl.pin_dir)
        assert r.prog_ids["sockops"] not in cgroup_prog_ids(path)
        # what was redirected before down() is still there, then TCP carries on
        assert kit.read_exactly(s, len(f2)) == f2
        c.sendall(f3)
        assert kit.read_exactly(s, len(f3)) == f3
        assert kit.bytes_received(s) == len(f3)
        sl.down()  # idempotent


def test_another_build_replaces_and_detaches_the_old_one() -> None:
    require_privileged()
    with kit.scratch_cgroup("replace") as (path, rel):
        sl = SocketLayer(rel)
        try:
            old = sl.up([])
            new = sl.up([], tunables={"MM_SOCK_MAX": 4096})
            assert not new.adopted and new.prog_ids != old.prog_ids
            ids = cgroup_prog_ids(path)
            assert new.prog_ids["sockops"] in ids and old.prog_ids["sockops"] not in ids
            assert sl.status().attached == {"sockops": True, "sk_msg": True}
            c, s = redirected_pair(path, sl, stage=52)
            f = kit.frame(int(Modality.AUDIO), 100)
            c.sendall(f)
            assert kit.read_exactly(s, len(f)) == f and kit.bytes_received(s) == 0
        finally:
            sl.down()
