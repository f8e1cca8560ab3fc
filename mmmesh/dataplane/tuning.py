"""Knobs for experiments: the HTB bucket time and the leaf queue length that
``Dataplane.up`` and ``set_overrides`` compile into the HTB tree, changed for
a block of calls in this process (``bench/qos.py --htb-burst-us``,
``--matrix``).  The product's values are the defaults; qosd never changes them.

    with htb_tuning(burst_us=0, leaf_limit=1000):   # the kernel's ~1 MTU buckets
        dp.up(policy)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from . import _compile

__all__ = ["DEFAULT_HTB_BURST_US", "DEFAULT_LEAF_LIMIT", "htb_tuning"]

DEFAULT_HTB_BURST_US = _compile.HTB_BURST_US
"""Microseconds of traffic the link class's buckets and the leaves' ceil
buckets hold (docs/dataplane.md, "HTB buckets of 1 ms"); 0: the kernel's."""
DEFAULT_LEAF_LIMIT = _compile.LEAF_LIMIT
"""Packets a leaf's queue (fq_codel, else pfifo) holds."""


@contextmanager
def htb_tuning(*, burst_us: int | None = None, leaf_limit: int | None = None) -> Iterator[None]:
    """Inside the block, policies compile with ``burst_us`` and ``leaf_limit``
    (None: unchanged); the previous values come back after it, also on error."""
    if burst_us is not None and burst_us < 0:
        raise ValueError("burst_us must be >= 0")
    if leaf_limit is not None and not 1 <= leaf_limit <= 100_000:
        raise ValueError("leaf_limit must be within 1..100000")
    saved = _compile.HTB_BURST_US, _compile.LEAF_LIMIT
    if burst_us is not None:
        _compile.HTB_BURST_US = burst_us
    if leaf_limit is not None:
        _compile.LEAF_LIMIT = leaf_limit
    try:
        yield
    finally:
        _compile.HTB_BURST_US, _compile.LEAF_LIMIT = saved
