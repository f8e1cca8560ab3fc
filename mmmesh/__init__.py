"""mmmesh: an eBPF multimodal service-mesh dataplane.

The public names, importable from ``mmmesh`` directly (loaded on first use,
so ``import mmmesh`` stays cheap for the CLIs)::

    wire format   Header, TensorSpec, encode_header, decode_header, decode_frame,
                  frame, FrameReader, parse_modality, Modality, Flag, Tlv, DType
    policy        Policy, load_policy, parse_policy
    dataplane     Dataplane
    SLA reports   SlaReport
    errors        MeshError, WireError, PolicyError, DataplaneError, NotSupportedError

The modules behind them: ``mmmesh.wire``, ``mmmesh.policy``,
``mmmesh.dataplane``, ``mmmesh.sla.report``; ``mmmesh.errors`` documents the
error tree.
"""

from __future__ import annotations

import importlib
from typing import Any

from mmmesh.errors import DataplaneError, MeshError, NotSupportedError, PolicyError, WireError

# name -> module that defines it (imported when the name is first used)
_LAZY: dict[str, str] = {
    "Header": "mmmesh.wire",
    "TensorSpec": "mmmesh.wire",
    "encode_header": "mmmesh.wire",
    "decode_header": "mmmesh.wire",
    "decode_frame": "mmmesh.wire",
    "frame": "mmmesh.wire",
    "FrameReader": "mmmesh.wire",
    "parse_modality": "mmmesh.wire",
    "Modality": "mmmesh.abi",
    "Flag": "mmmesh.abi",
    "Tlv": "mmmesh.abi",
    "DType": "mmmesh.abi",
    "Policy": "mmmesh.policy",
    "load_policy": "mmmesh.policy",
    "parse_policy": "mmmesh.policy",
    "Dataplane": "mmmesh.dataplane",
    "SlaReport": "mmmesh.sla.report",
}

__all__ = [
    "DType",
    "Dataplane",
    "DataplaneError",
    "Flag",
    "FrameReader",
    "Header",
    "MeshError",
    "Modality",
    "NotSupportedError",
    "Policy",
    "PolicyError",
    "SlaReport",
    "TensorSpec",
    "Tlv",
    "WireError",
    "decode_frame",
    "decode_header",
    "encode_header",
    "frame",
    "load_policy",
    "parse_modality",
    "parse_policy",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mmmesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
