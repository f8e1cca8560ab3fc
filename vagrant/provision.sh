#!/usr/bin/env bash
# Provisions one testbed VM as a mesh node (vagrant/README.md).  The
# Vagrantfile runs it as root on every `vagrant up` / `vagrant provision`;
# running it again changes nothing that is already right (idempotent).
#
#   provision.sh NODE          NODE: a name in nodes.conf (node1, node2, node3)
#
# 1. the project's own set-up: scripts/bootstrap.sh (packages, kernel headers,
#    bpffs, /opt/mmmesh/.venv); NTP (systemd-timesyncd) unless chrony or it
#    runs; with MMMESH_STORE=etcd, Debian's etcd-server on the etcd node (the
#    first in nodes.conf);
# 2. this node's certificates, copied from vagrant/pki (made once on the host
#    by the Vagrantfile: vagrant/pki.rb) to /etc/mmmesh/peers (and
#    /etc/mmmesh/etcd, /etc/mmmesh/etcd-server with etcd);
# 3. /etc/mmmesh/qosd.yaml: node_name NODE, uplink = the interface holding
#    NODE's private address, peers listening and advertised on that address,
#    seeds = the other nodes; with etcd, the cluster section for the etcd
#    back end instead (node1's etcd over mutual TLS; qosd takes one or the other);
# 4. etcd on the etcd node (with MMMESH_STORE=etcd): /etc/default/etcd for a
#    one-member cluster over TLS on the private address, the packaged unit;
# 5. qosd/qosd.service installed to /etc/systemd/system, checked with
#    `systemd-analyze verify`, enabled and (re)started when something
#    changed; waits until qosd answers and prints the members it sees.
#
# Environment:
#   MMMESH_STORE        gossip (default) | etcd
#   MMMESH_LINK_RATE    mesh_link.rate (e.g. 1gbit); empty: a mesh-wide policy's own rate
#   MMMESH_PUSH_PULL_S  peers' push-pull interval (default 5 s; qosd's default is 30 s)
#   MMMESH_ROOT         a directory standing for / (tests): every file goes under it and
#                       every path in the written configs points under it; no bootstrap,
#                       no packages, no systemctl (the unit is only verified), and the
#                       configs still name real paths a qosd started by hand can use
#   MMMESH_VAGRANT_NODES, MMMESH_PKI_DIR   other nodes file / certificate directory
#   MMMESH_SKIP_BOOTSTRAP=1   skip step 1 (the machine is already set up)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
NODE="${1:?usage: provision.sh NODE (a name in nodes.conf)}"
ROOT="${MMMESH_ROOT:-/}"
ROOT="${ROOT%/}" # "" for the real root: "$ROOT/etc" is then "/etc"
NODES_CONF="${MMMESH_VAGRANT_NODES:-$HERE/nodes.conf}"
PKI="${MMMESH_PKI_DIR:-$HERE/pki}"
STORE="${MMMESH_STORE:-gossip}"
LINK_RATE="${MMMESH_LINK_RATE:-}"
PUSH_PULL_S="${MMMESH_PUSH_PULL_S:-5}"
PEER_PORT=7946
ETCD_CLIENT_PORT=2379
ETCD_PEER_PORT=2380
ETCD_PREFIX=/mmmesh/
INSTALLED_REPO=/opt/mmmesh # what qosd/qosd.service runs from

log() { printf '[provision %s] %s\n' "$NODE" "$*" >&2; }
die() { printf '[provision %s] error: %s\n' "$NODE" "$*" >&2; exit 1; }
real_root() { [ -z "$ROOT" ]; }

case "$STORE" in
  gossip | etcd) ;;
  *) die "MMMESH_STORE must be gossip or etcd, not '$STORE'" ;;
esac
[ "$(id -u)" -eq 0 ] || die "run as root (vagrant runs provisioners as root)"

# --- the nodes -------------------------------------------------------------
IP="" ETCD_NODE="" ETCD_IP=""
SEEDS=()
while read -r name ip _role; do
  [ -n "$ETCD_NODE" ] || { ETCD_NODE="$name"; ETCD_IP="$ip"; }
  if [ "$name" = "$NODE" ]; then IP="$ip"; else SEEDS+=("$ip:$PEER_PORT"); fi
done < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$NODES_CONF")
[ -n "$IP" ] || die "$NODE is not in $NODES_CONF"
log "address $IP, store $STORE, seeds ${SEEDS[*]:-none}"

# --- 1. the project's bootstrap (and etcd) -----------------------------------
if real_root && [ "${MMMESH_SKIP_BOOTSTRAP:-0}" != 1 ]; then
  log "scripts/bootstrap.sh (packages, kernel headers, bpffs, .venv)"
  "$REPO/scripts/bootstrap.sh"
  # the pipeline's latencies cross the VMs' clocks (sensors -> core): keep them in step
  if ! systemctl is-active --quiet systemd-timesyncd.service &&
    ! systemctl is-active --quiet chrony.service; then
    log "installing systemd-timesyncd (NTP)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      systemd-timesyncd >/dev/null
    systemctl enable --now systemd-timesyncd.service
  fi
  if [ "$STORE" = etcd ] && [ "$NODE" = "$ETCD_NODE" ] && ! command -v etcd >/dev/null; then
    log "installing etcd-server"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      etcd-server >/dev/null
  fi
fi
[ -x "$REPO/.venv/bin/qosd" ] || die "$REPO/.venv/bin/qosd is missing: run scripts/bootstrap.sh"

# --- the private network's interface ------------------------------------------
UPLINK="${MMMESH_UPLINK:-}"
if [ -z "$UPLINK" ]; then
  UPLINK="$(ip -o -4 addr show |
    awk -v ip="$IP" '{split($4, a, "/"); if (a[1] == ip) {print $2; exit}}')"
fi
[ -n "$UPLINK" ] || die "no interface holds $IP (the private network of the Vagrantfile)"
log "uplink $UPLINK"

CHANGED=0 # something qosd reads changed: restart it
# put SRC DEST MODE: install a file if its content or mode differs
put() {
  if [ -f "$2" ] && cmp -s "$1" "$2" && [ "$(stat -c %a "$2")" = "$3" ]; then return 1; fi
  install -D -m "$3" "$1" "$2"
  log "wrote ${2}"
}
put_qosd() { if put "$@"; then CHANGED=1; fi; }

# --- 2. certificates --------------------------------------------------------
for f in ca.pem "$NODE.pem" "$NODE.key"; do
  [ -f "$PKI/$f" ] || die "$PKI/$f is missing: the Vagrantfile makes $PKI on the host before \
the VMs boot (vagrant provision; by hand: ruby vagrant/pki.rb vagrant/pki vagrant/nodes.conf)"
done
install -d -m 0755 "$ROOT/etc/mmmesh"
install -d -m 0700 "$ROOT/etc/mmmesh/peers"
put_qosd "$PKI/ca.pem" "$ROOT/etc/mmmesh/peers/ca.pem" 644
put_qosd "$PKI/$NODE.pem" "$ROOT/etc/mmmesh/peers/node.pem" 644
put_qosd "$PKI/$NODE.key" "$ROOT/etc/mmmesh/peers/node.key" 600
if [ "$STORE" = etcd ]; then
  install -d -m 0700 "$ROOT/etc/mmmesh/etcd"
  put_qosd "$PKI/etcd/ca.pem" "$ROOT/etc/mmmesh/etcd/ca.pem" 644
  put_qosd "$PKI/etcd/$NODE-client.pem" "$ROOT/etc/mmmesh/etcd/client.pem" 644
  put_qosd "$PKI/etcd/$NODE-client.key" "$ROOT/etc/mmmesh/etcd/client.key" 600
fi

# --- 3. qosd.yaml -------------------------------------------------------------
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
seeds_yaml="$(printf '"%s", ' "${SEEDS[@]}")"
{
  echo "# /etc/mmmesh/qosd.yaml of $NODE, written by vagrant/provision.sh: edit"
  echo "# vagrant/provision.sh or nodes.conf instead (the next provision rewrites this)."
  echo "node_name: $NODE"
  echo "uplinks: [$UPLINK]"
  echo "mesh_link: {device: $UPLINK${LINK_RATE:+, rate: $LINK_RATE}}"
  echo "state_dir: $ROOT/var/lib/mmmesh"
  echo "api_socket: $ROOT/run/mmmesh/qosd.sock"
  echo "sla_socket: $ROOT/run/mmmesh/sla.sock"
  echo "metrics_addr: 127.0.0.1:9464"
  if [ "$STORE" = gossip ]; then
    echo "peers:"
    echo "  listen: $IP:$PEER_PORT"
    echo "  advertise: $IP:$PEER_PORT"
    echo "  seeds: [${seeds_yaml%, }]"
    echo "  cert_file: $ROOT/etc/mmmesh/peers/node.pem"
    echo "  key_file: $ROOT/etc/mmmesh/peers/node.key"
    echo "  ca_file: $ROOT/etc/mmmesh/peers/ca.pem"
    echo "  protocol: {push_pull_interval_s: $PUSH_PULL_S}"
  else # the etcd back end replaces the peers' mesh (qosd refuses both)
    echo "cluster:"
    echo "  backend: etcd"
    echo "  etcd:"
    echo "    endpoints: [\"$ETCD_IP:$ETCD_CLIENT_PORT\"]"
    echo "    cert_file: $ROOT/etc/mmmesh/etcd/client.pem"
    echo "    key_file: $ROOT/etc/mmmesh/etcd/client.key"
    echo "    ca_file: $ROOT/etc/mmmesh/etcd/ca.pem"
    echo "    prefix: $ETCD_PREFIX"
    echo "    advertise: \"$IP\"" # shown in the members table
  fi
} >"$TMP/qosd.yaml"
put_qosd "$TMP/qosd.yaml" "$ROOT/etc/mmmesh/qosd.yaml" 644

# --- 4. etcd (one member, on the etcd node) -------------------------------------
ETCD_CHANGED=0
if [ "$STORE" = etcd ] && [ "$NODE" = "$ETCD_NODE" ]; then
  for f in ca.pem "$NODE-server.pem" "$NODE-server.key"; do
    [ -f "$PKI/etcd/$f" ] || die "$PKI/etcd/$f is missing (see vagrant/pki.rb)"
  done
  ed="$ROOT/etc/mmmesh/etcd-server"
  install -d -m 0750 "$ed"
  if put "$PKI/etcd/ca.pem" "$ed/ca.pem" 644; then ETCD_CHANGED=1; fi
  if put "$PKI/etcd/$NODE-server.pem" "$ed/server.pem" 644; then ETCD_CHANGED=1; fi
  if put "$PKI/etcd/$NODE-server.key" "$ed/server.key" 600; then ETCD_CHANGED=1; fi
  install -d -m 0700 "$ROOT/var/lib/etcd/mmmesh"
  if id etcd >/dev/null 2>&1; then # the packaged unit runs etcd as user etcd
    chown root:etcd "$ed"
    chown etcd:etcd "$ed/server.key" "$ROOT/var/lib/etcd/mmmesh"
  fi
  peer="https://$IP:$ETCD_PEER_PORT"
  cat >"$TMP/etcd" <<EOF
# /etc/default/etcd of $NODE, written by vagrant/provision.sh: a one-member
# etcd for qosd's etcd back end, mutual TLS for clients and peers.
ETCD_NAME=$NODE
ETCD_DATA_DIR=$ROOT/var/lib/etcd/mmmesh
ETCD_LISTEN_CLIENT_URLS=https://$IP:$ETCD_CLIENT_PORT,https://127.0.0.1:$ETCD_CLIENT_PORT
ETCD_ADVERTISE_CLIENT_URLS=https://$IP:$ETCD_CLIENT_PORT
ETCD_LISTEN_PEER_URLS=$peer
ETCD_INITIAL_ADVERTISE_PEER_URLS=$peer
ETCD_INITIAL_CLUSTER=$NODE=$peer
ETCD_INITIAL_CLUSTER_STATE=new
ETCD_INITIAL_CLUSTER_TOKEN=mmmesh-vagrant
ETCD_CERT_FILE=$ed/server.pem
ETCD_KEY_FILE=$ed/server.key
ETCD_TRUSTED_CA_FILE=$ed/ca.pem
ETCD_CLIENT_CERT_AUTH=true
ETCD_PEER_CERT_FILE=$ed/server.pem
ETCD_PEER_KEY_FILE=$ed/server.key
ETCD_PEER_TRUSTED_CA_FILE=$ed/ca.pem
ETCD_PEER_CLIENT_CERT_AUTH=true
# every node rewrites its SLA key every sla_period_s: keep 10 minutes of history
# (docs/operations.md "etcd"; etcd 3.4 keeps everything by default)
ETCD_AUTO_COMPACTION_MODE=periodic
ETCD_AUTO_COMPACTION_RETENTION=10m
EOF
  if put "$TMP/etcd" "$ROOT/etc/default/etcd" 644; then ETCD_CHANGED=1; fi
fi

# --- 5. the systemd unit ---------------------------------------------------------
UNIT="$ROOT/etc/systemd/system/qosd.service"
put_qosd "$REPO/qosd/qosd.service" "$UNIT" 644
# systemd-analyze verify checks that ExecStart's program exists.  Installed,
# that is /opt/mmmesh/.venv/bin/qosd; under MMMESH_ROOT it checks a copy run
# from this checkout instead (as tests/system/qosd/test_unit_hardening.py does).
verify_unit="$UNIT"
if ! real_root || [ "$REPO" != "$INSTALLED_REPO" ]; then
  if real_root; then # a checkout elsewhere: /opt/mmmesh -> it (docs/operations.md)
    [ -e "$INSTALLED_REPO" ] || ln -sfn "$REPO" "$INSTALLED_REPO"
  fi
  mkdir -p "$TMP/unit"
  sed "s#$INSTALLED_REPO/.venv/bin/qosd#$REPO/.venv/bin/qosd#" "$UNIT" >"$TMP/unit/qosd.service"
  verify_unit="$TMP/unit/qosd.service"
fi
said="$(cd "$(dirname "$verify_unit")" &&
  systemd-analyze verify "$(basename "$verify_unit")" 2>&1)" ||
  die "systemd-analyze verify failed: $said"
if grep -q "qosd.service" <<<"$said"; then die "systemd-analyze verify: $said"; fi
log "systemd-analyze verify: qosd.service is fine"

if ! real_root; then
  # what the unit's StateDirectory= and RuntimeDirectory= would make
  install -d -m 0700 "$ROOT/var/lib/mmmesh"
  install -d -m 0755 "$ROOT/run/mmmesh"
  log "MMMESH_ROOT=$ROOT: configuration written; systemd left alone (start qosd by hand:"
  log "  $REPO/.venv/bin/qosd --config $ROOT/etc/mmmesh/qosd.yaml)"
  exit 0
fi

# --- start (real root only) -----------------------------------------------------------
systemctl daemon-reload
if [ "$STORE" = etcd ] && [ "$NODE" = "$ETCD_NODE" ]; then
  systemctl enable etcd.service >/dev/null 2>&1
  if [ "$ETCD_CHANGED" = 1 ] || ! systemctl is-active --quiet etcd.service; then
    log "(re)starting etcd"
    systemctl restart etcd.service
  fi
  ed="/etc/mmmesh/etcd-server"
  for _ in $(seq 1 30); do
    if ETCDCTL_API=3 etcdctl --endpoints "https://$IP:$ETCD_CLIENT_PORT" --cacert "$ed/ca.pem" \
      --cert /etc/mmmesh/etcd/client.pem --key /etc/mmmesh/etcd/client.key \
      endpoint health >/dev/null 2>&1; then
      log "etcd healthy at https://$IP:$ETCD_CLIENT_PORT"
      break
    fi
    sleep 1
  done
fi
systemctl enable qosd.service >/dev/null 2>&1
if [ "$CHANGED" = 1 ] || ! systemctl is-active --quiet qosd.service; then
  log "(re)starting qosd"
  systemctl restart qosd.service
else
  log "qosd already running with this configuration"
fi
CTL=("$REPO/.venv/bin/mmmeshctl" --timeout 5)
for _ in $(seq 1 90); do
  if "${CTL[@]}" status >/dev/null 2>&1; then
    log "qosd answers; the members it sees:"
    "${CTL[@]}" cluster members || true
    exit 0
  fi
  sleep 1
done
systemctl status --no-pager qosd.service >&2 || true
die "qosd did not answer within 90 s (journalctl -u qosd)"
