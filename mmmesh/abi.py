"""The one source of truth for everything the BPF C code and Python share.

Constants (wire format numbers, map sizes, reason codes) and the layouts of map
keys and values are defined here, once.  ``scripts/gen_abi.py`` renders them as
``bpf/include/mm_abi.h``; ``tests/mmmesh/test_abi.py`` fails if the checked-in header
drifts from this module, and compares the struct layouts that clang computed
for the loaded program (bcc exposes them as ctypes types) with the ones below.

Byte order: every multi-byte field on the wire is big-endian (network order).
Map keys and values are host order unless a field comment says ``be``.
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

# Bump when a map layout, map set, or program section changes incompatibly.
# A pinned dataplane with another ABI version is replaced, never adopted.
ABI_VERSION = 4  # 3: per-flow and per-stage overrides (boost leaves), FlowInfo.boost;
#                 4: egress mode fq (ClassInfo/BoostInfo pacing fields, pace_map, CFG_PACING)

# --------------------------------------------------------------------------
# Wire format (MMH v1), see docs/wire-format.md
# --------------------------------------------------------------------------
MMH_MAGIC = b"MMH"  # bytes 0..2
MMH_VERSION = 1  # byte 3
# magic + version read as one big-endian u32: the classifier's single compare
MMH_MAGIC_V1_U32 = 0x4D4D4801
MMH_MAGIC_U24 = 0x4D4D48
MMH_PREAMBLE_LEN = 12  # fixed part: magic, version, hdr_len, modality, class, flags, payload_len
MMH_HDR_MAX = 255  # hdr_len is one byte: hard upper bound on a header
MMH_MAX_TLVS = 16  # a header with more TLVs is malformed
MMH_MAX_PAYLOAD = 1 << 30  # payload_len above this is malformed (1 GiB)

# preamble field offsets
MMH_OFF_VERSION = 3
MMH_OFF_HDR_LEN = 4
MMH_OFF_MODALITY = 5
MMH_OFF_CLASS = 6
MMH_OFF_FLAGS = 7
MMH_OFF_PAYLOAD_LEN = 8


class Modality(enum.IntEnum):
    """Byte 5 of the preamble.  0 means 'not stated'; unknown values are legal."""

    UNSPEC = 0
    TEXT = 1
    IMAGE = 2
    VIDEO = 3
    AUDIO = 4
    POINT_CLOUD = 5
    CONTROL = 6
    TENSOR = 7  # generic tensor / embedding exchanged between stages


class Flag(enum.IntFlag):
    """Byte 7 of the preamble.  Unknown bits are ignored by readers."""

    NONE = 0
    ERROR = 0x01  # the payload is an error report (TLV ERROR), not a tensor
    END_OF_STREAM = 0x02  # last frame of this stream id


class Tlv(enum.IntEnum):
    """TLV type numbers.  Layout: type (1 byte), length (1 byte, value bytes), value."""

    PAD = 0x00  # any length, value ignored
    STREAM_ID = 0x01  # u32
    SEQUENCE = 0x02  # u64
    TIMESTAMP_NS = 0x03  # u64, sender CLOCK_REALTIME in ns
    DEADLINE_NS = 0x04  # u64, absolute CLOCK_REALTIME in ns
    VIDEO_FPS = 0x10  # u16, frames per second
    AUDIO_BITRATE = 0x11  # u32, bit/s
    POINT_DENSITY = 0x12  # u32, points per sweep
    TENSOR = 0x20  # u8 dtype, u8 ndim (<= 8), ndim x u32 dims
    TRACEPARENT = 0x30  # 26 bytes: W3C version(1) trace-id(16) parent-id(8) flags(1)
    ERROR = 0x40  # u16 code, then UTF-8 message (length - 2 bytes)


# Fixed value lengths of known TLVs; None = variable (checked by its own rule).
TLV_FIXED_LEN: dict[Tlv, int | None] = {
    Tlv.PAD: None,
    Tlv.STREAM_ID: 4,
    Tlv.SEQUENCE: 8,
    Tlv.TIMESTAMP_NS: 8,
    Tlv.DEADLINE_NS: 8,
    Tlv.VIDEO_FPS: 2,
    Tlv.AUDIO_BITRATE: 4,
    Tlv.POINT_DENSITY: 4,
    Tlv.TENSOR: None,
    Tlv.TRACEPARENT: 26,
    Tlv.ERROR: None,
}
TENSOR_MAX_DIMS = 8


class DType(enum.IntEnum):
    """TENSOR TLV dtype byte (names as in the KServe v2 protocol)."""

    BOOL = 1
    UINT8 = 2
    UINT16 = 3
    UINT32 = 4
    UINT64 = 5
    INT8 = 6
    INT16 = 7
    INT32 = 8
    INT64 = 9
    FP16 = 10
    FP32 = 11
    FP64 = 12
    BYTES = 13
    BF16 = 14


class MetaKind(enum.IntEnum):
    """Which metadata TLV a policy rule matches on (mm_rule.meta)."""

    NONE = 0
    FPS = 1  # Tlv.VIDEO_FPS
    BITRATE = 2  # Tlv.AUDIO_BITRATE
    DENSITY = 3  # Tlv.POINT_DENSITY


# --------------------------------------------------------------------------
# Classifier
# --------------------------------------------------------------------------
class Reason(enum.IntEnum):
    """Per-direction reason counters (stats_map.reason[]); one primary per packet."""

    PARSED = 0  # MMH header read and classified
    FLOW_HIT = 1  # TCP segment without header, class from the flow table
    NOT_MESH = 2  # no header and no flow: best effort
    MALFORMED = 3  # header magic present but invalid: best effort
    CLAMPED = 4  # (extra) claim lowered by a source rule
    FLOW_NEW = 5  # (extra) TCP flow learnt
    FLOW_UPDATE = 6  # (extra) TCP flow changed class or modality
    DSCP_REWRITE = 7  # (extra) DSCP rewritten


NR_REASONS = 8
PRIMARY_REASONS = (Reason.PARSED, Reason.FLOW_HIT, Reason.NOT_MESH, Reason.MALFORMED)

DIR_EGRESS = 0
DIR_INGRESS = 1
NR_DIRS = 2

MAX_CLASSES = 64  # class ids 1..63; 0 is "no class"
MAX_MODALITIES = 256
MAX_RULES = 4  # metadata rules per modality
MAX_VLAN = 2  # stacked 802.1Q/802.1ad tags walked
MAX_EXTHDRS = 6  # IPv6 extension headers walked
DEFAULT_MAX_FLOWS = 65536  # flow_map size (cflag MM_MAX_FLOWS)
DEFAULT_MAX_SRC_RULES = 1024  # src_map size (cflag MM_MAX_SRC_RULES)
DSCP_KEEP = 0xFF  # mm_class_info.dscp: leave the DSCP alone
HTB_MAJOR = 1  # HTB root handle 1:, so class ids are 0x1XXXX
NO_MODALITY = 0x100  # cb[2] when no header or flow gave one (outside the byte: 255 is real)

# cb[] words written for every packet (read back by BPF_PROG_TEST_RUN)
CB_REASON = 0  # primary reason
CB_CLASS = 1  # class id chosen (0 = none)
CB_MODALITY = 2  # modality byte of the header or NO_MODALITY
CB_FLAGS = 3  # bit0 clamped, bit1 flow learnt/updated, bit2 dscp rewritten, bit3 boosted,
#              bit4 paced, bit5 past the pacing horizon (egress mode fq)
CBF_CLAMPED = 0x1
CBF_FLOW_LEARNT = 0x2
CBF_DSCP = 0x4
CBF_BOOSTED = 0x8  # an override put the packet in a boost leaf of its class
CBF_PACED = 0x10  # egress mode fq: the class's pacer gave the packet a departure time
CBF_OVER_HORIZON = 0x20  # ... past the class's horizon: stamped for the qdisc to drop

CFG_HAS_SRC_RULES = 0x1
CFG_STAGE_OVERRIDES = 0x2  # stage_ovr_map has entries: look senders up
CFG_FLOW_OVERRIDES = 0x4  # flow_ovr_map has entries: look flows up
CFG_OVERRIDES = CFG_STAGE_OVERRIDES | CFG_FLOW_OVERRIDES  # written by set_overrides, kept by up
CFG_PACING = 0x8  # egress mode fq: some class or boost has a pacing rate (EDT)

# Overrides (docs/dataplane.md, "Per-flow and per-stage overrides"): a
# class may have up to MAX_BOOSTS extra HTB leaves, "boost leaves", beside its
# own 1:<id>.  Boost level l (1..MAX_BOOSTS) of class c is HTB class
# 1:<BOOST_MINOR_STEP * l + c> (0x41..0xff): never a policy id (1..63) nor the
# link class 1:40.
MAX_BOOSTS = 3
BOOST_MINOR_STEP = MAX_CLASSES  # 0x40
BOOST_SLOTS = MAX_BOOSTS * MAX_CLASSES  # boost_map: key (level - 1) * MAX_CLASSES + class id
DEFAULT_MAX_STAGE_OVERRIDES = 1024  # stage_ovr_map size (cflag MM_MAX_STAGE_OVR)
DEFAULT_MAX_FLOW_OVERRIDES = 4096  # flow_ovr_map size (cflag MM_MAX_FLOW_OVR)


# Egress mode fq (docs/dataplane.md, "Egress modes"): no HTB.  A root mq
# with one sch_fq per TX queue (a single-queue device: one root sch_fq);
# the classifier writes skb->priority = FQ_PRIO_BASE + band, and the fq
# qdiscs' priomap sends slot FQ_PRIO_BASE + b to band b (every other slot to
# the default class's band); a class with a ceil below the link gets an EDT
# departure time from its pacer (pace_map).
FQ_BANDS = 3  # sch_fq's bands (include/uapi/linux/pkt_sched.h FQ_BANDS)
FQ_PRIO_SLOTS = 16  # sch_fq's priomap: skb->priority & 15 (TC_PRIO_MAX + 1)
FQ_PRIO_BASE = 13  # priomap slots 13, 14, 15 = bands 0, 1, 2 (no TC_PRIO_* name uses them)
FQ_MIN_WEIGHT = 16384  # the smallest band weight sch_fq accepts (bytes per WRR round)
FQ_ROOT_MAJOR = 0x4D4D  # handle 4d4d: of the mq (or single fq) root mmmesh makes
FQ_CHILD_MAJOR = 0x4E00  # handle (4e00 + queue): of the fq under mq class 4d4d:<queue + 1>
PACE_SLOTS = (MAX_BOOSTS + 1) * MAX_CLASSES  # pace_map: key level * MAX_CLASSES + class id
PACE_MIN_HORIZON_US = 1000  # a paced class may run this far ahead of now, at least ...
PACE_MAX_HORIZON_US = 1_000_000  # ... and at most (the rest: LEAF_LIMIT frames at its rate)
FQ_HORIZON_US = 2_000_000  # sch_fq's horizon (drops beyond): above every class's horizon
PACE_DROP_NS = 2 * FQ_HORIZON_US * 1000  # a frame past its class's horizon departs now + this:
#                                          beyond sch_fq's horizon, which drops it
NSEC_PER_SEC = 1_000_000_000


def pace_slot(class_id: int, level: int = 0) -> int:
    """The pace_map key of class ``class_id`` (level 0) or of its boost ``level``."""
    return level * MAX_CLASSES + class_id


def boost_classid(class_id: int, level: int) -> int:
    """The HTB class id of boost level ``level`` (1..MAX_BOOSTS) of class ``class_id``."""
    return (HTB_MAJOR << 16) | (BOOST_MINOR_STEP * level + class_id)


def boost_slot(class_id: int, level: int) -> int:
    """The boost_map key of boost level ``level`` of class ``class_id``."""
    return (level - 1) * MAX_CLASSES + class_id


# --------------------------------------------------------------------------
# Map layouts (host order unless marked be)
# --------------------------------------------------------------------------
class ClassInfo(ctypes.Structure):
    """class_map value (ARRAY[MAX_CLASSES], key = class id)."""

    _fields_ = [
        ("classid", ctypes.c_uint32),  # skb->priority: the HTB class id; fq: FQ_PRIO_BASE + band
        ("valid", ctypes.c_uint8),
        ("rank", ctypes.c_uint8),  # 0 = most privileged
        ("dscp", ctypes.c_uint8),  # 0..63 or DSCP_KEEP
        ("pad", ctypes.c_uint8),
        ("horizon_us", ctypes.c_uint32),  # fq: how far its pacer may run ahead of now
        ("pad2", ctypes.c_uint32),
        ("pace_Bps", ctypes.c_uint64),  # fq: pacing rate, bytes/s (its ceil); 0 = not paced
    ]


class Config(ctypes.Structure):
    """config_map value (ARRAY[1])."""

    _fields_ = [
        ("policy_version", ctypes.c_uint32),
        ("default_class", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),  # CFG_*
        ("clamp_below_rank", ctypes.c_uint8),  # no source rule limits ranks >= this
        ("pad", ctypes.c_uint8),
    ]


class Rule(ctypes.Structure):
    _fields_ = [
        ("meta", ctypes.c_uint8),  # MetaKind
        ("class_id", ctypes.c_uint8),
        ("pad", ctypes.c_uint16),
        ("min", ctypes.c_uint32),  # inclusive
        ("max", ctypes.c_uint32),  # inclusive
    ]


class ModalityInfo(ctypes.Structure):
    """modality_map value (ARRAY[MAX_MODALITIES], key = modality byte)."""

    _fields_ = [
        ("valid", ctypes.c_uint8),
        ("default_class", ctypes.c_uint8),  # class when no rule matches; 0 = policy default
        ("nrules", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
        ("rules", Rule * MAX_RULES),
    ]


class SrcKey(ctypes.Structure):
    """src_map key (LPM_TRIE).  IPv4 is stored IPv4-mapped (::ffff:a.b.c.d)."""

    _fields_ = [
        ("prefixlen", ctypes.c_uint32),
        ("addr", ctypes.c_uint8 * 16),  # be
    ]


class SrcInfo(ctypes.Structure):
    """src_map value: the most privileged class the prefix may claim."""

    _fields_ = [
        ("max_class", ctypes.c_uint8),
        ("max_rank", ctypes.c_uint8),
        ("pad", ctypes.c_uint16),
    ]


class FlowKey(ctypes.Structure):
    """flow_map key (LRU_HASH): the TCP 5-tuple, IPv4 stored IPv4-mapped."""

    _fields_ = [
        ("saddr", ctypes.c_uint8 * 16),  # be
        ("daddr", ctypes.c_uint8 * 16),  # be
        ("sport", ctypes.c_uint16),  # be
        ("dport", ctypes.c_uint16),  # be
        ("proto", ctypes.c_uint8),
        ("dir", ctypes.c_uint8),  # DIR_EGRESS / DIR_INGRESS: the directions never mix
        ("pad", ctypes.c_uint8 * 2),
    ]


class FlowInfo(ctypes.Structure):
    """flow_map value."""

    _fields_ = [
        ("last_seen_ns", ctypes.c_uint64),  # bpf_ktime_get_ns()
        ("packets", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("class_id", ctypes.c_uint8),
        ("modality", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),
        ("boost", ctypes.c_uint8),  # boost level taken at the flow's last message start, 0: none
        ("pad", ctypes.c_uint8 * 4),
    ]


class ClassCounter(ctypes.Structure):
    _fields_ = [("packets", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


class Stats(ctypes.Structure):
    """stats_map value (PERCPU_ARRAY[NR_DIRS], key = direction)."""

    _fields_ = [
        ("reason", ctypes.c_uint64 * NR_REASONS),
        ("cls", ClassCounter * MAX_CLASSES),
    ]


class Meta(ctypes.Structure):
    """meta_map value (ARRAY[1]): identifies a pinned dataplane."""

    _fields_ = [
        ("abi_version", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("build_id", ctypes.c_uint64),  # hash of the compiled source + cflags
    ]


class BoostInfo(ctypes.Structure):
    """boost_map value (ARRAY[BOOST_SLOTS], key = boost_slot(class, level))."""

    _fields_ = [
        ("classid", ctypes.c_uint32),  # skb->priority: the boost leaf's HTB class id
        #                                (boost_classid); fq: FQ_PRIO_BASE + the boost's band
        ("valid", ctypes.c_uint8),  # the leaf exists; overrides may point at it
        ("weight", ctypes.c_uint8),  # the leaf's weight and prio (user space reads them back)
        ("prio", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
        ("horizon_us", ctypes.c_uint32),  # fq: as ClassInfo's, for the boost's own pacer
        ("pad2", ctypes.c_uint32),
        ("pace_Bps", ctypes.c_uint64),  # fq: the boost's share of its class's ceil; 0: none
    ]


class StageOvrKey(ctypes.Structure):
    """stage_ovr_map key (LPM_TRIE): (class, sender prefix).  prefixlen counts
    from class_id: 32 + the address bits, so the class always matches whole."""

    _fields_ = [
        ("prefixlen", ctypes.c_uint32),
        ("class_id", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 3),
        ("addr", ctypes.c_uint8 * 16),  # be, IPv4-mapped for IPv4
    ]


class OvrInfo(ctypes.Structure):
    """stage_ovr_map and flow_ovr_map value (flow_ovr_map key: FlowKey, egress)."""

    _fields_ = [
        ("hits", ctypes.c_uint64),  # times it chose a leaf: TCP per message, UDP per datagram
        ("class_id", ctypes.c_uint8),  # the class it boosts (another class: no effect)
        ("level", ctypes.c_uint8),  # 1..MAX_BOOSTS
        ("pad", ctypes.c_uint8 * 6),
    ]


class PaceState(ctypes.Structure):
    """pace_map value (ARRAY[PACE_SLOTS], key = pace_slot(class, level)): one
    pacer's clock, written by the classifier only (user space reads it)."""

    _fields_ = [
        ("next_ns", ctypes.c_uint64),  # bpf_ktime_get_ns(): where the pacer's next frame starts
        ("over_horizon", ctypes.c_uint64),  # frames stamped for the qdisc to drop (approximate)
    ]


MM_SCRATCH_SIZE = 512  # a whole MMH header (<= MMH_HDR_MAX) fits; a power of two (mask)


class TlvOut(ctypes.Structure):
    """What the TLV walk found (part of scratch_map's value).

    Verifier: TLV results live in map memory, not on the stack.  Values the
    verifier reads back from a map are unknown scalars, so the states of
    different TLV orders merge; constant flags on the stack would multiply
    the explored states by every combination of TLV types seen."""

    _fields_ = [
        ("fps", ctypes.c_uint32),
        ("bitrate", ctypes.c_uint32),
        ("density", ctypes.c_uint32),
        ("have", ctypes.c_uint32),
        ("seen", ctypes.c_uint8 * 16),
    ]


class Scratch(ctypes.Structure):
    """scratch_map value (PERCPU_ARRAY[1]): a copy of the header being read.
    512 bytes so that an offset masked with MM_SCRATCH_SIZE - 1 is always
    inside the buffer: the mask is how the verifier is shown that the TLV
    walk never reads out of bounds."""

    _fields_ = [
        ("buf", ctypes.c_uint8 * MM_SCRATCH_SIZE),
        ("out", TlvOut),
    ]


# Name -> (struct, C name) rendered into the header, in dependency order.
STRUCTS: list[tuple[str, type[ctypes.Structure]]] = [
    ("mm_class_info", ClassInfo),
    ("mm_config", Config),
    ("mm_rule", Rule),
    ("mm_modality_info", ModalityInfo),
    ("mm_src_key", SrcKey),
    ("mm_src_info", SrcInfo),
    ("mm_flow_key", FlowKey),
    ("mm_flow_info", FlowInfo),
    ("mm_class_counter", ClassCounter),
    ("mm_stats", Stats),
    ("mm_meta", Meta),
    ("mm_boost_info", BoostInfo),
    ("mm_stage_ovr_key", StageOvrKey),
    ("mm_ovr_info", OvrInfo),
    ("mm_pace_state", PaceState),
    ("mm_tlv_out", TlvOut),
    ("mm_scratch", Scratch),
]

# --------------------------------------------------------------------------
# Maps and programs: the one list.  scripts/gen_abi.py renders the map
# declarations (bpf/include/mm_maps.h) and the program prototypes from it;
# the loader pins exactly these names and user space opens them by them.
# --------------------------------------------------------------------------
CType = type[ctypes.c_uint32] | type[ctypes.c_uint64] | type[ctypes.c_int] | type[ctypes.Structure]


@dataclass(frozen=True)
class MapDef:
    """One BPF map of the classifier."""

    name: str  # the C name, the pin name under /sys/fs/bpf/mmmesh/<dev>/
    kind: str  # "array" | "percpu_array" | "hash" | "lru_hash" | "lpm_trie" | "sockhash"
    #            | "sk_storage" (the last two: the socket layer only)
    key: CType
    value: CType
    max_entries: str  # a C expression (a constant or tunable name, or a number)
    doc: str
    no_prealloc: bool = False  # BPF_F_NO_PREALLOC (required for LPM tries)
    user: bool = True  # user space opens it (False: kernel-only scratch space)


MAPS: tuple[MapDef, ...] = (
    MapDef("config_map", "array", ctypes.c_uint32, Config, "1",
           "Policy: version, default class, flags (written by user space)."),
    MapDef("class_map", "array", ctypes.c_uint32, ClassInfo, "MM_MAX_CLASSES",
           "Policy: class id -> HTB class id, rank, DSCP."),
    MapDef("modality_map", "array", ctypes.c_uint32, ModalityInfo, "MM_MAX_MODALITIES",
           "Policy: modality byte -> metadata rules and fallback class."),
    MapDef("src_map", "lpm_trie", SrcKey, SrcInfo, "MM_MAX_SRC_RULES",
           "Policy: source prefix -> most privileged class it may claim.", no_prealloc=True),
    MapDef("meta_map", "array", ctypes.c_uint32, Meta, "1",
           "Identifies a pinned dataplane (ABI version, build id) for adoption."),
    MapDef("flow_map", "lru_hash", FlowKey, FlowInfo, "MM_MAX_FLOWS",
           "State: TCP flows learnt from the segment that starts a message."),
    MapDef("stats_map", "percpu_array", ctypes.c_uint32, Stats, "MM_NR_DIRS",
           "Counters: key = direction (MM_DIR_*), one copy per CPU."),
    MapDef("scratch_map", "percpu_array", ctypes.c_uint32, Scratch, "1",
           "Scratch space for a whole MMH header and the TLV walk's results.", user=False),
    MapDef("boost_map", "array", ctypes.c_uint32, BoostInfo, "MM_BOOST_SLOTS",
           "Overrides: (level, class) -> boost leaf (valid only while the leaf exists)."),
    MapDef("stage_ovr_map", "lpm_trie", StageOvrKey, OvrInfo, "MM_MAX_STAGE_OVR",
           "Overrides: (class, sender prefix) -> boost level, hits.", no_prealloc=True),
    MapDef("flow_ovr_map", "hash", FlowKey, OvrInfo, "MM_MAX_FLOW_OVR",
           "Overrides: egress flow (5-tuple) -> class, boost level, hits."),
    MapDef("pace_map", "array", ctypes.c_uint32, PaceState, "MM_PACE_SLOTS",
           "Egress mode fq: (level, class) -> its pacer's clock (EDT; the classifier's)."),
)
MAP_NAMES: tuple[str, ...] = tuple(m.name for m in MAPS)
MAP_LAYOUTS: dict[str, tuple[CType, CType]] = {m.name: (m.key, m.value) for m in MAPS}

# direction -> program (a SCHED_CLS function in bpf/mm_tc.c, attached with clsact)
PROGRAMS: dict[str, str] = {"egress": "mm_egress", "ingress": "mm_ingress"}


def constants() -> dict[str, int]:
    """Every integer constant exported to C, as MM_<NAME> -> value."""
    out: dict[str, int] = {
        "MM_ABI_VERSION": ABI_VERSION,
        "MM_MAGIC_V1": MMH_MAGIC_V1_U32,
        "MM_MAGIC_U24": MMH_MAGIC_U24,
        "MM_VERSION": MMH_VERSION,
        "MM_PREAMBLE_LEN": MMH_PREAMBLE_LEN,
        "MM_HDR_MAX": MMH_HDR_MAX,
        "MM_MAX_TLVS": MMH_MAX_TLVS,
        "MM_MAX_PAYLOAD": MMH_MAX_PAYLOAD,
        "MM_OFF_VERSION": MMH_OFF_VERSION,
        "MM_OFF_HDR_LEN": MMH_OFF_HDR_LEN,
        "MM_OFF_MODALITY": MMH_OFF_MODALITY,
        "MM_OFF_CLASS": MMH_OFF_CLASS,
        "MM_OFF_FLAGS": MMH_OFF_FLAGS,
        "MM_OFF_PAYLOAD_LEN": MMH_OFF_PAYLOAD_LEN,
        "MM_TENSOR_MAX_DIMS": TENSOR_MAX_DIMS,
        "MM_NR_REASONS": NR_REASONS,
        "MM_DIR_EGRESS": DIR_EGRESS,
        "MM_DIR_INGRESS": DIR_INGRESS,
        "MM_NR_DIRS": NR_DIRS,
        "MM_MAX_CLASSES": MAX_CLASSES,
        "MM_MAX_MODALITIES": MAX_MODALITIES,
        "MM_MAX_RULES": MAX_RULES,
        "MM_MAX_VLAN": MAX_VLAN,
        "MM_MAX_EXTHDRS": MAX_EXTHDRS,
        "MM_DSCP_KEEP": DSCP_KEEP,
        "MM_HTB_MAJOR": HTB_MAJOR,
        "MM_NO_MODALITY": NO_MODALITY,
        "MM_CB_REASON": CB_REASON,
        "MM_CB_CLASS": CB_CLASS,
        "MM_CB_MODALITY": CB_MODALITY,
        "MM_CB_FLAGS": CB_FLAGS,
        "MM_CBF_CLAMPED": CBF_CLAMPED,
        "MM_CBF_FLOW_LEARNT": CBF_FLOW_LEARNT,
        "MM_CBF_DSCP": CBF_DSCP,
        "MM_CBF_BOOSTED": CBF_BOOSTED,
        "MM_CBF_PACED": CBF_PACED,
        "MM_CBF_OVER_HORIZON": CBF_OVER_HORIZON,
        "MM_CFG_HAS_SRC_RULES": CFG_HAS_SRC_RULES,
        "MM_CFG_STAGE_OVERRIDES": CFG_STAGE_OVERRIDES,
        "MM_CFG_FLOW_OVERRIDES": CFG_FLOW_OVERRIDES,
        "MM_CFG_PACING": CFG_PACING,
        "MM_MAX_BOOSTS": MAX_BOOSTS,
        "MM_BOOST_SLOTS": BOOST_SLOTS,
        "MM_PACE_SLOTS": PACE_SLOTS,
        "MM_PACE_DROP_NS": PACE_DROP_NS,
        "MM_NSEC_PER_SEC": NSEC_PER_SEC,
        "MM_TLV_FIXED_UNSET": 0xFF,
        "MM_SCRATCH_SIZE": MM_SCRATCH_SIZE,
    }
    for m in Modality:
        out[f"MM_MOD_{m.name}"] = int(m)
    for f in Flag:
        if f.value:
            out[f"MM_FLAG_{f.name}"] = int(f)
    for t in Tlv:
        out[f"MM_TLV_{t.name}"] = int(t)
    for k in MetaKind:
        out[f"MM_META_{k.name}"] = int(k)
    for r in Reason:
        out[f"MM_R_{r.name}"] = int(r)
    out.update(sock_constants())
    return out


# Tunables: C has #ifndef defaults equal to these; the loader passes -D flags.
TUNABLES: dict[str, int] = {
    "MM_MAX_FLOWS": DEFAULT_MAX_FLOWS,
    "MM_MAX_SRC_RULES": DEFAULT_MAX_SRC_RULES,
    "MM_MAX_STAGE_OVR": DEFAULT_MAX_STAGE_OVERRIDES,
    "MM_MAX_FLOW_OVR": DEFAULT_MAX_FLOW_OVERRIDES,
}


# --------------------------------------------------------------------------
# The socket layer (bpf/mm_sock.c, docs/socklayer.md): sockops registers mesh
# sockets in a SOCKHASH, sk_msg reads MMH frames at their boundaries, counts
# them and redirects same-node frames socket to socket.  Its maps and
# programs are a second object (SOCK_MAPS, SOCK_PROGRAMS), pinned under
# /sys/fs/bpf/mmmesh/sock/<cgroup>/, rendered into bpf/include/mm_sock_maps.h.
# --------------------------------------------------------------------------
class SockEvent(enum.IntEnum):
    """sock_stats_map.events[]: what the socket layer did (counts)."""

    REGISTERED = 0  # sockops put an established mesh socket in the sockhash
    REMOVED = 1  # a registered socket closed (registry, lane and lead claim cleared)
    SKIPPED = 2  # an established socket that is not a mesh socket (no endpoint)
    HASH_FULL = 3  # a mesh socket that did not fit the sockhash or the registry
    FRAMES = 4  # frames read at a boundary (valid MMH header)
    FRAME_BYTES = 5  # their bytes (header + payload, as the header announces)
    REDIRECTED = 6  # frames redirected into a local socket (TCP/IP bypassed)
    REDIRECTED_BYTES = 7
    PASSED = 8  # frames sent over TCP (valid header, not redirected)
    PASSED_BYTES = 9
    SPLIT_HEADER = 10  # a frame whose header is split across messages (carried over)
    MALFORMED = 11  # MMH magic but a broken header: the stream is unaligned from here
    NOT_MMH = 12  # no MMH magic at a boundary: the stream is unaligned from here
    UNALIGNED = 13  # messages passed over TCP on an unaligned stream
    UNALIGNED_BYTES = 14
    OFF = 15  # (pass reason) redirect switched off
    REMOTE = 16  # (pass reason) the peer is not a local mesh socket
    PEER_TCP = 17  # (pass reason) the peer already got TCP bytes from us (order guard)
    NOT_LEAD = 18  # (pass reason) weights set but another socket leads this group
    REDIRECT_FAILED = 19  # (pass reason) the target left the sockhash meanwhile
    LANE_MISS = 20  # a weighted pick without a usable lane: the own peer was used
    NO_STATE = 21  # a message on a socket without socket storage


SOCK_NR_EVENTS = 24  # room for a few more events without an ABI change
SOCK_MAX_REPLICAS = 8  # replicas of one stage that weights and lanes address (a power of 2)
SOCK_NR_MOD = 9  # per-socket counters for modalities 0..7; slot 8 counts every other value
SOCK_MAX_WEIGHT = 0xFFFF  # a larger weight is clamped (keeps the weighted pick in 32 bits)
SOCK_NO_PICK = 0xFF  # mm_sock_state.last_pick before any weighted pick
SOCK_CARRY_SIZE = 256  # bytes of a split header kept in socket storage (a power of 2 > MMH_HDR_MAX)
SOCK_CARRY_REDIRECT = 1  # the frame whose header is carried is redirected to carry_tgt
SOCK_CARRY_PASS = 2  # ... goes over TCP
SOCK_ROLE_CLIENT = 1  # the socket connected (its endpoint is the remote side)
SOCK_ROLE_SERVER = 2  # the socket was accepted (its endpoint is the local side)
SOCK_CFG_REGISTER = 0x1  # sockops registers new mesh sockets
SOCK_CFG_REDIRECT = 0x2  # sk_msg redirects frames to local peers (else: count, pass)
SOCK_CFG_ALL = 0x4  # every TCP socket of the cgroup is a mesh socket (no endpoint needed)
SOCK_F_SENT_TCP = 0x1  # bytes went over TCP to the peer: the peer never gets redirects
SOCK_F_LOST = 0x2  # unaligned stream (no header at a boundary): everything passes
SOCK_F_LEAD = 0x4  # this socket leads its group's lanes (weighted redirect)
DEFAULT_SOCK_MAX = 16384  # sockhash and registry size (cflag MM_SOCK_MAX)
AF_INET = 2
AF_INET6 = 10


class SockKey(ctypes.Structure):
    """sock_hash and sock_flow_map key: one socket seen from its own side.
    IPv4 and IPv4-mapped IPv6 addresses are stored IPv4-mapped with family
    AF_INET, so a dual-stack socket and its IPv4 peer have mirrored keys."""

    _fields_ = [
        ("laddr", ctypes.c_uint8 * 16),  # be
        ("raddr", ctypes.c_uint8 * 16),  # be
        ("lport", ctypes.c_uint16),
        ("rport", ctypes.c_uint16),
        ("family", ctypes.c_uint8),  # AF_INET (also IPv4-mapped) or AF_INET6
        ("pad", ctypes.c_uint8 * 3),
    ]


class SockEpKey(ctypes.Structure):
    """sock_ep_map key: a mesh endpoint; port 0 = every port of the address."""

    _fields_ = [
        ("addr", ctypes.c_uint8 * 16),  # be, IPv4-mapped for IPv4
        ("port", ctypes.c_uint16),
        ("pad", ctypes.c_uint16),
    ]


class SockEp(ctypes.Structure):
    """sock_ep_map value: which stage and replica listens there."""

    _fields_ = [("stage", ctypes.c_uint32), ("replica", ctypes.c_uint32)]


class SockWeights(ctypes.Structure):
    """sock_weight_map value (key = stage): weight per replica; 0 = none."""

    _fields_ = [("w", ctypes.c_uint32 * SOCK_MAX_REPLICAS)]


class SockGroupKey(ctypes.Structure):
    """sock_group_map key: one sender (netns + local address) towards one stage."""

    _fields_ = [
        ("netns", ctypes.c_uint64),  # bpf_get_netns_cookie()
        ("addr", ctypes.c_uint8 * 16),  # be, the sender's local address
        ("stage", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class SockGroup(ctypes.Structure):
    """sock_group_map value: the one socket that spreads the group's frames."""

    _fields_ = [("lead", ctypes.c_uint64)]  # socket cookie, 0 = unclaimed


class SockLaneKey(ctypes.Structure):
    """sock_lane_map key: a group's connection to one replica."""

    _fields_ = [
        ("group", SockGroupKey),
        ("replica", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class SockLane(ctypes.Structure):
    """sock_lane_map value: where frames for that replica go (the newest
    connection of the group to it)."""

    _fields_ = [
        ("peer", SockKey),  # the replica's socket (the redirect target)
        ("cookie", ctypes.c_uint64),  # the group's socket that connected
    ]


class SockFlow(ctypes.Structure):
    """sock_flow_map value (key SockKey): the registry user space lists."""

    _fields_ = [
        ("cookie", ctypes.c_uint64),
        ("netns", ctypes.c_uint64),
        ("established_ns", ctypes.c_uint64),  # bpf_ktime_get_ns() (CLOCK_MONOTONIC)
        ("stage", ctypes.c_uint32),  # the connection's endpoint: stage, 0 = none
        ("replica", ctypes.c_uint32),
        ("peer_stage", ctypes.c_uint32),  # the other side's stage (address-wide endpoint)
        ("role", ctypes.c_uint8),  # SOCK_ROLE_*
        ("flags", ctypes.c_uint8),  # SOCK_F_* (SENT_TCP is what the order guard reads)
        ("pad", ctypes.c_uint8 * 2),
    ]


class SockCounter(ctypes.Structure):
    _fields_ = [("frames", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


class SockState(ctypes.Structure):
    """sock_state_map value (SK_STORAGE): the socket's own state, freed with it."""

    _fields_ = [
        ("cookie", ctypes.c_uint64),  # from sockops (sk_msg cannot read it)
        ("netns", ctypes.c_uint64),
        ("stage", ctypes.c_uint32),
        ("replica", ctypes.c_uint32),
        ("peer_stage", ctypes.c_uint32),
        ("weight", ctypes.c_uint32),  # weight of the replica its last frame went to (0: none)
        ("role", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),  # SOCK_F_*
        ("last_modality", ctypes.c_uint8),
        ("last_class", ctypes.c_uint8),  # requested class byte of the last frame
        ("last_pick", ctypes.c_uint8),  # replica of the last weighted pick, SOCK_NO_PICK
        ("pad", ctypes.c_uint8 * 3),
        ("swrr", ctypes.c_int32 * SOCK_MAX_REPLICAS),  # smooth weighted round robin state
        ("redirected", ctypes.c_uint64),  # frames
        ("passed", ctypes.c_uint64),  # frames
        ("mod", SockCounter * SOCK_NR_MOD),  # per modality (8 = any other value)
        # the alignment state machine: a header split across messages is
        # carried over here until it is whole (docs/socklayer.md)
        ("carry_len", ctypes.c_uint16),  # header bytes of the frame in progress seen so far
        ("carry_mode", ctypes.c_uint8),  # SOCK_CARRY_*: where that frame's bytes go
        ("pad2", ctypes.c_uint8 * 5),
        ("carry_tgt", SockKey),  # its redirect target (the socket's own peer)
        ("carry", ctypes.c_uint8 * SOCK_CARRY_SIZE),
    ]


class SockConfig(ctypes.Structure):
    """sock_config_map value (ARRAY[1])."""

    _fields_ = [("flags", ctypes.c_uint32), ("version", ctypes.c_uint32)]  # SOCK_CFG_*


class SockStats(ctypes.Structure):
    """sock_stats_map value (PERCPU_ARRAY[1])."""

    _fields_ = [
        ("events", ctypes.c_uint64 * SOCK_NR_EVENTS),  # SockEvent
        ("mod", SockCounter * MAX_MODALITIES),  # frames per modality byte
        ("cls", SockCounter * MAX_CLASSES),  # frames per requested class (0: none or >= 64)
    ]


STRUCTS += [
    ("mm_sock_key", SockKey),
    ("mm_sock_ep_key", SockEpKey),
    ("mm_sock_ep", SockEp),
    ("mm_sock_weights", SockWeights),
    ("mm_sock_group_key", SockGroupKey),
    ("mm_sock_group", SockGroup),
    ("mm_sock_lane_key", SockLaneKey),
    ("mm_sock_lane", SockLane),
    ("mm_sock_flow", SockFlow),
    ("mm_sock_counter", SockCounter),
    ("mm_sock_state", SockState),
    ("mm_sock_config", SockConfig),
    ("mm_sock_stats", SockStats),
]

SOCK_MAPS: tuple[MapDef, ...] = (
    MapDef("sock_config_map", "array", ctypes.c_uint32, SockConfig, "1",
           "Switches: register, redirect, all sockets (written by user space)."),
    MapDef("sock_meta_map", "array", ctypes.c_uint32, Meta, "1",
           "Identifies a pinned socket layer (ABI version, build id) for adoption."),
    MapDef("sock_hash", "sockhash", SockKey, ctypes.c_uint64, "MM_SOCK_MAX",
           "The mesh sockets (value: a socket reference; user space reads its cookie)."),
    MapDef("sock_state_map", "sk_storage", ctypes.c_int, SockState, "0",
           "Per-socket state and counters, freed with the socket (key: a socket fd)."),
    MapDef("sock_flow_map", "hash", SockKey, SockFlow, "MM_SOCK_MAX",
           "Registry of the mesh sockets: identity and the order guard's flags."),
    MapDef("sock_ep_map", "hash", SockEpKey, SockEp, "MM_SOCK_MAX_ENDPOINTS",
           "Mesh endpoints: (address, port) -> stage, replica (written by user space)."),
    MapDef("sock_weight_map", "hash", ctypes.c_uint32, SockWeights, "MM_SOCK_MAX_STAGES",
           "Stage -> weight per replica (written by user space)."),
    MapDef("sock_group_map", "hash", SockGroupKey, SockGroup, "MM_SOCK_MAX_LANES",
           "Group -> its lead socket (the one writer of the group's lanes)."),
    MapDef("sock_lane_map", "hash", SockLaneKey, SockLane, "MM_SOCK_MAX_LANES",
           "(group, replica) -> the replica's socket that frames are redirected into."),
    MapDef("sock_stats_map", "percpu_array", ctypes.c_uint32, SockStats, "1",
           "Counters: events, frames per modality and per requested class."),
    # the header-reading scratch space that bpf/lib/mmh.h names: the same map
    # definition as the classifier's, a separate map in this object
    next(m for m in MAPS if m.name == "scratch_map"),
)
SOCK_MAP_NAMES: tuple[str, ...] = tuple(m.name for m in SOCK_MAPS)

# attach point -> program (bpf/mm_sock.c): sockops on a cgroup v2, sk_msg on sock_hash
SOCK_PROGRAMS: dict[str, str] = {"sockops": "mm_sockops", "sk_msg": "mm_sk_msg"}

SOCK_TUNABLES: dict[str, int] = {
    "MM_SOCK_MAX": DEFAULT_SOCK_MAX,
    "MM_SOCK_MAX_ENDPOINTS": 1024,
    "MM_SOCK_MAX_STAGES": 1024,
    "MM_SOCK_MAX_LANES": 4096,
}


_SOCK_EXPORTED = (
    "SOCK_NR_EVENTS", "SOCK_MAX_REPLICAS", "SOCK_NR_MOD", "SOCK_MAX_WEIGHT", "SOCK_NO_PICK",
    "SOCK_CARRY_SIZE", "SOCK_CARRY_REDIRECT", "SOCK_CARRY_PASS", "SOCK_ROLE_CLIENT",
    "SOCK_ROLE_SERVER", "SOCK_CFG_REGISTER", "SOCK_CFG_REDIRECT", "SOCK_CFG_ALL",
    "SOCK_F_SENT_TCP", "SOCK_F_LOST", "SOCK_F_LEAD", "AF_INET", "AF_INET6",
)


def sock_constants() -> dict[str, int]:
    """The socket layer's integer constants exported to C (part of constants()):
    MM_<name> for the names above, MM_SE_<event> for every SockEvent."""
    out: dict[str, int] = {f"MM_{n}": int(globals()[n]) for n in _SOCK_EXPORTED}
    for e in SockEvent:
        out[f"MM_SE_{e.name}"] = int(e)
    return out
