#!/usr/bin/env bash
# The pipeline demo (`mmmesh-demo --pipeline`) across the testbed's VMs, run
# from vagrant/ on the host once `vagrant up` is done (vagrant/README.md):
#
#   ./pipeline.sh [--rate 300mbit] [--duration 8] [--flood 0.5] [--lead 20]
#
# nodes.conf says which VM is which node of the demo (sensors, edge, core).
# 1. the demo's policy at --rate goes to every node: `mmmeshctl policy apply
#    --cluster` on the sensors VM (each qosd applies it to its private
#    interface, its mesh_link);
# 2. every VM runs its share of the pipeline (vagrant/pipeline_node.py run:
#    the demo's own processes and stage configs), all starting at the same
#    wall-clock instant, --lead seconds after now on the sensors VM;
# 3. the SLA attainment per modality (the demo's table, mesh ON column) from
#    the three VMs' results, then, once every node's windows are in it, the
#    global SLA view: `mmmeshctl cluster sla --nodes` on the sensors VM.
#
# Each command on a VM runs as root through `vagrant ssh NODE -c "sudo ..."`.
# MMMESH_NODE_EXEC=PROGRAM runs `PROGRAM NODE COMMAND...` instead (the test runs
# the VMs as network namespaces); MMMESH_VM_REPO is the checkout on the VMs
# (default /opt/mmmesh), MMMESH_VAGRANT_NODES another nodes file.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NODES_CONF="${MMMESH_VAGRANT_NODES:-$HERE/nodes.conf}"
VM_REPO="${MMMESH_VM_REPO:-/opt/mmmesh}"
PY="$VM_REPO/.venv/bin/python"
NODE_PY="$VM_REPO/vagrant/pipeline_node.py"
CTL="$VM_REPO/.venv/bin/mmmeshctl"

RATE=300mbit DURATION=8 FLOOD=0.5 LEAD=20
usage() { sed -n '2,5p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --rate) RATE="${2:?}"; shift 2 ;;
    --duration) DURATION="${2:?}"; shift 2 ;;
    --flood) FLOOD="${2:?}"; shift 2 ;;
    --lead) LEAD="${2:?}"; shift 2 ;;
    -h | --help) usage ;;
    *) echo "pipeline.sh: unknown argument $1" >&2; usage ;;
  esac
done
[[ "$LEAD" =~ ^[0-9]+$ ]] || { echo "pipeline.sh: --lead takes whole seconds" >&2; exit 2; }

say() { printf '[pipeline.sh] %s\n' "$*" >&2; }

# on_node NODE COMMAND...: COMMAND as root on NODE, stdin and stdout passed through
on_node() {
  local node="$1"
  shift
  if [ -n "${MMMESH_NODE_EXEC:-}" ]; then
    "$MMMESH_NODE_EXEC" "$node" "$@"
  else
    # -T: no tty (vagrant's default for -c is one: CRLF line ends, stdin refused)
    (cd "$HERE" && vagrant ssh "$node" -c "sudo $(printf '%q ' "$@")" -- -q -T)
  fi
}

declare -A NODE IP
while read -r name ip role; do
  NODE[$role]="$name"
  IP[$role]="$ip"
done < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$NODES_CONF")
for role in sensors edge core; do
  [ -n "${NODE[$role]:-}" ] || { echo "pipeline.sh: no $role node in $NODES_CONF" >&2; exit 2; }
done
FIRST="${NODE[sensors]}"

TMP="$(mktemp -d)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT

for role in sensors edge core; do
  synced="$(on_node "${NODE[$role]}" timedatectl show -p NTPSynchronized --value 2>/dev/null ||
    echo unknown)"
  [ "$synced" = yes ] || say "clock of ${NODE[$role]}: NTP synchronized: $synced" \
    "(latencies cross the sensors' and the core's clocks)"
done

say "policy: the demo's at $RATE, mesh-wide (mmmeshctl policy apply --cluster on $FIRST)"
on_node "$FIRST" "$PY" "$NODE_PY" apply-policy --rate "$RATE" >&2

now="$(on_node "$FIRST" date +%s)"
AT=$((now + LEAD))
say "pipeline: ${NODE[sensors]} (sensors) -> ${NODE[edge]} (edge) -> ${NODE[core]} (core)," \
  "starting at $AT (in $LEAD s on $FIRST's clock), $DURATION s, flood ${FLOOD}x $RATE"
ARGS=(--at "$AT" --rate "$RATE" --duration "$DURATION" --flood "$FLOOD"
  --sensors "${IP[sensors]}" --edge "${IP[edge]}" --core "${IP[core]}")
for role in core edge sensors; do
  on_node "${NODE[$role]}" "$PY" "$NODE_PY" run --role "$role" "${ARGS[@]}" \
    >"$TMP/$role.json" </dev/null &
  PIDS+=("$!")
done
failed=0
for p in "${PIDS[@]}"; do wait "$p" || failed=1; done
PIDS=()
if [ "$failed" != 0 ]; then
  echo "pipeline.sh: a node's run failed (its messages are above)" >&2
  exit 1
fi

echo
cat "$TMP/sensors.json" "$TMP/edge.json" "$TMP/core.json" |
  on_node "$FIRST" "$PY" "$NODE_PY" report --rate "$RATE" --duration "$DURATION" --flood "$FLOOD"
echo
echo "== mmmeshctl cluster sla --nodes (on $FIRST)"
on_node "$FIRST" "$CTL" cluster sla --nodes
