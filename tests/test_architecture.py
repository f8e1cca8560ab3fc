"""The house: one library, applications beside it (docs/architecture.md).

* docs/architecture.md names only paths that exist, and names every product
  folder;
* nothing in the library (mmmesh/) imports an application; the product never
  imports the test kit or the tests;
* no import circle among product modules;
* no product module imports another part's underscore module;
* the cores of qosd (every ``core/`` folder) import no I/O: no asyncio,
  sockets, gRPC, threads or clocks;
* the HTTP server (qosd/httpd/) knows no route; every Prometheus collector of
  qosd lives under qosd/metrics/.

Imports are read from the source (ast), top level and inside functions alike:
a lazy import is still an import."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
LIBRARY = "mmmesh"
APPS = ("qosd", "sidecar", "mmmeshctl", "demo")
PRODUCT = (LIBRARY, *APPS)
DEV_ONLY = ("testkit", "tests", "bench")
NO_IO = {"asyncio", "socket", "selectors", "ssl", "grpc", "threading", "time", "datetime",
         "concurrent", "subprocess", "multiprocessing", "http", "urllib", "httpx", "h11",
         "pyroute2", "bcc"}
COLLECTOR_PARTS = {"prometheus_client.core", "prometheus_client.metrics_core",
                   "prometheus_client.registry"}


# --------------------------------------------------------------------------
# the import graph
# --------------------------------------------------------------------------
def _modules() -> dict[str, Path]:
    out = {}
    for top in PRODUCT:
        for p in (ROOT / top).rglob("*.py"):
            if "__pycache__" in p.parts:
                continue
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = p
    return out


MODULES = _modules()


def _imports(mod: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported module or name, line) of every import in ``mod``; a
    ``from P import x`` yields ``P.x`` when that is a module, else ``P``."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            whole = True
            for a in node.names:
                if f"{target}.{a.name}" in MODULES:
                    yield f"{target}.{a.name}", node.lineno
                else:
                    whole = False
            if not whole or not node.names:
                yield target, node.lineno


def _own(name: str) -> str | None:
    """The product module ``name`` refers to (the longest module prefix)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in MODULES:
            return cand
    return None


EDGES: dict[str, set[tuple[str, int]]] = defaultdict(set)
RAW: dict[str, set[tuple[str, int]]] = defaultdict(set)
for _m, _p in MODULES.items():
    for _name, _line in _imports(_m, _p):
        RAW[_m].add((_name, _line))
        _t = _own(_name)
        if _t is not None and _t != _m:
            EDGES[_m].add((_t, _line))


def _where(mod: str, line: int) -> str:
    return f"{MODULES[mod].relative_to(ROOT)}:{line}"


def test_the_library_imports_no_application_and_nothing_imports_the_test_kit() -> None:
    bad = []
    for mod, names in RAW.items():
        for name, line in names:
            top = name.split(".")[0]
            if mod.split(".")[0] == LIBRARY and top in APPS:
                bad.append(f"{_where(mod, line)} imports {name}")
            if top in DEV_ONLY:
                bad.append(f"{_where(mod, line)} imports {name}")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_circle_among_product_modules() -> None:
    # Tarjan's strongly connected components
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _ in EDGES.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def _owner_of_private(name: str) -> str | None:
    """For ``a.b._c.d``: ``a.b`` (the package whose private module it is)."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.startswith("_") and not p.startswith("__"):
            return ".".join(parts[:i])
    return None


def test_no_product_module_imports_another_parts_private_module() -> None:
    bad = []
    for mod, targets in EDGES.items():
        for t, line in targets:
            owner = _owner_of_private(t)
            if owner is not None and not (mod == owner or mod.startswith(owner + ".")):
                bad.append(f"{_where(mod, line)} imports {t}")
    assert not bad, "\n".join(sorted(bad))


def _is_core(mod: str) -> bool:
    return mod.startswith("qosd.") and "core" in mod.split(".")


def _core_modules() -> list[str]:
    return sorted(m for m in MODULES if _is_core(m))


def test_the_cores_are_sans_io() -> None:
    cores = _core_modules()
    assert {m.rsplit(".core", 1)[0] for m in cores} == {
        "qosd.mesh.membership", "qosd.mesh.rollout", "qosd.mesh.slaview", "qosd.controller"}
    bad = []
    for mod in cores:
        for name, line in RAW[mod]:
            top = name.split(".")[0]
            if top in NO_IO:
                bad.append(f"{_where(mod, line)} imports {name}")
            t = _own(name)
            # within qosd, a core imports cores only (never its host or the daemon)
            if t is not None and t.startswith("qosd") and not _is_core(t):
                bad.append(f"{_where(mod, line)} imports {name} (not a core)")
    assert not bad, "\n".join(sorted(bad))


def test_the_http_server_knows_no_route_and_collectors_live_in_metrics() -> None:
    bad = []
    for mod, names in RAW.items():
        for name, line in names:
            if mod.startswith("qosd.httpd") and name.startswith("qosd.api"):
                bad.append(f"{_where(mod, line)}: the server imports {name}")
            if (mod.startswith("qosd.") and not mod.startswith("qosd.metrics")
                    and any(name == c or name.startswith(c + ".") for c in COLLECTOR_PARTS)):
                bad.append(f"{_where(mod, line)}: a collector outside qosd/metrics ({name})")
    assert not bad, "\n".join(sorted(bad))


# --------------------------------------------------------------------------
# docs/architecture.md: true paths, every folder named
# --------------------------------------------------------------------------
TICKED = re.compile(r"`([^`\s]+)`")
PATHISH = re.compile(r"^[A-Za-z0-9_.*-]+(/[A-Za-z0-9_.*-]*)+$")


def _doc_paths() -> list[tuple[int, str, str | None]]:
    """(line, path, the line's first existing folder) of every `a/b` in the doc."""
    out = []
    for i, line in enumerate(DOC.read_text().splitlines(), 1):
        ticks = [t for t in TICKED.findall(line) if PATHISH.match(t)]
        context = next((t for t in ticks if (ROOT / t.rstrip("/")).is_dir()), None)
        out += [(i, t, context) for t in ticks]
    return out


def _exists(path: str, context: str | None) -> bool:
    for base in (ROOT, ROOT / context if context else None):
        if base is None:
            continue
        if any(base.glob(path.rstrip("/"))) if "*" in path else (base / path.rstrip("/")).exists():
            return True
    return False


def test_every_path_the_architecture_names_exists() -> None:
    missing = [f"docs/architecture.md:{i}: {p}" for i, p, ctx in _doc_paths()
               if not _exists(p, ctx)]
    assert not missing, "\n".join(missing)
    links = re.findall(r"\]\(([^)#]+)\)", DOC.read_text())
    assert links and all((DOC.parent / link).exists() for link in links), links


def _product_folders() -> list[str]:
    dirs = set()
    for top in (*PRODUCT, "bpf", "proto"):
        for p in (ROOT / top).rglob("*"):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix in (
                    ".py", ".c", ".h", ".proto"):
                dirs.add(p.parent.relative_to(ROOT).as_posix())
    return sorted(dirs)


def test_every_product_folder_is_named() -> None:
    named: set[str] = set()
    for _, path, ctx in _doc_paths():
        p = path.rstrip("/")
        named.add(p)
        if ctx:
            named.add(f"{ctx.rstrip('/')}/{p}")
    # a folder is named by its path, or by a file in it
    covered = {d for d in _product_folders()
               if d in named or any(n.startswith(d + "/") for n in named)}
    missing = sorted(set(_product_folders()) - covered)
    assert not missing, "docs/architecture.md does not name: " + ", ".join(missing)


def test_the_sans_io_check_sees_the_cores() -> None:
    """The check above is not vacuous: it reads each core's imports."""
    cores = _core_modules()
    assert len(cores) >= 20
    assert any(RAW[m] for m in cores)
