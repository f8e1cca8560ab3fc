"""Rate-limited logging: at most one line per cause per interval, and a count
of the lines held back.

A flood of bad connections must not turn into a flood of log lines (a local
process once made qosd write ~250k lines, ~100 MB, in 20 s).  Two ways in,
one rule (:class:`RateLimiter`):

    RateLimitedLog   for code that knows its causes (the API server's
                     per-connection errors): ``.log(level, cause, msg, *args)``
    RateLimitFilter  on the daemon's log handlers, for everything else: the
                     cause is the call site (file, line, level)

The first line of a cause goes out; the next ones within ``interval_s`` are
counted, not written.  The next line of that cause after the interval carries
the count ("... (and 2,341 more like this in the last 10 s)"); :meth:`flush`
(called every interval by the owner) writes the count of a burst that ended
without a further line.  Records written by a :class:`RateLimitedLog` are
marked so that a :class:`RateLimitFilter` lets them through unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

__all__ = [
    "DEFAULT_INTERVAL_S",
    "RateLimitFilter",
    "RateLimitedLog",
    "RateLimiter",
    "install_rate_limit",
]

DEFAULT_INTERVAL_S = 10.0
MAX_CAUSES = 1024  # causes remembered; the oldest is forgotten past this
_MARK = "mmmesh_rate_limited"  # record attribute: already limited, let it through
_DECIDED = "mmmesh_rate_decision"  # record attribute: a filter's answer, for its other handlers
_LABEL_CHARS = 200


@dataclass
class _Slot:
    last_out: float  # when a line of this cause last went out
    held: int  # lines held back since then
    level: int
    logger: str
    label: str  # the last held-back line, shortened (for the summary)


@dataclass(frozen=True)
class Held:
    """A cause's lines held back: how many, over how long, and the last one."""

    count: int
    seconds: float
    level: int
    logger: str
    label: str

    def suffix(self) -> str:
        return f" (and {self.count:,} more like this in the last {self.seconds:.0f} s)"


class RateLimiter:
    """Per cause: lets one line out per ``interval_s``, counts the rest.

    Thread-safe.  Remembers at most ``max_causes`` causes (the oldest is
    forgotten, with its count)."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, *,
                 clock: Callable[[], float] = time.monotonic,
                 max_causes: int = MAX_CAUSES) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.interval_s = interval_s
        self._clock = clock
        self._max = max_causes
        self._slots: dict[Hashable, _Slot] = {}
        self._lock = threading.Lock()

    def admit(self, cause: Hashable, *, level: int = logging.WARNING, logger: str = "",
              label: str = "") -> Held | None:
        """None: hold this line back (it is counted).  Otherwise let it out;
        the :class:`Held` says how many were held back before it (count 0: none)."""
        now = self._clock()
        with self._lock:
            slot = self._slots.pop(cause, None)  # re-inserted last: the dict stays oldest-first
            if slot is not None and now - slot.last_out < self.interval_s:
                slot.held += 1
                slot.label = label[:_LABEL_CHARS]
                self._slots[cause] = slot
                return None
            held = Held(slot.held if slot else 0, now - slot.last_out if slot else 0.0,
                        level, logger, label)
            self._slots[cause] = _Slot(now, 0, level, logger, "")
            while len(self._slots) > self._max:
                del self._slots[next(iter(self._slots))]
            return held

    def due(self) -> list[Held]:
        """The counts of bursts whose interval has passed without a further line
        going out; each is reset (its summary counts as that interval's line)."""
        now = self._clock()
        out: list[Held] = []
        with self._lock:
            for slot in self._slots.values():
                if slot.held and now - slot.last_out >= self.interval_s:
                    out.append(Held(slot.held, now - slot.last_out, slot.level, slot.logger,
                                    slot.label))
                    slot.held, slot.last_out = 0, now
        return out


def _summarize(held: list[Held]) -> None:
    for h in held:
        logging.getLogger(h.logger).log(
            h.level, "%s more like this in the last %.0f s: %s", f"{h.count:,}", h.seconds,
            h.label, extra={_MARK: True})


class RateLimitedLog:
    """A logger whose lines are limited per named cause (see the module doc)."""

    def __init__(self, logger: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.limiter = RateLimiter(interval_s, clock=clock)

    def log(self, level: int, cause: Hashable, msg: str, *args: object,
            exc_info: BaseException | bool | None = None) -> bool:
        """Writes ``msg % args`` unless ``cause`` had its line this interval;
        True when it was written."""
        if not self.logger.isEnabledFor(level):
            return False
        text = msg % args if args else msg
        held = self.limiter.admit(cause, level=level, logger=self.logger.name, label=text)
        if held is None:
            return False
        if held.count:
            text += held.suffix()
        self.logger.log(level, "%s", text, exc_info=exc_info, extra={_MARK: True})
        return True

    def flush(self) -> None:
        """Writes the counts of ended bursts (call it every interval)."""
        _summarize(self.limiter.due())


class RateLimitFilter(logging.Filter):
    """A handler filter: records at ``min_level`` or above are limited per call
    site (file, line, level); lower ones, and records already limited by a
    :class:`RateLimitedLog`, pass unchanged."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, *,
                 min_level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.limiter = RateLimiter(interval_s, clock=clock)
        self.min_level = min_level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.min_level or getattr(record, _MARK, False):
            return True
        decided = getattr(record, _DECIDED, None)
        if decided is not None:  # another handler with this filter saw it first
            return bool(decided)
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: let logging report it
            return True
        held = self.limiter.admit((record.pathname, record.lineno, record.levelno),
                                  level=record.levelno, logger=record.name, label=text)
        if held is not None and held.count:
            record.msg, record.args = text + held.suffix(), None
        setattr(record, _DECIDED, held is not None)
        return held is not None

    def flush(self) -> None:
        """Writes the counts of ended bursts (call it every interval)."""
        _summarize(self.limiter.due())


def install_rate_limit(interval_s: float = DEFAULT_INTERVAL_S,
                       logger: logging.Logger | None = None) -> RateLimitFilter:
    """Adds one :class:`RateLimitFilter` to every handler of ``logger`` (default:
    the root logger) and returns it; call its ``flush()`` every interval."""
    target = logger if logger is not None else logging.getLogger()
    flt = RateLimitFilter(interval_s)
    for handler in target.handlers:
        handler.addFilter(flt)
    return flt
