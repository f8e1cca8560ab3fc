#!/usr/bin/env bash
# Builds the testbed's Vagrant box, mmmesh/bookworm (vagrant-libvirt), from
# Debian packages alone, and adds it to vagrant (vagrant/box/README.md).
# Idempotent; run as root.
#
#   build.sh            build unless the cached box is current; add it to vagrant
#                       unless vagrant already has this very box
#   build.sh --force    build again even if the cached box is current
#   build.sh --key      print the box's cache key and exit
#
# The box: Debian 12 (bookworm) made by mmdebstrap from packages.txt, the kernel
# (and its headers) from bookworm-backports, on an MBR-partitioned disk that
# boots with grub (no host files involved), qcow2, in the box format of
# vagrant-libvirt (box.img + metadata.json + Vagrantfile, from
# box.Vagrantfile).  User vagrant with Vagrant's insecure public key and
# passwordless sudo; DHCP on eth0 (systemd-networkd); console on ttyS0; ssh
# host keys and machine-id made on each VM's first boot.
#
# Cache: $CACHE/boxes/<key>.box, key = a hash of this script, packages.txt,
# box.Vagrantfile, the suite, the mirrors, the disk size and the insecure key.
# Changing any of them builds a new box (and `vagrant box add --force`s it);
# otherwise nothing is built.  Old boxes are deleted, as are libvirt's copies
# of old box images that no VM uses any more.
#
# Environment:
#   MMMESH_VM_CACHE          cache directory (default /var/cache/mmmesh-vm)
#   MMMESH_BOX_NAME          the name in vagrant (default mmmesh/bookworm)
#   MMMESH_MIRROR            Debian mirror (default http://deb.debian.org/debian)
#   MMMESH_SECURITY_MIRROR   (default http://deb.debian.org/debian-security)
#   MMMESH_BOX_DISK_GB       the disk's virtual size (default 20)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SELF="$HERE/$(basename "${BASH_SOURCE[0]}")"
CACHE="${MMMESH_VM_CACHE:-/var/cache/mmmesh-vm}"
BOX_NAME="${MMMESH_BOX_NAME:-mmmesh/bookworm}"
SUITE=bookworm
MIRROR="${MMMESH_MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${MMMESH_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
DISK_GB="${MMMESH_BOX_DISK_GB:-20}"
HOSTNAME_IN_BOX=mmmesh
SOURCES=(
  "deb $MIRROR $SUITE main"
  "deb $MIRROR $SUITE-updates main"
  "deb $SECURITY_MIRROR $SUITE-security main"
  "deb $MIRROR $SUITE-backports main"
)
HOST_PKGS=(mmdebstrap qemu-utils e2fsprogs fdisk mount util-linux vagrant vagrant-libvirt)
T0=$SECONDS

log() { printf '[build.sh %3ds] %s\n' "$((SECONDS - T0))" "$*" >&2; }
die() { printf '[build.sh] error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (mmdebstrap, loop devices, mounts)"

# The build's mounts in a mount namespace of their own: a process that unshares
# its mount namespace meanwhile (ip netns exec, a container, libvirt's QEMU)
# would otherwise get a copy of them and keep the new file system busy after
# our umount ("/dev/loop0p1 is in use" from e2fsck; / is not a shared mount
# when PID 1 is not systemd, so the umount does not reach that copy).
if [ -z "${MMMESH_BOX_UNSHARED:-}" ]; then
  MMMESH_BOX_UNSHARED=1 exec unshare --mount --propagation private -- "$SELF" "$@"
fi

# Vagrant's insecure public key, from vagrant itself (keys/vagrant.pub in its gem)
insecure_key() {
  local f
  for f in $(dpkg -L vagrant 2>/dev/null | grep '/keys/vagrant\.pub$') \
    /opt/vagrant/embedded/gems/gems/vagrant-*/keys/vagrant.pub; do
    if [ -r "$f" ]; then cat "$f"; return 0; fi
  done
  die "vagrant's keys/vagrant.pub not found (is vagrant installed?)"
}

install_host_packages() {
  local missing=() p
  for p in "${HOST_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  log "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
}

packages() { sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' "$HERE/packages.txt"; }

install_host_packages
INSECURE_KEY="$(insecure_key)"
KEY="$({
  sha256sum "$SELF" "$HERE/packages.txt" "$HERE/box.Vagrantfile" | cut -d' ' -f1
  printf '%s\n' "$SUITE" "${SOURCES[@]}" "$DISK_GB" "$HOSTNAME_IN_BOX" "$INSECURE_KEY"
} | sha256sum | cut -c1-16)"
if [ "${1:-}" = --key ]; then echo "$KEY"; exit 0; fi

BOXES="$CACHE/boxes"
BOX="$BOXES/$KEY.box"
VAGRANT_DIR="${VAGRANT_HOME:-$HOME/.vagrant.d}"
INSTALLED_INFO="$VAGRANT_DIR/boxes/${BOX_NAME//\//-VAGRANTSLASH-}/0/libvirt/info.json"
INSTALLED_IMG="${INSTALLED_INFO%/*}/box.img"
mkdir -p "$BOXES"
exec 9>"$CACHE/build.lock"
flock -w 3600 9 || die "another build.sh holds $CACHE/build.lock"

# --- the build -----------------------------------------------------------------------
WORK="" LOOP=""
cleanup() {
  set +e
  if [ -n "$WORK" ] && [ -d "$WORK/root" ]; then
    umount -R "$WORK/root" 2>/dev/null
  fi
  [ -n "$LOOP" ] && losetup -d "$LOOP" 2>/dev/null
  [ -n "$WORK" ] || return 0
  # never rm -rf through a mount (proc, sysfs, the new disk)
  if awk -v w="$WORK/" 'index($5, w) == 1 {found = 1} END {exit !found}' /proc/self/mountinfo; then
    log "left $WORK alone: something is still mounted under it"
  else
    rm -rf "$WORK"
  fi
}

in_root() { chroot "$WORK/root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
  DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 "$@"; }

configure_root() {
  local r="$WORK/root" uuid="$1"
  # fstab, hostname, hosts
  printf 'UUID=%s / ext4 errors=remount-ro 0 1\n' "$uuid" >"$r/etc/fstab"
  echo "$HOSTNAME_IN_BOX" >"$r/etc/hostname"
  printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\tlocalhost ip6-localhost ip6-loopback\n' \
    "$HOSTNAME_IN_BOX" >"$r/etc/hosts"
  # network: DHCP on the first NIC (names eth0, eth1...: net.ifnames=0 below),
  # systemd-networkd; vagrant adds 50-vagrant-ethN.network for the private ones
  cat >"$r/etc/systemd/network/10-mmmesh-eth0.network" <<'EOF'
# The box's management NIC (vagrant/box/build.sh): vagrant-libvirt's
# management network, addressed by libvirt's DHCP; vagrant ssh goes here.
[Match]
Name=eth0

[Network]
DHCP=ipv4

[DHCPv4]
UseHostname=no
EOF
  ln -sfn ../run/systemd/resolve/stub-resolv.conf "$r/etc/resolv.conf"
  # user vagrant: insecure key, passwordless sudo (password "vagrant", the convention)
  in_root useradd --create-home --shell /bin/bash --groups sudo vagrant
  echo 'vagrant:vagrant' | in_root chpasswd
  install -d -m 0700 -o 1000 -g 1000 "$r/home/vagrant/.ssh"
  echo "$INSECURE_KEY" >"$r/home/vagrant/.ssh/authorized_keys"
  chown 1000:1000 "$r/home/vagrant/.ssh/authorized_keys"
  chmod 0600 "$r/home/vagrant/.ssh/authorized_keys"
  [ "$(in_root id -u vagrant)" = 1000 ] || die "user vagrant is not uid 1000"
  printf 'vagrant ALL=(ALL) NOPASSWD:ALL\nDefaults:vagrant !requiretty\n' >"$r/etc/sudoers.d/vagrant"
  chmod 0440 "$r/etc/sudoers.d/vagrant"
  in_root visudo -c -q -f /etc/sudoers.d/vagrant
  # sshd: keys only, no DNS look-ups (slow logins without a resolver)
  cat >"$r/etc/ssh/sshd_config.d/vagrant.conf" <<'EOF'
UseDNS no
PubkeyAuthentication yes
PasswordAuthentication no
PermitRootLogin no
EOF
  # every VM its own ssh host keys and machine-id (made on first boot)
  rm -f "$r"/etc/ssh/ssh_host_*
  cat >"$r/etc/systemd/system/ssh-host-keys.service" <<'EOF'
[Unit]
Description=Make this machine's ssh host keys (first boot)
Before=ssh.service
ConditionPathExistsGlob=!/etc/ssh/ssh_host_*_key

[Service]
Type=oneshot
ExecStart=/usr/bin/ssh-keygen -A

[Install]
WantedBy=ssh.service
EOF
  in_root systemctl enable ssh-host-keys.service ssh.service chrony.service \
    systemd-networkd.service systemd-resolved.service >/dev/null 2>&1 ||
    die "systemctl enable failed"
  # etcd runs only on the etcd node of the etcd variant (vagrant/provision.sh
  # enables it there); the package enables it everywhere
  in_root systemctl disable etcd.service >/dev/null 2>&1 || true
  # chrony: no public pool (nothing resolves from the VMs here); provision.sh
  # adds the host as the source (/etc/chrony/sources.d/mmmesh.sources)
  sed -i 's/^pool /#pool /' "$r/etc/chrony/chrony.conf"
  : >"$r/etc/machine-id"
  rm -f "$r/var/lib/dbus/machine-id"
  # grub: serial and VGA consoles, classic NIC names (eth0 ...), no menu wait
  cat >"$r/etc/default/grub" <<'EOF'
# vagrant/box/build.sh
GRUB_DEFAULT=0
GRUB_TIMEOUT=0
GRUB_TIMEOUT_STYLE=hidden
GRUB_DISTRIBUTOR=Debian
GRUB_CMDLINE_LINUX_DEFAULT=""
GRUB_CMDLINE_LINUX="console=tty0 console=ttyS0,115200n8 net.ifnames=0 biosdevname=0"
GRUB_TERMINAL="console serial"
GRUB_SERIAL_COMMAND="serial --unit=0 --speed=115200"
GRUB_DISABLE_OS_PROBER=true
EOF
  echo 'grub-pc grub-pc/install_devices multiselect /dev/vda' | in_root debconf-set-selections
}

build() {
  WORK="$CACHE/work.$KEY"
  trap cleanup EXIT
  rm -rf "$WORK"
  mkdir -p "$WORK/root" "$WORK/box"
  local raw="$WORK/disk.raw" part uuid

  # an MBR disk, one bootable ext4 partition from 1 MiB
  truncate -s "${DISK_GB}G" "$raw"
  echo 'start=2048, type=83, bootable' | sfdisk -q --label dos "$raw"
  LOOP="$(losetup --find --show --partscan "$raw")"
  part="${LOOP}p1"
  for _ in $(seq 1 25); do [ -b "$part" ] && break; sleep 0.2; done
  # a kernel without a DOS partition parser (CONFIG_MSDOS_PARTITION=n) scans
  # nothing: tell it the partition ourselves (BLKPG, no parser needed)
  [ -b "$part" ] || partx --add "$LOOP"
  for _ in $(seq 1 25); do [ -b "$part" ] && break; sleep 0.2; done
  [ -b "$part" ] || die "$part did not appear (neither losetup --partscan nor partx --add)"
  mkfs.ext4 -q -L root -E lazy_itable_init=0,lazy_journal_init=0 "$part"
  uuid="$(blkid -s UUID -o value "$part")"
  mount "$part" "$WORK/root"
  rmdir "$WORK/root/lost+found"
  log "disk: ${DISK_GB} GiB, $part (UUID $uuid) on $WORK/root; mmdebstrap ..."

  local include
  include="$(packages | paste -sd,)"
  mmdebstrap --variant=minbase --mode=root --format=directory \
    --aptopt='Acquire::Retries "3"' \
    --include="$include" \
    "$SUITE" "$WORK/root" "${SOURCES[@]}" >"$WORK/mmdebstrap.log" 2>&1 ||
    { tail -30 "$WORK/mmdebstrap.log" >&2; die "mmdebstrap failed"; }
  in_root mklost+found >/dev/null 2>&1 || mkdir -m 0700 "$WORK/root/lost+found"
  log "mmdebstrap done ($(grep -o 'success in .*' "$WORK/mmdebstrap.log" || true))"

  # a /dev of its own for the chroot: the few nodes grub needs, and the
  # /dev/disk/by-uuid link udev would make (grub-mkconfig writes root=UUID=...
  # only if it exists, root=/dev/loopNp1 otherwise)
  mount -t tmpfs -o mode=0755,size=16m devtmpfs-mmmesh "$WORK/root/dev"
  cp -a /dev/null /dev/zero /dev/full /dev/random /dev/urandom /dev/tty "$LOOP" "$part" \
    "$WORK/root/dev/"
  ln -s /proc/self/fd "$WORK/root/dev/fd"
  mkdir -p "$WORK/root/dev/disk/by-uuid"
  ln -s "../../$(basename "$part")" "$WORK/root/dev/disk/by-uuid/$uuid"
  mount -t proc proc "$WORK/root/proc"
  mount -t sysfs sysfs "$WORK/root/sys"
  configure_root "$uuid"
  in_root grub-install --target=i386-pc --boot-directory=/boot "$LOOP" >"$WORK/grub.log" 2>&1 ||
    { cat "$WORK/grub.log" >&2; die "grub-install failed"; }
  in_root update-grub >>"$WORK/grub.log" 2>&1 || { cat "$WORK/grub.log" >&2; die "update-grub failed"; }
  grep -q "root=UUID=$uuid" "$WORK/root/boot/grub/grub.cfg" ||
    die "grub.cfg does not boot root=UUID=$uuid: $(grep -m1 'linux[[:space:]]' "$WORK/root/boot/grub/grub.cfg")"
  local kver
  kver="$(basename "$(ls -d "$WORK"/root/lib/modules/*)")"
  in_root test -e "/lib/modules/$kver/build/Makefile" || die "no kernel headers for $kver"
  log "kernel $kver (headers in /lib/modules/$kver/build), grub on the MBR"

  # the box's own record (vagrant box list -i shows it; build.sh compares the key)
  cat >"$WORK/box/info.json" <<EOF
{
  "mmmesh_box_key": "$KEY",
  "built": "$(date -u +%Y-%m-%dT%H:%M:%SZ)",
  "debian": "$SUITE, $(cat "$WORK/root/etc/debian_version")",
  "kernel": "$kver",
  "bcc": "$(in_root dpkg-query -W -f="\${Version}" python3-bpfcc)"
}
EOF
  rm -rf "$WORK/root/tmp/"* "$WORK/root/var/tmp/"*
  find "$WORK/root/var/log" -type f -exec truncate -s 0 {} +
  umount "$WORK/root/sys" "$WORK/root/proc" "$WORK/root/dev"
  fstrim "$WORK/root" >/dev/null 2>&1 || true # freed blocks become holes: a smaller image
  sync -f "$WORK/root"
  umount "$WORK/root"
  # e2fsck: 0 clean, 1 fixed; 8 is an operational error (the device still busy
  # a moment after umount): try again, briefly; anything else is a broken disk
  local fsck_rc
  for _ in 1 2 3; do
    fsck_rc=0
    e2fsck -f -y "$part" >"$WORK/e2fsck.log" 2>&1 || fsck_rc=$?
    [ "$fsck_rc" -eq 8 ] || break
    log "e2fsck: exit 8 ($(grep -m1 -v '^e2fsck [0-9]' "$WORK/e2fsck.log")), again in 2 s"
    sync
    sleep 2
  done
  [ "$fsck_rc" -le 1 ] || { cat "$WORK/e2fsck.log" >&2; die "e2fsck: exit $fsck_rc on the new disk"; }
  losetup -d "$LOOP"
  LOOP=""

  qemu-img convert -O qcow2 "$raw" "$WORK/box/box.img"
  rm -f "$raw"
  printf '{"provider": "libvirt", "format": "qcow2", "virtual_size": %s}\n' "$DISK_GB" \
    >"$WORK/box/metadata.json"
  cp "$HERE/box.Vagrantfile" "$WORK/box/Vagrantfile"
  tar -C "$WORK/box" -cf "$BOX.tmp" metadata.json Vagrantfile info.json box.img
  mv "$BOX.tmp" "$BOX"
  find "$BOXES" -name '*.box' ! -name "$KEY.box" -delete # older boxes
  find "$BOXES" -name '*.cold-seconds' ! -name "$KEY.cold-seconds" -delete
  cleanup
  trap - EXIT
  echo "$((SECONDS - T0))" >"$BOXES/$KEY.cold-seconds"
  log "box built: $BOX ($(du -h "$BOX" | cut -f1))"
}

# libvirt's copies of earlier versions of the box (vagrant-libvirt uploads a box
# to the pool once, as <name>_vagrant_box_image_0_<mtime of box.img>_box.img)
# that no VM's disk is backed by.  The copy of the current box stays.
prune_pool_volumes() {
  timeout 10 virsh -q -c qemu:///system version >/dev/null 2>&1 || return 0
  local prefix="${BOX_NAME//\//-VAGRANTSLASH-}_vagrant_box_image_" vols used current="" v p
  [ -r "$INSTALLED_IMG" ] && current="${prefix}0_$(stat -c %Y "$INSTALLED_IMG")_box.img"
  vols="$(virsh -q -c qemu:///system vol-list default 2>/dev/null | awk 'NF >= 2 {print $1" "$2}')"
  [ -n "$vols" ] || return 0
  used="$(while read -r v p; do
    qemu-img info -U --output=json "$p" 2>/dev/null |
      sed -n 's/.*"backing-filename": "\(.*\)".*/\1/p'
  done <<<"$vols")" || true
  while read -r v p; do
    case "$v" in "$prefix"*) ;; *) continue ;; esac
    [ "$v" != "$current" ] || continue
    if ! grep -qF "$p" <<<"$used"; then
      virsh -q -c qemu:///system vol-delete --pool default "$v" >/dev/null &&
        log "deleted libvirt's copy of an earlier box: $v"
    fi
  done <<<"$vols"
  return 0
}

BUILT=0
if [ -s "$BOX" ] && [ "${1:-}" != --force ]; then
  log "box $KEY is current: $BOX (nothing to build)"
else
  build
  BUILT=1
fi

if [ "$BUILT" = 0 ] && [ -r "$INSTALLED_INFO" ] &&
  grep -q "\"mmmesh_box_key\": \"$KEY\"" "$INSTALLED_INFO"; then
  log "vagrant has $BOX_NAME = box $KEY already"
else
  log "vagrant box add --force $BOX_NAME"
  vagrant box add --force --name "$BOX_NAME" "$BOX" >"$CACHE/box-add.log" 2>&1 ||
    { cat "$CACHE/box-add.log" >&2; die "vagrant box add failed"; }
fi
prune_pool_volumes

cold="$(cat "$BOXES/$KEY.cold-seconds" 2>/dev/null || echo '?')"
log "done in $((SECONDS - T0)) s (box $KEY; its cold build took $cold s)"
