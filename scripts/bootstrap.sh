#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian 12 / Ubuntu 22.04+ machine, run as root.
#
#   scripts/bootstrap.sh demo    what the demo needs (scripts/demo.sh)
#   scripts/bootstrap.sh test    all of that, and what the tests need (scripts/test.sh;
#                                the default)
#
# demo: Debian's bcc (python3-bpfcc), libbpf, iproute2, venv; kernel headers for
# the running kernel or the documented fallback (docs/operations.md); bpffs;
# the virtualenv at .venv (sees Debian's bcc) with mmmesh[demo] in it.
# test, in addition: iperf3 (bench/qos.py), systemd (the unit tests run
# systemd-analyze and systemd itself), prometheus (promtool, a real scraper),
# etcd-server and etcd-client (the etcd back end's tests and bench), vagrant,
# vagrant-libvirt and shellcheck (tests/system/vagrant), libvirt, QEMU,
# mmdebstrap and podman (the VM testbed, vagrant/prepare.sh), mmmesh[test] in .venv,
# MLServer in .venv-mlserver (scripts/mlserver-env.sh), and a wheelhouse for
# the sidecar-only install test (.cache/wheelhouse: mmmesh[sidecar]'s wheels).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
log() { printf '[bootstrap] %s\n' "$*" >&2; }

. "$ROOT/scripts/as-root.sh" "$0" "$@"

PROFILE="${1:-test}"
case "$PROFILE" in
  demo|test) ;;
  *) echo "bootstrap: unknown profile '$PROFILE' (demo or test)" >&2; exit 2 ;;
esac

export DEBIAN_FRONTEND=noninteractive
PKGS=(python3-bpfcc python3-venv python3-dev iproute2 libbpf1 ca-certificates)
if [ "$PROFILE" = test ]; then
  PKGS+=(iperf3 systemd prometheus etcd-server etcd-client)
  # vagrant/ (tests/system/vagrant/test_vagrant.py): `vagrant validate`, which with the libvirt
  # plugin also checks that provider's block, ruby for vagrant/pki.rb, shellcheck
  PKGS+=(vagrant vagrant-libvirt shellcheck)
  # the VM testbed (vagrant/prepare.sh): libvirt and QEMU (KVM, or emulation where KVM does
  # not work), the box's and the base image's builders, podman for the sidecar's image
  # (vagrant/box/host.sh and vagrant/artifacts.sh check the same, and start nothing here)
  PKGS+=(libvirt-daemon-system libvirt-clients qemu-system-x86 qemu-utils dnsmasq-base
    iptables busybox-static cpio rsync mmdebstrap e2fsprogs fdisk podman crun catatonit
    netavark aardvark-dns)
fi
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
APT_UPDATED=0
apt_install() {
  if [ "$APT_UPDATED" = 0 ]; then apt-get update -qq; APT_UPDATED=1; fi
  apt-get install -y -qq --no-install-recommends "$@"
}
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  apt_install "${missing[@]}" >/dev/null
fi
# The tests run prometheus and etcd (a 3-member cluster per test,
# testkit/etcd_cluster.py) as plain binaries with configs of their own; the
# packages enable system services (prometheus's node exporter too, etcd's
# etcd.service with its alias etcd2.service): not wanted here.
for unit in prometheus.service prometheus-node-exporter.service etcd.service; do
  if systemctl is-enabled "$unit" >/dev/null 2>&1; then
    systemctl disable --now "$unit" >/dev/null 2>&1 || true
    log "disabled $unit"
  fi
done

# --- kernel headers -------------------------------------------------------
# bcc compiles at load time against /lib/modules/$(uname -r)/build. Never
# replace an existing build link: real nodes have their own headers.
KVER="$(uname -r)"
KDIR="/lib/modules/$KVER"
if [ ! -e "$KDIR/build" ]; then
  if apt_install "linux-headers-$KVER" >/dev/null 2>&1 && [ -e "$KDIR/build" ]; then
    log "installed linux-headers-$KVER"
  else
    # Documented fallback (docs/operations.md): TC, sockops and sk_msg programs
    # only use stable UAPI structs, so the distribution's current header
    # package works for a kernel that has no package of its own.
    FLAVOUR=cloud-amd64
    if ! apt-cache show "linux-headers-$FLAVOUR" >/dev/null 2>&1; then FLAVOUR=amd64; fi
    if grep -qi ubuntu /etc/os-release; then FLAVOUR=generic; fi
    log "no headers for $KVER; using fallback linux-headers-$FLAVOUR"
    apt_install "linux-headers-$FLAVOUR" >/dev/null
    HDR="$(ls -d /usr/src/linux-headers-*-"$FLAVOUR" 2>/dev/null | sort -V | tail -1)"
    if [ -z "$HDR" ]; then
      HDR="$(ls -d /usr/src/linux-headers-*-generic 2>/dev/null | sort -V | tail -1)"
    fi
    [ -n "$HDR" ] || { echo "bootstrap: no kernel headers found under /usr/src" >&2; exit 1; }
    COMMON="${HDR%-*-*}-common"
    [ -d "$COMMON" ] || COMMON="${HDR%-*}"
    mkdir -p "$KDIR"
    ln -s "$HDR" "$KDIR/build"
    [ -e "$KDIR/source" ] || ln -s "$COMMON" "$KDIR/source"
    log "linked $KDIR/build -> $HDR"
  fi
fi

# --- bpffs -----------------------------------------------------------------
if ! mount | grep -q " /sys/fs/bpf type bpf "; then
  mkdir -p /sys/fs/bpf
  mount -t bpf bpf /sys/fs/bpf
  log "mounted bpffs at /sys/fs/bpf"
fi

# --- virtualenv ------------------------------------------------------------
# bcc is not on PyPI; the venv must be made by Debian's python3 with
# --system-site-packages so that `import bcc` works.
VENV="$ROOT/.venv"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import bcc" >/dev/null 2>&1; then
  rm -rf "$VENV"
  log "creating $VENV"
  /usr/bin/python3 -m venv --system-site-packages "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
# one stamp per profile; the test profile's install holds the demo's too
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1)"
installed() { [ -f "$VENV/.mmmesh-installed-$1" ] && [ "$(cat "$VENV/.mmmesh-installed-$1")" = "$WANT" ]; }
if ! installed "$PROFILE" && ! installed test; then
  log "installing mmmesh[$PROFILE] and its dependencies into $VENV"
  "$VENV/bin/python" -m pip install -q -e ".[$PROFILE]"
  rm -f "$VENV"/.mmmesh-installed*
  echo "$WANT" > "$VENV/.mmmesh-installed-$PROFILE"
fi
if [ "$PROFILE" = test ]; then
  # A real KServe v2 / Open Inference Protocol server for the sidecar's interop
  # tests (MLServer and KServe's model server pin their own web stack, so they
  # get a venv of their own).
  "$ROOT/scripts/mlserver-env.sh"
  # The wheels of a sidecar-only install (tests/sidecar/test_install.py installs
  # them into an empty venv with --no-index: the test itself needs no registry).
  WHEELS="$ROOT/.cache/wheelhouse"
  if [ ! -f "$WHEELS/.stamp" ] || [ "$(cat "$WHEELS/.stamp")" != "$WANT" ]; then
    log "building the sidecar's wheelhouse in $WHEELS"
    rm -rf "$WHEELS"
    "$VENV/bin/python" -m pip wheel -q --wheel-dir "$WHEELS" ".[sidecar]" setuptools pip
    rm -rf "$ROOT/build"  # the in-tree build of the mmmesh wheel
    echo "$WANT" > "$WHEELS/.stamp"
  fi
fi
log "ready ($PROFILE)"
