"""``SocketLayer``: the socket layer (sockops + SOCKHASH + sk_msg) on one
cgroup v2, the public face of ``_sock.py``.  See docs/socklayer.md.

    from mmmesh.dataplane import Endpoint, SocketLayer

    sl = SocketLayer("mesh.slice")             # below the cgroup v2 mount
    sl.up([Endpoint("10.1.0.7", 7000, stage=2, replica=0)])   # load or adopt, attach
    sl.set_weights(2, [3, 1])                  # stage 2: replica 0 gets 3/4 of the frames
    sl.set_redirect(False)                     # everything over TCP again (counted)
    sl.flows(); sl.stats(); sl.status()
    sl.down()                                  # detach, release the sockets, unpin

Like ``Dataplane``, a handle holds no kernel resources between calls.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mmmesh import abi
from mmmesh.errors import DataplaneError

from . import _pins, _sock
from ._bpf import count_by_next_key

_ROLES = {abi.SOCK_ROLE_CLIENT: "client", abi.SOCK_ROLE_SERVER: "server"}
_FLAGS = {abi.SOCK_F_SENT_TCP: "sent_tcp", abi.SOCK_F_LOST: "unaligned",
          abi.SOCK_F_LEAD: "lead"}


@dataclass(frozen=True, order=True)
class Endpoint:
    """A mesh endpoint: ``addr:port`` is replica ``replica`` of ``stage``.
    Port 0 covers every port of the address (a pod's address: its stage).
    Stage 0 marks mesh sockets that belong to no stage (counted, bypassed,
    never weighted)."""

    addr: str
    port: int
    stage: int
    replica: int = 0

    def key(self) -> abi.SockEpKey:
        if not 0 <= self.port <= 0xFFFF:
            raise DataplaneError(errno.EINVAL, f"endpoint port {self.port} out of range")
        if not 0 <= self.stage <= 0xFFFFFFFF:
            raise DataplaneError(errno.EINVAL, f"endpoint stage {self.stage} out of range")
        if not 0 <= self.replica < abi.SOCK_MAX_REPLICAS:
            raise DataplaneError(errno.EINVAL, f"endpoint replica {self.replica} not in "
                                 f"0..{abi.SOCK_MAX_REPLICAS - 1}")
        k = abi.SockEpKey(port=self.port)
        k.addr[:] = addr16(self.addr)
        return k


def addr16(addr: str) -> bytes:
    """An address as the maps store it: IPv4 as ::ffff:a.b.c.d."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError as e:
        raise DataplaneError(errno.EINVAL, f"not an IP address: {addr!r}") from e
    if isinstance(ip, ipaddress.IPv4Address):
        return b"\0" * 10 + b"\xff\xff" + ip.packed
    return ip.packed


def addr_text(raw: bytes) -> str:
    if raw[:12] == b"\0" * 10 + b"\xff\xff":
        return str(ipaddress.IPv4Address(raw[12:]))
    return str(ipaddress.IPv6Address(raw))


def _flag_names(flags: int) -> tuple[str, ...]:
    return tuple(n for b, n in _FLAGS.items() if flags & b)


@dataclass(frozen=True)
class SocketUpResult:
    cgroup: str  # absolute path
    pin_dir: str
    adopted: bool  # same ABI and build were pinned: reused, program ids kept
    prog_ids: dict[str, int]  # "sockops" / "sk_msg" -> program id


@dataclass(frozen=True)
class SocketFlow:
    """One registered mesh socket (an entry of the registry)."""

    local: str
    lport: int
    remote: str
    rport: int
    cookie: int
    netns: int
    role: str  # "client" (connected) or "server" (accepted)
    stage: int  # the connection's endpoint
    replica: int
    peer_stage: int  # the other side's stage (address-wide endpoint), 0 = unknown
    flags: tuple[str, ...]  # "sent_tcp", "unaligned", "lead"
    age_s: float
    in_sockhash: bool


@dataclass(frozen=True)
class SocketState:
    """One socket's storage, read through its fd."""

    cookie: int
    netns: int
    role: str
    stage: int
    replica: int
    peer_stage: int
    weight: int
    flags: tuple[str, ...]
    last_modality: int
    last_class: int
    last_pick: int | None
    redirected: int
    passed: int
    modalities: dict[int | str, tuple[int, int]]  # modality (or "other") -> (frames, bytes)


@dataclass(frozen=True)
class SocketStats:
    events: dict[str, int]  # SockEvent names, lower case
    modalities: dict[int, tuple[int, int]]  # modality byte -> (frames, bytes), non-zero only
    classes: dict[int, tuple[int, int]]  # requested class -> (frames, bytes); 0: none or >= 64


@dataclass(frozen=True)
class SocketStatus:
    cgroup: str
    pin_dir: str
    loaded: bool
    attached: dict[str, bool] = field(default_factory=dict)
    prog_ids: dict[str, int] = field(default_factory=dict)
    abi_version: int = 0
    register: bool = False
    redirect: bool = False
    all_sockets: bool = False
    endpoints: int = 0
    weights: dict[int, tuple[int, ...]] = field(default_factory=dict)
    flows: int = 0
    stats: SocketStats | None = None


def _flags_for(register: bool, redirect: bool, all_sockets: bool) -> int:
    return ((abi.SOCK_CFG_REGISTER if register else 0)
            | (abi.SOCK_CFG_REDIRECT if redirect else 0)
            | (abi.SOCK_CFG_ALL if all_sockets else 0))


class SocketLayer:
    """The socket layer on one cgroup v2 (``cgroup``: a path below the
    cgroup v2 mount, '' for its root, or an absolute path inside it)."""

    def __init__(self, cgroup: str = "", *, mount: str | None = None) -> None:
        self.mount = mount or _sock.cgroup2_mount()
        self.cgroup, self.rel = _sock.resolve_cgroup(cgroup, self.mount)
        self.pin_dir = _sock.pin_dir(self.rel)

    def __repr__(self) -> str:
        return f"SocketLayer({self.cgroup!r})"

    # ------------------------------------------------------------- write
    def up(self, endpoints: Iterable[Endpoint] | None = None, *, redirect: bool = True,
           all_sockets: bool = False, tunables: dict[str, int] | None = None) -> SocketUpResult:
        """Loads (or adopts) the programs and maps, writes the endpoints (when
        given: the whole set) and switches, and attaches sockops to the
        cgroup and sk_msg to the sockhash.  Idempotent.  ``all_sockets``
        makes every TCP socket of the cgroup a mesh socket; refused on the
        root cgroup, whose sockops sees every socket of the machine."""
        from ._bcc import build_id  # source hashing only; bcc is not imported

        if all_sockets and not self.rel:
            raise DataplaneError(errno.EINVAL, "all_sockets on the root cgroup would take every "
                                 "socket of the machine: name the mesh's cgroup or endpoints")
        if not os.path.isdir(self.cgroup):
            raise DataplaneError(errno.ENOENT, f"no cgroup {self.cgroup}")
        wanted = [e.key() for e in endpoints] if endpoints is not None else None
        _pins.ensure_bpffs()
        build = build_id(tunables, layer="sock")
        state = _sock.pinned_state(self.pin_dir, build)
        old = _OldLayer(self.pin_dir, self.cgroup) if state == "replace" else None
        try:
            if state != "adopt":
                _pins.load_and_pin(self.pin_dir, tunables, build, layer="sock",
                                   stamp=_sock.stamp)
            with _sock.SockMaps(self.pin_dir) as maps:
                if wanted is not None:
                    _write_endpoints(maps, [(k, e) for k, e in zip(wanted, endpoints or [])])
                maps.write_flags(_flags_for(True, redirect, all_sockets))
            with _sock.Attachment(self.pin_dir, self.cgroup) as att:
                att.attach()
                ids = dict(att.ids)
            if old is not None:
                old.retire()
        finally:
            if old is not None:
                old.close()
        return SocketUpResult(self.cgroup, self.pin_dir, state == "adopt", ids)

    def down(self, *, unpin: bool = True) -> None:
        """Switches registration and redirect off, detaches both programs and
        unpins.  Sockets already registered stay in the (now unreachable)
        sockhash until they close, passing everything over TCP: taking a
        socket out of a sockhash makes the kernel drop the bytes redirected
        to it and not yet read.  ``unpin=False`` keeps the maps and programs
        pinned, detached (the next ``up`` adopts them)."""
        if not self.loaded():
            return
        with _sock.SockMaps(self.pin_dir) as maps:
            maps.write_flags(0)
        with _sock.Attachment(self.pin_dir, self.cgroup) as att:
            att.detach()
        if unpin:
            _pins.unpin(self.pin_dir)

    def set_redirect(self, on: bool) -> None:
        """Redirect on or off; off, every frame goes over TCP and is still
        counted.  A socket that sent TCP bytes is never redirected again (the
        order guard), so switching back on takes effect for new connections."""
        with _sock.SockMaps(self.pin_dir) as maps:
            f = maps.flags()
            maps.write_flags((f | abi.SOCK_CFG_REDIRECT) if on else
                             (f & ~abi.SOCK_CFG_REDIRECT))

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Replaces the set of mesh endpoints (applies to sockets established
        afterwards)."""
        eps = list(endpoints)
        with _sock.SockMaps(self.pin_dir) as maps:
            _write_endpoints(maps, [(e.key(), e) for e in eps])

    def set_weights(self, stage: int, weights: Sequence[int] | Mapping[int, int]) -> None:
        """Weights of ``stage``'s replicas (a list by replica, or replica ->
        weight), 0..65535 each.  All zero (or empty): the stage is not
        weighted (each socket sends to its own peer)."""
        vals = dict(enumerate(weights)) if not isinstance(weights, Mapping) else dict(weights)
        w = abi.SockWeights()
        for r, v in vals.items():
            if not 0 <= r < abi.SOCK_MAX_REPLICAS:
                raise DataplaneError(errno.EINVAL, f"replica {r} not in "
                                     f"0..{abi.SOCK_MAX_REPLICAS - 1}")
            if not 0 <= int(v) <= abi.SOCK_MAX_WEIGHT:
                raise DataplaneError(errno.EINVAL, f"weight {v} not in 0..{abi.SOCK_MAX_WEIGHT}")
            w.w[r] = int(v)
        with _sock.SockMaps(self.pin_dir) as maps:
            if any(w.w):
                maps.weights.update(ctypes.c_uint32(stage), w)
            else:
                maps.weights.delete(ctypes.c_uint32(stage))

    # -------------------------------------------------------------- read
    def loaded(self) -> bool:
        return os.path.isdir(self.pin_dir)

    def weights(self) -> dict[int, tuple[int, ...]]:
        with _sock.SockMaps(self.pin_dir) as maps:
            return {int(k.value): tuple(int(x) for x in v.w) for k, v in maps.weights.items()}

    def endpoints(self) -> list[Endpoint]:
        with _sock.SockMaps(self.pin_dir) as maps:
            return sorted(Endpoint(addr_text(bytes(k.addr)), int(k.port), int(v.stage),
                                   int(v.replica)) for k, v in maps.endpoints.items())

    def flows(self) -> list[SocketFlow]:
        """The registered mesh sockets, decoded."""
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        out: list[SocketFlow] = []
        with _sock.SockMaps(self.pin_dir) as maps:
            for k, v in maps.flows.items():
                out.append(SocketFlow(
                    local=addr_text(bytes(k.laddr)), lport=int(k.lport),
                    remote=addr_text(bytes(k.raddr)), rport=int(k.rport),
                    cookie=int(v.cookie), netns=int(v.netns), role=_ROLES.get(int(v.role), "?"),
                    stage=int(v.stage), replica=int(v.replica), peer_stage=int(v.peer_stage),
                    flags=_flag_names(int(v.flags)),
                    age_s=max(0.0, (now - int(v.established_ns)) / 1e9),
                    in_sockhash=maps.hash.lookup(k) is not None,
                ))
        return out

    def sockhash(self) -> dict[tuple[str, int, str, int], int]:
        """(local, lport, remote, rport) -> socket cookie, for every socket in
        the sockhash (the kernel answers a lookup with the cookie)."""
        with _sock.SockMaps(self.pin_dir) as maps:
            return {(addr_text(bytes(k.laddr)), int(k.lport), addr_text(bytes(k.raddr)),
                     int(k.rport)): int(v.value) for k, v in maps.hash.items()}

    def socket_state(self, sock: socket.socket | int) -> SocketState | None:
        """The socket storage of a socket this process holds (None: the socket
        is not a mesh socket)."""
        fd = sock if isinstance(sock, int) else sock.fileno()
        with _sock.SockMaps(self.pin_dir) as maps:
            st = maps.state.lookup(ctypes.c_int(fd))
        if st is None:
            return None
        mods: dict[int | str, tuple[int, int]] = {}
        for i in range(abi.SOCK_NR_MOD):
            c = st.mod[i]
            if c.frames or c.bytes:
                mods[i if i < abi.SOCK_NR_MOD - 1 else "other"] = (int(c.frames), int(c.bytes))
        return SocketState(
            cookie=int(st.cookie), netns=int(st.netns), role=_ROLES.get(int(st.role), "?"),
            stage=int(st.stage), replica=int(st.replica), peer_stage=int(st.peer_stage),
            weight=int(st.weight), flags=_flag_names(int(st.flags)),
            last_modality=int(st.last_modality), last_class=int(st.last_class),
            last_pick=None if st.last_pick == abi.SOCK_NO_PICK else int(st.last_pick),
            redirected=int(st.redirected), passed=int(st.passed), modalities=mods)

    def stats(self) -> SocketStats:
        """Counters summed over the CPUs."""
        with _sock.SockMaps(self.pin_dir) as maps:
            return _sum_stats(maps.stats.lookup(0) or [])

    def status(self) -> SocketStatus:
        if not self.loaded():
            return SocketStatus(self.cgroup, self.pin_dir, False)
        with _sock.Attachment(self.pin_dir, self.cgroup) as att:
            attached, ids = att.attached(), dict(att.ids)
        with _sock.SockMaps(self.pin_dir) as maps:
            f = maps.flags()
            have_abi, _ = maps.meta_info()
            n_ep, n_fl = (count_by_next_key(m.fd, ctypes.sizeof(m.key_type), m.max_entries)
                          for m in (maps.endpoints, maps.flows))
            stats = _sum_stats(maps.stats.lookup(0) or [])
        return SocketStatus(
            self.cgroup, self.pin_dir, True, attached, ids, have_abi,
            register=bool(f & abi.SOCK_CFG_REGISTER), redirect=bool(f & abi.SOCK_CFG_REDIRECT),
            all_sockets=bool(f & abi.SOCK_CFG_ALL), endpoints=n_ep, weights=self.weights(),
            flows=n_fl, stats=stats)


class _OldLayer:
    """A pinned layer about to be replaced by another build: its programs
    and maps are held open across the swap, so that once the new one is
    attached the old one can be detached and switched off (its sockets carry
    on over TCP until they close, in order)."""

    def __init__(self, directory: str, cgroup: str) -> None:
        self.att: _sock.Attachment | None = None
        self.maps: _sock.SockMaps | None = None
        try:
            self.att = _sock.Attachment(directory, cgroup)
            self.maps = _sock.SockMaps(directory)
        except DataplaneError:  # an incomplete or foreign set: nothing to retire
            pass

    def retire(self) -> None:
        if self.maps is not None:
            self.maps.write_flags(0)
        if self.att is not None:
            self.att.detach()

    def close(self) -> None:
        for x in (self.att, self.maps):
            if x is not None:
                x.close()


def _write_endpoints(maps: _sock.SockMaps, wanted: list[tuple[abi.SockEpKey, Endpoint]]) -> None:
    keep = {bytes(k) for k, _ in wanted}
    for k in list(maps.endpoints.keys()):
        if bytes(k) not in keep:
            maps.endpoints.delete(k)
    for k, e in wanted:
        maps.endpoints.update(k, abi.SockEp(stage=e.stage, replica=e.replica))


def _sum_stats(percpu: Any) -> SocketStats:
    events = {e.name.lower(): sum(int(s.events[e]) for s in percpu) for e in abi.SockEvent}

    def per(attr: str, n: int) -> dict[int, tuple[int, int]]:
        out: dict[int, tuple[int, int]] = {}
        for i in range(n):
            fr = sum(int(getattr(s, attr)[i].frames) for s in percpu)
            by = sum(int(getattr(s, attr)[i].bytes) for s in percpu)
            if fr or by:
                out[i] = (fr, by)
        return out

    return SocketStats(events, per("mod", abi.MAX_MODALITIES), per("cls", abi.MAX_CLASSES))
