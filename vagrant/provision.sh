#!/usr/bin/env bash
# Provisions one testbed VM as a mesh node (vagrant/README.md).  The
# Vagrantfile runs it as root on every `vagrant up` / `vagrant provision`;
# running it again changes nothing that is already right (idempotent).
#
#   provision.sh NODE          NODE: a name in nodes.conf (node1, node2, node3)
#
# 1. qosd installed as an operator would: deploy/install-node.sh with the
#    artifacts the host built (vagrant/artifacts.sh: the mmmesh wheel and its
#    dependencies, installed with pip --no-index into /opt/mmmesh/.venv; the
#    unit the wheel carries; the sidecar image, podman load); NTP from the host
#    (chrony, MMMESH_NTP_SERVER); etcd-server on the etcd node with
#    MMMESH_STORE=etcd (in the box already; apt otherwise);
# 2. this node's certificates, copied from vagrant/pki (made once on the host
#    by the Vagrantfile: vagrant/pki.rb) to /etc/mmmesh/peers (and
#    /etc/mmmesh/etcd, /etc/mmmesh/etcd-server with etcd);
# 3. /etc/mmmesh/qosd.yaml: node_name NODE, uplink = the interface holding
#    NODE's private address, peers listening and advertised on that address,
#    seeds = the other nodes, metrics on the private address (the host's
#    Prometheus scrapes it); with etcd, the cluster section for the etcd
#    back end instead (node1's etcd over mutual TLS; qosd takes one or the other);
# 4. etcd on the etcd node (with MMMESH_STORE=etcd): /etc/default/etcd for a
#    one-member cluster over TLS on the private address, the packaged unit;
# 5. the unit (installed in 1), under emulation with a drop-in that gives the
#    start the minutes bcc needs there, checked with `systemd-analyze verify`,
#    enabled and (re)started when something changed; waits until qosd answers
#    and prints the members it sees.
#
# Environment:
#   MMMESH_STORE        gossip (default) | etcd
#   MMMESH_LINK_RATE    mesh_link.rate (e.g. 1gbit); empty: a mesh-wide policy's own rate
#   MMMESH_PUSH_PULL_S  peers' push-pull interval (default 5 s; qosd's default is 30 s)
#   MMMESH_PROTOCOL     more membership timers, YAML flow-mapping items (default: none;
#                       under emulation "probe_interval_s: 2.0, probe_timeout_s: 1.5, ...")
#   MMMESH_ETCD_MEMBERS 1 (default: etcd on the first node) | 3 (a member on each of the
#                       first three: a quorum that outlives one VM)
#   MMMESH_ARTIFACTS    the artifacts (default /opt/mmmesh-artifacts: wheelhouse/, images/)
#   MMMESH_NTP_SERVER   the VMs' NTP server (the Vagrantfile: the host, x.y.z.1); empty: none
#   MMMESH_QOSD_WAIT_S  how long to wait for qosd to answer (default 90, 1200 under emulation)
#   MMMESH_ROOT         a directory standing for / (tests): every file goes under it and
#                       every path in the written configs points under it; no install,
#                       no packages, no systemctl (the unit is only verified), and the
#                       configs still name real paths a qosd started by hand can use
#   MMMESH_VAGRANT_NODES, MMMESH_PKI_DIR   other nodes file / certificate directory
#   MMMESH_SKIP_BOOTSTRAP=1   skip step 1 (the machine is already set up)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)" # a checkout (tests), or the testbed's copy in a VM
NODE="${1:?usage: provision.sh NODE (a name in nodes.conf)}"
ROOT="${MMMESH_ROOT:-/}"
ROOT="${ROOT%/}" # "" for the real root: "$ROOT/etc" is then "/etc"
NODES_CONF="${MMMESH_VAGRANT_NODES:-$HERE/nodes.conf}"
PKI="${MMMESH_PKI_DIR:-$HERE/pki}"
STORE="${MMMESH_STORE:-gossip}"
LINK_RATE="${MMMESH_LINK_RATE:-}"
PUSH_PULL_S="${MMMESH_PUSH_PULL_S:-5}"
ARTIFACTS="${MMMESH_ARTIFACTS:-/opt/mmmesh-artifacts}"
NTP_SERVER="${MMMESH_NTP_SERVER:-}"
PEER_PORT=7946
API_PORT=8470
ETCD_CLIENT_PORT=2379
ETCD_PEER_PORT=2380
ETCD_PREFIX=/mmmesh/
ETCD_MEMBERS="${MMMESH_ETCD_MEMBERS:-1}"
case "$ETCD_MEMBERS" in 1 | 3) ;; *) echo "MMMESH_ETCD_MEMBERS must be 1 or 3" >&2; exit 1 ;; esac
INSTALLED_VENV=/opt/mmmesh/.venv # what qosd/qosd.service runs (ExecStart)
EMULATED=0 # a TCG guest: everything is many times slower (vagrant/box/README.md)
if [ -z "${MMMESH_ROOT:-}" ] && [ "$(systemd-detect-virt 2>/dev/null || true)" = qemu ]; then
  EMULATED=1
fi
# The membership's timers beyond push-pull (qosd.mesh.membership.core.Config): the
# LAN defaults (probe 1 s, timeout 0.5 s, suspicion 4) unless emulated, where a
# guest that the host starves for a second misses probes and live members are
# declared dead (docs/nodes.md, "Membership timers under emulation"): then
# probes every 2 s with 1.5 s to answer and suspicion 6 (at 3 nodes 12-72 s).
PROTOCOL="${MMMESH_PROTOCOL-}"
if [ -z "${MMMESH_PROTOCOL+set}" ] && [ "$EMULATED" = 1 ]; then
  PROTOCOL="probe_interval_s: 2.0, probe_timeout_s: 1.5, indirect_nack_s: 1.2, suspicion_mult: 6"
fi

log() { printf '[provision %s] %s\n' "$NODE" "$*" >&2; }
die() { printf '[provision %s] error: %s\n' "$NODE" "$*" >&2; exit 1; }
real_root() { [ -z "$ROOT" ]; }

case "$STORE" in
  gossip | etcd) ;;
  *) die "MMMESH_STORE must be gossip or etcd, not '$STORE'" ;;
esac
[ "$(id -u)" -eq 0 ] || die "run as root (vagrant runs provisioners as root)"

# --- the nodes -------------------------------------------------------------
IP=""
SEEDS=()
ETCD_NODES=() ETCD_ENDPOINTS=() ETCD_CLUSTER=() # the etcd members (MMMESH_ETCD_MEMBERS)
i=0
while read -r name ip _role; do
  if [ "$i" -lt "$ETCD_MEMBERS" ]; then
    ETCD_NODES+=("$name")
    ETCD_ENDPOINTS+=("\"$ip:$ETCD_CLIENT_PORT\"")
    ETCD_CLUSTER+=("$name=https://$ip:$ETCD_PEER_PORT")
  fi
  i=$((i + 1))
  if [ "$name" = "$NODE" ]; then IP="$ip"; else SEEDS+=("$ip:$PEER_PORT"); fi
done < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$NODES_CONF")
[ -n "$IP" ] || die "$NODE is not in $NODES_CONF"
[ "${#ETCD_NODES[@]}" -eq "$ETCD_MEMBERS" ] || die "MMMESH_ETCD_MEMBERS=$ETCD_MEMBERS: $NODES_CONF has ${#ETCD_NODES[@]} nodes"
ETCD_HERE=0 # this node runs an etcd member
for n in "${ETCD_NODES[@]}"; do [ "$n" != "$NODE" ] || ETCD_HERE=1; done
log "address $IP, store $STORE, seeds ${SEEDS[*]:-none}"

CHANGED=0 # something qosd reads changed: restart it
# put SRC DEST MODE: install a file if its content or mode differs
put() {
  if [ -f "$2" ] && cmp -s "$1" "$2" && [ "$(stat -c %a "$2")" = "$3" ]; then return 1; fi
  install -D -m "$3" "$1" "$2"
  log "wrote ${2}"
}
put_qosd() { if put "$@"; then CHANGED=1; fi; }
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
TMP_NTP="$TMP/ntp"

# --- 1. the install (and NTP, etcd) -------------------------------------------------
VENV="$INSTALLED_VENV"
real_root || VENV="$REPO/.venv" # tests: the checkout's venv stands for the installed one
WHEEL_BEFORE="$(cat "$VENV/.mmmesh-wheel" 2>/dev/null || true)"
# the unit and its drop-ins as one digest (none yet: the digest of nothing)
unit_digest() { { cat "$ROOT/etc/systemd/system/qosd.service" "$ROOT"/etc/systemd/system/qosd.service.d/*.conf 2>/dev/null || true; } | sha256sum; }
UNIT_BEFORE="$(unit_digest)"
if real_root && [ "${MMMESH_SKIP_BOOTSTRAP:-0}" != 1 ]; then
  [ -d "$ARTIFACTS/wheelhouse" ] || die "$ARTIFACTS/wheelhouse is missing (vagrant/artifacts.sh \
on the host; the Vagrantfile syncs it)"
  images=()
  if command -v podman >/dev/null && [ -d "$ARTIFACTS/images" ]; then images=(--images "$ARTIFACTS/images"); fi
  log "deploy/install-node.sh: mmmesh[qosd,ctl,demo] from $ARTIFACTS/wheelhouse${images:+, images}"
  "$REPO/deploy/install-node.sh" --wheelhouse "$ARTIFACTS/wheelhouse" --extras qosd,ctl,demo "${images[@]}"
  # NTP: the pipeline's latencies cross the VMs' clocks (sensors -> core), and an
  # emulated guest's clock drifts: chrony, polling the host every few seconds
  if [ -n "$NTP_SERVER" ] && [ -d /etc/chrony ]; then
    printf '# vagrant/provision.sh: the host, polled every 1-4 s\nserver %s iburst minpoll 0 maxpoll 2\n' \
      "$NTP_SERVER" >"$TMP_NTP"
    printf '# vagrant/provision.sh: step whenever the clock is 10 ms off\nmakestep 0.01 -1\n' >"$TMP_NTP.conf"
    ntp_changed=0
    if put "$TMP_NTP" /etc/chrony/sources.d/mmmesh.sources 644; then ntp_changed=1; fi
    if put "$TMP_NTP.conf" /etc/chrony/conf.d/mmmesh.conf 644; then ntp_changed=1; fi
    if [ "$ntp_changed" = 1 ] || ! systemctl is-active --quiet chrony.service; then
      systemctl restart chrony.service
    fi
  elif ! systemctl is-active --quiet systemd-timesyncd.service &&
    ! systemctl is-active --quiet chrony.service; then
    log "warning: no NTP client runs (the pipeline's cross-VM latencies need one)"
  fi
  if [ "$STORE" = etcd ] && [ "$ETCD_HERE" = 1 ] && ! command -v etcd >/dev/null; then
    log "installing etcd-server"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      etcd-server >/dev/null
  fi
fi
[ -x "$VENV/bin/qosd" ] || die "$VENV/bin/qosd is missing (the install, step 1)"
WHEEL_AFTER="$(cat "$VENV/.mmmesh-wheel" 2>/dev/null || true)"

# --- the private network's interface ------------------------------------------
UPLINK="${MMMESH_UPLINK:-}"
if [ -z "$UPLINK" ]; then
  UPLINK="$(ip -o -4 addr show |
    awk -v ip="$IP" '{split($4, a, "/"); if (a[1] == ip) {print $2; exit}}')"
fi
[ -n "$UPLINK" ] || die "no interface holds $IP (the private network of the Vagrantfile)"
log "uplink $UPLINK"

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
API_TOKEN=""
if [ -f "$PKI/api-token" ]; then
  put_qosd "$PKI/api-token" "$ROOT/etc/mmmesh/api-token" 600
  API_TOKEN="$ROOT/etc/mmmesh/api-token"
fi
if [ "$STORE" = etcd ]; then
  install -d -m 0700 "$ROOT/etc/mmmesh/etcd"
  put_qosd "$PKI/etcd/ca.pem" "$ROOT/etc/mmmesh/etcd/ca.pem" 644
  put_qosd "$PKI/etcd/$NODE-client.pem" "$ROOT/etc/mmmesh/etcd/client.pem" 644
  put_qosd "$PKI/etcd/$NODE-client.key" "$ROOT/etc/mmmesh/etcd/client.key" 600
fi

[ "$WHEEL_BEFORE" = "$WHEEL_AFTER" ] || CHANGED=1 # another qosd was installed

# --- 3. qosd.yaml -------------------------------------------------------------
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
  # the host's Prometheus scrapes the private address (docs/operations.md, "Metrics")
  echo "metrics_addr: $IP:9464"
  if [ -n "$API_TOKEN" ]; then # the admin API from the host: mmmeshctl --server ... --token
    echo "api_tcp: $IP:$API_PORT"
    echo "api_token_file: $API_TOKEN"
  fi
  # the model pod's sidecar (podman: a uid in a libpod cgroup, not a kubelet pod;
  # vagrant/README.md, "The model pod") may report its own stage
  echo "sla_reporters:"
  echo "  - {uid: 0, stages: ['*']}"
  echo "  - {unit: 'mmmesh-sidecar@*.service', stages: ['{instance}']}"
  echo "  - {pod: '*', stages: ['*']}"
  echo "  - {uid: 10001, cgroup: '/machine.slice/machine-libpod_pod_*', stages: [vision-encoder]}"
  if [ "$STORE" = gossip ]; then
    echo "peers:"
    echo "  listen: $IP:$PEER_PORT"
    echo "  advertise: $IP:$PEER_PORT"
    echo "  seeds: [${seeds_yaml%, }]"
    echo "  cert_file: $ROOT/etc/mmmesh/peers/node.pem"
    echo "  key_file: $ROOT/etc/mmmesh/peers/node.key"
    echo "  ca_file: $ROOT/etc/mmmesh/peers/ca.pem"
    echo "  protocol: {push_pull_interval_s: $PUSH_PULL_S${PROTOCOL:+, $PROTOCOL}}"
  else # the etcd back end replaces the peers' mesh (qosd refuses both)
    echo "cluster:"
    echo "  backend: etcd"
    echo "  etcd:"
    endpoints="$(IFS=,; echo "${ETCD_ENDPOINTS[*]}")"
    echo "    endpoints: [${endpoints//,/, }]"
    echo "    cert_file: $ROOT/etc/mmmesh/etcd/client.pem"
    echo "    key_file: $ROOT/etc/mmmesh/etcd/client.key"
    echo "    ca_file: $ROOT/etc/mmmesh/etcd/ca.pem"
    echo "    prefix: $ETCD_PREFIX"
    echo "    advertise: \"$IP\"" # shown in the members table
  fi
} >"$TMP/qosd.yaml"
put_qosd "$TMP/qosd.yaml" "$ROOT/etc/mmmesh/qosd.yaml" 644

# --- 4. etcd (one member on the first node, or one on each of the first three) -------
ETCD_CHANGED=0
if [ "$STORE" = etcd ] && [ "$ETCD_HERE" = 1 ]; then
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
# /etc/default/etcd of $NODE, written by vagrant/provision.sh: a member of a
# $ETCD_MEMBERS-member etcd for qosd's etcd back end, mutual TLS for clients and peers.
ETCD_NAME=$NODE
ETCD_DATA_DIR=$ROOT/var/lib/etcd/mmmesh
ETCD_LISTEN_CLIENT_URLS=https://$IP:$ETCD_CLIENT_PORT,https://127.0.0.1:$ETCD_CLIENT_PORT
ETCD_ADVERTISE_CLIENT_URLS=https://$IP:$ETCD_CLIENT_PORT
ETCD_LISTEN_PEER_URLS=$peer
ETCD_INITIAL_ADVERTISE_PEER_URLS=$peer
ETCD_INITIAL_CLUSTER=$(IFS=,; echo "${ETCD_CLUSTER[*]}")
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
if ! real_root; then
  # tests: the checkout's unit (install-node.sh installs the wheel's copy in a VM)
  put_qosd "$REPO/qosd/qosd.service" "$UNIT" 644
fi
[ -f "$UNIT" ] || die "$UNIT is missing (deploy/install-node.sh installs it from the wheel)"
if [ "$EMULATED" = 1 ]; then
  # bcc compiles each program in tens of seconds under TCG (vagrant/box/README.md):
  # a cold start takes minutes, past the unit's TimeoutStartSec=90s
  printf '%s\n' "# vagrant/provision.sh: an emulated (TCG) guest: compiling takes minutes" \
    "[Service]" "TimeoutStartSec=20min" >"$TMP/dropin.conf"
  put_qosd "$TMP/dropin.conf" "$ROOT/etc/systemd/system/qosd.service.d/50-emulated.conf" 644
fi
# systemd-analyze verify checks that ExecStart's program exists: the installed
# /opt/mmmesh/.venv/bin/qosd; under MMMESH_ROOT a copy run from this checkout
# instead (as tests/system/qosd/test_unit_hardening.py does).  In a VM only when the
# unit or its drop-in changed (it takes a minute under emulation).
UNIT_AFTER="$(unit_digest)"
verify_unit="$UNIT"
if ! real_root; then
  mkdir -p "$TMP/unit"
  sed "s#$INSTALLED_VENV/bin/qosd#$VENV/bin/qosd#" "$UNIT" >"$TMP/unit/qosd.service"
  verify_unit="$TMP/unit/qosd.service"
fi
if ! real_root || [ "$UNIT_BEFORE" != "$UNIT_AFTER" ]; then
  said="$(cd "$(dirname "$verify_unit")" &&
    systemd-analyze verify "$(basename "$verify_unit")" 2>&1)" ||
    die "systemd-analyze verify failed: $said"
  if grep -q "qosd.service" <<<"$said"; then die "systemd-analyze verify: $said"; fi
  log "systemd-analyze verify: qosd.service is fine"
fi

if ! real_root; then
  # what the unit's StateDirectory= and RuntimeDirectory= would make
  install -d -m 0700 "$ROOT/var/lib/mmmesh"
  install -d -m 0755 "$ROOT/run/mmmesh"
  log "MMMESH_ROOT=$ROOT: configuration written; systemd left alone (start qosd by hand:"
  log "  $VENV/bin/qosd --config $ROOT/etc/mmmesh/qosd.yaml)"
  exit 0
fi

# --- start (real root only) -----------------------------------------------------------
systemctl daemon-reload
if [ "$STORE" = etcd ] && [ "$ETCD_HERE" = 1 ]; then
  systemctl enable etcd.service >/dev/null 2>&1
  if [ "$ETCD_CHANGED" = 1 ] || ! systemctl is-active --quiet etcd.service; then
    log "(re)starting etcd"
    # --no-block: a member of three is ready only with a quorum, which the
    # nodes provisioned after this one bring (vagrant provision goes one by one)
    systemctl restart --no-block etcd.service
  fi
  ed="/etc/mmmesh/etcd-server"
  etcd_wait=30
  [ "$EMULATED" = 0 ] || etcd_wait=300
  [ "$ETCD_MEMBERS" = 1 ] || etcd_wait=5 # the others may not be up yet
  t0=$SECONDS
  until ETCDCTL_API=3 etcdctl --endpoints "https://$IP:$ETCD_CLIENT_PORT" --cacert "$ed/ca.pem" \
    --cert /etc/mmmesh/etcd/client.pem --key /etc/mmmesh/etcd/client.key \
    endpoint health >/dev/null 2>&1; do
    [ $((SECONDS - t0)) -lt "$etcd_wait" ] || { log "etcd not healthy within $etcd_wait s (a quorum needs the other members: qosd waits for it)"; break; }
    sleep 1
  done
  [ $((SECONDS - t0)) -ge "$etcd_wait" ] || log "etcd healthy at https://$IP:$ETCD_CLIENT_PORT"
elif systemctl is-enabled --quiet etcd.service 2>/dev/null; then
  log "gossip: etcd off"
  systemctl disable --now etcd.service >/dev/null 2>&1 || true
fi
systemctl enable qosd.service >/dev/null 2>&1
if [ "$CHANGED" = 1 ] || ! systemctl is-active --quiet qosd.service; then
  log "(re)starting qosd"
  systemctl restart qosd.service
else
  log "qosd already running with this configuration"
fi
WAIT_S="${MMMESH_QOSD_WAIT_S:-}"
[ -n "$WAIT_S" ] || { [ "$EMULATED" = 1 ] && WAIT_S=1200 || WAIT_S=90; }
CTL=("$VENV/bin/mmmeshctl" --timeout 10)
t0=$SECONDS
while [ $((SECONDS - t0)) -lt "$WAIT_S" ]; do
  if "${CTL[@]}" status >/dev/null 2>&1; then
    log "qosd answers ($((SECONDS - t0)) s); the members it sees:"
    "${CTL[@]}" cluster members || true
    exit 0
  fi
  if systemctl is-failed --quiet qosd.service; then break; fi
  sleep 2
done
systemctl status --no-pager qosd.service >&2 || true
die "qosd did not answer within $WAIT_S s (journalctl -u qosd)"
