"""The one source of truth for everything the BPF C code and Python share.

Constants (wire format numbers, map sizes, reason codes) and the layouts of map
keys and values are defined here, once.  ``scripts/gen_abi.py`` renders them as
``bpf/include/mm_abi.h``; ``tests/test_abi.py`` fails if the checked-in header
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
ABI_VERSION = 2

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
CB_FLAGS = 3  # bit0 clamped, bit1 flow learnt/updated, bit2 dscp rewritten
CBF_CLAMPED = 0x1
CBF_FLOW_LEARNT = 0x2
CBF_DSCP = 0x4

CFG_HAS_SRC_RULES = 0x1


# --------------------------------------------------------------------------
# Map layouts (host order unless marked be)
# --------------------------------------------------------------------------
class ClassInfo(ctypes.Structure):
    """class_map value (ARRAY[MAX_CLASSES], key = class id)."""

    _fields_ = [
        ("classid", ctypes.c_uint32),  # HTB handle written to skb->priority
        ("valid", ctypes.c_uint8),
        ("rank", ctypes.c_uint8),  # 0 = most privileged
        ("dscp", ctypes.c_uint8),  # 0..63 or DSCP_KEEP
        ("pad", ctypes.c_uint8),
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
        ("pad", ctypes.c_uint8 * 5),
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
    ("mm_tlv_out", TlvOut),
    ("mm_scratch", Scratch),
]

# --------------------------------------------------------------------------
# Maps and programs: the one list.  scripts/gen_abi.py renders the map
# declarations (bpf/include/mm_maps.h) and the program prototypes from it;
# the loader pins exactly these names and user space opens them by them.
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class MapDef:
    """One BPF map of the classifier."""

    name: str  # the C name, the pin name under /sys/fs/bpf/mmmesh/<dev>/
    kind: str  # "array" | "percpu_array" | "hash" | "lru_hash" | "lpm_trie"
    key: type[ctypes.c_uint32] | type[ctypes.Structure]
    value: type[ctypes.Structure]
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
)
MAP_NAMES: tuple[str, ...] = tuple(m.name for m in MAPS)
MAP_LAYOUTS: dict[str, tuple[type[ctypes.c_uint32] | type[ctypes.Structure],
                             type[ctypes.Structure]]] = {m.name: (m.key, m.value) for m in MAPS}

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
        "MM_CFG_HAS_SRC_RULES": CFG_HAS_SRC_RULES,
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
    return out


# Tunables: C has #ifndef defaults equal to these; the loader passes -D flags.
TUNABLES: dict[str, int] = {
    "MM_MAX_FLOWS": DEFAULT_MAX_FLOWS,
    "MM_MAX_SRC_RULES": DEFAULT_MAX_SRC_RULES,
}
