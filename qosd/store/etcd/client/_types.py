"""The client's values and request helpers (no I/O here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .pb import rpc_pb2

__all__ = ["EtcdConfig", "KeyValue", "TxnResult", "WatchEvent", "cmp_mod_revision", "cmp_version",
           "op_delete", "op_delete_prefix", "op_put", "op_range", "prefix_end"]


@dataclass(frozen=True)
class EtcdConfig:
    """Where etcd is and how to reach it.  ``endpoints``: ``host:port`` of the
    members (a name stands for its addresses, resolved at connect); TLS when
    ``ca_file`` is set (``cert_file``/``key_file``: the client certificate for
    etcd's ``--client-cert-auth``), the server's name checked against
    ``server_name`` or else each endpoint's host."""

    endpoints: tuple[str, ...]
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None
    timeout_s: float = 5.0
    """Deadline of a unary call."""
    keepalive_s: float = 10.0
    """HTTP/2 pings on an idle connection (etcd refuses pings more often than 5 s)."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0

    @classmethod
    def of(cls, kv: object) -> KeyValue:
        return cls(kv.key, kv.value, kv.create_revision,  # type: ignore[attr-defined]
                   kv.mod_revision, kv.version, kv.lease)  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: Literal["put", "delete"]
    kv: KeyValue
    """For a delete: the key, its deletion's ``mod_revision``, no value."""


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    """The store's revision after the transaction."""
    ranges: list[list[KeyValue]] = field(default_factory=list)
    """The kvs of each range op of the branch that ran, in order."""


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes ``[prefix, end)`` every key under ``prefix``."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"  # every key


def cmp_mod_revision(key: bytes, revision: int) -> rpc_pb2.Compare:
    """The key was last written at ``revision`` (0: it does not exist)."""
    return rpc_pb2.Compare(result=rpc_pb2.Compare.EQUAL, target=rpc_pb2.Compare.MOD, key=key,
                           mod_revision=revision)


def cmp_version(key: bytes, version: int) -> rpc_pb2.Compare:
    """The key's version (writes since creation) is ``version`` (0: absent)."""
    return rpc_pb2.Compare(result=rpc_pb2.Compare.EQUAL, target=rpc_pb2.Compare.VERSION,
                           key=key, version=version)


def op_put(key: bytes, value: bytes, lease: int = 0) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))


def op_range(key: bytes) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key))


def op_delete(key: bytes, range_end: bytes = b"") -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(
        key=key, range_end=range_end))


def op_delete_prefix(prefix: bytes) -> rpc_pb2.RequestOp:
    return op_delete(prefix, prefix_end(prefix))
