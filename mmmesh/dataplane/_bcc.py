"""Compiling and loading the BPF programs: the only module that imports bcc.

bcc's rewriter turns ``map.lookup(&k)`` into map-fd calls only in the file it
is given, not in headers it includes, so the quoted ``#include "..."`` lines
of an entry file are inlined here before the text goes to bcc (system
``<...>`` includes are left to clang).  Two objects (``LAYERS``): the TC
classifier (``bpf/mm_tc.c``) and the socket layer (``bpf/mm_sock.c``,
docs/socklayer.md).  See docs/dataplane.md.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from mmmesh.abi import (
    MAP_NAMES,
    PROGRAMS,
    SOCK_MAP_NAMES,
    SOCK_PROGRAMS,
    SOCK_TUNABLES,
    TUNABLES,
)
from mmmesh.errors import DataplaneError, NotSupportedError

BPF_DIR = Path(__file__).resolve().parent.parent.parent / "bpf"
"""The checkout's bpf/ (a source tree or an editable install)."""
MAIN_SOURCE = BPF_DIR / "mm_tc.c"
INSTALLED_SUBDIR = Path("share") / "mmmesh" / "bpf"
"""Where a wheel puts the sources, under the install's data prefix (pyproject.toml,
``[tool.setuptools.data-files]``): a venv's ``<venv>/share/mmmesh/bpf``."""
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


@dataclass(frozen=True)
class Layer:
    """One BPF object: its entry file, programs (function -> bcc program
    type), maps and tunables."""

    source: str
    programs: dict[str, str]
    maps: tuple[str, ...]
    tunables: dict[str, int]


LAYERS: dict[str, Layer] = {
    "tc": Layer("mm_tc.c", {p: "SCHED_CLS" for p in PROGRAMS.values()}, MAP_NAMES, TUNABLES),
    "sock": Layer("mm_sock.c", {SOCK_PROGRAMS["sockops"]: "SOCK_OPS",
                                SOCK_PROGRAMS["sk_msg"]: "SK_MSG"}, SOCK_MAP_NAMES, SOCK_TUNABLES),
}


def installed_bpf_dirs() -> tuple[Path, ...]:
    """Where an installed wheel's BPF sources can be: the data prefix of this
    interpreter's install scheme (a venv: ``<venv>/share/mmmesh/bpf``), then
    ``sys.prefix`` and the base prefix (``pip install --prefix``, a system install)."""
    seen: list[Path] = []
    for base in (sysconfig.get_path("data"), sys.prefix, sys.base_prefix):
        if base:
            cand = Path(base) / INSTALLED_SUBDIR
            if cand not in seen:
                seen.append(cand)
    return tuple(seen)


def bpf_dir() -> Path:
    """The BPF source tree bcc compiles: ``MMMESH_BPF_DIR`` if set, else the
    checkout's ``bpf/`` beside the package (a source tree, an editable
    install), else the sources an installed wheel carries (installed_bpf_dirs)."""
    env = os.environ.get("MMMESH_BPF_DIR")
    if env:
        return Path(env)
    if (BPF_DIR / "mm_tc.c").is_file():
        return BPF_DIR
    for cand in installed_bpf_dirs():
        if (cand / "mm_tc.c").is_file():
            return cand
    return BPF_DIR  # nothing found: the error names the checkout's path


def inline_source(path: Path, search: tuple[Path, ...] = (), _seen: set[Path] | None = None) -> str:
    """Returns ``path`` with its quoted includes inlined, each file once."""
    seen = set() if _seen is None else _seen
    path = path.resolve()
    seen.add(path)
    dirs = (path.parent, *search)
    out: list[str] = [f'#line 1 "{path}"']
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = _INCLUDE.match(line)
        if not m:
            out.append(line)
            continue
        for d in dirs:
            cand = (d / m.group(1)).resolve()
            if cand.is_file():
                break
        else:
            raise DataplaneError(2, f"{path}:{n}: include {m.group(1)!r} not found")
        if cand not in seen:
            out.append(inline_source(cand, search, seen))
            out.append(f'#line {n + 1} "{path}"')
    return "\n".join(out)


def cflags_for(tunables: dict[str, int] | None = None, extra: list[str] | None = None,
               layer: str = "tc") -> list[str]:
    vals = dict(LAYERS[layer].tunables)
    vals.update(tunables or {})
    flags = [f"-D{k}={int(v)}" for k, v in sorted(vals.items())]
    flags.append("-Wno-unused-function")
    return flags + list(extra or [])


def build_id(tunables: dict[str, int] | None = None, extra: list[str] | None = None,
             layer: str = "tc") -> int:
    """A 64-bit id of what would be compiled: the inlined source and the
    cflags.  Stamped into meta_map; a pinned dataplane with another build id
    is replaced, so fixed BPF code or new tunables always get loaded."""
    import hashlib

    root = bpf_dir()
    text = inline_source(root / LAYERS[layer].source, (root, root / "include"))
    h = hashlib.sha256(text.encode())
    h.update("\0".join(cflags_for(tunables, extra, layer)).encode())
    return int.from_bytes(h.digest()[:8], "little")


@dataclass
class LoadedObject:
    """Program and map fds of one freshly loaded copy (owned: close() them)."""

    prog_fds: dict[str, int] = field(default_factory=dict)
    map_fds: dict[str, int] = field(default_factory=dict)

    def close(self) -> None:
        for fd in [*self.prog_fds.values(), *self.map_fds.values()]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.prog_fds.clear()
        self.map_fds.clear()


def compile_and_load(
    tunables: dict[str, int] | None = None, extra_cflags: list[str] | None = None,
    layer: str = "tc",
) -> LoadedObject:
    """Compiles a layer's entry file (bpf/mm_tc.c: both TC programs;
    bpf/mm_sock.c: sockops and sk_msg) with bcc, loads its programs into the
    kernel and returns duplicated fds, so bcc's object (and its memory) can go."""
    try:
        import bcc  # noqa: PLC0415 - the one place bcc is imported
    except ImportError as e:  # pragma: no cover - set-up problem
        raise NotSupportedError(
            "bcc is not importable: run scripts/bootstrap.sh (python3-bpfcc in a "
            "--system-site-packages venv)"
        ) from e
    root = bpf_dir()
    spec = LAYERS[layer]
    text = inline_source(root / spec.source, (root, root / "include"))
    try:
        b = bcc.BPF(text=text.encode(), cflags=cflags_for(tunables, extra_cflags, layer))
    except Exception as e:  # bcc raises bare Exception on compile errors
        raise DataplaneError(22, f"BPF compile failed: {e}") from e
    obj = LoadedObject()
    try:
        for name, prog_type in spec.programs.items():
            try:
                fn = b.load_func(name.encode(), getattr(bcc.BPF, prog_type))
            except Exception as e:
                raise DataplaneError(22, f"BPF verifier rejected {name}: {e}") from e
            obj.prog_fds[name] = os.dup(fn.fd)
        for name in spec.maps:
            fd = bcc.libbcc.lib.bpf_table_fd(b.module, name.encode())
            if fd < 0:
                raise DataplaneError(2, f"map {name} missing from the compiled object")
            obj.map_fds[name] = os.dup(fd)
    except BaseException:
        obj.close()
        raise
    finally:
        b.cleanup()
    return obj


def compile_and_pin(directory: str, tunables: dict[str, int] | None = None,
                    extra_cflags: list[str] | None = None, layer: str = "tc") -> None:
    """Compiles, loads and pins programs and maps under ``directory``."""
    from . import _bpf  # noqa: PLC0415

    obj = compile_and_load(tunables, extra_cflags, layer)
    try:
        os.makedirs(directory, exist_ok=True)
        for name, fd in [*obj.map_fds.items(), *obj.prog_fds.items()]:
            _bpf.obj_pin(fd, os.path.join(directory, name))
    finally:
        obj.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m mmmesh.dataplane._bcc DIR [-D NAME=VALUE]...``: compile and
    pin in a short-lived process, so that the long-running caller (qosd)
    never carries bcc and clang in its memory."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m mmmesh.dataplane._bcc")
    ap.add_argument("pin_dir")
    ap.add_argument("-D", dest="tunables", action="append", default=[],
                    help="tunable NAME=VALUE (see mmmesh/abi.py TUNABLES)")
    ap.add_argument("--layer", choices=sorted(LAYERS), default="tc",
                    help="which object: the TC classifier or the socket layer")
    a = ap.parse_args(argv)
    tun: dict[str, int] = {}
    for t in a.tunables:
        k, _, v = t.partition("=")
        tun[k] = int(v, 0)
    try:
        compile_and_pin(a.pin_dir, tun, layer=a.layer)
    except DataplaneError as e:
        print(f"mmmesh: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
