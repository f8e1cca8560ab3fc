#!/usr/bin/env bash
# One command to see the point: set the machine up (idempotent, as root), then
# run the multi-node QoS demo in network namespaces:
#   scripts/demo.sh [--rate 300mbit] [--duration 8] [--policy FILE] [--out out/demo] [--json]
# Prints a table (voice / video / LiDAR latency and loss, mesh off vs on) and
# writes out/demo/results.json and out/demo/latency.png.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/as-root.sh" "$0" "$@"
cd "$ROOT"
scripts/bootstrap.sh demo
exec .venv/bin/mmmesh-demo "$@"
