"""Everything that talks netlink (pyroute2), and nothing else does.

Kernel objects mmmesh owns on a device:
  * a clsact qdisc with one cls_bpf filter per direction (prio/handle
    FILTER_PRIO/FILTER_HANDLE, direct-action) running the classifier;
  * an HTB root ``1:`` with one parent class ``1:1`` at the link rate and one
    leaf class ``1:<id>`` per policy class, each with a short leaf queue.
Every call is idempotent (replace verbs) so a reconciler can re-apply.
Testbeds (namespaces, veth links, addresses, routes) are built elsewhere:
``demo/netlab.py``.
"""

from __future__ import annotations

import errno
import os
from typing import Any, Self

from pyroute2 import IPRoute
from pyroute2 import config as pyroute2_config
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl.tcmsg import sched_htb

from mmmesh.abi import HTB_MAJOR, MAX_CLASSES
from mmmesh.errors import DataplaneError

from ._types import HtbClass, HtbClassStats, HtbSpec


def _teach_pyroute2_bpf_ids() -> None:
    """pyroute2 0.9 decodes cls_bpf options only up to TCA_BPF_FLAGS; the
    program id and tag that the kernel also dumps (TCA_BPF_TAG = 10,
    TCA_BPF_ID = 11) come back as UNKNOWN.  Status and adoption need the id,
    so extend the attribute map (additive: nothing else changes)."""
    from pyroute2.netlink.rtnl.tcmsg import sched_bpf

    names = [n for n, _ in sched_bpf.options.nla_map]
    if "TCA_BPF_ID" not in names and len(names) == 9:
        sched_bpf.options.nla_map = (
            *sched_bpf.options.nla_map,
            ("TCA_BPF_FLAGS_GEN", "uint32"),
            ("TCA_BPF_TAG", "hex"),
            ("TCA_BPF_ID", "uint32"),
        )
        if hasattr(sched_bpf.options, "compile_nla"):
            sched_bpf.options.compile_nla()


_teach_pyroute2_bpf_ids()

# pyroute2 forks a helper process to open a netlink socket in another netns
# and stops it with SIGTERM.  A forked child inherits the parent's Python
# signal handlers and asyncio's wakeup fd, so without this the child would
# report "SIGTERM" to the parent's event loop (qosd would stop itself).  With
# it, the child resets SIGTERM/SIGINT to their defaults first.
pyroute2_config.disable_mp_signal = True

NETNS_RUN_DIR = "/var/run/netns"
TC_H_CLSACT = 0xFFFFFFF1
PARENT_INGRESS = 0xFFFFFFF2
PARENT_EGRESS = 0xFFFFFFF3
FILTER_PRIO = 0x4D4D  # "MM": our filter among others on the same hook
FILTER_HANDLE = 0x4D4D
HTB_ROOT = HTB_MAJOR << 16
HTB_PARENT = HTB_ROOT | MAX_CLASSES  # 1:40, outside the policy ids 1..63
DIRECTIONS = {"egress": PARENT_EGRESS, "ingress": PARENT_INGRESS}
# Root qdiscs a device has when nobody configured it: safe to replace.
DEFAULT_ROOT_KINDS = {None, "noqueue", "pfifo_fast", "mq", "fq_codel"}
# what distributions put under an mq root by default (net.core.default_qdisc)
DEFAULT_MQ_CHILDREN = {"pfifo_fast", "fq_codel"}


def _bit(bps: int) -> str:
    return f"{int(bps)}bit"


def _same_rates(cur: HtbClassStats, rate_bps: int, ceil_bps: int) -> bool:
    """Kernel rates are bytes/s: compare what pyroute2 would send."""
    return cur.rate_Bps == int(rate_bps) // 8 and cur.ceil_Bps == int(ceil_bps) // 8


def _buckets(burst: int | None, cburst: int | None) -> dict[str, int]:
    """pyroute2 keywords for an HTB class's token buckets, in bytes (a bucket
    left out gets the kernel's default)."""
    kw = {"burst": burst, "cburst": cburst}
    return {k: int(v) for k, v in kw.items() if v is not None}


def _buffers(rate_bps: int, ceil_bps: int, buckets: dict[str, int]) -> tuple[int, int]:
    """(buffer, cbuffer) in scheduler ticks, as pyroute2 sends them for these
    and the kernel dumps them back."""
    p = sched_htb.get_class_parameters(
        {"rate": _bit(rate_bps), "ceil": _bit(ceil_bps), **buckets})["attrs"][0][1]
    return int(p["buffer"]), int(p["cbuffer"])


def _err(e: NetlinkError, what: str) -> DataplaneError:
    return DataplaneError(e.code, f"{what}: {e}")


class Netlink:
    """A netlink session in one network namespace (None = the current one)."""

    def __init__(self, ns: str | None = None) -> None:
        self.ns = ns
        # pyroute2 creates a named netns that does not exist: never let a
        # read (a status, a metrics scrape) do that.
        if ns and not os.path.exists(os.path.join(NETNS_RUN_DIR, ns)):
            raise DataplaneError(errno.ENOENT, f"no netns {ns!r}")
        try:
            self.ipr = IPRoute(netns=ns) if ns else IPRoute()
        except (OSError, NetlinkError) as e:
            raise DataplaneError(errno.ENOENT, f"netns {ns!r}: {e}") from e

    def close(self) -> None:
        self.ipr.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- links
    def ifindex(self, ifname: str) -> int:
        idx = self.ipr.link_lookup(ifname=ifname)
        if not idx:
            where = f" in netns {self.ns}" if self.ns else ""
            raise DataplaneError(errno.ENODEV, f"no device {ifname!r}{where}")
        return int(idx[0])

    def link_exists(self, ifname: str) -> bool:
        return bool(self.ipr.link_lookup(ifname=ifname))

    # ----------------------------------------------------------------- tc
    def root_qdisc(self, idx: int) -> tuple[str | None, int]:
        for q in self.ipr.get_qdiscs(index=idx):
            if q["parent"] == 0xFFFFFFFF:
                return q.get_attr("TCA_KIND"), int(q["handle"])
        return None, 0

    def has_clsact(self, idx: int) -> bool:
        return any(
            q.get_attr("TCA_KIND") == "clsact" for q in self.ipr.get_qdiscs(index=idx)
        )

    def ensure_clsact(self, idx: int) -> None:
        if not self.has_clsact(idx):
            try:
                self.ipr.tc("add", "clsact", idx)
            except NetlinkError as e:
                if e.code != errno.EEXIST:
                    raise _err(e, "add clsact") from e

    def attach_bpf(self, idx: int, direction: str, prog_fd: int, name: str) -> None:
        try:
            self.ipr.tc(
                "replace-filter", "bpf", idx, FILTER_HANDLE, parent=DIRECTIONS[direction],
                prio=FILTER_PRIO, fd=prog_fd, name=name, direct_action=True, protocol=0x0003,
            )
        except NetlinkError as e:
            raise _err(e, f"attach {name} ({direction})") from e

    def bpf_filters(self, idx: int) -> dict[str, dict[str, Any]]:
        """Our filters by direction: {'egress': {'name':..., 'prog_id':...}}."""
        out: dict[str, dict[str, Any]] = {}
        if not self.has_clsact(idx):
            return out
        for direction, parent in DIRECTIONS.items():
            try:
                filters = self.ipr.get_filters(index=idx, parent=parent)
            except NetlinkError:
                continue
            for f in filters:
                if f.get_attr("TCA_KIND") != "bpf" or (f["info"] >> 16) != FILTER_PRIO:
                    continue
                opts = f.get_attr("TCA_OPTIONS")
                if opts is None:
                    continue
                out[direction] = {
                    "name": opts.get_attr("TCA_BPF_NAME"),
                    "prog_id": opts.get_attr("TCA_BPF_ID"),
                }
        return out

    def detach_bpf(self, idx: int, direction: str) -> None:
        try:
            self.ipr.tc(
                "del-filter", "bpf", idx, FILTER_HANDLE, parent=DIRECTIONS[direction],
                prio=FILTER_PRIO, protocol=0x0003,
            )
        except NetlinkError as e:
            if e.code not in (errno.ENOENT, errno.EINVAL):
                raise _err(e, f"detach ({direction})") from e

    def remove_clsact_if_empty(self, idx: int) -> None:
        if not self.has_clsact(idx):
            return
        for parent in DIRECTIONS.values():
            if list(self.ipr.get_filters(index=idx, parent=parent)):
                return
        try:
            self.ipr.tc("del", "clsact", idx)
        except NetlinkError as e:
            if e.code not in (errno.ENOENT, errno.EINVAL):
                raise _err(e, "delete clsact") from e

    # ---------------------------------------------------------------- HTB
    def htb_classes(self, idx: int, buffers: dict[int, tuple[int, int]] | None = None
                    ) -> dict[int, HtbClassStats]:
        """Our HTB classes with their live statistics, by class id; ``buffers``,
        if given, gets each class's (buffer, cbuffer) in scheduler ticks."""
        out: dict[int, HtbClassStats] = {}
        for c in self.ipr.get_classes(index=idx):
            if c.get_attr("TCA_KIND") != "htb" or (c["handle"] >> 16) != HTB_MAJOR:
                continue
            st: dict[str, Any] = {"classid": int(c["handle"]), "parent": int(c["parent"])}
            basic = c.get_attr("TCA_STATS2")
            if basic is not None:
                b = basic.get_attr("TCA_STATS_BASIC") or {}
                q = basic.get_attr("TCA_STATS_QUEUE") or {}
                st.update(
                    bytes=int(b.get("bytes", 0)), packets=int(b.get("packets", 0)),
                    drops=int(q.get("drops", 0)), overlimits=int(q.get("overlimits", 0)),
                    backlog=int(q.get("backlog", 0)), qlen=int(q.get("qlen", 0)),
                )
            opts = c.get_attr("TCA_OPTIONS")
            params = opts.get_attr("TCA_HTB_PARMS") if opts is not None else None
            if params is not None:
                st.update(prio=int(params["prio"]), quantum=int(params["quantum"]),
                          rate_Bps=int(params["rate"]), ceil_Bps=int(params["ceil"]))
                if buffers is not None:
                    buffers[st["classid"]] = (int(params["buffer"]), int(params["cbuffer"]))
                r64 = opts.get_attr("TCA_HTB_RATE64")
                c64 = opts.get_attr("TCA_HTB_CEIL64")
                if r64:
                    st["rate_Bps"] = int(r64)
                if c64:
                    st["ceil_Bps"] = int(c64)
            out[st["classid"]] = HtbClassStats(**st)
        return out

    def _leaf_qdisc(self, idx: int, classid: int, limit: int) -> None:
        handle = (0x100 + (classid & 0xFFFF)) << 16
        try:
            self.ipr.tc("replace", "fq_codel", idx, handle, parent=classid, limit=limit)
            return
        except NetlinkError as e:
            if e.code not in (errno.ENOENT, errno.EOPNOTSUPP, errno.EINVAL):
                raise _err(e, f"leaf qdisc of {classid:#x}") from e
        try:  # no fq_codel on this kernel: a short FIFO
            self.ipr.tc("replace", "pfifo", idx, handle, parent=classid, limit=limit)
        except NetlinkError as e:
            raise _err(e, f"leaf qdisc of {classid:#x}") from e

    def apply_htb(self, idx: int, spec: HtbSpec, *, force: bool = False) -> None:
        """Makes the HTB tree what ``spec`` says: :meth:`add_htb` then
        :meth:`prune_htb` (a caller that writes maps in between uses the two)."""
        self.add_htb(idx, spec, force=force)
        self.prune_htb(idx, spec)

    def add_htb(self, idx: int, spec: HtbSpec, *, force: bool = False) -> None:
        """The root, the link class and every leaf of ``spec`` (created, or
        changed where they differ; lowered rates before raised ones, so the
        guarantees never add up to more than either policy's).  Classes that
        are not in ``spec`` stay: maps may still point at them."""
        kind, handle = self.root_qdisc(idx)
        ours = kind == "htb" and handle == HTB_ROOT
        self._check_root(idx, kind, handle, ours, force)
        try:
            # sch_htb has no change op: the default class can only be set at
            # creation, so a new default means a new root.
            if ours and self.htb_default(idx) != spec.default_minor:
                self.ipr.tc("del", "htb", idx, HTB_ROOT)
                ours = False
            if not ours:
                self.ipr.tc("replace", "htb", idx, HTB_ROOT, default=spec.default_minor)
            # Only what differs is rewritten: a re-apply of the same policy
            # costs two dumps, and unchanged classes keep their state.
            buf: dict[int, tuple[int, int]] = {}
            have = self.htb_classes(idx, buf) if ours else {}
            leaves = self._leaf_parents(idx) if ours else set()
            parent = have.get(HTB_PARENT)
            link_kw = _buckets(spec.link_burst, spec.link_burst)
            if (parent is None or not _same_rates(parent, spec.link_bps, spec.link_bps)
                    or buf.get(HTB_PARENT) != _buffers(spec.link_bps, spec.link_bps, link_kw)):
                self.ipr.tc(
                    "replace-class", "htb", idx, HTB_PARENT, parent=HTB_ROOT,
                    rate=_bit(spec.link_bps), ceil=_bit(spec.link_bps), prio=0, **link_kw,
                )

            def lowered_first(c: HtbClass) -> tuple[bool, int]:
                cur = have.get(c.classid)
                return (cur is None or (cur.rate_Bps or 0) * 8 <= c.rate_bps, c.classid)

            for c in sorted(spec.leaves, key=lowered_first):
                cur = have.get(c.classid)
                kw = _buckets(None, c.cburst)
                if (cur is None or cur.parent != HTB_PARENT
                        or not _same_rates(cur, c.rate_bps, c.ceil_bps)
                        or cur.prio != c.prio or cur.quantum != c.quantum
                        or buf.get(c.classid) != _buffers(c.rate_bps, c.ceil_bps, kw)):
                    self.ipr.tc(
                        "replace-class", "htb", idx, c.classid, parent=HTB_PARENT,
                        rate=_bit(c.rate_bps), ceil=_bit(c.ceil_bps), prio=c.prio,
                        quantum=c.quantum, **kw,
                    )
                if c.classid not in leaves:
                    self._leaf_qdisc(idx, c.classid, spec.leaf_limit)
        except NetlinkError as e:
            raise _err(e, "configure HTB") from e

    def prune_htb(self, idx: int, spec: HtbSpec) -> None:
        """Deletes our leaf classes that ``spec`` does not have."""
        want = {c.classid for c in spec.leaves}
        try:
            for classid, st in self.htb_classes(idx).items():
                if classid not in want and classid != HTB_PARENT and st.parent == HTB_PARENT:
                    self.ipr.tc("del-class", index=idx, handle=classid, parent=HTB_PARENT)
        except NetlinkError as e:
            raise _err(e, "configure HTB") from e

    def _check_root(self, idx: int, kind: str | None, handle: int, ours: bool,
                    force: bool) -> None:
        """Refuses to replace a root qdisc somebody else configured."""
        if ours or force:
            return
        if kind == "mq":
            # mq with fq children is a configuration (e.g. a bandwidth manager's)
            kids = {q.get_attr("TCA_KIND") for q in self.ipr.get_qdiscs(index=idx)
                    if q["parent"] != 0xFFFFFFFF and (q["parent"] >> 16) == (handle >> 16)}
            if not kids <= DEFAULT_MQ_CHILDREN:
                raise DataplaneError(
                    errno.EBUSY,
                    f"device has an mq root with {', '.join(sorted(map(str, kids)))} queues "
                    "that mmmesh did not create; remove them or pass --force",
                )
        if kind not in DEFAULT_ROOT_KINDS:
            raise DataplaneError(
                errno.EBUSY,
                f"device has a root qdisc {kind} {handle >> 16:x}: that mmmesh did not "
                "create; remove it or pass --force",
            )

    def _leaf_parents(self, idx: int) -> set[int]:
        """Class ids that already have a leaf qdisc."""
        return {
            int(q["parent"]) for q in self.ipr.get_qdiscs(index=idx)
            if (q["parent"] >> 16) == HTB_MAJOR and q.get_attr("TCA_KIND") in ("fq_codel", "pfifo")
        }

    def htb_default(self, idx: int) -> int | None:
        """The minor of the HTB root's default class (None without our root)."""
        for q in self.ipr.get_qdiscs(index=idx):
            if q.get_attr("TCA_KIND") == "htb" and q["handle"] == HTB_ROOT:
                opts = q.get_attr("TCA_OPTIONS")
                init = opts.get_attr("TCA_HTB_INIT") if opts is not None else None
                return int(init["defcls"]) if init is not None else None
        return None

    def remove_htb(self, idx: int) -> None:
        kind, handle = self.root_qdisc(idx)
        if kind == "htb" and handle == HTB_ROOT:
            try:
                self.ipr.tc("del", "htb", idx, HTB_ROOT)
            except NetlinkError as e:
                if e.code not in (errno.ENOENT, errno.EINVAL):
                    raise _err(e, "delete HTB") from e
