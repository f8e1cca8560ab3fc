"""How an output with several replicas spreads frames over its lanes.

``Swrr`` is the smooth weighted round robin (nginx's) of the socket layer's
weighted pick (``mm_sock_swrr`` in ``bpf/lib/sock_msg.h``), in user space:
per frame every lane with a weight gains its weight, the one ahead (the
first of equals) is picked and loses the total.  Over any window of
sum-of-weights frames every lane gets exactly its share, and the sequence of
picks is the kernel's for the same weights, so an output spreads the same
way whether the sidecar or the kernel does it (``spread: user`` or
``kernel``, docs/sidecar.md "Replicas and lanes").

One addition the kernel does not need: a lane that is down is left out of
the pick as if its weight were 0 (its running state reset, as the kernel
resets a replica whose weight is 0), so its share goes to the others by
their weights until it is back.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmmesh.abi import SOCK_MAX_WEIGHT

__all__ = ["Swrr"]


class Swrr:
    """Smooth weighted round robin over ``len(weights)`` lanes."""

    __slots__ = ("cur", "weights")

    def __init__(self, weights: Sequence[int]) -> None:
        self.weights = [min(max(int(w), 0), SOCK_MAX_WEIGHT) for w in weights]
        self.cur = [0] * len(self.weights)

    def pick(self, usable: Sequence[bool] | None = None) -> int | None:
        """The next lane, among the ``usable`` ones (all when None); None when
        no usable lane has a weight."""
        cur = self.cur
        total = 0
        best = -1
        for i, w in enumerate(self.weights):
            if not w or (usable is not None and not usable[i]):
                cur[i] = 0
                continue
            cur[i] += w
            total += w
            if best < 0 or cur[i] > cur[best]:
                best = i
        if best < 0:
            return None
        cur[best] -= total
        return best
