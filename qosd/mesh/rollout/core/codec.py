"""The rollout's payloads on the wire: compact JSON, read strictly.

Three payloads, all UTF-8 JSON objects with ``"v": 1``:

``policy`` (gossip, key ``policy``; ~150 bytes, plus a roll call)::

    {"v":1,"c":12,"o":"node-a","h":"<sha256 hex>","n":3412,"a":"alice@ops","t":1700000000.5,
     "p":["node-7","node-93"]}

    (p: a roll call, only from the origin: the nodes named gossip their report again)

``ack/<node>`` (gossip; ~75 bytes, plus the reason of a NACK, cut to 400 bytes)::

    {"v":1,"c":12,"o":"node-a","h":"<16 hex>","ok":0,"r":"classes: ...",
     "ac":11,"ao":"node-b","t":1700000001.2}

    (h: the first 16 hex digits of the version's sha256; ac/ao: the version the
    node runs after this report, absent when it is the reported one, and "ac":0
    when the node runs no mesh version)

push-pull app state (the rollout's section; ~70 bytes per member plus the text)::

    {"v":1,"d":{"c":..,"o":..,"h":..,"n":..,"a":..,"t":..},"x":"<policy text>",
     "r":[[node, seq, c, o, h16, ok, reason, ac, ao, t], ...]}

    d: the desired version (absent: none); x: its text when the node has it and
    it is at most inline_text_bytes; r: the latest report of every node known
    (ac 0 / ao "" for none).

Decoding never trusts a field: wrong types, out-of-range numbers, a sha that
is not lowercase hex, over-long strings, payloads over their size limit all
raise :class:`Dropped` with the reason the stats count it under.
"""

from __future__ import annotations

import json
import math
from typing import Any

from qosd.mesh.rollout.core._types import (
    MAX_COUNTER,
    SHA_PREFIX,
    Announcement,
    MeshVersion,
    Report,
    RolloutConfig,
)

MAX_GOSSIP_PAYLOAD = 1400
"""No gossip payload of ours is larger (the core's packet budget is 1400)."""
_HEX = frozenset("0123456789abcdef")


class Dropped(Exception):
    """Peer input that is thrown away; ``reason`` names the counter."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def cut(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes (on a character boundary)."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    return raw[: max(0, limit - 3)].decode("utf-8", "ignore") + "..."


# -- encoding ------------------------------------------------------------------------
def _ann_fields(a: Announcement) -> dict[str, Any]:
    out: dict[str, Any] = {"c": a.version.counter, "o": a.version.origin, "h": a.sha256,
                           "n": a.size, "t": a.proposed_at}
    if a.author:
        out["a"] = a.author
    return out


def encode_announcement(a: Announcement, call: tuple[str, ...] = ()) -> bytes:
    out: dict[str, Any] = {"v": 1, **_ann_fields(a)}
    if call:
        out["p"] = list(call)
    return _dumps(out)


def encode_report(r: Report) -> bytes:
    out: dict[str, Any] = {"v": 1, "c": r.version.counter, "o": r.version.origin,
                           "h": r.sha[:SHA_PREFIX], "ok": int(r.ok), "t": round(r.at, 2)}
    if r.reason:
        out["r"] = r.reason
    if r.applied is None:
        out["ac"] = 0
    elif r.applied != r.version:
        out["ac"], out["ao"] = r.applied.counter, r.applied.origin
    return _dumps(out)


def encode_state(desired: Announcement | None, text: str | None,
                 reports: list[Report]) -> bytes:
    out: dict[str, Any] = {"v": 1}
    if desired is not None:
        out["d"] = _ann_fields(desired)
        if text is not None:
            out["x"] = text
    rows = []
    for r in reports:
        ac, ao = (r.applied.counter, r.applied.origin) if r.applied else (0, "")
        rows.append([r.node, r.seq, r.version.counter, r.version.origin, r.sha[:SHA_PREFIX],
                     int(r.ok), r.reason, ac, ao, round(r.at, 2)])
    out["r"] = rows
    return _dumps(out)


# -- decoding ------------------------------------------------------------------------
class Reader:
    """Strict field readers bound to one config's limits."""

    def __init__(self, cfg: RolloutConfig) -> None:
        self.cfg = cfg

    def loads(self, data: bytes, limit: int) -> dict[str, Any]:
        if len(data) > limit:
            raise Dropped("oversize", f"{len(data)} bytes, at most {limit}")
        try:
            obj = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise Dropped("malformed", f"not JSON ({e})") from None
        if not isinstance(obj, dict) or obj.get("v") != 1:
            raise Dropped("malformed", "not a version-1 object")
        return obj

    @staticmethod
    def integer(v: object, lo: int, hi: int, what: str) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise Dropped("malformed", f"{what} is not an integer in {lo}..{hi}")
        return v

    @staticmethod
    def string(v: object, limit: int, what: str, *, empty: bool = False) -> str:
        if not isinstance(v, str) or (not v and not empty):
            raise Dropped("malformed", f"{what} is not a{'' if empty else ' non-empty'} string")
        if len(v) > limit or len(v.encode("utf-8", "surrogatepass")) > limit:
            raise Dropped("malformed", f"{what} is longer than {limit} bytes")
        return v

    @staticmethod
    def hexdigits(v: object, n: int, what: str) -> str:
        if not isinstance(v, str) or len(v) != n or not set(v) <= _HEX:
            raise Dropped("malformed", f"{what} is not {n} lowercase hex digits")
        return v

    @staticmethod
    def timestamp(v: object, what: str) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                or v < 0:
            raise Dropped("malformed", f"{what} is not a time")
        return float(v)

    def version(self, c: object, o: object, what: str) -> MeshVersion:
        return MeshVersion(self.integer(c, 1, MAX_COUNTER, f"{what} counter"),
                           self.string(o, self.cfg.max_node_id_bytes, f"{what} origin"))

    def announcement(self, d: object) -> Announcement:
        if not isinstance(d, dict):
            raise Dropped("malformed", "the desired version is not an object")
        return Announcement(
            self.version(d.get("c"), d.get("o"), "version"),
            self.hexdigits(d.get("h"), 64, "sha256"),
            self.integer(d.get("n"), 0, self.cfg.max_text_bytes, "size"),
            self.string(d.get("a", ""), self.cfg.max_author_bytes, "author", empty=True),
            self.timestamp(d.get("t"), "proposed_at"))


def decode_announcement(reader: Reader, data: bytes) -> tuple[Announcement, tuple[str, ...]]:
    """The announcement and its roll call."""
    obj = reader.loads(data, MAX_GOSSIP_PAYLOAD)
    call = obj.get("p", [])
    if not isinstance(call, list):
        raise Dropped("malformed", "the roll call is not a list")
    limit = reader.cfg.max_node_id_bytes
    return reader.announcement(obj), tuple(reader.string(n, limit, "node") for n in call)


def decode_report(reader: Reader, node: str, seq: int, data: bytes) -> Report:
    obj = reader.loads(data, MAX_GOSSIP_PAYLOAD)
    version = reader.version(obj.get("c"), obj.get("o"), "version")
    applied: MeshVersion | None = version
    if obj.get("ac") == 0 and "ao" not in obj:
        applied = None
    elif "ac" in obj or "ao" in obj:
        applied = reader.version(obj.get("ac"), obj.get("ao"), "applied")
    return Report(node, seq, version, reader.hexdigits(obj.get("h"), SHA_PREFIX, "sha prefix"),
                  bool(reader.integer(obj.get("ok"), 0, 1, "ok")),
                  reader.string(obj.get("r", ""), reader.cfg.max_reason_bytes, "reason",
                                empty=True),
                  applied, reader.timestamp(obj.get("t"), "time"))


def decode_state(reader: Reader, data: bytes
                 ) -> tuple[Announcement | None, str | None, list[Report]]:
    """(desired, its text, rows) of a peer's push-pull section."""
    cfg = reader.cfg
    obj = reader.loads(data, cfg.max_state_bytes)
    desired = reader.announcement(obj["d"]) if "d" in obj else None
    text = None
    if "x" in obj:
        text = reader.string(obj["x"], cfg.inline_text_bytes, "text")
        if desired is None:
            raise Dropped("malformed", "a text without a version")
    rows = obj.get("r", [])
    if not isinstance(rows, list) or len(rows) > cfg.max_rows:
        raise Dropped("malformed", f"rows is not a list of at most {cfg.max_rows}")
    return desired, text, [_row(reader, row) for row in rows]


def _row(reader: Reader, row: object) -> Report:
    if not isinstance(row, list) or len(row) != 10:
        raise Dropped("malformed", "a row is not a list of 10 fields")
    node, seq, c, o, h, ok, reason, ac, ao, t = row
    cfg = reader.cfg
    applied = None if ac == 0 and ao == "" else reader.version(ac, ao, "applied")
    return Report(reader.string(node, cfg.max_node_id_bytes, "node"),
                  reader.integer(seq, 0, 2**63 - 1, "seq"), reader.version(c, o, "version"),
                  reader.hexdigits(h, SHA_PREFIX, "sha prefix"),
                  bool(reader.integer(ok, 0, 1, "ok")),
                  reader.string(reason, cfg.max_reason_bytes, "reason", empty=True), applied,
                  reader.timestamp(t, "time"))
