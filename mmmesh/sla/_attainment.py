"""Attainment: the one definition, for one window and for windows merged.

A window's **attainment** is the share of its frames that were within their
deadline: delivered, and not past it.  A frame without a deadline is within
it; a dropped frame never is, whatever dropped it (it did not arrive, which
is what docs/policy.md's objective counts).  1.0 for a window without
frames.  The sidecar measures it frame by frame (``sidecar/sla/windows.py``,
the only place that sees each frame, and so the only one that can tell a
frame dropped on time from one that was late) and reports it with the
window, to 6 places (``SlaWindow.attainment``).

**Windows merge** by adding up what attainment is made of: the frames within
their deadline (``attainment x frames`` of each window, :func:`within_deadline`)
over all the frames (:func:`attainment`), i.e. frame-weighted.  Every merge
uses that sum: the replicas of a stage and the stages of a class on qosd's
board (``sketch.merge``), and the nodes of the global SLA view
(``qosd/mesh/slaview``, whose digests carry per node the frames *not* within
their deadline, ``frames - within``, in their ``misses`` field).

Why not ``1 - deadline_misses / frames`` of the counts: ``deadline_misses``
counts the late frames only.  A frame a full queue dropped before its
deadline is no miss, yet it did not arrive within its deadline either, so
``1 - misses / frames`` says 1.0 for a window that lost frames to overload
while the sidecar's own attainment says what arrived.  The two agree when
no frame is dropped on time.
"""

from __future__ import annotations

__all__ = ["ATTAINMENT_DIGITS", "attainment", "within_deadline"]

ATTAINMENT_DIGITS = 6
"""Places an attainment is reported to (a report's, a merged row's)."""


def attainment(frames: float, within: float, *, digits: int | None = ATTAINMENT_DIGITS) -> float:
    """``within / frames``: the attainment of ``frames`` of which ``within``
    were within their deadline (1.0 without frames), rounded to ``digits``
    places (None: not rounded)."""
    if frames <= 0:
        return 1.0
    a = within / frames
    return a if digits is None else round(a, digits)


def within_deadline(frames: int, stated: float | None, misses: int = 0) -> float:
    """The frames of one window within their deadline: ``stated x frames``,
    ``stated`` the window's attainment (``ValueError`` unless within 0..1).  A
    window that states none (not one the report schema accepts: it requires
    one) is taken at its counts, ``frames - misses``."""
    if stated is None:
        return float(frames - misses)
    a = float(stated)
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"attainment {stated!r} is not within 0..1")
    return a * frames
