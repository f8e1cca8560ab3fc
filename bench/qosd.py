#!/usr/bin/env python3
"""qosd: policy apply latency, and resident memory at steady state.

A real qosd process on a netns node (veth a0).  Apply latency is measured two
ways, both ending when the kernel holds the new version (the config map's
policy_version), alternating two policies that differ in a class rate:

  api   PUT /v1/policy over the unix socket, then the kernel check
  cli   a whole `mmmeshctl policy apply -f FILE` process (Python start-up
        included), then the kernel check

Resident memory is qosd's VmRSS after the applies, then after 200 scrapes of
/metrics and 200 status calls (steady state).  bcc is never imported by
qosd: the programs are compiled in a short-lived child process.

Targets: apply p99 < 200 ms (api and whole CLI process), steady RSS < 120 MB.  Writes
out/bench/qosd.json; exit 0 unless --strict and a target is missed.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import yaml  # noqa: E402

from demo import netlab as nl  # noqa: E402
from mmmesh.dataplane import Dataplane  # noqa: E402
from mmmesh.files import write_json  # noqa: E402
from mmmesh.policy import load_policy, parse_policy  # noqa: E402

BIN = Path(sys.executable).parent


def policy_text(voice_rate: str) -> str:
    data = load_policy(ROOT / "examples" / "policy.yaml").model_dump(mode="json", by_alias=True)
    data["link"] = {"device": "a0", "rate": "500mbit"}
    for c in data["classes"]:
        if c["name"] == "voice":
            c["rate"] = voice_rate
    return parse_policy(data).to_yaml()


def kernel_version(ns: str) -> int:
    return Dataplane("a0", ns).policy_version()


def wait_version(ns: str, want: int, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while kernel_version(ns) != want:
        if time.monotonic() > end:
            raise RuntimeError(f"kernel never reached version {want}")
        time.sleep(0.0005)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--applies", type=int, default=40)
    ap.add_argument("--cli-applies", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "out" / "bench" / "qosd.json"))
    ap.add_argument("--strict", action="store_true")
    a = ap.parse_args()

    ns, peer = f"mmb{os.getpid()}-a", f"mmb{os.getpid()}-b"
    tmp = Path(tempfile.mkdtemp(prefix="mmmesh-bench-"))
    nl.create_netns(ns)
    nl.create_netns(peer)
    proc = None
    try:
        with nl.Lab(ns) as n:
            n.add_veth("a0", "b0", peer)
            n.configure("a0", "10.79.0.1/24")
        sock = tmp / "qosd.sock"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            mport = s.getsockname()[1]
        cfg = tmp / "qosd.yaml"
        cfg.write_text(yaml.safe_dump({
            "netns": ns, "state_dir": str(tmp / "state"), "api_socket": str(sock),
            "metrics_addr": f"127.0.0.1:{mport}", "resync_interval_s": 30,
            "history_limit": 1000}))
        log = open(tmp / "qosd.log", "wb")
        proc = subprocess.Popen([str(BIN / "qosd"), "--config", str(cfg)], stdout=log,
                                stderr=subprocess.STDOUT)
        client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)),
                              base_url="http://qosd", timeout=60)
        end = time.monotonic() + 60
        while True:
            try:
                if client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > end or proc.poll() is not None:
                raise RuntimeError((tmp / "qosd.log").read_text())
            time.sleep(0.1)
        texts = [policy_text("1.2mbit"), policy_text("2mbit")]
        t0 = time.monotonic()
        first = client.put("/v1/policy", json={"yaml": texts[0]})
        first.raise_for_status()
        first_ms = (time.monotonic() - t0) * 1000
        version = first.json()["version"]

        api_ms: list[float] = []
        for i in range(a.applies):
            t = time.monotonic()
            r = client.put("/v1/policy", json={"yaml": texts[(i + 1) % 2]})
            r.raise_for_status()
            version = r.json()["version"]
            wait_version(ns, version)
            api_ms.append((time.monotonic() - t) * 1000)
        rss_after_apply = rss_mb(proc.pid)

        cli_ms: list[float] = []
        files = []
        for i, text in enumerate(texts):
            f = tmp / f"p{i}.yaml"
            f.write_text(text)
            files.append(f)
        # As an installed CLI runs: from cached bytecode (this environment may
        # set PYTHONDONTWRITEBYTECODE, which recompiles every module each run).
        cli_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        subprocess.run([str(BIN / "mmmeshctl"), "--help"], env=cli_env, capture_output=True)
        for i in range(a.cli_applies):
            t = time.monotonic()
            subprocess.run([str(BIN / "mmmeshctl"), "--socket", str(sock), "policy", "apply",
                            "-f", str(files[i % 2])], check=True, capture_output=True,
                           env=cli_env)
            version += 1
            wait_version(ns, version)
            cli_ms.append((time.monotonic() - t) * 1000)

        for _ in range(200):
            httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=10)
            client.get("/v1/status")
        rss_steady = rss_mb(proc.pid)
        mapped = {ln.split()[-1] for ln in Path(f"/proc/{proc.pid}/maps").read_text()
                  .splitlines() if "/" in ln}
        bcc_loaded = any("libbcc" in m or "/bcc/" in m for m in mapped)
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
        try:
            Dataplane("a0", ns).down()
        except Exception:
            pass
        nl.remove_netns(ns)
        nl.remove_netns(peer)

    res = {
        "first_apply_ms (compile+load)": round(first_ms, 1),
        "api_apply_p50_ms": round(statistics.median(api_ms), 1),
        "api_apply_p99_ms": round(pct(api_ms, 99), 1),
        "cli_apply_p50_ms": round(statistics.median(cli_ms), 1) if cli_ms else None,
        "cli_apply_p99_ms": round(pct(cli_ms, 99), 1) if cli_ms else None,
        "rss_after_applies_mb": round(rss_after_apply, 1),
        "rss_steady_mb": round(rss_steady, 1),
        "bcc_mapped_in_qosd": bcc_loaded,
    }
    targets = {
        "api_apply_p99_ms": (res["api_apply_p99_ms"], 200.0),
        "cli_apply_p99_ms": (res["cli_apply_p99_ms"] or 0.0, 200.0),
        "rss_steady_mb": (res["rss_steady_mb"], 120.0),
    }
    print(f"{'measure':34}{'value':>10}{'target':>10}  result")
    for k, v in res.items():
        t = targets.get(k)
        verdict = ("PASS" if t[0] < t[1] else "FAIL") if t else ""
        print(f"{k:34}{str(v):>10}{('< ' + str(t[1])) if t else '':>10}  {verdict}")
    res["targets"] = {k: {"value": v, "limit": lim, "pass": v < lim}
                      for k, (v, lim) in targets.items()}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, res)
    ok = all(v["pass"] for v in res["targets"].values())
    return 0 if ok or not a.strict else 1


if __name__ == "__main__":
    sys.exit(main())
