"""Raw BPF syscalls through libbpf.so.1 (ctypes): map access, pinning,
BPF_PROG_TEST_RUN, object info and batched map reads.  No bcc here: this is
how a dataplane that is already loaded and pinned is read and written.  The
one place libbpf is bound.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections import Counter
from collections.abc import Iterator
from functools import lru_cache
from typing import Any, TypeVar

from mmmesh.errors import DataplaneError, NotSupportedError

BPF_ANY = 0
BPF_NOEXIST = 1
BPF_EXIST = 2

T = TypeVar("T", bound=ctypes.Structure)


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("bpf") or "libbpf.so.1"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:
        raise NotSupportedError(f"libbpf not found ({name}): install libbpf1") from e
    vp, u32p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)
    for fn, args in {
        "bpf_map_update_elem": [ctypes.c_int, vp, vp, ctypes.c_uint64],
        "bpf_map_lookup_elem": [ctypes.c_int, vp, vp],
        "bpf_map_delete_elem": [ctypes.c_int, vp],
        "bpf_map_get_next_key": [ctypes.c_int, vp, vp],
        "bpf_map_lookup_batch": [ctypes.c_int, vp, vp, vp, vp, u32p, vp],
        "bpf_obj_pin": [ctypes.c_int, ctypes.c_char_p],
        "bpf_obj_get": [ctypes.c_char_p],
        "bpf_obj_get_info_by_fd": [ctypes.c_int, vp, u32p],
        "bpf_prog_test_run_opts": [ctypes.c_int, vp],
        "bpf_prog_get_fd_by_id": [ctypes.c_uint32],
        "bpf_prog_attach": [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint],
        "bpf_prog_detach2": [ctypes.c_int, ctypes.c_int, ctypes.c_int],
        "bpf_prog_query": [ctypes.c_int, ctypes.c_int, ctypes.c_uint32, u32p, u32p, u32p],
        "libbpf_num_possible_cpus": [],
    }.items():
        f = getattr(lib, fn)
        f.argtypes = args
        f.restype = ctypes.c_int
    return lib


def _check(rc: int, what: str) -> int:
    if rc < 0:
        err = ctypes.get_errno() or -rc
        raise DataplaneError(err, f"{what}: {os.strerror(err)}")
    return rc


@lru_cache(maxsize=1)
def num_possible_cpus() -> int:
    return _check(_lib().libbpf_num_possible_cpus(), "libbpf_num_possible_cpus")


def obj_pin(fd: int, path: str) -> None:
    _check(_lib().bpf_obj_pin(fd, path.encode()), f"pin {path}")


def obj_get(path: str) -> int:
    """Opens a pinned object; returns a new fd (the caller closes it)."""
    return _check(_lib().bpf_obj_get(path.encode()), f"open pinned {path}")


# enum bpf_attach_type values used by the socket layer, and attach flags
BPF_CGROUP_SOCK_OPS = 3
BPF_SK_MSG_VERDICT = 7
BPF_F_ALLOW_MULTI = 2


def prog_attach(prog_fd: int, target_fd: int, attach_type: int, flags: int = 0) -> None:
    """Attaches a program to a cgroup or a map (BPF_PROG_ATTACH, no link: it
    stays attached after the process exits, until detached)."""
    _check(_lib().bpf_prog_attach(prog_fd, target_fd, attach_type, flags), "attach program")


def prog_detach(prog_fd: int, target_fd: int, attach_type: int) -> None:
    _check(_lib().bpf_prog_detach2(prog_fd, target_fd, attach_type), "detach program")


def prog_query(target_fd: int, attach_type: int, cap: int = 64) -> list[int]:
    """Ids of the programs attached to a cgroup or map at ``attach_type``."""
    ids = (ctypes.c_uint32 * cap)()
    cnt, flags = ctypes.c_uint32(cap), ctypes.c_uint32()
    _check(_lib().bpf_prog_query(target_fd, attach_type, 0, ctypes.byref(flags), ids,
                                 ctypes.byref(cnt)), "query attached programs")
    return [int(ids[i]) for i in range(min(cnt.value, cap))]


class BpfProgInfo(ctypes.Structure):
    """The head of struct bpf_prog_info (enough for id and name)."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", ctypes.c_uint32),
        ("xlated_prog_len", ctypes.c_uint32),
        ("jited_prog_insns", ctypes.c_uint64),
        ("xlated_prog_insns", ctypes.c_uint64),
        ("load_time", ctypes.c_uint64),
        ("created_by_uid", ctypes.c_uint32),
        ("nr_map_ids", ctypes.c_uint32),
        ("map_ids", ctypes.c_uint64),
        ("name", ctypes.c_char * 16),
    ]


class BpfMapInfo(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
    ]


def prog_info(fd: int) -> BpfProgInfo:
    info = BpfProgInfo()
    n = ctypes.c_uint32(ctypes.sizeof(info))
    _check(_lib().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(n)), "prog info")
    return info


def map_info(fd: int) -> BpfMapInfo:
    info = BpfMapInfo()
    n = ctypes.c_uint32(ctypes.sizeof(info))
    _check(_lib().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(n)), "map info")
    return info


BPF_MAP_TYPE_PERCPU_ARRAY = 6
BPF_MAP_TYPE_PERCPU_HASH = 5
BPF_MAP_TYPE_LRU_PERCPU_HASH = 10


class Map:
    """A BPF map by fd, with typed key and value (ctypes types).

    Per-CPU maps return a list of values, one per possible CPU."""

    def __init__(self, fd: int, key_type: type[Any], value_type: type[Any], name: str = "") -> None:
        self.fd = fd
        self.key_type = key_type
        self.value_type = value_type
        self.name = name
        info = map_info(fd)
        if info.key_size != ctypes.sizeof(key_type) or info.value_size != ctypes.sizeof(value_type):
            raise DataplaneError(
                errno.EINVAL,
                f"map {name or info.name!r}: kernel key/value size {info.key_size}/"
                f"{info.value_size} != expected {ctypes.sizeof(key_type)}/"
                f"{ctypes.sizeof(value_type)} (ABI mismatch)",
            )
        self.max_entries = info.max_entries
        self.percpu = info.type in (
            BPF_MAP_TYPE_PERCPU_ARRAY,
            BPF_MAP_TYPE_PERCPU_HASH,
            BPF_MAP_TYPE_LRU_PERCPU_HASH,
        )
        self._vsz = (ctypes.sizeof(value_type) + 7) & ~7

    @classmethod
    def open_pinned(cls, path: str, key_type: type[Any], value_type: type[Any]) -> Map:
        return cls(obj_get(path), key_type, value_type, name=os.path.basename(path))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _key(self, key: Any) -> Any:
        return key if isinstance(key, self.key_type) else self.key_type(key)

    def update(self, key: Any, value: Any, flags: int = BPF_ANY) -> None:
        k = self._key(key)
        if self.percpu:
            buf = (ctypes.c_uint8 * (self._vsz * num_possible_cpus()))()
            vals = value if isinstance(value, list) else [value] * num_possible_cpus()
            for i, v in enumerate(vals):
                ctypes.memmove(ctypes.addressof(buf) + i * self._vsz, ctypes.addressof(v),
                               ctypes.sizeof(self.value_type))
            rc = _lib().bpf_map_update_elem(self.fd, ctypes.byref(k), buf, flags)
        else:
            rc = _lib().bpf_map_update_elem(self.fd, ctypes.byref(k), ctypes.byref(value), flags)
        _check(rc, f"update {self.name}")

    def lookup(self, key: Any) -> Any | None:
        k = self._key(key)
        if self.percpu:
            n = num_possible_cpus()
            buf = (ctypes.c_uint8 * (self._vsz * n))()
            rc = _lib().bpf_map_lookup_elem(self.fd, ctypes.byref(k), buf)
            if rc < 0 and ctypes.get_errno() == errno.ENOENT:
                return None
            _check(rc, f"lookup {self.name}")
            return [
                self.value_type.from_buffer_copy(buf, i * self._vsz) for i in range(n)
            ]
        v = self.value_type()
        rc = _lib().bpf_map_lookup_elem(self.fd, ctypes.byref(k), ctypes.byref(v))
        if rc < 0 and ctypes.get_errno() == errno.ENOENT:
            return None
        _check(rc, f"lookup {self.name}")
        return v

    def delete(self, key: Any) -> bool:
        rc = _lib().bpf_map_delete_elem(self.fd, ctypes.byref(self._key(key)))
        if rc < 0 and ctypes.get_errno() == errno.ENOENT:
            return False
        _check(rc, f"delete {self.name}")
        return True

    def keys(self) -> Iterator[Any]:
        """Keys in kernel order; at most max_entries of them (under LRU churn
        get_next_key restarts from the first key when ``prev`` was evicted)."""
        prev: Any = None
        for _ in range(self.max_entries):
            nxt = self.key_type()
            rc = _lib().bpf_map_get_next_key(
                self.fd, None if prev is None else ctypes.byref(prev), ctypes.byref(nxt)
            )
            if rc < 0:
                if ctypes.get_errno() == errno.ENOENT:
                    return
                _check(rc, f"iterate {self.name}")
            yield nxt
            prev = nxt

    def items(self) -> Iterator[tuple[Any, Any]]:
        for k in self.keys():
            v = self.lookup(k)
            if v is not None:
                yield k, v

    def clear(self) -> None:
        for k in list(self.keys()):
            self.delete(k)


class SkBuff(ctypes.Structure):
    """struct __sk_buff (uapi/linux/bpf.h), as BPF_PROG_TEST_RUN's ctx."""

    _fields_ = [
        ("len", ctypes.c_uint32),
        ("pkt_type", ctypes.c_uint32),
        ("mark", ctypes.c_uint32),
        ("queue_mapping", ctypes.c_uint32),
        ("protocol", ctypes.c_uint32),
        ("vlan_present", ctypes.c_uint32),
        ("vlan_tci", ctypes.c_uint32),
        ("vlan_proto", ctypes.c_uint32),
        ("priority", ctypes.c_uint32),
        ("ingress_ifindex", ctypes.c_uint32),
        ("ifindex", ctypes.c_uint32),
        ("tc_index", ctypes.c_uint32),
        ("cb", ctypes.c_uint32 * 5),
        ("hash", ctypes.c_uint32),
        ("tc_classid", ctypes.c_uint32),
        ("data", ctypes.c_uint32),
        ("data_end", ctypes.c_uint32),
        ("napi_id", ctypes.c_uint32),
        ("family", ctypes.c_uint32),
        ("remote_ip4", ctypes.c_uint32),
        ("local_ip4", ctypes.c_uint32),
        ("remote_ip6", ctypes.c_uint32 * 4),
        ("local_ip6", ctypes.c_uint32 * 4),
        ("remote_port", ctypes.c_uint32),
        ("local_port", ctypes.c_uint32),
        ("data_meta", ctypes.c_uint32),
        ("flow_keys", ctypes.c_uint64),
        ("tstamp", ctypes.c_uint64),
        ("wire_len", ctypes.c_uint32),
        ("gso_segs", ctypes.c_uint32),
        ("sk", ctypes.c_uint64),
        ("gso_size", ctypes.c_uint32),
        ("tstamp_type", ctypes.c_uint8),
        ("_pad", ctypes.c_uint8 * 3),
        ("hwtstamp", ctypes.c_uint64),
    ]


assert ctypes.sizeof(SkBuff) == 192


class _TestRunOpts(ctypes.Structure):
    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("data_in", ctypes.c_void_p),
        ("data_out", ctypes.c_void_p),
        ("data_size_in", ctypes.c_uint32),
        ("data_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_void_p),
        ("ctx_out", ctypes.c_void_p),
        ("ctx_size_in", ctypes.c_uint32),
        ("ctx_size_out", ctypes.c_uint32),
        ("retval", ctypes.c_uint32),
        ("repeat", ctypes.c_int),
        ("duration", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32),
    ]


class TestRunResult:
    __slots__ = ("retval", "duration_ns", "ctx", "data")

    def __init__(self, retval: int, duration_ns: int, ctx: SkBuff, data: bytes) -> None:
        self.retval = retval
        self.duration_ns = duration_ns
        self.ctx = ctx
        self.data = data


def prog_test_run(prog_fd: int, packet: bytes, repeat: int = 1, ctx: SkBuff | None = None) -> TestRunResult:
    """Runs a SCHED_CLS program on one Ethernet frame (BPF_PROG_TEST_RUN)."""
    data_in = ctypes.create_string_buffer(bytes(packet), len(packet))
    out_cap = len(packet) + 256
    data_out = ctypes.create_string_buffer(out_cap)
    ctx_in = ctx if ctx is not None else SkBuff()
    ctx_out = SkBuff()
    opts = _TestRunOpts(
        sz=ctypes.sizeof(_TestRunOpts),
        data_in=ctypes.cast(data_in, ctypes.c_void_p),
        data_out=ctypes.cast(data_out, ctypes.c_void_p),
        data_size_in=len(packet),
        data_size_out=out_cap,
        ctx_in=ctypes.addressof(ctx_in),
        ctx_out=ctypes.addressof(ctx_out),
        ctx_size_in=ctypes.sizeof(SkBuff),
        ctx_size_out=ctypes.sizeof(SkBuff),
        repeat=max(1, repeat),
    )
    _check(_lib().bpf_prog_test_run_opts(prog_fd, ctypes.byref(opts)), "BPF_PROG_TEST_RUN")
    return TestRunResult(opts.retval, opts.duration, ctx_out, data_out.raw[: opts.data_size_out])


# --------------------------------------------------------------------------
# Counting a hash map without per-entry Python work
# --------------------------------------------------------------------------
ENOTSUPP = 524  # kernel-internal "operation not supported", leaks to user space


def count_map_entries(fd: int, key_size: int, value_size: int, max_entries: int,
                      byte_offset: int | None = None, chunk: int = 4096
                      ) -> tuple[int, Counter[int] | None]:
    """Entries in the (non per-CPU) hash map ``fd``, and, when ``byte_offset``
    is given, how many entries have each value of the byte at that offset of
    the value.  The second item is None when the kernel cannot batch-read the
    map (the count then comes from a ``bpf_map_get_next_key`` loop).

    Reads the map with ``bpf_map_lookup_batch``, ``chunk`` entries per syscall,
    into two reused buffers; the per-entry byte is taken with one strided
    slice and counted by ``collections.Counter`` (C code)."""
    lib = _lib()
    chunk = max(1, min(chunk, max_entries or chunk))
    keys = ctypes.create_string_buffer(key_size * chunk)
    values = ctypes.create_string_buffer(value_size * chunk)
    # Hash maps use a u32 bucket index as the batch token; 8 bytes is plenty.
    tok_a, tok_b = ctypes.create_string_buffer(8), ctypes.create_string_buffer(8)
    in_tok: Any = None
    total = 0
    by_byte: Counter[int] = Counter()
    count = ctypes.c_uint32()
    while True:
        count.value = chunk
        rc = lib.bpf_map_lookup_batch(fd, in_tok, tok_b, keys, values, ctypes.byref(count), None)
        err = ctypes.get_errno() if rc < 0 else 0
        if rc < 0 and err == errno.ENOSPC:
            # One hash bucket holds more entries than fit: grow, read it again.
            if chunk >= max(max_entries, 1) * 2:
                raise DataplaneError(err, "bpf_map_lookup_batch: bucket larger than the map")
            chunk *= 2
            keys = ctypes.create_string_buffer(key_size * chunk)
            values = ctypes.create_string_buffer(value_size * chunk)
            continue
        if rc < 0 and err != errno.ENOENT:
            if total == 0 and err in (errno.EINVAL, errno.EOPNOTSUPP, ENOTSUPP, errno.ENOSYS):
                return count_by_next_key(fd, key_size, max_entries), None
            raise DataplaneError(err, f"bpf_map_lookup_batch: {os.strerror(err)}")
        n = count.value
        total += n
        if n and byte_offset is not None:
            raw = ctypes.string_at(values, n * value_size)
            by_byte.update(raw[byte_offset::value_size])
        if rc < 0 or n == 0:  # ENOENT: that was the last batch
            return total, by_byte if byte_offset is not None else None
        in_tok = tok_a
        ctypes.memmove(tok_a, tok_b, 8)


def count_by_next_key(fd: int, key_size: int, max_entries: int) -> int:
    """Counts keys with bpf_map_get_next_key, two reused key buffers.  Capped at
    ``max_entries`` (an LRU map restarts the walk when the previous key was
    evicted meanwhile)."""
    nxt = _lib().bpf_map_get_next_key
    a, b = ctypes.create_string_buffer(key_size), ctypes.create_string_buffer(key_size)
    n = 0
    rc = nxt(fd, None, a)
    limit = max_entries or (1 << 31)
    while rc == 0 and n < limit:
        n += 1
        rc = nxt(fd, a, b)
        a, b = b, a
    if rc < 0 and ctypes.get_errno() != errno.ENOENT and n < limit:
        err = ctypes.get_errno()
        raise DataplaneError(err, f"bpf_map_get_next_key: {os.strerror(err)}")
    return n
