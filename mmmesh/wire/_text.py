"""MMH values as text: modality names and aliases, W3C ``traceparent`` text.

The one parser of modality names (the CLI, the policy schema, the sidecar
and the scapy layer all use it) and the conversion between the W3C text form
of a trace context and the 26 bytes of the TRACEPARENT TLV
(``docs/wire-format.md`` section 2.4).  Re-exported by :mod:`mmmesh.wire`.
"""

from __future__ import annotations

import re

from mmmesh.abi import TLV_FIXED_LEN, Modality, Tlv

__all__ = [
    "MODALITY_ALIASES",
    "TRACEPARENT_LEN",
    "modality_from_name",
    "modality_name",
    "modality_names",
    "parse_modality",
    "traceparent_from_text",
    "traceparent_to_text",
]

# version(1) trace-id(16) parent-id(8) trace-flags(1); the length is the ABI's
TRACEPARENT_LEN: int = TLV_FIXED_LEN[Tlv.TRACEPARENT] or 0
assert TRACEPARENT_LEN == 26

# Extra names accepted by parse_modality (besides the lowercased enum names).
MODALITY_ALIASES: dict[str, Modality] = {
    "lidar": Modality.POINT_CLOUD,
    "pointcloud": Modality.POINT_CLOUD,
    "voice": Modality.AUDIO,
}

_MODALITY_NAMES: dict[int, str] = {int(m): m.name.lower() for m in Modality}


def modality_name(value: int) -> str:
    """``4 -> "audio"``; unknown values come back as their decimal string."""
    name = _MODALITY_NAMES.get(value)
    return name if name is not None else str(value)


def modality_names() -> list[str]:
    """Every name :func:`parse_modality` accepts: enum names first, then aliases."""
    return [m.name.lower() for m in Modality] + list(MODALITY_ALIASES)


def modality_from_name(text: str) -> Modality | None:
    """The modality a name means (case-insensitive, ``-`` as ``_``, aliases
    allowed), None when it names none.  The one parser of modality names."""
    key = text.strip().lower().replace("-", "_")
    if key in MODALITY_ALIASES:
        return MODALITY_ALIASES[key]
    if key.upper() in Modality.__members__:
        return Modality[key.upper()]
    return None


def parse_modality(text: str) -> int:
    """Modality from a name (case-insensitive, aliases allowed) or a number 0..255.

    Raises ``ValueError`` listing the valid names.
    """
    named = modality_from_name(text)
    if named is not None:
        return int(named)
    key = text.strip()
    if key.isdigit() and int(key) <= 0xFF:
        return int(key)
    raise ValueError(
        f"unknown modality {text!r}; valid: {', '.join(modality_names())} or a number 0..255"
    )


_TRACEPARENT_RE = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def traceparent_from_text(text: str) -> bytes:
    """W3C ``traceparent`` text -> the 26-byte binary form carried in the TLV.

    Raises ``ValueError`` unless ``text`` is ``vv-<32 hex>-<16 hex>-<2 hex>``
    in lowercase with a version other than ``ff``.
    """
    m = _TRACEPARENT_RE.fullmatch(text.strip())
    if m is None or m.group(1) == "ff":
        raise ValueError(f"not a W3C traceparent: {text!r}")
    return bytes.fromhex("".join(m.groups()))


def traceparent_to_text(raw: bytes) -> str:
    """26 raw bytes -> ``"00-<trace-id>-<parent-id>-<flags>"`` (any 26 bytes: no
    W3C rule is checked, so every TLV a decoder accepts has a text form)."""
    if len(raw) != TRACEPARENT_LEN:
        raise ValueError(f"traceparent must be {TRACEPARENT_LEN} bytes, got {len(raw)}")
    h = bytes(raw).hex()
    return f"{h[0:2]}-{h[2:34]}-{h[34:50]}-{h[50:52]}"
