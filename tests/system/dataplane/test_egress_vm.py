"""Both egress modes on a multiqueue virtio NIC (4 queue pairs, 1 Gbit/s), in
one small VM with the kernel this host lacks (the testbed box's 6.12: sch_fq
with bands, mq, fq_codel): HTB replaces mq, fq keeps an fq per queue; both
classify; fq's bands, pacing across queues, horizon drops, drift repair,
adoption after kill -9, overrides, refusals, the SLA controller's writes
through qosd's reconciler, a one-queue device, the way back to htb.

The checks themselves are testkit/fq_vm_checks.py (they run inside the VM,
testkit/fq_vm.py boots it: ~30 s under emulation, then ~2 min of bcc and
checks); each is one test here.  This host's own kernel runs the BPF side in
tests/system/dataplane/test_egress_fq.py.

Runs where the host can boot the VM (root, QEMU, virtiofsd, /dev/net/tun);
elsewhere it skips with one line.  With CI set, a host that has QEMU but
cannot boot the VM fails.  MMMESH_VM_TIER=0 skips it on purpose (a
developer's quick run; CI does not set it)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.fq_vm import QEMU, FqVm, VmUnavailable, can_boot
from testkit.fq_vm_checks import CHECKS

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(3600)]
WORK = Path(os.environ.get("MMMESH_FQVM_DIR", "/tmp/mmmesh-fqvm"))


def _cannot(why: str) -> None:
    if os.environ.get("CI") and shutil.which(QEMU):
        pytest.fail(f"egress-mode VM cannot run on this CI host: {why}", pytrace=False)
    pytest.skip(f"egress-mode VM: {why}")


@pytest.fixture(scope="module")
def results() -> Iterator[dict[str, Any]]:
    if os.environ.get("MMMESH_VM_TIER", "1") == "0":
        pytest.skip("egress-mode VM: MMMESH_VM_TIER=0")
    ok, why = can_boot()
    if not ok:
        _cannot(why)
    try:
        with FqVm(WORK) as vm:
            rc, out = vm.run("python3 -m testkit.fq_vm_checks", timeout=2400)
            boot = f"booted in {vm.boot_s:.0f} s: {vm.ready}"
    except VmUnavailable as e:
        _cannot(str(e))
    lines = [ln for ln in out.splitlines() if ln.startswith("MMFQ-RESULTS ")]
    assert rc == 0 and lines, f"the checks did not finish (exit {rc}):\n{out[-4000:]}"
    print(f"\n{boot}\n" + "\n".join(ln for ln in out.splitlines() if ln.startswith("[")))
    yield json.loads(lines[-1].removeprefix("MMFQ-RESULTS "))


@pytest.mark.parametrize("name", [n for n, _ in CHECKS])
def test_in_the_vm(results: dict[str, Any], name: str) -> None:
    r = results.get(name)
    assert r is not None, f"{name} did not run"
    assert r["ok"], f"{r['detail']}\n{r.get('trace', '')}\n{r.get('qdiscs', '')}"
