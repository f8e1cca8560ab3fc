"""Netlink for testbeds: network namespaces, veth links, addresses, routes,
and the "mesh off" baseline (one FIFO class at the link rate).

This is demo, test and bench support, not product code: the product's kernel
work goes through :class:`mmmesh.dataplane.Dataplane`.  Everything here uses
pyroute2 (no ``ip``/``tc`` processes).
"""

from __future__ import annotations

import contextlib
import errno
from typing import Any

from pyroute2 import IPRoute, netns
from pyroute2 import config as pyroute2_config
from pyroute2.netlink.exceptions import NetlinkError

from mmmesh.abi import HTB_MAJOR, MAX_CLASSES
from mmmesh.errors import DataplaneError

# See mmmesh/dataplane/_netlink.py: a forked pyroute2 netns helper must not
# inherit the parent's signal handlers.
pyroute2_config.disable_mp_signal = True

# The baseline uses the mesh's HTB layout (root 1:, link class 1:40) with a
# single leaf 1:10, so the same readers (Dataplane.htb_classes) show its
# counters and `Dataplane.up` takes the root over as its own.
FIFO_ROOT = HTB_MAJOR << 16
FIFO_LINK = FIFO_ROOT | MAX_CLASSES
FIFO_CLASS = FIFO_ROOT | 0x10


def _err(e: NetlinkError, what: str) -> DataplaneError:
    return DataplaneError(e.code, f"{what}: {e}")


def create_netns(name: str) -> None:
    try:
        netns.create(name)
    except OSError as e:
        raise DataplaneError(e.errno or errno.EIO, f"create netns {name}: {e}") from e


def remove_netns(name: str) -> None:
    try:
        netns.remove(name)
    except OSError:
        pass


def list_netns() -> list[str]:
    return list(netns.listnetns())


def enter_netns(name: str) -> None:
    """Moves the calling process (call it in a fresh child) into netns ``name``."""
    try:
        netns.setns(name)
    except OSError as e:
        raise DataplaneError(e.errno or errno.EIO, f"enter netns {name}: {e}") from e


def _iproute(ns: str | None) -> IPRoute:
    try:
        return IPRoute(netns=ns) if ns else IPRoute()
    except (OSError, NetlinkError) as e:
        raise DataplaneError(errno.ENOENT, f"netns {ns!r}: {e}") from e


class Lab(contextlib.AbstractContextManager["Lab"]):
    """A netlink session in one namespace (None = the current one) for
    building testbeds; ``with Lab(ns) as lab:`` closes it afterwards."""

    def __init__(self, ns: str | None = None) -> None:
        self.ns = ns
        self.ipr = _iproute(ns)

    def __exit__(self, *exc: object) -> None:
        self.ipr.close()

    def ifindex(self, ifname: str) -> int:
        found = self.ipr.link_lookup(ifname=ifname)
        if found:
            return int(found[0])
        raise DataplaneError(errno.ENODEV, f"no device {ifname!r} in netns {self.ns}")

    def add_veth(self, name: str, peer: str, peer_ns: str | None = None) -> None:
        peer_spec: dict[str, Any] = {"ifname": peer}
        if peer_ns:
            peer_spec["net_ns_fd"] = peer_ns
        try:
            self.ipr.link("add", ifname=name, kind="veth", peer=peer_spec)
        except NetlinkError as e:
            raise _err(e, f"add veth {name}") from e

    def move_to_ns(self, ifname: str, ns: str) -> None:
        self.ipr.link("set", index=self.ifindex(ifname), net_ns_fd=ns)

    def configure(self, ifname: str, cidr: str | None = None, *, up: bool = True,
                  mtu: int | None = None) -> int:
        idx = self.ifindex(ifname)
        if cidr:
            addr, plen = cidr.split("/")
            try:
                self.ipr.addr("add", index=idx, address=addr, prefixlen=int(plen))
            except NetlinkError as e:
                if e.code != errno.EEXIST:
                    raise _err(e, f"address {cidr} on {ifname}") from e
        kw: dict[str, Any] = {}
        if mtu:
            kw["mtu"] = mtu
        if up:
            kw["state"] = "up"
        if kw:
            self.ipr.link("set", index=idx, **kw)
        return idx

    def loopback_up(self) -> None:
        self.ipr.link("set", index=self.ifindex("lo"), state="up")

    def add_route(self, dst: str, gateway: str) -> None:
        try:
            self.ipr.route("add", dst=dst, gateway=gateway)
        except NetlinkError as e:
            if e.code != errno.EEXIST:
                raise _err(e, f"route {dst} via {gateway}") from e

    # ------------------------------------------------------ mesh-off baseline
    def apply_fifo(self, ifname: str, link_bps: int, limit: int = 1000) -> None:
        """The "mesh off" baseline: the same link rate, one HTB class, one FIFO
        (whatever root qdisc was there is replaced)."""
        idx = self.ifindex(ifname)
        rate = f"{int(link_bps)}bit"
        try:
            self.remove_root_qdisc(ifname)
            self.ipr.tc("add", "htb", idx, FIFO_ROOT, default=FIFO_CLASS & 0xFFFF)
            self.ipr.tc("add-class", "htb", idx, FIFO_LINK, parent=FIFO_ROOT,
                        rate=rate, ceil=rate, prio=0)
            self.ipr.tc("add-class", "htb", idx, FIFO_CLASS, parent=FIFO_LINK,
                        rate=rate, ceil=rate, prio=0, quantum=1514)
            self.ipr.tc("replace", "pfifo", idx, (0x100 + 0x10) << 16, parent=FIFO_CLASS,
                        limit=limit)
        except NetlinkError as e:
            raise _err(e, f"FIFO baseline on {ifname}") from e

    def remove_root_qdisc(self, ifname: str) -> None:
        """Deletes the device's root qdisc (back to the kernel's default)."""
        idx = self.ifindex(ifname)
        for q in self.ipr.get_qdiscs(index=idx):
            if q["parent"] != 0xFFFFFFFF or not q["handle"]:
                continue
            try:
                self.ipr.tc("del", q.get_attr("TCA_KIND"), idx, int(q["handle"]))
            except NetlinkError as e:
                if e.code not in (errno.ENOENT, errno.EINVAL):
                    raise _err(e, f"delete root qdisc of {ifname}") from e

    def root_qdisc_kind(self, ifname: str) -> str | None:
        for q in self.ipr.get_qdiscs(index=self.ifindex(ifname)):
            if q["parent"] == 0xFFFFFFFF:
                kind = q.get_attr("TCA_KIND")
                return str(kind) if kind is not None else None
        return None
