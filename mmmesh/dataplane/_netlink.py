"""Everything that talks netlink (pyroute2), and nothing else does.

Kernel objects mmmesh owns on a device:
  * a clsact qdisc with one cls_bpf filter per direction (prio/handle
    FILTER_PRIO/FILTER_HANDLE, direct-action) running the classifier;
  * egress mode htb: an HTB root ``1:`` with one parent class ``1:40`` at the
    link rate and one leaf class ``1:<id>`` per policy class (and boost
    leaf), each with a short leaf queue;
  * egress mode fq: an ``mq`` root ``4d4d:`` with one ``fq`` per TX queue
    (``4e00+q:`` under class ``4d4d:<q+1>``), or on a single-queue device one
    ``fq`` root ``4d4d:``, each with 3 bands, mmmesh's priomap, band weights
    and horizon (pyroute2 0.9 has no fq or mq plugin: ``_FQ`` below is one).
Every call is idempotent (replace verbs) so a reconciler can re-apply.
Testbeds (namespaces, veth links, addresses, routes) are built elsewhere:
``demo/netlab.py``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import struct
import subprocess
import sys
import types
from typing import Any, Self

from pyroute2 import IPRoute
from pyroute2 import config as pyroute2_config
from pyroute2.netlink import nla
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl.tcmsg import plugins as _tc_plugins
from pyroute2.netlink.rtnl.tcmsg import sched_htb

from mmmesh.abi import (
    FQ_BANDS,
    FQ_CHILD_MAJOR,
    FQ_PRIO_SLOTS,
    FQ_ROOT_MAJOR,
    HTB_MAJOR,
    MAX_CLASSES,
)
from mmmesh.errors import DataplaneError

from ._types import FqQdiscStats, FqSpec, HtbClass, HtbClassStats, HtbSpec


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


class _FqOptions(nla):  # type: ignore[misc]  # pyroute2 is untyped
    """sch_fq's TCA_OPTIONS (include/uapi/linux/pkt_sched.h, TCA_FQ_*; PRIOMAP,
    WEIGHTS since Linux 6.7).  A kernel ignores attributes it does not know,
    so whether it has bands is read back, never assumed (:func:`probe_fq_bands`)."""

    nla_map = (
        ("TCA_FQ_UNSPEC", "none"),
        ("TCA_FQ_PLIMIT", "uint32"),
        ("TCA_FQ_FLOW_PLIMIT", "uint32"),
        ("TCA_FQ_QUANTUM", "uint32"),
        ("TCA_FQ_INITIAL_QUANTUM", "uint32"),
        ("TCA_FQ_RATE_ENABLE", "uint32"),
        ("TCA_FQ_FLOW_DEFAULT_RATE", "uint32"),
        ("TCA_FQ_FLOW_MAX_RATE", "uint32"),
        ("TCA_FQ_BUCKETS_LOG", "uint32"),
        ("TCA_FQ_FLOW_REFILL_DELAY", "uint32"),
        ("TCA_FQ_ORPHAN_MASK", "uint32"),
        ("TCA_FQ_LOW_RATE_THRESHOLD", "uint32"),
        ("TCA_FQ_CE_THRESHOLD", "uint32"),
        ("TCA_FQ_TIMER_SLACK", "uint32"),
        ("TCA_FQ_HORIZON", "uint32"),
        ("TCA_FQ_HORIZON_DROP", "uint8"),
        ("TCA_FQ_PRIOMAP", "priomap"),
        ("TCA_FQ_WEIGHTS", "weights"),
        ("TCA_FQ_OFFLOAD_HORIZON", "uint32"),
    )

    class priomap(nla):  # type: ignore[misc]  # struct tc_prio_qopt
        fields = (("bands", "i"), ("priomap", "16B"))

    class weights(nla):  # type: ignore[misc]  # s32[FQ_BANDS]
        fields = (("weights", "3i"),)


def _fq_parameters(kwarg: dict[str, Any]) -> dict[str, Any] | None:
    """TCA_OPTIONS of an fq request: ``fq_attrs`` (a delete has none)."""
    attrs = kwarg.get("fq_attrs")
    return {"attrs": attrs} if attrs else None


_FQ = types.SimpleNamespace(parent=0xFFFFFFFF, get_parameters=_fq_parameters, options=_FqOptions)
_tc_plugins.setdefault("fq", _FQ)

# struct tc_fq_qd_stats (TCA_XSTATS of sch_fq), as far as a kernel fills it:
# 8 x u64/s64, 4 x u32, then (later kernels) ce_mark, horizon_drops,
# horizon_caps, fastpath_packets (u64), band_drops[3] (u64), band_pkt_count[3] (u32)
_FQ_XSTATS_HEAD = struct.Struct("<QQQQQQQqIIII")
_FQ_XSTATS_TAIL = struct.Struct("<QQQQ3Q3I")

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
FQ_ROOT = FQ_ROOT_MAJOR << 16  # 4d4d:, the mq (or single fq) root of egress mode fq


def fq_child_handle(queue: int) -> int:
    """The handle of the fq on TX queue ``queue`` (0-based) under the mq root."""
    return (FQ_CHILD_MAJOR + queue) << 16
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
        # egress mode fq's root is mmmesh's too: a mode switch replaces it
        mine = ours or (kind, handle) in (("mq", FQ_ROOT), ("fq", FQ_ROOT))
        self._check_root(idx, kind, handle, mine, force)
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

    # ----------------------------------------------------------- egress fq
    def tx_queues(self, idx: int) -> int:
        """The device's TX queues (IFLA_NUM_TX_QUEUES: what it has, as mq makes
        its children for)."""
        for link in self.ipr.get_links(idx):
            n = link.get_attr("IFLA_NUM_TX_QUEUES")
            return int(n) if n else 1
        return 1

    def fq_qdiscs(self, idx: int) -> tuple[tuple[str | None, int], dict[int, FqQdiscStats],
                                           dict[int, str]]:
        """(root kind and handle, our fq qdiscs by TX queue, the kind of what
        every other queue under our mq root runs)."""
        root = self.root_qdisc(idx)
        ours: dict[int, FqQdiscStats] = {}
        other: dict[int, str] = {}
        for q in self.ipr.get_qdiscs(index=idx):
            kind, parent = q.get_attr("TCA_KIND"), int(q["parent"])
            if parent == 0xFFFFFFFF:
                if root == ("fq", FQ_ROOT):
                    ours[0] = _fq_stats(q, 0)
                continue
            if root != ("mq", FQ_ROOT) or parent >> 16 != FQ_ROOT_MAJOR:
                continue
            queue = (parent & 0xFFFF) - 1
            if kind == "fq" and int(q["handle"]) == fq_child_handle(queue):
                ours[queue] = _fq_stats(q, queue)
            else:
                other[queue] = str(kind)
        return root, ours, other

    def add_fq(self, idx: int, spec: FqSpec, *, force: bool = False) -> None:
        """Makes the device's egress qdiscs egress mode fq's: an mq root 4d4d:
        with one fq per TX queue (a single-queue device: one fq root 4d4d:),
        each with ``spec``.  An HTB root of mmmesh's is replaced (what it holds
        is dropped); a qdisc somebody else configured is refused (``force``:
        replaced).  Only what differs is written: an fq that has ``spec`` is
        left alone, one with other bands is changed in place (it keeps its
        flows)."""
        kind, handle = self.root_qdisc(idx)
        multi = self.tx_queues(idx) > 1
        want_root = ("mq", FQ_ROOT) if multi else ("fq", FQ_ROOT)
        if (kind, handle) != want_root:
            ours = (kind, handle) in (("htb", HTB_ROOT), ("mq", FQ_ROOT), ("fq", FQ_ROOT))
            self._check_root(idx, kind, handle, ours, force)
        attrs = _fq_attrs(spec)
        try:
            if (kind, handle) != want_root:
                if handle == FQ_ROOT and kind is not None:
                    self.ipr.tc("del", kind, idx, handle)  # ours, of the other kind
                if multi:
                    self.ipr.tc("replace", "mq", idx, FQ_ROOT)
                else:
                    self.ipr.tc("replace", "fq", idx, FQ_ROOT, fq_attrs=attrs)
            _, have, _ = self.fq_qdiscs(idx)
            if not multi:
                if not _fq_matches(have.get(0), spec):
                    self.ipr.tc("replace", "fq", idx, FQ_ROOT, fq_attrs=attrs)
                return
            for queue in self._mq_queues(idx):
                if _fq_matches(have.get(queue), spec):
                    continue
                self.ipr.tc("replace", "fq", idx, fq_child_handle(queue),
                            parent=FQ_ROOT | (queue + 1), fq_attrs=attrs)
        except NetlinkError as e:
            if e.code in (errno.ENOENT, errno.EOPNOTSUPP) and "fq" not in self._known_kinds():
                raise DataplaneError(errno.EOPNOTSUPP, "egress mode fq: this kernel has no "
                                     "sch_fq (CONFIG_NET_SCH_FQ)") from e
            raise _err(e, "configure egress mode fq") from e

    def _mq_queues(self, idx: int) -> list[int]:
        """The TX queues under our mq root (each has a child qdisc)."""
        out = set()
        for q in self.ipr.get_qdiscs(index=idx):
            parent = int(q["parent"])
            if parent != 0xFFFFFFFF and parent >> 16 == FQ_ROOT_MAJOR and parent & 0xFFFF:
                out.add((parent & 0xFFFF) - 1)
        return sorted(out)

    def _known_kinds(self) -> set[str]:
        return {str(k) for k in _tc_plugins}

    def remove_fq(self, idx: int) -> None:
        """Deletes egress mode fq's root (the kernel puts the device's default back)."""
        kind, handle = self.root_qdisc(idx)
        if (kind, handle) in (("mq", FQ_ROOT), ("fq", FQ_ROOT)):
            try:
                self.ipr.tc("del", kind, idx, handle)
            except NetlinkError as e:
                if e.code not in (errno.ENOENT, errno.EINVAL):
                    raise _err(e, "delete the fq root") from e


def _fq_attrs(spec: FqSpec) -> list[list[Any]]:
    return [["TCA_FQ_PRIOMAP", {"bands": FQ_BANDS, "priomap": list(spec.priomap)}],
            ["TCA_FQ_WEIGHTS", {"weights": list(spec.weights)}],
            ["TCA_FQ_HORIZON", int(spec.horizon_us)],
            ["TCA_FQ_HORIZON_DROP", 1]]


def _fq_matches(have: FqQdiscStats | None, spec: FqSpec) -> bool:
    return (have is not None and have.weights == tuple(spec.weights)
            and have.priomap == tuple(spec.priomap) and have.horizon_us == spec.horizon_us
            and have.horizon_drop is True)


def _fq_stats(q: Any, queue: int) -> FqQdiscStats:
    st: dict[str, Any] = {"queue": queue, "handle": int(q["handle"]), "parent": int(q["parent"])}
    opts = q.get_attr("TCA_OPTIONS")
    if opts is not None and hasattr(opts, "get_attr"):
        pm, w = opts.get_attr("TCA_FQ_PRIOMAP"), opts.get_attr("TCA_FQ_WEIGHTS")
        if pm is not None:
            st["priomap"] = tuple(int(x) for x in pm["priomap"])[:FQ_PRIO_SLOTS]
        if w is not None:
            st["weights"] = tuple(int(x) for x in w["weights"])
        h, hd = opts.get_attr("TCA_FQ_HORIZON"), opts.get_attr("TCA_FQ_HORIZON_DROP")
        st["horizon_us"] = int(h) if h is not None else None
        st["horizon_drop"] = bool(hd) if hd is not None else None
    basic = q.get_attr("TCA_STATS2")
    if basic is not None:
        b = basic.get_attr("TCA_STATS_BASIC") or {}
        qs = basic.get_attr("TCA_STATS_QUEUE") or {}
        st.update(bytes=int(b.get("bytes", 0)), packets=int(b.get("packets", 0)),
                  drops=int(qs.get("drops", 0)), backlog=int(qs.get("backlog", 0)),
                  qlen=int(qs.get("qlen", 0)))
    raw = _hex_bytes(q.get_attr("TCA_XSTATS"))
    if len(raw) >= _FQ_XSTATS_HEAD.size:
        head = _FQ_XSTATS_HEAD.unpack_from(raw)
        st.update(flows=head[8], throttled_flows=head[10])
        if len(raw) >= _FQ_XSTATS_HEAD.size + _FQ_XSTATS_TAIL.size:
            tail = _FQ_XSTATS_TAIL.unpack_from(raw, _FQ_XSTATS_HEAD.size)
            st.update(horizon_drops=tail[1], band_drops=tuple(tail[4:7]),
                      band_pkt_count=tuple(tail[7:10]))
    return FqQdiscStats(**st)


def _hex_bytes(v: Any) -> bytes:
    """A pyroute2 ``hex`` attribute ("01:02:...") or raw bytes as bytes."""
    if v is None:
        return b""
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    try:
        return bytes.fromhex(str(v).replace(":", ""))
    except ValueError:
        return b""


# ------------------------------------------------------------------ probes
CLONE_NEWNET = 0x40000000


PROBE_TIMEOUT_S = 600.0  # a fresh interpreter importing pyroute2: seconds on a node,
#                         minutes in an emulated VM on a busy host; once per process


def probe_fq_bands() -> bool:
    """Whether this kernel has sch_fq with priority bands (Linux >= 6.7):
    an fq with a priomap and weights on the loopback of a network namespace
    of a short-lived child process, read back (a kernel without bands ignores
    the attributes).  False when the probe cannot run (no CAP_SYS_ADMIN for
    the namespace): the caller then chooses htb.  Cached per process;
    :func:`probe_fq` says why."""
    return probe_fq()[0]


@functools.lru_cache(maxsize=1)
def probe_fq() -> tuple[bool, str]:
    """(sch_fq has bands, what the probe found: "fq-bands", "fq-without-bands",
    "no-fq <errno>", "no-netns", or why it could not run)."""
    try:
        r = subprocess.run([sys.executable, "-m", "mmmesh.dataplane._netlink", "probe-fq"],
                           capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"the probe could not run: {e}"
    out = r.stdout.strip().splitlines()
    said = out[-1] if out else f"the probe exited {r.returncode}: {r.stderr.strip()[-200:]}"
    return r.returncode == 0 and said == "fq-bands", said


def _probe_fq_child() -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        print("no-netns")
        return 1
    spec = FqSpec((3 << 16, 2 << 16, 1 << 16), (1,) * FQ_PRIO_SLOTS, 1_000_000, 1)
    with Netlink() as nl:
        idx = nl.ifindex("lo")
        try:
            nl.ipr.tc("replace", "fq", idx, FQ_ROOT, fq_attrs=_fq_attrs(spec))
        except NetlinkError as e:
            print(f"no-fq {e.code}")
            return 1
        _, have, _ = nl.fq_qdiscs(idx)
        ok = have.get(0) is not None and have[0].weights == spec.weights
    print("fq-bands" if ok else "fq-without-bands")
    return 0


def line_rate_bps(ifname: str, netns: str | None) -> int | None:
    """The device's line rate (ethtool speed) in bit/s, None when it reports
    none (veth in a netns, virtio without a speed) or lives in a named netns
    (its sysfs is not this one's)."""
    if netns:
        return None
    try:
        with open(f"/sys/class/net/{ifname}/speed") as f:
            mbit = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return mbit * 1_000_000 if mbit > 0 else None


if __name__ == "__main__":
    if sys.argv[1:] == ["probe-fq"]:
        raise SystemExit(_probe_fq_child())
    raise SystemExit("usage: python -m mmmesh.dataplane._netlink probe-fq")
