#!/usr/bin/env python3
"""Regenerate bpf/include/mm_abi.h and mm_maps.h from mmmesh/abi.py."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mmmesh import abigen as _abigen  # noqa: E402

_abigen.write()
print(f"wrote {_abigen.HEADER_PATH}, {_abigen.MAPS_HEADER_PATH} and {_abigen.SOCK_MAPS_HEADER_PATH}")
