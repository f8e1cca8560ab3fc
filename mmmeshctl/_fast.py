"""Option values without pydantic: typer's click classes with a faster coercion.

typer coerces option values with pydantic TypeAdapters, and importing pydantic
costs ~65 ms of every ``mmmeshctl`` run.  ``FastCommand`` / ``FastGroup`` give
the plain str/int/float/bool/Enum options a pydantic-free path for
well-formed values; everything else goes to typer's own coercion (and its
error messages).  tests/mmmeshctl/test_ctl.py checks that both paths agree on every
sample value and that commands run without importing pydantic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

from typer.core import TyperCommand, TyperGroup

__all__ = ["FastCommand", "FastGroup", "FastRuntimeParam", "fast_params"]

_SLOW = object()  # "ask typer": the fast path does not decide this value


def _fast_coercer(descriptor: Any) -> Callable[[Any, Any], Any] | None:
    """A pydantic-free coercion for the values of one option, or None.

    It returns exactly what typer's TypeAdapter would for the values it
    accepts (str as is, ASCII decimal ints and floats within min/max, bools,
    Enum members by their exact value) and ``_SLOW`` for anything else, which
    then goes to typer's own coercion: same results, same error messages.
    """
    ann = descriptor.annotation
    info = descriptor.parameter_info
    if (descriptor.file_annotation is not None or getattr(info, "parser", None) is not None
            or getattr(info, "click_type", None) is not None or getattr(info, "clamp", False)):
        return None
    lo, hi = getattr(info, "min", None), getattr(info, "max", None)
    if ann in (int, float):
        return _number_coercer(ann, lo, hi)
    if lo is not None or hi is not None:
        return None
    if ann in (str, bool):
        return lambda v, ctx: v if isinstance(v, ann) else _SLOW
    if (isinstance(ann, type) and issubclass(ann, Enum)
            and getattr(info, "case_sensitive", False)):
        return _enum_coercer(ann)
    return None


def _number_coercer(kind: type[int | float], lo: float | None,
                    hi: float | None) -> Callable[[Any, Any], Any]:
    """int: optional sign and ASCII digits; float: the same with at most one '.'."""
    def to_number(v: Any, ctx: Any) -> Any:
        if isinstance(v, str):
            digits = v[1:] if v[:1] in ("+", "-") else v
            if kind is float:
                digits = digits.replace(".", "", 1)
            if not (digits.isascii() and digits.isdigit()):
                return _SLOW
            v = kind(v)
        elif type(v) is not kind:
            return _SLOW
        return v if (lo is None or v >= lo) and (hi is None or v <= hi) else _SLOW
    return to_number


def _enum_coercer(ann: type[Enum]) -> Callable[[Any, Any], Any] | None:
    """Members by their exact string value (None when a value is not a string)."""
    by_value: dict[str, Enum] = {}
    for member in ann:
        if not isinstance(member.value, str):
            return None
        by_value.setdefault(member.value, member)

    def to_member(v: Any, ctx: Any) -> Any:
        if isinstance(v, ann):
            return v
        if isinstance(v, str) and getattr(ctx, "token_normalize_func", None) is None:
            return by_value.get(v, _SLOW)
        return _SLOW
    return to_member


class FastRuntimeParam:
    """Stands in for typer's RuntimeParam of one single-valued option."""

    def __init__(self, descriptor: Any, fast: Callable[[Any, Any], Any],
                 build: Callable[[Any], Any]) -> None:
        self._descriptor, self._fast, self._build = descriptor, fast, build
        self._slow: Any = None

    def coerce(self, value: Any, param: Any, ctx: Any) -> Any:
        if value is None:
            return None
        out = self._fast(value, ctx)
        if out is not _SLOW:
            return out
        if self._slow is None:
            self._slow = self._build(self._descriptor)  # typer's pydantic coercion
        return self._slow.coerce(value, param=param, ctx=ctx)


def fast_params(params: Sequence[Any]) -> None:
    """Gives the params whose values _fast_coercer handles the pydantic-free path.

    Uses typer internals (``typer._coercion``, ``type_descriptor``, the lazily
    built ``_runtime_param``); with a typer that does not have them
    (pyproject.toml allows typer>=0.12, older than ``typer._coercion``),
    nothing changes but the start-up time.
    """
    try:
        from typer._coercion import build_runtime_param
    except ImportError:  # pragma: no cover - a typer before 0.29's typer._coercion
        return
    for p in params:
        desc = getattr(p, "type_descriptor", None)
        if (desc is None or getattr(p, "_runtime_param", False) is not None
                or getattr(p, "multiple", True) or getattr(p, "nargs", 0) != 1):
            continue
        fast = _fast_coercer(desc)
        if fast is not None:
            p._runtime_param = FastRuntimeParam(desc, fast, build_runtime_param)


# typer appends its --install/--show-completion after making the group, and
# --help is made per context: the params get the fast path when parsing starts.
class FastCommand(TyperCommand):
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        fast_params(self.get_params(ctx))
        return super().parse_args(ctx, args)


class FastGroup(TyperGroup):
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        fast_params(self.get_params(ctx))
        return super().parse_args(ctx, args)
