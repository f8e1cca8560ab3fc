"""The scalar field types of the policy schema: rates, names, modalities, prefixes.

:class:`Rate` is an ``int`` of bit/s read from tc-style strings; the annotated
types (``Slug``, ``IfName``, ``U32``, ``ModalityName``, ``Prefix``) carry their
validators, serialisers and JSON Schema, so that the models in ``_schema``
only name them.  Every validator raises ValueError (pydantic reports no other
exception as a field error), with a message that says what to write instead.
"""

from __future__ import annotations

import decimal
import ipaddress
import math
import re
from collections.abc import Callable
from typing import Annotated, Any, Self, TypeVar

from pydantic import (
    AfterValidator,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    PlainSerializer,
    PlainValidator,
    StrictInt,
    StrictStr,
    WithJsonSchema,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

from mmmesh.abi import Modality

from ..wire import MODALITY_ALIASES, modality_from_name, modality_names

U32_MAX = 2**32 - 1
RATE_MIN = 8  # HTB counts bytes: anything below 1 byte/s is 0
RATE_MAX = 2**64 - 1

T = TypeVar("T")


def _value_error(fn: Callable[[object], T]) -> Callable[[object], T]:
    """``fn`` raising ValueError for TypeError: pydantic reports only the former."""

    def wrapped(value: object) -> T:
        try:
            return fn(value)
        except TypeError as e:
            raise ValueError(str(e)) from None

    return wrapped


# --------------------------------------------------------------------------
# Rates
# --------------------------------------------------------------------------
_RATE_RE = re.compile(r"(?P<num>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[a-z/]*)")
_RATE_UNITS: dict[str, int] = {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_RATE_AMBIGUOUS = re.compile(r"[kmgt]?i?(?:b|bps|bs|byte|bytes)(?:/s)?")
_RATE_HINT = "write bits per second, e.g. 150mbit, 1.2mbit, 500kbit, 10gbit or 1000000"


def _parse_rate(value: object) -> int:
    """A rate in bit/s from an int or a tc-style string (k/m/g = 10^3/10^6/10^9)."""
    if isinstance(value, bool):
        raise TypeError(f"a rate is a number of bit/s, not a boolean; {_RATE_HINT}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"{value!r} is not a whole number of bit/s; {_RATE_HINT}")
        value = int(value)
    if isinstance(value, int):
        bits = value
    elif isinstance(value, str):
        bits = _parse_rate_str(value)
    else:
        raise TypeError(f"a rate is an integer or a string, got {type(value).__name__}")
    if bits < RATE_MIN:
        raise ValueError(f"a rate must be at least {RATE_MIN}bit (1 byte/s), got {bits} bit/s")
    if bits > RATE_MAX:
        raise ValueError(f"a rate must be at most {RATE_MAX} bit/s")
    return bits


def _parse_rate_str(text: str) -> int:
    s = text.strip().lower()
    m = _RATE_RE.fullmatch(s) if len(s) <= 64 else None
    if m is None:
        raise ValueError(f"cannot read {text!r} as a rate; {_RATE_HINT}")
    unit = m["unit"]
    if unit.endswith("/s") and unit != "/s":
        unit = unit[:-2]  # "1.2mbit/s"; a bare "/s" stays unknown
    if unit not in _RATE_UNITS:
        if _RATE_AMBIGUOUS.fullmatch(m["unit"]):
            raise ValueError(
                f"{text!r} is ambiguous: tc reads 'bps' as bytes per second and 'B'/'b' "
                f"are easily confused; {_RATE_HINT}"
            )
        raise ValueError(f"unknown rate unit {m['unit']!r} in {text!r}; {_RATE_HINT}")
    with decimal.localcontext() as ctx:
        ctx.prec = 200
        q = decimal.Decimal(m["num"]) * _RATE_UNITS[unit]
        if q != q.to_integral_value():
            raise ValueError(f"{text!r} is not a whole number of bit/s ({q.normalize():f} bit/s)")
        return int(q)


def format_rate(bits: int) -> str:
    """The shortest exact tc-style spelling of ``bits`` bit/s."""
    best = f"{bits}bit"
    for unit in ("kbit", "mbit", "gbit"):
        scale = _RATE_UNITS[unit]
        if bits < scale:
            break
        whole, frac = divmod(bits, scale)
        digits = str(frac).rjust(len(str(scale)) - 1, "0").rstrip("0")
        text = f"{whole}.{digits}{unit}" if digits else f"{whole}{unit}"
        if len(text) <= len(best):
            best = text
    return best


class Rate(int):
    """A rate in bit/s.  An ``int`` whose ``str()`` is the compact tc spelling.

    Accepts an int (bit/s) or a string in tc's units, case-insensitive, with an
    optional ``/s``: ``"150mbit"``, ``"1.2Mbit"``, ``"1.2mbit/s"``, ``"500kbit"``,
    ``"10gbit"``, ``"1000000"`` (k/m/g are 10^3/10^6/10^9; a bare number is
    bit/s).  Byte forms and look-alikes (``"150mbps"``, ``"150MB"``, ``"150Mb"``)
    are refused as ambiguous.  The value must be a whole number of bit/s, at
    least 8 (HTB counts bytes).
    """

    def __new__(cls, value: float | str) -> Self:
        return super().__new__(cls, _parse_rate(value))

    def __str__(self) -> str:
        return format_rate(int(self))

    def __repr__(self) -> str:
        return f"Rate({str(self)!r})"

    @property
    def bytes_per_second(self) -> int:
        """What tc and HTB store (bit/s divided by 8, truncated)."""
        return int(self) // 8

    @classmethod
    def _validate(cls, value: object) -> Rate:
        if isinstance(value, Rate):
            return value
        return cls(_value_error(_parse_rate)(value))

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: type[Any], handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.no_info_plain_validator_function(
            cls._validate,
            serialization=core_schema.plain_serializer_function_ser_schema(str, when_used="json"),
        )

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {
            "description": "bit/s: an integer or a tc-style string (k/m/g = 10^3/10^6/10^9)",
            "anyOf": [
                {"type": "integer", "minimum": RATE_MIN, "maximum": RATE_MAX},
                {
                    "type": "string",
                    "pattern": r"^\s*[0-9]+(\.[0-9]+)?\s*([kKmMgG]?[bB][iI][tT](/[sS])?)?\s*$",
                    "examples": ["150mbit", "1.2mbit", "500kbit", "10gbit", "1000000"],
                },
            ],
        }


# --------------------------------------------------------------------------
# Names, modalities, prefixes
# --------------------------------------------------------------------------
_SLUG_RE = re.compile(r"[a-z][a-z0-9-]{0,31}")


def _slug(value: str) -> str:
    if not _SLUG_RE.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a valid class name: a lowercase letter, then up to 31 "
            "lowercase letters, digits or '-'"
        )
    return value


def _ifname(value: str) -> str:
    # the rules of the kernel's dev_valid_name()
    if not 1 <= len(value) <= 15:
        raise ValueError(f"{value!r} is not a valid interface name: 1 to 15 characters")
    if value in (".", "..") or any(c in "/:\0" or c.isspace() for c in value):
        raise ValueError(
            f"{value!r} is not a valid interface name: no '/', ':' or whitespace, "
            "and not '.' or '..'"
        )
    return value


def _modality(value: object) -> Modality:
    if isinstance(value, Modality):
        return value
    names = ", ".join(m.name.lower() for m in Modality)
    if not isinstance(value, str):
        raise TypeError(f"a modality is a name ({names}), got {type(value).__name__}")
    named = modality_from_name(value)
    if named is not None:
        return named
    aliases = ", ".join(MODALITY_ALIASES)
    raise ValueError(f"unknown modality {value!r}; known: {names} (aliases: {aliases})")


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _prefix(value: object) -> Network:
    if isinstance(value, ipaddress.IPv4Network | ipaddress.IPv6Network):
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"a prefix is a string like '10.0.99.0/24' or 'fd00::/64', got {type(value).__name__}"
        )
    try:
        return ipaddress.ip_network(value.strip(), strict=False)
    except ValueError as e:
        raise ValueError(f"{value!r} is not an IPv4 or IPv6 prefix ({e})") from None


def ipv4_mapped(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv6Address:
    """The address as the dataplane's LPM trie holds it (IPv4 as ::ffff:a.b.c.d)."""
    if isinstance(addr, ipaddress.IPv6Address):
        return addr
    return ipaddress.IPv6Address((0xFFFF << 32) | int(addr))


Slug = Annotated[StrictStr, AfterValidator(_slug)]
IfName = Annotated[StrictStr, AfterValidator(_ifname)]
U32 = Annotated[StrictInt, Field(ge=0, le=U32_MAX)]
ModalityName = Annotated[
    Modality,
    PlainValidator(_value_error(_modality)),
    PlainSerializer(lambda m: m.name.lower(), return_type=str),
    WithJsonSchema({"type": "string", "enum": modality_names()}),
]
Prefix = Annotated[
    Network,
    PlainValidator(_value_error(_prefix)),
    PlainSerializer(str, return_type=str),
    WithJsonSchema({"type": "string", "examples": ["10.0.99.0/24", "fd00:99::/64"]}),
]
