#!/usr/bin/env bash
# Everything the testbed needs on the host before `vagrant up` (vagrant/README.md),
# each step idempotent and cached (a second run takes seconds); as root:
#
#   eval "$(vagrant/prepare.sh)"
#
# 1. vagrant/box/host.sh up     libvirt, QEMU, vagrant-libvirt; libvirtd and virtlogd
#                               (by hand when PID 1 is not systemd); KVM or emulation
#                               (probed): prints `export MMMESH_LIBVIRT_DRIVER=...`
# 2. vagrant/artifacts.sh       the mmmesh wheel, its dependencies' wheels, the sidecar
#                               image (podman, FROM a base made from Debian packages)
# 3. vagrant/box/build.sh       the box mmmesh/bookworm (Debian packages only)
# 4. vagrant/box/node.sh        mmmesh/bookworm-node: that box with the dependencies
#                               installed (the Vagrantfile's default box)
#
# Afterwards: cd vagrant && vagrant up ... vagrant destroy -f && box/host.sh down
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ "$(id -u)" -eq 0 ] || { echo "[prepare.sh] run as root" >&2; exit 1; }
t0=$SECONDS
exports="$("$HERE/box/host.sh" up)"
"$HERE/artifacts.sh"
"$HERE/box/build.sh"
"$HERE/box/node.sh"
printf '[prepare.sh] ready in %d s\n' "$((SECONDS - t0))" >&2
echo "$exports"
