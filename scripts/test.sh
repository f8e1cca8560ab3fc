#!/usr/bin/env bash
# The README's test command: set up this machine (idempotent), then run the
# whole suite as root (re-run through sudo when started as another user).
# Run as root, tests that need BPF, qdiscs or namespaces fail instead of
# skipping when they cannot run (testkit/privileged.py), CI set or not.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/as-root.sh" "$0" "$@"
cd "$ROOT"
./scripts/bootstrap.sh test
exec .venv/bin/python -m pytest -p no:cacheprovider -q -rfEs "$@"
