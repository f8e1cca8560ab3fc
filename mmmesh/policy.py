"""The SLA policy: schema, validation and the reference classifier (dataplane part).

A policy names a shaped link and the traffic classes that share it.  Every class
gets an HTB class under the root ``1:`` with its guaranteed rate, ceiling,
quantum (from ``weight``) and prio; the BPF classifier maps a frame's MMH header
to one class and writes that class's handle into ``skb->priority``.

A policy is refused whole: :func:`parse_policy` and :func:`load_policy` either
return a fully validated, immutable :class:`Policy` or raise
:class:`~mmmesh._errors.PolicyError` listing every problem as ``(field path,
message)``, the path written like ``classes[2].rate``.  Structural problems
(types, ranges, unknown fields) are reported first, all together; the
cross-field rules run once the structure is valid, and report all together too.

Privilege order ("rank"): :meth:`Policy.ranked` sorts the classes by
``(priority, -rate, id)``; rank 0 is the most privileged class.  A source rule
caps what senders inside its prefix may get: when the class picked for their
frame ranks better (lower) than the rule's ``max_class``, it is lowered to
``max_class``.

:func:`classify_reference` is the pure-Python statement of what the BPF
program (``bpf/lib/classify.h``) does with a header; tests compare the two.
docs/policy.md describes the schema field by field.
"""

from __future__ import annotations

import decimal
import ipaddress
import math
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from os import PathLike
from typing import Annotated, Any, Literal, NamedTuple, Self, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    PlainSerializer,
    PlainValidator,
    StrictInt,
    StrictStr,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

from ._abi import (
    DEFAULT_MAX_SRC_RULES,
    DSCP_KEEP,
    HTB_MAJOR,
    MAX_CLASSES,
    MAX_RULES,
    MetaKind,
    Modality,
)
from ._errors import PolicyError
from .wire import MODALITY_ALIASES, modality_from_name

__all__ = [
    "API_VERSION",
    "MAX_WEIGHT",
    "MODALITY_ALIASES",
    "QUANTUM_UNIT",
    "Link",
    "Match",
    "MetaRange",
    "Policy",
    "Rate",
    "SourceRule",
    "TrafficClass",
    "Verdict",
    "classify_reference",
    "load_policy",
    "parse_policy",
    "policy_json_schema",
    "reference_verdict",
]

API_VERSION = "mmmesh/v1"
MAX_WEIGHT = 100
# HTB quantum per unit of weight, in bytes: one full Ethernet frame, so that
# weight 1 still sends a whole frame per round and weight 100 (151400 bytes)
# stays below HTB's "quantum is big" threshold of 200000 bytes.
QUANTUM_UNIT = 1514
MAX_PRIORITY = 7  # HTB has 8 prios, 0..7
MAX_DSCP = 63
U32_MAX = 2**32 - 1
RATE_MIN = 8  # HTB counts bytes: anything below 1 byte/s is 0
RATE_MAX = 2**64 - 1

_META_FIELDS: tuple[tuple[str, MetaKind], ...] = (
    ("fps", MetaKind.FPS),
    ("bitrate", MetaKind.BITRATE),
    ("density", MetaKind.DENSITY),
)


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


def _format_rate(bits: int) -> str:
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
        return _format_rate(int(self))

    def __repr__(self) -> str:
        return f"Rate({str(self)!r})"

    @property
    def bits_per_second(self) -> int:
        return int(self)

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
# Small field types
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


T = TypeVar("T")


def _value_error(fn: Callable[[object], T]) -> Callable[[object], T]:
    """``fn`` raising ValueError for TypeError: pydantic reports only the former."""

    def wrapped(value: object) -> T:
        try:
            return fn(value)
        except TypeError as e:
            raise ValueError(str(e)) from None

    return wrapped


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


def _v6(net: Network) -> ipaddress.IPv6Network:
    """The prefix as the dataplane's LPM trie holds it (IPv4 as ::ffff:a.b.c.d)."""
    if isinstance(net, ipaddress.IPv6Network):
        return net
    mapped = ipaddress.IPv6Address((0xFFFF << 32) | int(net.network_address))
    return ipaddress.IPv6Network((mapped, 96 + net.prefixlen))


Slug = Annotated[StrictStr, AfterValidator(_slug)]
IfName = Annotated[StrictStr, AfterValidator(_ifname)]
U32 = Annotated[StrictInt, Field(ge=0, le=U32_MAX)]
ModalityName = Annotated[
    Modality,
    PlainValidator(_value_error(_modality)),
    PlainSerializer(lambda m: m.name.lower(), return_type=str),
    WithJsonSchema(
        {
            "type": "string",
            "enum": [m.name.lower() for m in Modality] + list(MODALITY_ALIASES),
        }
    ),
]
Prefix = Annotated[
    Network,
    PlainValidator(_value_error(_prefix)),
    PlainSerializer(str, return_type=str),
    WithJsonSchema({"type": "string", "examples": ["10.0.99.0/24", "fd00:99::/64"]}),
]


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Link(_Model):
    """The shaped interface: HTB root ``1:`` on ``device``, capped at ``rate``."""

    device: IfName = Field(description="Linux interface name (1..15 characters)")
    rate: Rate = Field(description="link capacity to shape to, bit/s")


class MetaRange(_Model):
    """An inclusive range of a metadata value (u32, as the BPF rule holds it)."""

    min: U32 = 0
    max: U32 = U32_MAX

    @model_validator(mode="after")
    def _ordered(self) -> MetaRange:
        if self.min > self.max:
            raise ValueError(f"min {self.min} is greater than max {self.max}")
        return self

    def contains(self, value: int) -> bool:
        return self.min <= value <= self.max


class Match(_Model):
    """Which frames a class takes: their modality, and optionally one metadata range.

    ``fps`` is the VIDEO_FPS TLV (frames/s), ``bitrate`` AUDIO_BITRATE (bit/s),
    ``density`` POINT_DENSITY (points per sweep).  A condition holds only when
    the header carries that TLV and its value lies in the range.
    """

    modalities: tuple[ModalityName, ...]
    fps: MetaRange | None = None
    bitrate: MetaRange | None = None
    density: MetaRange | None = None

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, value: tuple[Modality, ...]) -> tuple[Modality, ...]:
        if not value:
            raise ValueError(
                "at least one modality; leave 'match' out for a class reached only by its id"
            )
        seen: set[Modality] = set()
        for m in value:
            if m in seen:
                raise ValueError(f"modality {m.name.lower()!r} is listed twice")
            seen.add(m)
        return value

    @model_validator(mode="after")
    def _one_condition(self) -> Match:
        given = [name for name, _ in _META_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(
                f"at most one metadata condition per match (fps, bitrate or density), "
                f"got {' and '.join(given)}"
            )
        return self

    @property
    def meta(self) -> MetaKind:
        """The kind of metadata condition, MetaKind.NONE when there is none."""
        for name, kind in _META_FIELDS:
            if getattr(self, name) is not None:
                return kind
        return MetaKind.NONE

    @property
    def condition(self) -> MetaRange | None:
        for name, _ in _META_FIELDS:
            rng: MetaRange | None = getattr(self, name)
            if rng is not None:
                return rng
        return None

    def holds(
        self, *, fps: int | None = None, bitrate: int | None = None, density: int | None = None
    ) -> bool:
        """True if the metadata condition holds for these header values (None = absent).

        A match without a condition holds for any values.
        """
        values = {MetaKind.FPS: fps, MetaKind.BITRATE: bitrate, MetaKind.DENSITY: density}
        rng = self.condition
        if rng is None:
            return True
        value = values[self.meta]
        return value is not None and rng.contains(value)


class TrafficClass(_Model):
    """One traffic class: an HTB class ``1:<id hex>`` under the link's root."""

    name: Slug = Field(description="slug: [a-z][a-z0-9-]{0,31}")
    id: Annotated[StrictInt, Field(ge=1, le=MAX_CLASSES - 1)] = Field(
        description="1..63: HTB minor and the header's sla_class value that requests it"
    )
    match: Match | None = Field(
        default=None, description="frames the class takes; none = reachable only by id"
    )
    rate: Rate = Field(description="guaranteed rate, bit/s (HTB rate)")
    ceil: Rate | None = Field(
        default=None, description="most the class may borrow up to, bit/s; default: link rate"
    )
    weight: Annotated[StrictInt, Field(ge=1, le=MAX_WEIGHT)] = Field(
        default=1, description="share of spare bandwidth; HTB quantum = weight x 1514 bytes"
    )
    priority: Annotated[StrictInt, Field(ge=0, le=MAX_PRIORITY)] = Field(
        default=MAX_PRIORITY, description="0 = most urgent .. 7 (HTB prio)"
    )
    dscp: Annotated[StrictInt, Field(ge=0, le=MAX_DSCP)] | None = Field(
        default=None, description="DSCP written on egress, 0..63; none = leave alone"
    )

    @property
    def classid(self) -> int:
        """The HTB handle ``(1 << 16) | id`` that the classifier writes to skb->priority."""
        return (HTB_MAJOR << 16) | self.id

    @property
    def handle(self) -> str:
        """The HTB class handle as tc spells it, e.g. ``"1:a"`` for id 10."""
        return f"{HTB_MAJOR:x}:{self.id:x}"

    @property
    def quantum(self) -> int:
        """HTB quantum in bytes: ``weight * QUANTUM_UNIT``."""
        return self.weight * QUANTUM_UNIT

    @property
    def dscp_value(self) -> int:
        """The DSCP for the class map: 0..63, or DSCP_KEEP when left alone."""
        return DSCP_KEEP if self.dscp is None else self.dscp


class SourceRule(_Model):
    """Senders inside ``prefix`` may claim at most ``max_class`` (by rank)."""

    prefix: Prefix = Field(description="IPv4 or IPv6 network; host bits are cleared")
    max_class: Slug = Field(description="name of the most privileged class the prefix may get")

    @property
    def lpm_prefix(self) -> ipaddress.IPv6Network:
        """The prefix as the dataplane's LPM trie holds it: IPv4 as ::ffff:0:0/96 + prefix."""
        return _v6(self.prefix)


class Policy(_Model):
    """A whole SLA policy.  Immutable, and only ever built fully validated."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True
    )

    api_version: Literal["mmmesh/v1"] = Field(alias="apiVersion")
    description: str | None = None
    link: Link
    classes: tuple[TrafficClass, ...]
    default_class: Slug = Field(description="class for frames no match takes")
    source_rules: tuple[SourceRule, ...] = Field(
        default=(), max_length=DEFAULT_MAX_SRC_RULES,
        description=f"at most {DEFAULT_MAX_SRC_RULES} (the size of the dataplane's LPM map)")

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise _policy_error(e) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        """As BaseModel's, raising PolicyError instead of a pydantic ValidationError."""
        if isinstance(obj, Mapping):
            # pydantic passes a mapping on to __init__(**obj): keywords must be strings
            odd = [(str(k), "unknown field") for k in obj if not isinstance(k, str)]
            if odd:
                raise PolicyError(odd)
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as e:
            raise _policy_error(e) from None

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **kwargs: Any) -> Self:
        """As BaseModel's, raising PolicyError instead of a pydantic ValidationError."""
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as e:
            raise _policy_error(e) from None

    @field_validator("classes")
    @classmethod
    def _count(cls, value: tuple[TrafficClass, ...]) -> tuple[TrafficClass, ...]:
        if not value:
            raise ValueError("a policy needs at least one class")
        if len(value) > MAX_CLASSES - 1:
            raise ValueError(f"at most {MAX_CLASSES - 1} classes (ids are 1..{MAX_CLASSES - 1})")
        return value

    @model_validator(mode="after")
    def _cross_check(self) -> Policy:
        errors = _cross_errors(self)
        if errors:
            raise PolicyError(errors)
        return self

    # -- look-ups ---------------------------------------------------------
    def class_named(self, name: str) -> TrafficClass:
        """The class called ``name``; KeyError if there is none."""
        for c in self.classes:
            if c.name == name:
                return c
        raise KeyError(name)

    def class_by_id(self, class_id: int) -> TrafficClass | None:
        for c in self.classes:
            if c.id == class_id:
                return c
        return None

    @property
    def default(self) -> TrafficClass:
        return self.class_named(self.default_class)

    def ceil_of(self, cls: TrafficClass) -> Rate:
        """The class's ceiling, the link rate when the class states none."""
        return cls.ceil if cls.ceil is not None else self.link.rate

    def ranked(self) -> tuple[TrafficClass, ...]:
        """Classes in privilege order: sorted by (priority, -rate, id); index = rank.

        Rank 0 is the most privileged class: the most urgent priority, then the
        larger guarantee, then the smaller id.  Ids are unique, so ranks are too.
        """
        return tuple(sorted(self.classes, key=lambda c: (c.priority, -int(c.rate), c.id)))

    def rank(self, cls: TrafficClass | str) -> int:
        """The rank of a class (object or name); 0 = most privileged."""
        name = cls if isinstance(cls, str) else cls.name
        for i, c in enumerate(self.ranked()):
            if c.name == name:
                return i
        raise KeyError(name)

    def to_yaml(self) -> str:
        """The policy as YAML that :func:`parse_policy` reads back to an equal Policy."""
        data = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def _rate_text(r: int) -> str:
    return f"{_format_rate(int(r))} ({int(r)} bit/s)"


def _cross_errors(p: Policy) -> list[tuple[str, str]]:
    """Every cross-field rule; [] for a valid policy."""
    errors: list[tuple[str, str]] = []
    link = int(p.link.rate)
    names: dict[str, int] = {}
    ids: dict[int, int] = {}
    for i, c in enumerate(p.classes):
        at = f"classes[{i}]"
        if c.name in names:
            errors.append(
                (f"{at}.name", f"duplicate class name {c.name!r} (also classes[{names[c.name]}])")
            )
        else:
            names[c.name] = i
        if c.id in ids:
            j = ids[c.id]
            errors.append(
                (f"{at}.id", f"duplicate class id {c.id} (also classes[{j}] {p.classes[j].name!r})")
            )
        else:
            ids[c.id] = i
        if c.rate > link:
            msg = f"guaranteed rate {_rate_text(c.rate)} exceeds the link rate {_rate_text(link)}"
            errors.append((f"{at}.rate", msg))
        if c.ceil is not None and c.ceil < c.rate:
            msg = f"ceil {_rate_text(c.ceil)} is below the guaranteed rate {_rate_text(c.rate)}"
            errors.append((f"{at}.ceil", msg))
        if c.ceil is not None and c.ceil > link:
            msg = f"ceil {_rate_text(c.ceil)} exceeds the link rate {_rate_text(link)}"
            errors.append((f"{at}.ceil", msg))
    total = sum(int(c.rate) for c in p.classes)
    if total > link:
        msg = (
            f"sum of guaranteed rates {_rate_text(total)} exceeds the link rate {_rate_text(link)}"
        )
        errors.append(("classes", msg))

    known = ", ".join(names)
    if p.default_class not in names:
        errors.append(("default_class", f"unknown class {p.default_class!r}; classes are: {known}"))
    prefixes: dict[ipaddress.IPv6Network, int] = {}
    for i, r in enumerate(p.source_rules):
        at = f"source_rules[{i}]"
        if r.max_class not in names:
            errors.append(
                (f"{at}.max_class", f"unknown class {r.max_class!r}; classes are: {known}")
            )
        key = r.lpm_prefix
        if key in prefixes:
            msg = f"duplicate prefix {r.prefix} (also source_rules[{prefixes[key]}])"
            errors.append((f"{at}.prefix", msg))
        else:
            prefixes[key] = i

    fallback: dict[Modality, int] = {}
    conditional: dict[Modality, list[int]] = {}
    for i, c in enumerate(p.classes):
        if c.match is None:
            continue
        for m in c.match.modalities:
            mname = m.name.lower()
            if c.match.condition is not None:
                rules = conditional.setdefault(m, [])
                rules.append(i)
                if len(rules) == MAX_RULES + 1:
                    listed = ", ".join(repr(p.classes[k].name) for k in rules)
                    msg = (
                        f"modality {mname!r} has more than {MAX_RULES} metadata rules ({listed});"
                        f" the dataplane holds {MAX_RULES} per modality"
                    )
                    errors.append((f"classes[{i}].match", msg))
            elif m in fallback:
                j = fallback[m]
                msg = (
                    f"ambiguous: modality {mname!r} is claimed without a metadata condition by"
                    f" both {p.classes[j].name!r} (classes[{j}]) and {c.name!r} (classes[{i}])"
                )
                errors.append((f"classes[{i}].match.modalities", msg))
            else:
                fallback[m] = i
    return errors


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------
# libyaml's parser where PyYAML was built with it (~10x faster); same safe
# constructor either way.
_SafeBase: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _StrictLoader(_SafeBase):  # type: ignore[misc,valid-type]
    """SafeLoader that refuses duplicate mapping keys (a silent override otherwise)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Hashable] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, Hashable):
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def _load_yaml(text: str | bytes, source: str) -> object:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        what = " ".join(x for x in (e.context, e.problem) if x) or str(e)
        raise PolicyError([(where, f"invalid YAML: {what}")]) from None
    except (yaml.YAMLError, ValueError, OverflowError, RecursionError) as e:
        raise PolicyError([(source, f"invalid YAML: {e}")]) from None


def _loc(parts: Sequence[int | str]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _policy_error(exc: ValidationError) -> PolicyError:
    errors: list[tuple[str, str]] = []
    for e in exc.errors():
        loc = _loc(e["loc"])
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, PolicyError):
            errors.extend(
                (f"{loc}.{sub}" if loc and sub else loc or sub, msg) for sub, msg in cause.errors
            )
        elif e["type"] == "value_error" and isinstance(cause, Exception):
            errors.append((loc, str(cause)))
        elif e["type"] == "extra_forbidden":
            errors.append((loc, "unknown field"))
        elif e["type"] == "missing":
            errors.append((loc, "required field is missing"))
        else:
            errors.append((loc, e["msg"]))
    return PolicyError(errors)


def parse_policy(
    data: str | bytes | Mapping[str, Any] | Policy, *, source: str = "<string>"
) -> Policy:
    """A validated Policy from YAML text or an already parsed mapping.

    Raises PolicyError with every problem found; ``source`` names the text in
    YAML syntax errors (``source:line:column``).
    """
    if isinstance(data, Policy):
        return data
    raw: object = _load_yaml(data, source) if isinstance(data, str | bytes) else data
    if raw is None:
        raise PolicyError([("", f"{source}: the policy is empty")])
    if not isinstance(raw, Mapping):
        raise PolicyError([("", f"a policy is a mapping of fields, got {type(raw).__name__}")])
    try:
        return Policy.model_validate(dict(raw))
    except ValidationError as e:
        raise _policy_error(e) from None


def load_policy(path: str | PathLike[str]) -> Policy:
    """Read and validate a YAML policy file; PolicyError names the file on read errors."""
    name = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise PolicyError([(name, f"not UTF-8 text: {e.reason} at byte {e.start}")]) from None
    except OSError as e:
        raise PolicyError([(name, f"cannot read: {e.strerror or e}")]) from None
    return parse_policy(text, source=name)


def policy_json_schema() -> dict[str, Any]:
    """The JSON Schema of a policy document (YAML keys, as written in files)."""
    return Policy.model_json_schema(by_alias=True, mode="validation")


# --------------------------------------------------------------------------
# Reference classifier
# --------------------------------------------------------------------------
class Verdict(NamedTuple):
    """What :func:`reference_verdict` decided and why.

    ``via`` is ``"claim"`` (header's sla_class), ``"rule"`` (a metadata rule),
    ``"fallback"`` (the modality's condition-less class) or ``"default"``;
    ``clamped`` is True when a source rule lowered the class (CBF_CLAMPED).
    """

    cls: TrafficClass
    via: Literal["claim", "rule", "fallback", "default"]
    clamped: bool


def reference_verdict(
    policy: Policy,
    modality: int,
    sla_class: int = 0,
    *,
    fps: int | None = None,
    bitrate: int | None = None,
    density: int | None = None,
    src_ip: str | ipaddress.IPv4Address | ipaddress.IPv6Address | None = None,
) -> Verdict:
    """Like :func:`classify_reference`, also telling which step chose the class."""
    via: Literal["claim", "rule", "fallback", "default"] = "default"
    chosen: TrafficClass | None = policy.class_by_id(sla_class) if sla_class else None
    if chosen is not None:
        via = "claim"
    else:
        mod = Modality(modality) if modality in Modality._value2member_map_ else None
        takers = [
            c
            for c in policy.classes
            if mod is not None and c.match is not None and mod in c.match.modalities
        ]
        for c in takers:
            assert c.match is not None
            if c.match.condition is not None and c.match.holds(
                fps=fps, bitrate=bitrate, density=density
            ):
                chosen, via = c, "rule"
                break
        else:
            for c in takers:
                assert c.match is not None
                if c.match.condition is None:
                    chosen, via = c, "fallback"
                    break
    if chosen is None:
        chosen = policy.default
    clamped = False
    if src_ip is not None and policy.source_rules:
        addr = ipaddress.ip_address(src_ip)
        if isinstance(addr, ipaddress.IPv4Address):
            addr = ipaddress.IPv6Address((0xFFFF << 32) | int(addr))
        best: SourceRule | None = None
        for r in policy.source_rules:
            key = r.lpm_prefix
            if addr in key and (best is None or key.prefixlen > best.lpm_prefix.prefixlen):
                best = r
        if best is not None and policy.rank(chosen) < policy.rank(best.max_class):
            chosen, clamped = policy.class_named(best.max_class), True
    return Verdict(chosen, via, clamped)


def classify_reference(
    policy: Policy,
    modality: int,
    sla_class: int = 0,
    *,
    fps: int | None = None,
    bitrate: int | None = None,
    density: int | None = None,
    src_ip: str | ipaddress.IPv4Address | ipaddress.IPv6Address | None = None,
) -> TrafficClass:
    """The class the dataplane gives a frame whose MMH header it read.

    ``modality`` and ``sla_class`` are the header bytes; ``fps``, ``bitrate``,
    ``density`` the metadata TLVs (None = not in the header); ``src_ip`` the
    packet's source address (None = no source rule applies).

    1. ``sla_class`` that is the id of a class in the policy: that class.
    2. Otherwise the first class, in file order, whose match lists the modality
       and whose metadata condition holds; then the modality's condition-less
       class (its fallback); then ``default_class``.
    3. Clamp: the source rule with the longest prefix containing ``src_ip``
       (IPv4 compared IPv4-mapped, as the LPM trie does) lowers the class to
       its ``max_class`` when the class's rank is lower (better) than that of
       ``max_class``.
    """
    return reference_verdict(
        policy, modality, sla_class, fps=fps, bitrate=bitrate, density=density, src_ip=src_ip
    ).cls
