"""The policy models (pydantic v2) and the cross-field rules that make a Policy valid.

Every model is frozen and refuses unknown fields.  Structural problems (types,
ranges, unknown fields) are reported first, all together; once the structure is
valid, :func:`_cross_errors` runs every cross-field rule (those of ``adapt``
too, :func:`adapt_errors`, with :func:`bounds` and :func:`policy_values`) and
reports all its findings together too.  :func:`policy_error` turns a pydantic ValidationError
into the one :class:`~mmmesh.errors.PolicyError`, with paths written like
``classes[2].rate``; no pydantic ValidationError leaves a :class:`Policy`
constructor.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from mmmesh.abi import (
    DEFAULT_MAX_SRC_RULES,
    DSCP_KEEP,
    HTB_MAJOR,
    MAX_CLASSES,
    MAX_RULES,
    MetaKind,
    Modality,
)
from mmmesh.errors import PolicyError, field_path

from ._adapt import KNOBS, Adapt, Objective
from ._types import (
    U32,
    U32_MAX,
    IfName,
    ModalityName,
    Prefix,
    Rate,
    Slug,
    format_rate,
    ipv4_mapped,
)

ApiVersion = Literal["mmmesh/v1"]
API_VERSION: ApiVersion = "mmmesh/v1"  # the one value ApiVersion allows (mypy checks)
MAX_WEIGHT = 100
# HTB quantum per unit of weight, in bytes: one full Ethernet frame, so that
# weight 1 still sends a whole frame per round and weight 100 (151400 bytes)
# stays below HTB's "quantum is big" threshold of 200000 bytes.
QUANTUM_UNIT = 1514
MAX_PRIORITY = 7  # HTB has 8 prios, 0..7
MAX_DSCP = 63

_META_FIELDS: tuple[tuple[str, MetaKind], ...] = (
    ("fps", MetaKind.FPS),
    ("bitrate", MetaKind.BITRATE),
    ("density", MetaKind.DENSITY),
)


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
    sla: Objective | None = Field(
        default=None, description="the objective the controller keeps: p99_ms and/or attainment"
    )
    adapt: Adapt | None = Field(
        default=None, description="ranges [min, max] qosd may move rate/ceil/weight/priority in"
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
        net = self.prefix
        if isinstance(net, ipaddress.IPv6Network):
            return net
        return ipaddress.IPv6Network((ipv4_mapped(net.network_address), 96 + net.prefixlen))


class Policy(_Model):
    """A whole SLA policy.  Immutable, and only ever built fully validated."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True
    )

    api_version: ApiVersion = Field(alias="apiVersion")
    description: str | None = None
    link: Link
    classes: tuple[TrafficClass, ...]
    default_class: Slug = Field(description="class for frames no match takes")
    source_rules: tuple[SourceRule, ...] = Field(
        default=(),
        max_length=DEFAULT_MAX_SRC_RULES,
        description=f"at most {DEFAULT_MAX_SRC_RULES} (the size of the dataplane's LPM map)",
    )

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise policy_error(e) from None

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
            raise policy_error(e) from None

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **kwargs: Any) -> Self:
        """As BaseModel's, raising PolicyError instead of a pydantic ValidationError."""
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as e:
            raise policy_error(e) from None

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

    def p99_targets(self) -> dict[str, float]:
        """The p99 objective in ms of every class that states one, by class name
        (what ``SlaView.snapshot(targets=...)`` takes)."""
        return {c.name: c.sla.p99_ms for c in self.classes
                if c.sla is not None and c.sla.p99_ms is not None}  # fmt: skip

    def to_yaml(self) -> str:
        """The policy as YAML that :func:`parse_policy` reads back to an equal Policy."""
        data = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def _rate_text(r: int) -> str:
    return f"{format_rate(int(r))} ({int(r)} bit/s)"


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
    errors.extend(adapt_errors(p))
    return errors


# --------------------------------------------------------------------------
# The cross-field rules of ``adapt`` (the models are _adapt.py's)
# --------------------------------------------------------------------------
# * every range holds the policy's own value (the controller starts there and
#   decays back to it);
# * rate and ceil ranges stay within the link, and the highest rate stays at or
#   below the lowest ceil (HTB needs rate <= ceil at every step);
# * anti-escalation: for every source rule capping senders at ``max_class`` M,
#   every class C that ranks below M in the policy must still rank below M at
#   every setting within the ranges: C's most privileged setting (lowest
#   priority, highest rate) keeps a rank key ``(priority, -rate, id)`` greater
#   than M's least privileged one (highest priority, lowest rate).  So a sender
#   capped at M never gets, through adaptation, a class served before M.  The
#   default class (traffic the mesh cannot read) may give but never gain: its
#   ranges end at its policy values on the privileged side;
# * the sum of guaranteed rates at any moment is the controller's rule, not a
#   schema rule: it pays every rate increase from the unreserved link or from
#   another class, so the sum never exceeds the link (docs/controller.md).
def bounds(p: Policy, c: TrafficClass) -> dict[str, tuple[int, int]]:
    """Per knob, the inclusive range the class may take: its ``adapt`` range, or
    its policy value alone where it has none (ceil: the effective ceiling)."""
    value = policy_values(p, c)
    out: dict[str, tuple[int, int]] = {}
    for knob in KNOBS:
        rng = getattr(c.adapt, knob) if c.adapt is not None else None
        out[knob] = (int(rng[0]), int(rng[1])) if rng is not None else (value[knob], value[knob])
    return out


def policy_values(p: Policy, c: TrafficClass) -> dict[str, int]:
    """The class's own values of the adaptable knobs (ceil: the effective one)."""
    return {"rate": int(c.rate), "ceil": int(p.ceil_of(c)), "weight": c.weight,
            "priority": c.priority}  # fmt: skip


def _show(knob: str, v: int) -> str:
    return format_rate(v) if knob in ("rate", "ceil") else str(v)


def adapt_errors(p: Policy) -> list[tuple[str, str]]:
    """The cross-field rules of ``adapt`` (above); [] when they hold."""
    errors: list[tuple[str, str]] = []
    link = int(p.link.rate)
    for i, c in enumerate(p.classes):
        if c.adapt is None:
            continue
        at = f"classes[{i}].adapt"
        own = policy_values(p, c)
        rng = bounds(p, c)
        for knob in KNOBS:
            if getattr(c.adapt, knob) is None:
                continue
            lo, hi = rng[knob]
            if not lo <= own[knob] <= hi:
                errors.append((f"{at}.{knob}", (
                    f"the range [{_show(knob, lo)}, {_show(knob, hi)}] does not hold the "
                    f"class's own {knob} {_show(knob, own[knob])}")))
            if knob in ("rate", "ceil") and hi > link:
                errors.append((f"{at}.{knob}", (
                    f"max {format_rate(hi)} ({hi} bit/s) exceeds the link rate "
                    f"{format_rate(link)} ({link} bit/s)")))
        if c.adapt.rate is not None and rng["rate"][1] > rng["ceil"][0] and rng["rate"][1] <= link:
            errors.append((f"{at}.rate", (
                f"max {format_rate(rng['rate'][1])} is above the lowest ceil "
                f"{format_rate(rng['ceil'][0])}: HTB needs rate <= ceil at every setting")))
        if c.name == p.default_class:
            errors.extend(_default_gains(p, c, at))
    errors.extend(_escalations(p))
    return errors


def _default_gains(p: Policy, c: TrafficClass, at: str) -> list[tuple[str, str]]:
    """The default class carries traffic the mesh cannot read: it may give, not gain."""
    own, rng = policy_values(p, c), bounds(p, c)
    gains = [(k, rng[k][1]) for k in ("rate", "ceil", "weight") if rng[k][1] > own[k]]
    if rng["priority"][0] < own["priority"]:
        gains.append(("priority", rng["priority"][0]))
    return [(f"{at}.{knob}", (
        f"{c.name!r} is the default class (traffic the mesh cannot read): it may give, never "
        f"gain; the range may not go past its own {knob} {_show(knob, own[knob])} "
        f"to {_show(knob, v)}")) for knob, v in gains]


def _escalations(p: Policy) -> list[tuple[str, str]]:
    """Anti-escalation: no class below a rule's max_class may outrank it when adapted."""
    errors: list[tuple[str, str]] = []
    index = {c.name: i for i, c in enumerate(p.classes)}
    ranks = {c.name: r for r, c in enumerate(p.ranked())}
    seen: set[tuple[str, str]] = set()
    for ri, rule in enumerate(p.source_rules):
        if rule.max_class not in index:
            continue  # reported by the schema's own rule
        m = p.classes[index[rule.max_class]]
        m_rng = bounds(p, m)
        worst_m = (m_rng["priority"][1], -m_rng["rate"][0], m.id)
        for c in p.classes:
            if ranks[c.name] <= ranks[m.name] or (m.name, c.name) in seen:
                continue
            c_rng = bounds(p, c)
            best_c = (c_rng["priority"][0], -c_rng["rate"][1], c.id)
            if best_c > worst_m:
                continue
            seen.add((m.name, c.name))
            knob = "priority" if best_c[0] < worst_m[0] else "rate"
            own_c = policy_values(p, c)[knob]
            blame_c = c_rng[knob][0] < own_c if knob == "priority" else c_rng[knob][1] > own_c
            who = c if blame_c else m
            errors.append((f"classes[{index[who.name]}].adapt.{knob}", (
                f"anti-escalation: {c.name!r} ranks below {m.name!r}, the max_class of "
                f"source_rules[{ri}] ({rule.prefix}), but could outrank it when adapted: "
                f"{c.name} at priority {best_c[0]}, rate {format_rate(-best_c[1])} against "
                f"{m.name} at priority {worst_m[0]}, rate {format_rate(-worst_m[1])}")))
    return errors


# --------------------------------------------------------------------------
# ValidationError -> PolicyError
# --------------------------------------------------------------------------
def policy_error(exc: ValidationError) -> PolicyError:
    """The PolicyError that lists what ``exc`` found, one (field path, message) each."""
    errors: list[tuple[str, str]] = []
    for e in exc.errors():
        loc = field_path(e["loc"])
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


def policy_json_schema() -> dict[str, Any]:
    """The JSON Schema of a policy document (YAML keys, as written in files)."""
    return Policy.model_json_schema(by_alias=True, mode="validation")
