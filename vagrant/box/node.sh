#!/usr/bin/env bash
# Builds mmmesh/bookworm-node: the box of vagrant/box/build.sh with what does
# not change from one checkout to the next already installed, so that three
# emulated VMs need not install 50 wheels each on every `vagrant up`
# (vagrant/README.md, "What is installed, and from what").  Idempotent; root.
#
#   node.sh            build unless the cached node box is current; add it to vagrant
#   node.sh --force    build again
#   node.sh --key      print its cache key
#
# Into a copy of the base box's disk, in a chroot at the host's speed:
#   - deploy/install-node.sh --deps-only with vagrant/.artifacts/wheelhouse: the
#     venv /opt/mmmesh/.venv with every dependency of mmmesh[qosd,ctl,demo], not
#     mmmesh itself (the VM installs the checkout's wheel: seconds);
#   - those wheels at /opt/mmmesh-artifacts/wheelhouse (the Vagrantfile's rsync
#     then sends only mmmesh's wheel), and the images in vagrant/.artifacts/images
#     loaded into podman's storage (a newer image then brings its last layer only).
# Key: the base box's key, the dependency key (vagrant/artifacts.sh --key), this
# script and deploy/install-node.sh.  The images are not part of the key: a
# node box with an older sidecar image is still current (the VM loads the new one).
#
# Environment: MMMESH_VM_CACHE (default /var/cache/mmmesh-vm),
# MMMESH_NODE_BOX_NAME (default mmmesh/bookworm-node), MMMESH_ARTIFACTS.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SELF="$HERE/$(basename "${BASH_SOURCE[0]}")"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${MMMESH_VM_CACHE:-/var/cache/mmmesh-vm}"
BOX_NAME="${MMMESH_NODE_BOX_NAME:-mmmesh/bookworm-node}"
ARTIFACTS="${MMMESH_ARTIFACTS:-$REPO/vagrant/.artifacts}"
INSTALLER="$REPO/deploy/install-node.sh"
T0=$SECONDS

log() { printf '[node.sh %3ds] %s\n' "$((SECONDS - T0))" "$*" >&2; }
die() { printf '[node.sh] error: %s\n' "$*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "run as root (loop devices, mounts, chroot)"

# mounts in a mount namespace of our own (vagrant/box/build.sh says why)
if [ -z "${MMMESH_BOX_UNSHARED:-}" ]; then
  MMMESH_BOX_UNSHARED=1 exec unshare --mount --propagation private -- "$SELF" "$@"
fi

BASE_KEY="$(MMMESH_BOX_UNSHARED=1 "$HERE/build.sh" --key)"
DEPS_KEY="$("$REPO/vagrant/artifacts.sh" --key)"
KEY="$({
  echo "$BASE_KEY" "$DEPS_KEY"
  sha256sum "$SELF" "$INSTALLER" | cut -d' ' -f1
} | sha256sum | cut -c1-16)"
if [ "${1:-}" = --key ]; then echo "$KEY"; exit 0; fi

BOXES="$CACHE/boxes"
BASE_BOX="$BOXES/$BASE_KEY.box"
BOX="$BOXES/node-$KEY.box"
VAGRANT_DIR="${VAGRANT_HOME:-$HOME/.vagrant.d}"
INSTALLED_INFO="$VAGRANT_DIR/boxes/${BOX_NAME//\//-VAGRANTSLASH-}/0/libvirt/info.json"
exec 9>"$CACHE/node.lock"
flock -w 3600 9 || die "another node.sh holds $CACHE/node.lock"

WORK="" LOOP="" RUNROOT=""
cleanup() {
  set +e
  [ -z "$RUNROOT" ] || rm -rf "$RUNROOT"
  if [ -n "$WORK" ] && [ -d "$WORK/root" ]; then umount -R "$WORK/root" 2>/dev/null; fi
  [ -n "$LOOP" ] && losetup -d "$LOOP" 2>/dev/null
  [ -n "$WORK" ] || return 0
  if awk -v w="$WORK/" 'index($5, w) == 1 {found = 1} END {exit !found}' /proc/self/mountinfo; then
    log "left $WORK alone: something is still mounted under it"
  else
    rm -rf "$WORK"
  fi
}

build() {
  [ -s "$BASE_BOX" ] || die "no base box $BASE_BOX: run vagrant/box/build.sh first"
  [ -d "$ARTIFACTS/wheelhouse" ] || die "no $ARTIFACTS/wheelhouse: run vagrant/artifacts.sh first"
  [ "$(awk '$1 == "deps" {print $2}' "$ARTIFACTS/KEYS" 2>/dev/null)" = "$DEPS_KEY" ] ||
    die "$ARTIFACTS was built for other dependencies: run vagrant/artifacts.sh first"
  WORK="$CACHE/work.node-$KEY"
  trap cleanup EXIT
  rm -rf "$WORK"
  mkdir -p "$WORK/root" "$WORK/box"
  RUNROOT="$(mktemp -d /tmp/mmnode.XXXXXX)" # podman wants a short runroot path
  local raw="$WORK/disk.raw" part r="$WORK/root"
  tar -C "$WORK" -xf "$BASE_BOX" box.img
  qemu-img convert -O raw "$WORK/box.img" "$raw"
  rm -f "$WORK/box.img"
  LOOP="$(losetup --find --show --partscan "$raw")"
  part="${LOOP}p1"
  for _ in $(seq 1 25); do [ -b "$part" ] && break; sleep 0.2; done
  [ -b "$part" ] || partx --add "$LOOP" # no DOS partition parser in the host kernel
  for _ in $(seq 1 25); do [ -b "$part" ] && break; sleep 0.2; done
  [ -b "$part" ] || die "$part did not appear"
  mount "$part" "$r"
  mount -t tmpfs -o mode=0755,size=16m devtmpfs-mmmesh "$r/dev"
  cp -a /dev/null /dev/zero /dev/full /dev/random /dev/urandom /dev/tty "$r/dev/"
  ln -s /proc/self/fd "$r/dev/fd"
  mount -t proc proc "$r/proc"
  mount -t sysfs sysfs "$r/sys"
  log "base box $BASE_KEY mounted; installing the dependencies (chroot) ..."

  # the dependency wheels where the VMs' synced folder puts them (mtimes kept)
  install -d -m 0755 "$r/opt/mmmesh-artifacts/wheelhouse" "$r/opt/mmmesh-artifacts/images"
  find "$ARTIFACTS/wheelhouse" -name '*.whl' ! -name 'mmmesh-*' -exec cp -p {} "$r/opt/mmmesh-artifacts/wheelhouse/" \;
  install -m 0755 "$INSTALLER" "$r/tmp/install-node.sh"
  chroot "$r" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C.UTF-8 HOME=/root \
    /tmp/install-node.sh --deps-only --wheelhouse /opt/mmmesh-artifacts/wheelhouse >"$WORK/install.log" 2>&1 ||
    { cat "$WORK/install.log" >&2; die "install-node.sh --deps-only failed in the chroot"; }
  log "$(tail -2 "$WORK/install.log" | head -1)"

  # the images, into the VM's podman storage (the host's podman: the same 4.3)
  local tar
  for tar in "$ARTIFACTS"/images/*.tar; do
    [ -e "$tar" ] || continue
    podman --root "$r/var/lib/containers/storage" --runroot "$RUNROOT" \
      --storage-driver overlay load -q -i "$tar" >/dev/null
    cp -p "$tar" "${tar%.tar}.id" "$r/opt/mmmesh-artifacts/images/" 2>/dev/null || true
    log "image $(basename "$tar") loaded into the box's podman storage"
  done
  rm -rf "$RUNROOT"

  rm -rf "$r/tmp/"* "$r/root/.cache" "$r/var/lib/apt/lists/"*
  local info="$WORK/box/info.json"
  tar -C "$WORK/box" -xf "$BASE_BOX" info.json
  sed -i "s/^{/{\n  \"mmmesh_node_key\": \"$KEY\",\n  \"mmmesh_deps_key\": \"$DEPS_KEY\",/" "$info"
  umount "$r/sys" "$r/proc" "$r/dev"
  fstrim "$r" >/dev/null 2>&1 || true
  sync -f "$r"
  umount "$r"
  local fsck_rc
  for _ in 1 2 3; do
    fsck_rc=0
    e2fsck -f -y "$part" >"$WORK/e2fsck.log" 2>&1 || fsck_rc=$?
    [ "$fsck_rc" -eq 8 ] || break
    sync
    sleep 2
  done
  [ "$fsck_rc" -le 1 ] || { cat "$WORK/e2fsck.log" >&2; die "e2fsck: exit $fsck_rc"; }
  losetup -d "$LOOP"
  LOOP=""
  qemu-img convert -O qcow2 "$raw" "$WORK/box/box.img"
  rm -f "$raw"
  tar -C "$WORK/box" -xf "$BASE_BOX" metadata.json Vagrantfile
  tar -C "$WORK/box" -cf "$BOX.tmp" metadata.json Vagrantfile info.json box.img
  mv "$BOX.tmp" "$BOX"
  find "$BOXES" -name 'node-*.box' ! -name "node-$KEY.box" -delete
  cleanup
  trap - EXIT
  echo "$((SECONDS - T0))" >"$BOXES/node-$KEY.cold-seconds"
  find "$BOXES" -name 'node-*.cold-seconds' ! -name "node-$KEY.cold-seconds" -delete
  log "node box built: $BOX ($(du -h "$BOX" | cut -f1))"
}

# libvirt's copies of earlier node boxes that no VM's disk is backed by
prune_pool_volumes() {
  timeout 10 virsh -q -c qemu:///system version >/dev/null 2>&1 || return 0
  local prefix="${BOX_NAME//\//-VAGRANTSLASH-}_vagrant_box_image_" vols used current="" v p img
  img="${INSTALLED_INFO%/*}/box.img"
  [ -r "$img" ] && current="${prefix}0_$(stat -c %Y "$img")_box.img"
  vols="$(virsh -q -c qemu:///system vol-list default 2>/dev/null | awk 'NF >= 2 {print $1" "$2}')"
  [ -n "$vols" ] || return 0
  used="$(while read -r v p; do
    qemu-img info -U --output=json "$p" 2>/dev/null | sed -n 's/.*"backing-filename": "\(.*\)".*/\1/p'
  done <<<"$vols")" || true
  while read -r v p; do
    case "$v" in "$prefix"*) ;; *) continue ;; esac
    [ "$v" != "$current" ] || continue
    if ! grep -qF "$p" <<<"$used"; then
      virsh -q -c qemu:///system vol-delete --pool default "$v" >/dev/null &&
        log "deleted libvirt's copy of an earlier node box: $v"
    fi
  done <<<"$vols"
  return 0
}

BUILT=0
if [ -s "$BOX" ] && [ "${1:-}" != --force ]; then
  log "node box $KEY is current: $BOX"
else
  build
  BUILT=1
fi
if [ "$BUILT" = 0 ] && [ -r "$INSTALLED_INFO" ] && grep -q "\"mmmesh_node_key\": \"$KEY\"" "$INSTALLED_INFO"; then
  log "vagrant has $BOX_NAME = node box $KEY already"
else
  log "vagrant box add --force $BOX_NAME"
  vagrant box add --force --name "$BOX_NAME" "$BOX" >"$CACHE/node-box-add.log" 2>&1 ||
    { cat "$CACHE/node-box-add.log" >&2; die "vagrant box add failed"; }
fi
prune_pool_volumes
cold="$(cat "$BOXES/node-$KEY.cold-seconds" 2>/dev/null || echo '?')"
log "done in $((SECONDS - T0)) s (node box $KEY; its cold build took $cold s)"
