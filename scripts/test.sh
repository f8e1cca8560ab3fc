#!/usr/bin/env bash
# The README's test command: set up this machine (idempotent), then run the
# whole suite as root.  With CI set, privileged tests fail instead of skipping.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
./scripts/bootstrap.sh
exec .venv/bin/python -m pytest -p no:cacheprovider -q -rfEs "$@"
