#!/usr/bin/env bash
# Prepares this machine to run the testbed's VMs with vagrant-libvirt
# (vagrant/box/README.md).  Idempotent; run as root.
#
#   host.sh [up]     install what is missing (libvirt, QEMU, vagrant, vagrant-libvirt,
#                    dnsmasq-base, iptables), start virtlogd and libvirtd if they do
#                    not answer (by hand when PID 1 is not systemd), find out whether
#                    KVM works (a real probe boot, cached), and print on stdout
#                        export MMMESH_LIBVIRT_DRIVER=kvm|qemu
#                    (eval "$(vagrant/box/host.sh up)").  The same word is written
#                    to $CACHE/libvirt-driver, which the Vagrantfile reads when the
#                    variable is not set.
#                    It also starts the VMs' NTP server (ntp_server.py: the host's clock).
#   host.sh down     stop the daemons this script started (refused while a domain
#                    runs; --force destroys the running domains first) and the
#                    libvirt networks' dnsmasq with them
#   host.sh status   daemons, domains, networks, the probe's verdict
#   host.sh probe    run the KVM probe again, whatever the cache says
#
# Environment:
#   MMMESH_VM_CACHE         cache directory (default /var/cache/mmmesh-vm)
#   MMMESH_LIBVIRT_DRIVER   kvm | qemu: skip the probe and use this
#   MMMESH_KVM_PROBE_S      deadline of the KVM probe boot (default 60 s)
#   MMMESH_TCG_PROBE_S      deadline of the emulated probe boot (default 240 s)
#
# The probe: a transient libvirt domain (kernel: Debian's cloud kernel, an
# initramfs whose /init is busybox printing a marker and powering off) is booted
# with <domain type='kvm'> and the CPU vagrant-libvirt gives a kvm domain
# (host-model).  The marker on its serial console within the deadline means KVM
# works.  Otherwise (no /dev/kvm, the guest hangs, libvirt refuses) the same
# boot runs with <domain type='qemu'> (TCG emulation), which must work.  The
# verdict is cached under a key of the host kernel, the CPU, QEMU's and
# libvirt's versions: a changed host probes again.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${MMMESH_VM_CACHE:-/var/cache/mmmesh-vm}"
RUN=/run/mmmesh-vm # what this script started (gone at reboot, as the daemons are)
URI=qemu:///system
KVM_PROBE_S="${MMMESH_KVM_PROBE_S:-60}"
TCG_PROBE_S="${MMMESH_TCG_PROBE_S:-240}"
PKGS=(libvirt-daemon-system libvirt-clients qemu-system-x86 qemu-utils dnsmasq-base
  iptables vagrant vagrant-libvirt busybox-static cpio rsync)
MARKER=MMMESH-PROBE-OK

log() { printf '[host.sh] %s\n' "$*" >&2; }
die() { printf '[host.sh] error: %s\n' "$*" >&2; exit 1; }
virsh_() { virsh -q -c "$URI" "$@"; }
systemd_pid1() { [ "$(cat /proc/1/comm 2>/dev/null)" = systemd ]; }
libvirt_answers() { timeout 10 virsh -c "$URI" version >/dev/null 2>&1; }
pid_alive() { # PID NAME: PID runs a program called NAME
  [ -n "$1" ] && [ -r "/proc/$1/comm" ] && [ "$(cat "/proc/$1/comm")" = "$2" ]
}

[ "$(id -u)" -eq 0 ] || die "run as root"

install_packages() {
  local missing=() p
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  log "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
}

# without_fds CMD...: CMD with none of this shell's open files beyond stdin, stdout
# and stderr.  A daemon inherits every descriptor: started under `flock FILE ...`
# (`flock /tmp/mmmesh-vm.lock vagrant/prepare.sh`, as VM work is serialised here) it kept
# the lock for as long as it ran.
# Run it in a subshell of its own, `(without_fds ...)`: it replaces the shell it runs in.
without_fds() {
  local fd
  for fd in /proc/"$BASHPID"/fd/*; do
    fd="${fd##*/}"
    if [ "$fd" -gt 2 ]; then eval "exec $fd>&-"; fi
  done
  exec "$@"
}

# start_daemon NAME: start virtlogd/libvirtd unless it runs; note it in $RUN
start_daemon() {
  local name="$1" pidfile="/run/$1.pid" pid=""
  [ -r "$pidfile" ] && pid="$(cat "$pidfile")"
  if pid_alive "$pid" "$name"; then return 0; fi
  if systemd_pid1; then
    if ! systemctl is-active --quiet "$name.service"; then
      systemctl start "$name.service"
      echo systemd >"$RUN/started-$name"
      log "started $name.service"
    fi
    return 0
  fi
  (without_fds "/usr/sbin/$name" -d)
  local deadline=$((SECONDS + 30))
  until [ -r "$pidfile" ] && pid_alive "$(cat "$pidfile")" "$name"; do
    [ "$SECONDS" -lt "$deadline" ] || die "$name did not start within 30 s"
    sleep 0.5
  done
  cat "$pidfile" >"$RUN/started-$name"
  log "started $name (pid $(cat "$pidfile"); PID 1 is not systemd)"
}

# stop_daemon NAME: stop it if this script started it
stop_daemon() {
  local name="$1" rec="$RUN/started-$1" how
  [ -f "$rec" ] || { log "$name: not started by host.sh, left alone"; return 0; }
  how="$(cat "$rec")"
  if [ "$how" = systemd ]; then
    systemctl stop "$name.service" && log "stopped $name.service"
  elif pid_alive "$how" "$name"; then
    kill -TERM "$how"
    local deadline=$((SECONDS + 30))
    while pid_alive "$how" "$name"; do
      [ "$SECONDS" -lt "$deadline" ] || die "$name (pid $how) did not stop within 30 s"
      sleep 0.5
    done
    log "stopped $name (pid $how)"
  fi
  rm -f "$rec"
}

# --- the KVM probe -----------------------------------------------------------------
probe_key() {
  {
    uname -r
    grep -m1 '^model name' /proc/cpuinfo || true
    grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(vmx|svm)$' || true
    qemu-system-x86_64 --version | head -1
    virsh -c "$URI" version --daemon 2>/dev/null | grep -i 'running' || true
    ls -l /dev/kvm 2>/dev/null || echo no-kvm
  } | sha256sum | cut -c1-16
}

# The probe's kernel (Debian's cloud kernel, as a .deb from the archive: nothing is
# installed on the host) and a busybox initramfs printing $MARKER.
probe_files() {
  local dir="$CACHE/probe" deb pkg
  mkdir -p "$dir"
  if [ ! -s "$dir/vmlinuz" ]; then
    pkg="$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-/ {print $2; exit}')"
    [ -n "$pkg" ] || die "apt knows no linux-image-cloud-amd64 (apt-get update?)"
    rm -rf "$dir/deb" && mkdir -p "$dir/deb"
    (cd "$dir/deb" && apt-get download -qq -o APT::Sandbox::User=root "$pkg" >/dev/null)
    deb="$(ls "$dir"/deb/*.deb)"
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$dir/deb" --wildcards './boot/vmlinuz-*'
    mv "$dir"/deb/boot/vmlinuz-* "$dir/vmlinuz"
    rm -rf "$dir/deb"
  fi
  if [ ! -s "$dir/initrd.cpio" ]; then
    local t
    t="$(mktemp -d)"
    mkdir -p "$t/bin" "$t/dev" "$t/proc"
    cp /bin/busybox "$t/bin/busybox"
    printf '#!/bin/busybox sh\n/bin/busybox echo %s\n/bin/busybox poweroff -f\n' \
      "$MARKER" >"$t/init"
    chmod 755 "$t/init"
    (cd "$t" && find . | cpio -o -H newc --quiet) >"$dir/initrd.cpio"
    rm -rf "$t"
  fi
  chmod 755 "$dir"
  chmod 644 "$dir/vmlinuz" "$dir/initrd.cpio"
}

# probe_boot TYPE DEADLINE: 0 if a TYPE (kvm|qemu) domain prints the marker in time
probe_boot() {
  local type="$1" deadline_s="$2" dir="$CACHE/probe" name="mmmesh-probe-$1" cpu
  local logf="$dir/serial-$type.log" xml="$dir/domain-$type.xml"
  # the CPUs the box's Vagrantfile gives a domain of that type (box.Vagrantfile)
  if [ "$type" = kvm ]; then
    cpu="<cpu mode='host-model'/>"
  else
    cpu="<cpu mode='custom' match='exact'><model fallback='allow'>Westmere</model><feature policy='disable' name='cx16'/></cpu>"
  fi
  virsh_ destroy "$name" >/dev/null 2>&1 || true
  : >"$logf"
  cat >"$xml" <<EOF
<domain type='$type'>
  <name>$name</name>
  <memory unit='MiB'>256</memory>
  <vcpu>1</vcpu>
  $cpu
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>
    <kernel>$dir/vmlinuz</kernel>
    <initrd>$dir/initrd.cpio</initrd>
    <cmdline>console=ttyS0 panic=-1 quiet</cmdline>
  </os>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <serial type='file'><source path='$logf'/><target port='0'/></serial>
    <memballoon model='none'/>
  </devices>
</domain>
EOF
  local t0=$SECONDS t1
  if ! timeout "$deadline_s" virsh -q -c "$URI" create "$xml" >"$dir/virsh-$type.out" 2>&1; then
    log "probe $type: libvirt refused the domain: $(tr '\n' ' ' <"$dir/virsh-$type.out")"
    return 1
  fi
  t1=$SECONDS
  while [ $((SECONDS - t0)) -lt "$deadline_s" ]; do
    if grep -q "$MARKER" "$logf" 2>/dev/null; then
      log "probe $type: the guest reached its init $((SECONDS - t0)) s after the start ($((t1 - t0)) s of it in virsh create)"
      virsh_ destroy "$name" >/dev/null 2>&1 || true
      return 0
    fi
    sleep 1
  done
  virsh_ destroy "$name" >/dev/null 2>&1 || true
  log "probe $type: no sign of the guest's init within $deadline_s s (last console line: $(tail -c 200 "$logf" | tr -d '\r' | tail -1))"
  return 1
}

probe() { # [force]: print kvm or qemu
  local key driver="" cached
  key="$(probe_key)"
  cached="$CACHE/kvm-probe-$key"
  if [ "${1:-}" != force ] && [ -s "$cached" ]; then
    cat "$cached"
    return 0
  fi
  probe_files
  if [ -r /dev/kvm ] && [ -w /dev/kvm ] && probe_boot kvm "$KVM_PROBE_S"; then
    driver=kvm
  elif probe_boot qemu "$TCG_PROBE_S"; then
    driver=qemu
  else
    die "neither KVM nor TCG emulation booted the probe guest (see $CACHE/probe/serial-*.log)"
  fi
  rm -f "$CACHE"/kvm-probe-*
  echo "$driver" >"$cached"
  echo "$driver"
}

# What udev's rule (GROUP="kvm", MODE="0660") does on a normal host: without
# it /dev/kvm stays root-only and QEMU, run by libvirt as libvirt-qemu, is
# refused it (the probe would then fail for the wrong reason).
kvm_device_access() {
  [ -c /dev/kvm ] || return 0
  getent group kvm >/dev/null || return 0
  if [ "$(stat -c %G /dev/kvm)" != kvm ] || (((8#$(stat -c %a /dev/kvm) & 8#060) != 8#060)); then
    [ -f "$RUN/kvm-device" ] || stat -c '%G %a' /dev/kvm >"$RUN/kvm-device"
    chgrp kvm /dev/kvm && chmod 0660 /dev/kvm
    log "/dev/kvm: group kvm, mode 0660 (as udev's rule would set it; host.sh down restores it)"
  fi
}

restore_kvm_device() {
  [ -f "$RUN/kvm-device" ] || return 0
  local group mode
  read -r group mode <"$RUN/kvm-device"
  chgrp "$group" /dev/kvm && chmod "$mode" /dev/kvm && log "/dev/kvm: group $group, mode $mode again"
  rm -f "$RUN/kvm-device"
}

# The VMs' NTP server (ntp_server.py: the host's clock over SNTP, to the testbed's
# networks only): nothing else serves time to them here, and an emulated guest's
# clock drifts.  Not started when something listens on UDP 123 already.
start_ntp() {
  local pid
  pid="$(cat "$RUN/started-ntp" 2>/dev/null || true)"
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then return 0; fi
  if ss -Hlun 2>/dev/null | awk '{print $4}' | grep -qE '(^|:)123$'; then
    log "UDP 123 is taken: the VMs use that NTP server"
    return 0
  fi
  (without_fds setsid /usr/bin/python3 "$HERE/ntp_server.py") </dev/null >"$RUN/ntp.log" 2>&1 &
  echo "$!" >"$RUN/started-ntp"
  log "started the VMs' NTP server (pid $!, $HERE/ntp_server.py)"
}

stop_ntp() {
  local pid
  pid="$(cat "$RUN/started-ntp" 2>/dev/null || true)"
  [ -n "$pid" ] || return 0
  if kill -0 "$pid" 2>/dev/null && grep -q ntp_server.py "/proc/$pid/cmdline" 2>/dev/null; then
    kill -TERM "$pid" && log "stopped the VMs' NTP server (pid $pid)"
  fi
  rm -f "$RUN/started-ntp"
}

up() {
  mkdir -p "$CACHE" "$RUN"
  install_packages
  kvm_device_access
  start_daemon virtlogd
  start_daemon libvirtd
  local deadline=$((SECONDS + 60))
  until libvirt_answers; do
    [ "$SECONDS" -lt "$deadline" ] || die "libvirtd does not answer on $URI within 60 s"
    sleep 1
  done
  local driver="${MMMESH_LIBVIRT_DRIVER:-}"
  if [ -z "$driver" ]; then driver="$(probe "${1:-}")"; fi
  case "$driver" in kvm | qemu) ;; *) die "MMMESH_LIBVIRT_DRIVER must be kvm or qemu, not '$driver'" ;; esac
  echo "$driver" >"$CACHE/libvirt-driver"
  log "libvirt domain type: $driver ($CACHE/libvirt-driver)"
  start_ntp
  echo "export MMMESH_LIBVIRT_DRIVER=$driver"
}

down() {
  local running
  if libvirt_answers; then
    running="$(virsh_ list --name --state-running | sed '/^$/d')"
    if [ -n "$running" ]; then
      if [ "${1:-}" = --force ]; then
        while read -r d; do virsh_ destroy "$d" >/dev/null && log "destroyed domain $d"; done <<<"$running"
      else
        die "domains still run (vagrant destroy -f, or host.sh down --force): $(echo "$running" | tr '\n' ' ')"
      fi
    fi
    # a network's dnsmasq outlives libvirtd: stop the networks of a libvirtd we started
    if [ -f "$RUN/started-libvirtd" ]; then
      while read -r n; do
        [ -n "$n" ] || continue
        virsh_ net-destroy "$n" >/dev/null && log "stopped network $n"
      done < <(virsh_ net-list --name)
    fi
  fi
  stop_daemon libvirtd
  stop_daemon virtlogd
  stop_ntp
  restore_kvm_device
}

status() {
  local d pid
  for d in virtlogd libvirtd; do
    pid="$(cat "/run/$d.pid" 2>/dev/null || true)"
    if pid_alive "$pid" "$d"; then
      printf '%-9s running (pid %s)%s\n' "$d" "$pid" "$([ -f "$RUN/started-$d" ] && echo ', started by host.sh')"
    else
      printf '%-9s not running\n' "$d"
    fi
  done
  if libvirt_answers; then
    echo "domains:"; virsh_ list --all
    echo "networks:"; virsh_ net-list --all
  fi
  printf 'domain type: %s\n' "$(cat "$CACHE/libvirt-driver" 2>/dev/null || echo 'not probed yet')"
  pid="$(cat "$RUN/started-ntp" 2>/dev/null || true)"
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then echo "ntp       running (pid $pid)"; fi
}

case "${1:-up}" in
  up) up ;;
  probe) up force ;;
  down) down "${2:-}" ;;
  status) status ;;
  *) die "usage: host.sh [up|down [--force]|status|probe]" ;;
esac
