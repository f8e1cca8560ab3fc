"""``mmmesh dataplane up|down|status|classify``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mmmesh.policy import load_policy
from mmmesh.policy.overrides import Overrides


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("up", help="load (or adopt) the classifier and apply a policy")
    p.add_argument("--iface", help="device (default: the policy's link.device)")
    p.add_argument("--policy", required=True, help="policy YAML file")
    p.add_argument("--netns", help="network namespace of the device")
    p.add_argument("--force", action="store_true",
                   help="replace a root qdisc that mmmesh did not create")
    p.add_argument("--no-ingress", action="store_true", help="attach the egress program only")
    p.add_argument("--egress", choices=("htb", "fq", "auto"), default="htb",
                   help="egress mode (docs/dataplane.md \"Egress modes\"; default htb)")
    p.set_defaults(func=_up)

    p = sub.add_parser("down", help="detach and unpin everything on a device")
    p.add_argument("--iface", required=True)
    p.add_argument("--netns")
    p.set_defaults(func=_down)

    p = sub.add_parser("status", help="programs, counters and HTB classes (or fq bands) of a "
                       "device")
    p.add_argument("--iface", required=True)
    p.add_argument("--netns")
    p.add_argument("--policy", help="policy file, to show class names")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_status)

    p = sub.add_parser(
        "classify",
        help="run frames through a private copy of the egress program (BPF_PROG_TEST_RUN)",
    )
    p.add_argument("--policy", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    # extend: "--hex A B" and "--hex A --hex B" both keep every frame, in order
    src.add_argument("--hex", nargs="+", action="extend", metavar="HEX",
                     help="Ethernet frames as hex (several per flag, and the flag repeated)")
    src.add_argument("--pcap", help="pcap file of Ethernet frames")
    p.add_argument("--direction", choices=("egress", "ingress"), default="egress")
    p.add_argument("--overrides", metavar="FILE",
                   help="per-stage and per-flow overrides (YAML or JSON, docs/dataplane.md); "
                        "--json then adds 'boosted'")
    p.add_argument("--egress", choices=("htb", "fq"), default="htb",
                   help="write the maps as this egress mode does (fq: --json adds band, "
                        "tstamp, paced, over_horizon)")
    p.add_argument("--json", action="store_true", help="one JSON object per packet")
    p.set_defaults(func=_classify)


def _up(a: argparse.Namespace) -> int:
    from mmmesh.dataplane import Dataplane

    pol = load_policy(a.policy)
    dp = Dataplane(a.iface or pol.link.device, a.netns, egress=a.egress)
    r = dp.up(pol, force=a.force, ingress=not a.no_ingress)
    how = "adopted" if r.adopted else "loaded"
    progs = ", ".join(f"{d} prog {i}" for d, i in r.prog_ids.items())
    print(f"{how} mmmesh on {r.iface}{' in netns ' + r.netns if r.netns else ''}: {progs}; "
          f"{len(pol.classes)} classes, link {pol.link.rate}, egress mode {dp.egress_mode()}")
    return 0


def _down(a: argparse.Namespace) -> int:
    from mmmesh.dataplane import Dataplane

    Dataplane(a.iface, a.netns).down()
    print(f"mmmesh removed from {a.iface}")
    return 0


def _status(a: argparse.Namespace) -> int:
    from mmmesh.dataplane import Dataplane

    pol = load_policy(a.policy) if a.policy else None
    st = Dataplane(a.iface, a.netns).status(pol).as_dict()
    if a.json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return 0
    print(f"{st['iface']}: {'loaded' if st.get('loaded') else 'not loaded'}  "
          f"programs={st['programs']}  flows={st.get('flows', 0)}")
    if not st.get("loaded"):
        return 0
    if st.get("egress") == "fq":  # no HTB classes: each class's band, each queue's fq
        print(f"{'class':<14}{'band':>8}{'egress pkts':>14}{'egress bytes':>16}")
        for name, c in st["classes"].items():
            print(f"{name:<14}{c.get('band', '-'):>8}{c['egress_packets']:>14}{c['egress_bytes']:>16}")
        for q in st["fq"]:
            print(f"fq {q['handle']} (TX queue {q['queue']}): weights {q.get('weights')} "
                  f"packets {q['packets']} drops {q['drops']} horizon drops "
                  f"{q['horizon_drops']} backlog {q['backlog']}")
        for pc in st["pacers"]:
            print(f"pacer class {pc['class_id']} level {pc['level']}: {pc['rate_bps']} bit/s, "
                  f"{pc['ahead_ns']} ns ahead, {pc['over_horizon']} over the horizon")
    else:
        print(f"{'class':<14}{'classid':>8}{'egress pkts':>14}{'egress bytes':>16}"
              f"{'htb drops':>11}{'backlog':>9}")
        for name, c in st["classes"].items():
            h = c["htb"]
            print(f"{name:<14}{c['classid']:>8}{c['egress_packets']:>14}"
                  f"{c['egress_bytes']:>16}{h.get('drops', 0):>11}{h.get('backlog', 0):>9}")
    for d, rs in st["reasons"].items():
        print(f"{d}: " + "  ".join(f"{k}={v}" for k, v in rs.items()))
    return 0


def _frames(a: argparse.Namespace) -> list[bytes]:
    if a.hex:
        out = []
        for h in a.hex:
            try:
                out.append(bytes.fromhex(h.replace(":", "").replace(" ", "")))
            except ValueError as e:
                raise SystemExit(f"mmmesh: error: --hex {h[:20]}...: {e}") from e
        return out
    from scapy.utils import rdpcap

    return [bytes(p) for p in rdpcap(a.pcap)]


def _overrides(path: str | None) -> Overrides | None:
    if path is None:
        return None
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise SystemExit(f"mmmesh: error: --overrides {path}: {e}") from e
    return Overrides.from_dict(data)


def _classify(a: argparse.Namespace) -> int:
    from mmmesh.dataplane.classify import Classifier

    pol = load_policy(a.policy)
    ovr = _overrides(a.overrides)
    frames = _frames(a)
    with Classifier(pol, overrides=ovr, egress=a.egress) as clf:
        for i, f in enumerate(frames):
            v = clf.run(f, a.direction)
            d: dict[str, Any] = {"index": i, **v.as_json(overrides=ovr is not None)}
            if a.json:
                print(json.dumps(d, sort_keys=True))
            else:
                where = f"band={v.band}" if v.band is not None else f"prio={v.classid or '-'}"
                print(f"{i:>4} {v.verdict:<5} {where:<11} "
                      f"class={v.class_ or '-':<12} modality={v.modality or '-':<12} "
                      f"reason={v.reason}{' clamped' if v.clamped else ''}"
                      f"{' boosted' if v.boosted else ''}{' paced' if v.paced else ''}")
    sys.stdout.flush()
    return 0
