"""One small VM with a multiqueue virtio NIC, for the egress-mode tests that
need a kernel this host does not have (sch_fq with bands, mq, fq_codel):
tests/system/dataplane/test_egress_vm.py and, by hand, ``python -m
testkit.fq_vm`` (boots it and runs a command in it).

The VM is made from the testbed's box (vagrant/box/, cached by
vagrant/box/build.sh under /var/cache/mmmesh-vm/boxes/): its disk, used
read-only (``-snapshot``: nothing the VM writes stays), and its own kernel
and initramfs, booted directly with a shell script as PID 1 instead of
systemd (it boots in seconds instead of minutes under emulation).  No vagrant,
no libvirt, no network of the host's:

* the checkout is shared read-only with virtiofs (``/src`` in the VM, with
  the venv's site-packages on PYTHONPATH: the box's python3 is the same
  3.11 as the venv's), and a job directory read-write (``/job``);
* the NIC under test is ``eth0``: virtio-net with ``queues`` queue pairs
  (``mq=on``) on a multiqueue tap that lives in a network namespace of its
  own on the host (``mmfq-<pid>``), so nothing appears in the host's; the VM
  turns on every queue pair (``ethtool -L``) and gives it ``speed_mbit``;
* the VM runs the jobs it finds in ``/job/q/`` (bash scripts) one at a time
  and writes each one's output and exit code beside it: :meth:`FqVm.run`.

1 vCPU, 1.5 GiB, KVM when this host's probe (vagrant/box/host.sh) found it
works, else TCG with the CPU model the box's notes require (Westmere
without cx16).  Nothing here waits for a fixed time: every wait polls up to
a deadline.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from testkit import ROOT

CACHE = Path(os.environ.get("MMMESH_VM_CACHE", "/var/cache/mmmesh-vm"))
VIRTIOFSD = "/usr/lib/qemu/virtiofsd"
QEMU = "qemu-system-x86_64"
VENV_SITE = next((ROOT / ".venv" / "lib").glob("python3*/site-packages"), None) \
    if (ROOT / ".venv" / "lib").is_dir() else None

HOST_MODULES = ("six",)  # single-file modules the venv has from Debian (ddsketch needs six)

__all__ = ["FqVm", "VmUnavailable", "box_key", "can_boot"]


class VmUnavailable(RuntimeError):
    """This host cannot boot the VM (and why, in one line)."""


def _run(argv: list[str], timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                          **kw)  # type: ignore[call-overload]


def can_boot() -> tuple[bool, str]:
    """(True, "") when this host has what the VM needs (root, QEMU, virtiofsd,
    /dev/net/tun); else False and why, in one line.  The box is built on
    demand (:func:`box_path`)."""
    if os.geteuid() != 0:
        return False, "not root"
    if shutil.which(QEMU) is None:
        return False, f"no {QEMU} (Debian: qemu-system-x86)"
    if not os.access(VIRTIOFSD, os.X_OK):
        return False, f"no {VIRTIOFSD} (Debian: qemu-system-common)"
    if not os.path.exists("/dev/net/tun"):
        return False, "no /dev/net/tun"
    if VENV_SITE is None:
        return False, "no .venv (scripts/bootstrap.sh): the VM borrows its site-packages"
    return True, ""


def box_key() -> str:
    r = _run([str(ROOT / "vagrant" / "box" / "build.sh"), "--key"], 60)
    if r.returncode != 0 or not r.stdout.strip():
        raise VmUnavailable(f"vagrant/box/build.sh --key failed: {r.stderr.strip()[-300:]}")
    return r.stdout.strip().splitlines()[-1]


def box_path(build: bool = True) -> Path:
    """The testbed's box, built by vagrant/box/build.sh when it is not cached."""
    box = CACHE / "boxes" / f"{box_key()}.box"
    if not box.exists() and build:
        r = _run([str(ROOT / "vagrant" / "box" / "build.sh")], 3600)
        if r.returncode != 0:
            raise VmUnavailable(f"vagrant/box/build.sh failed: {r.stderr.strip()[-500:]}")
    if not box.exists():
        raise VmUnavailable(f"no box {box} (vagrant/box/build.sh)")
    return box


def boot_files(work: Path) -> tuple[Path, Path, Path]:
    """(disk, kernel, initrd) of the box, unpacked into ``work/<key>/`` once
    (the kernel and initramfs read from its first partition, mounted read-only
    in a mount namespace of its own: vagrant/box/NOTES.md, "Mounts leak")."""
    box = box_path()
    d = work / box.stem
    disk, kernel, initrd = d / "box.img", d / "vmlinuz", d / "initrd.img"
    if disk.exists() and kernel.exists() and initrd.exists():
        return disk, kernel, initrd
    d.mkdir(parents=True, exist_ok=True)
    with tarfile.open(box) as t:
        t.extract("box.img", d)
    raw = d / "box.raw"
    try:
        r = _run(["qemu-img", "convert", "-O", "raw", str(disk), str(raw)], 600)
        if r.returncode != 0:
            raise VmUnavailable(f"qemu-img convert: {r.stderr.strip()[-300:]}")
        script = (f"set -e; m=$(mktemp -d); mount -o ro,loop,offset=1048576 {raw} $m; "
                  f"cp $m/boot/vmlinuz-* {kernel}; cp $m/boot/initrd.img-* {initrd}; "
                  f"umount $m; rmdir $m")
        r = _run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], 300)
        if r.returncode != 0:
            raise VmUnavailable(f"reading the box's kernel: {r.stderr.strip()[-300:]}")
    finally:
        raw.unlink(missing_ok=True)
    return disk, kernel, initrd


def accel() -> str:
    """kvm when vagrant/box/host.sh found that KVM works here, else tcg."""
    f = CACHE / "libvirt-driver"
    found = f.read_text().strip() if f.exists() else ""
    return "kvm" if found == "kvm" and os.path.exists("/dev/kvm") else "tcg"


INIT = r"""#!/bin/bash
# PID 1 of the egress-mode test VM (testkit/fq_vm.py): mount, bring the NIC
# up with every queue pair, then run the jobs of /job/q/ until /job/stop.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t tmpfs tmp /tmp
mount -t tmpfs run /run; mkdir -p /sys/fs/bpf /src /job; mount -t bpf bpf /sys/fs/bpf
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
mount -t virtiofs -o ro src /src && mount -t virtiofs job /job || { echo MMFQ-NOFS; echo o > /proc/sysrq-trigger; }
echo 1 > /proc/sys/kernel/sysrq
modprobe virtio_net; modprobe sch_fq; modprobe sch_htb; modprobe sch_mq 2>/dev/null
ip link set lo up
for i in $(seq 50); do [ -e /sys/class/net/eth0 ] && break; sleep 0.2; done
ethtool -L eth0 combined @QUEUES@ 2>/dev/null
ip link set eth0 up; ip addr add 10.231.0.2/24 dev eth0
ip neigh replace 10.231.0.1 lladdr 02:6d:6d:00:00:01 dev eth0 nud permanent
echo "MMFQ-READY $(uname -r) queues=$(ls -d /sys/class/net/eth0/queues/tx-* | wc -l)" > /job/ready
echo MMFQ-READY
mkdir -p /job/q
while [ ! -e /job/stop ]; do
  for f in /job/q/*.sh; do
    [ -e "$f" ] || continue
    n="${f%.sh}"
    (cd /src && PYTHONPATH=/src:@SITE@ bash "$f") > "$n.out" 2>&1 < /dev/null
    echo $? > "$n.rc.tmp"; mv "$n.rc.tmp" "$n.rc"; rm -f "$f"
  done
  sleep 0.3
done
sync; echo MMFQ-STOP; echo o > /proc/sysrq-trigger
"""


@dataclass
class FqVm:
    """``with FqVm(work) as vm: vm.run("python3 -c 'print(1)'")``: boots on enter
    (up to ``boot_timeout`` s), powers off and removes its network namespace,
    tap and virtiofsd on exit, also on failure."""

    work: Path
    queues: int = 4
    speed_mbit: int = 1000
    memory_mib: int = 1536
    boot_timeout: float = 600
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.ns = f"mmfq-{os.getpid()}"
        self.job = self.work / f"job-{os.getpid()}"
        self._procs: list[subprocess.Popen[bytes]] = []
        self._n = 0
        self.boot_s = 0.0

    # ---------------------------------------------------------- lifecycle
    def __enter__(self) -> FqVm:  # noqa: PYI034
        try:
            self.boot()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def boot(self) -> None:
        ok, why = can_boot()
        if not ok:
            raise VmUnavailable(why)
        disk, kernel, initrd = boot_files(self.work)
        if self.job.exists():
            shutil.rmtree(self.job)
        (self.job / "q").mkdir(parents=True)
        # what the venv takes from the host's Debian packages (--system-site-packages)
        # and the box lacks: copied beside the jobs
        (self.job / "pylib").mkdir()
        for name in HOST_MODULES:
            mod = __import__(name)
            assert mod.__file__ is not None, name
            shutil.copy(mod.__file__, self.job / "pylib")
        # PID 1 is bash reading its script from a raw disk (vdb): nothing is
        # written into the box's disk.  Padded to whole sectors with newlines.
        assert VENV_SITE is not None
        text = (INIT.replace("@QUEUES@", str(self.queues))
                .replace("@SITE@", "/src/" + str(VENV_SITE.relative_to(ROOT))
                         + ":/job/pylib:/usr/lib/python3/dist-packages"))
        init = self.work / f"init-{os.getpid()}.img"
        init.write_text(text + "\n" * (-len(text.encode()) % 512 + 512))
        socks = {}
        for tag, path in (("src", ROOT), ("job", self.job)):
            sock = self.work / f"vfs-{tag}-{os.getpid()}.sock"
            sock.unlink(missing_ok=True)
            argv = [VIRTIOFSD, f"--socket-path={sock}", "-o", f"source={path}",
                    "-o", "cache=none"]
            with open(self.work / f"vfs-{tag}.log", "wb") as vlog:  # the child keeps its copy
                self._procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=vlog))
            socks[tag] = sock
        _wait(lambda: all(s.exists() for s in socks.values()), 30, "virtiofsd sockets")
        r = _run(["ip", "netns", "add", self.ns], 30)
        if r.returncode != 0:
            raise VmUnavailable(f"ip netns add {self.ns}: {r.stderr.strip()}")
        a = accel()
        cpu = ["-cpu", "host"] if a == "kvm" else ["-cpu", "Westmere,cx16=off"]
        vectors = 2 * self.queues + 2
        argv = ["ip", "netns", "exec", self.ns, QEMU, "-accel", a, *cpu, "-smp", "1",
                "-m", str(self.memory_mib), "-nographic", "-no-reboot",
                "-object", f"memory-backend-memfd,id=mem,size={self.memory_mib}M,share=on",
                "-numa", "node,memdev=mem",
                "-kernel", str(kernel), "-initrd", str(initrd),
                "-append", ("console=ttyS0 root=/dev/vda1 rw net.ifnames=0 panic=-1 "
                            "init=/bin/bash -- /dev/vdb"),
                "-drive", f"file={disk},if=virtio,format=qcow2,snapshot=on",
                "-drive", f"file={init},if=virtio,format=raw,readonly=on",
                "-chardev", f"socket,id=vsrc,path={socks['src']}",
                "-device", "vhost-user-fs-pci,chardev=vsrc,tag=src",
                "-chardev", f"socket,id=vjob,path={socks['job']}",
                "-device", "vhost-user-fs-pci,chardev=vjob,tag=job",
                "-netdev", (f"tap,id=n0,ifname=mmfq0,script=no,downscript=no,vhost=off,"
                            f"queues={self.queues}"),
                "-device", (f"virtio-net-pci,netdev=n0,mq=on,vectors={vectors},"
                            f"mac=02:6d:6d:00:00:02,speed={self.speed_mbit},duplex=full")]
        t0 = time.monotonic()
        with open(self.work / "console.log", "wb") as console:  # the child keeps its copy
            self._qemu = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=console,
                                          stderr=subprocess.STDOUT)
        self._procs.append(self._qemu)
        _wait(lambda: _run(["ip", "netns", "exec", self.ns, "ip", "link", "show", "mmfq0"],
                           10).returncode == 0 or self._qemu.poll() is not None, 60, "the tap")
        _run(["ip", "netns", "exec", self.ns, "ip", "link", "set", "mmfq0", "address",
              "02:6d:6d:00:00:01", "up"], 10)
        _run(["ip", "netns", "exec", self.ns, "ip", "addr", "add", "10.231.0.1/24", "dev",
              "mmfq0"], 10)
        # the guest's shell creates the file, then writes its line: wait for the line
        _wait(lambda: self._ready_line() or self._qemu.poll() is not None,
              self.boot_timeout, "the VM's init", self.console_tail)
        if self._qemu.poll() is not None:
            raise VmUnavailable(f"the VM stopped while booting: {self.console_tail()}")
        self.boot_s = time.monotonic() - t0
        self.ready = self._ready_line()

    def _ready_line(self) -> str:
        try:
            text = (self.job / "ready").read_text().strip()
        except OSError:
            return ""
        return text if text.startswith("MMFQ-READY") else ""

    def close(self) -> None:
        with contextlib.suppress(OSError):
            (self.job / "stop").touch()
        q = getattr(self, "_qemu", None)
        if q is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                q.wait(60)
        for p in reversed(self._procs):
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
        self._procs.clear()
        _run(["ip", "netns", "del", self.ns], 30)
        for s in [*self.work.glob(f"vfs-*-{os.getpid()}.sock*"),
                  *self.work.glob(f"init-{os.getpid()}.img")]:
            s.unlink(missing_ok=True)
        shutil.rmtree(self.job, ignore_errors=True)  # the jobs' output was read by run()

    def console_tail(self, n: int = 1500) -> str:
        try:
            return (self.work / "console.log").read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    # ---------------------------------------------------------------- jobs
    def run(self, script: str, timeout: float = 900) -> tuple[int, str]:
        """``script`` run by bash as root in the VM (cwd /src, PYTHONPATH the
        checkout and the venv's packages); (exit code, output)."""
        self._n += 1
        base = self.job / "q" / f"{self._n:03d}"
        tmp = base.with_suffix(".tmp")
        tmp.write_text(script)
        tmp.rename(base.with_suffix(".sh"))
        rc = base.with_suffix(".rc")
        _wait(lambda: rc.exists() or self._qemu.poll() is not None, timeout,
              f"job {self._n}", self.console_tail)
        if not rc.exists():
            raise RuntimeError(f"the VM stopped during job {self._n}: {self.console_tail()}")
        return int(rc.read_text().strip() or 1), base.with_suffix(".out").read_text()


def _wait(cond: object, timeout: float, what: str, why: object = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            extra = f": {why()}" if callable(why) else ""
            raise VmUnavailable(f"timed out after {timeout:.0f} s waiting for {what}{extra}")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    """``python -m testkit.fq_vm 'command'...``: boot, run each, print, power off."""
    args = sys.argv[1:] if argv is None else argv
    with FqVm(Path("/tmp/mmmesh-fqvm")) as vm:
        print(f"booted in {vm.boot_s:.0f} s: {vm.ready}", flush=True)
        for cmd in args:
            rc, out = vm.run(cmd)
            print(f"$ {cmd}  (exit {rc})\n{out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
