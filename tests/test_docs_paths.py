"""Every repository path the docs name exists (README.md, docs/*.md and the
READMEs of the folders): a path that moved or went is a doc that lies.
``apiVersion: mmmesh/v1`` is a schema version, not a path."""

from __future__ import annotations

import re

from testkit import ROOT

TOPS = ("mmmesh", "qosd", "sidecar", "mmmeshctl", "demo", "tests", "testkit", "bench",
        "scripts", "docs", "examples", "deploy", "bpf", "proto", "vagrant")
PATH = re.compile(r"(?<![\w/.-])((?:%s)/[\w./*,-]*[\w*/])" % "|".join(TOPS))
NOT_PATHS = {"mmmesh/v1", "vagrant/pki", "vagrant/pki/"}  # the schema version; made by vagrant


def _docs() -> list[str]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted(ROOT.glob("*/README.md")), *sorted(ROOT.glob("examples/*/README.md"))]
    return [str(f.relative_to(ROOT)) for f in files]


def test_every_path_named_in_the_docs_exists() -> None:
    missing = []
    for doc in _docs():
        for i, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
            for m in PATH.finditer(line):
                p = m.group(1).rstrip(".,")
                if p in NOT_PATHS or "{" in line[m.start():m.end() + 1]:
                    continue
                if not (any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists()):
                    missing.append(f"{doc}:{i}: {p}")
    assert not missing, "\n".join(missing)


def test_the_check_reads_the_docs() -> None:
    assert len(_docs()) >= 10
    assert PATH.search("see `qosd/daemon.py` and mmmesh/wire/")
