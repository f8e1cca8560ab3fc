"""Two sidecar images side by side: size, what they carry, start-up, idle RSS.

    python bench/sidecar_image.py --image before=localhost/mmmesh/sidecar:before \
        --image after=localhost/mmmesh/sidecar:0.1.0 [--rounds 7] [--json out.json]

Each image's root file system is mounted read-only (``podman image mount``)
and its ``mmmesh-sidecar`` is run from it with ``chroot`` (the image's own
Python and virtualenv, this host's kernel and loopback): ``podman run``
cannot start a container on these build machines (crun: setrlimit
RLIMIT_NOFILE not permitted), so the bench measures what the image holds and
what its process costs, not the runtime around it.  Per round, images
alternate (same host load for both): ``mmmesh-sidecar --help`` (wall and CPU
time), then a sidecar with an identity python stage started until it
listens (wall), and its RSS once it is idle.  Medians of the rounds; the
ratios after/before are what to read (docs/benchmarks.md, "The sidecar image").

Run as root (mount, chroot).  Building a "before" image from an older commit:
docs/benchmarks.md, "The sidecar image"."""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PATHS = "/opt/mmmesh/app/bin:/opt/mmmesh/venv/bin:/usr/local/bin:/usr/bin:/bin"
ENV = {"PATH": PATHS, "PYTHONPATH": "/opt/mmmesh/app:/tmp", "PYTHONDONTWRITEBYTECODE": "1",
       "HOME": "/tmp", "LANG": "C.UTF-8"}
PROBE = ("pyroute2", "scapy", "fastapi", "bcc", "onnxruntime", "grpc", "uvloop", "numpy")


def podman(*args: str) -> str:
    return subprocess.run(["podman", *args], check=True, capture_output=True, text=True,
                          timeout=120).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Image:
    def __init__(self, name: str, ref: str, work: Path) -> None:
        self.name, self.ref = name, ref
        self.root = Path(podman("image", "mount", ref))
        self.size = int(podman("image", "inspect", "-f", "{{.Size}}", ref))
        self.work = work / name
        self.work.mkdir(parents=True)
        (self.work / "stage_ident.py").write_text("def identity(x):\n    return x\n")
        target = self.root / "tmp"
        subprocess.run(["mount", "--bind", str(self.work), str(target)], check=True, timeout=30)
        self.target = target

    def close(self) -> None:
        subprocess.run(["umount", str(self.target)], check=False, timeout=30)
        subprocess.run(["podman", "image", "unmount", self.ref], check=False,
                       capture_output=True, timeout=60)

    def chroot(self, *argv: str) -> list[str]:
        return ["chroot", str(self.root), "env", "-i", *(f"{k}={v}" for k, v in ENV.items()),
                *argv]

    def carries(self) -> dict[str, bool]:
        code = ("import importlib.util as u, json; print(json.dumps({m: u.find_spec(m) is not None "
                f"for m in {list(PROBE)!r}}}))")
        r = subprocess.run(self.chroot("python3", "-c", code), check=True, capture_output=True,
                           text=True, timeout=120)
        return dict(json.loads(r.stdout))

    def help_run(self) -> tuple[float, float]:
        """(wall s, CPU s) of ``mmmesh-sidecar --help``."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(self.chroot("mmmesh-sidecar", "--help"), check=True,
                       capture_output=True, timeout=120)
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)

    def start_run(self) -> tuple[float, int, int]:
        """(s until it listens, VmRSS kB, RssAnon kB once idle)."""
        sink = socket.create_server(("127.0.0.1", 0))
        port = free_port()
        # the image's /tmp is this bench's directory (bind mount): paths inside are /tmp/...
        (self.work / "sidecar.yaml").write_text(
            "stage: relay\n"
            f'listen: {{tcp: "127.0.0.1:{port}"}}\n'
            'runner: {kind: python, target: "stage_ident:identity", timeout_s: 5}\n'
            "outputs:\n"
            f'  - {{name: next, address: "127.0.0.1:{sink.getsockname()[1]}", '
            "modality: tensor, sla_class: video}\n"
            "qosd: {socket: null}\n")
        env = dict(ENV, PYTHONPATH="/opt/mmmesh/app:/tmp")
        argv = ["chroot", str(self.root), "env", "-i", *(f"{k}={v}" for k, v in env.items()),
                "mmmesh-sidecar", "--config", "/tmp/sidecar.yaml"]
        t = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=5).close()
                    break
                except OSError:
                    if proc.poll() is not None:
                        err = proc.stderr.read().decode()[-2000:] if proc.stderr else ""
                        raise SystemExit(f"{self.name}: the sidecar exited: {err}") from None
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{self.name}: the sidecar did not listen in 120 s") \
                            from None
                    time.sleep(0.02)
            up = time.perf_counter() - t
            time.sleep(2.0)  # idle: what it holds once started (a benchmark, not a test)
            pid = sidecar_pid(proc.pid)
            status = Path(f"/proc/{pid}/status").read_text()
            vals = {ln.split(":")[0]: int(ln.split()[1]) for ln in status.splitlines()
                    if ln.startswith(("VmRSS", "RssAnon"))}
            return up, vals["VmRSS"], vals["RssAnon"]
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
            sink.close()


def sidecar_pid(pid: int) -> int:
    """``chroot`` and ``env`` exec, so the pid is the sidecar's; follow a child if not."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    kids = children.read_text().split() if children.exists() else []
    return int(kids[0]) if kids and "python" not in Path(f"/proc/{pid}/comm").read_text() else pid


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", action="append", required=True, metavar="NAME=REF",
                    help="an image to measure (two or more; the first is the reference)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path, default=Path("out/sidecar_image.json"))
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench/sidecar_image.py: run as root (podman image mount, chroot)", file=sys.stderr)
        return 2
    pairs = [s.split("=", 1) for s in args.image]
    with tempfile.TemporaryDirectory(prefix="mmbench-img-") as tmp:
        images = [Image(n, r, Path(tmp)) for n, r in pairs]
        try:
            samples: dict[str, dict[str, list[float]]] = {
                im.name: {"help_wall": [], "help_cpu": [], "listen": [], "rss": [], "anon": []}
                for im in images}
            carried = {im.name: im.carries() for im in images}
            for _ in range(args.rounds):
                for im in images:
                    w, c = im.help_run()
                    up, rss, anon = im.start_run()
                    s = samples[im.name]
                    s["help_wall"].append(w)
                    s["help_cpu"].append(c)
                    s["listen"].append(up)
                    s["rss"].append(rss / 1024)
                    s["anon"].append(anon / 1024)
        finally:
            for im in images:
                im.close()
    load = os.getloadavg()
    ref = images[0].name
    med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    rows = []
    print(f"host load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {args.rounds} rounds, medians")
    print(f"{'image':10} {'size MB':>8} {'--help s':>9} {'CPU s':>6} {'listen s':>9} "
          f"{'RSS MB':>7} {'anon MB':>8}  carries")
    for im in images:
        m = med[im.name]
        have = ",".join(k for k, v in carried[im.name].items() if v)
        print(f"{im.name:10} {im.size / 1e6:8.0f} {m['help_wall']:9.2f} {m['help_cpu']:6.2f} "
              f"{m['listen']:9.2f} {m['rss']:7.1f} {m['anon']:8.1f}  {have}")
        rows.append({"image": im.name, "ref": im.ref, "size_bytes": im.size, "carries": carried[
            im.name], "median": m, "samples": samples[im.name],
            "ratio_to_" + ref: {k: (m[k] / med[ref][k]) if med[ref][k] else None for k in m}
            | {"size": im.size / images[0].size}})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmpf = args.json.with_suffix(".tmp")
    tmpf.write_text(json.dumps({"load": load, "rounds": args.rounds, "images": rows}, indent=2))
    tmpf.replace(args.json)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
