"""Reading a policy: a strict YAML loader, :func:`parse_policy` and :func:`load_policy`.

The loader is PyYAML's safe loader (libyaml's when PyYAML was built with it)
that also refuses a key given twice in one mapping, which plain YAML would let
the later one silently win.  YAML problems become a PolicyError naming
``source:line:column``; an unreadable file, one naming the file.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from os import PathLike
from typing import Any

import yaml
from pydantic import ValidationError

from mmmesh.errors import PolicyError

from ._schema import Policy, policy_error

# libyaml's parser where PyYAML was built with it (~10x faster); same safe
# constructor either way.
_SafeBase: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _StrictLoader(_SafeBase):  # type: ignore[misc,valid-type]
    """SafeLoader that refuses duplicate mapping keys (a silent override otherwise)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Hashable] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, Hashable):
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
    mapping: dict[Any, Any] = loader.construct_mapping(node, deep=True)
    return mapping


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def _load_yaml(text: str | bytes, source: str) -> object:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        what = " ".join(x for x in (e.context, e.problem) if x) or str(e)
        raise PolicyError([(where, f"invalid YAML: {what}")]) from None
    except (yaml.YAMLError, ValueError, OverflowError, RecursionError) as e:
        raise PolicyError([(source, f"invalid YAML: {e}")]) from None


def parse_policy(
    data: str | bytes | Mapping[str, Any] | Policy, *, source: str = "<string>"
) -> Policy:
    """A validated Policy from YAML text or an already parsed mapping.

    Raises PolicyError with every problem found; ``source`` names the text in
    YAML syntax errors (``source:line:column``).
    """
    if isinstance(data, Policy):
        return data
    raw: object = _load_yaml(data, source) if isinstance(data, str | bytes) else data
    if raw is None:
        raise PolicyError([("", f"{source}: the policy is empty")])
    if not isinstance(raw, Mapping):
        raise PolicyError([("", f"a policy is a mapping of fields, got {type(raw).__name__}")])
    try:
        return Policy.model_validate(dict(raw))
    except ValidationError as e:
        raise policy_error(e) from None


def load_policy(path: str | PathLike[str]) -> Policy:
    """Read and validate a YAML policy file; PolicyError names the file on read errors."""
    name = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise PolicyError([(name, f"not UTF-8 text: {e.reason} at byte {e.start}")]) from None
    except OSError as e:
        raise PolicyError([(name, f"cannot read: {e.strerror or e}")]) from None
    return parse_policy(text, source=name)
