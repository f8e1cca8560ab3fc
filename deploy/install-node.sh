#!/usr/bin/env bash
# Installs qosd (and mmmeshctl) on a Debian 12 / Ubuntu 22.04+ node from built
# artifacts, as an operator would: no checkout, no developer bootstrap, no
# registry (docs/operations.md, "Installing from a wheel").  Idempotent; root.
#
#   install-node.sh --wheelhouse DIR [--extras qosd,ctl] [--images DIR] [--deps-only]
#
#   --wheelhouse DIR  mmmesh-<version>-*.whl and the wheels of its
#                     dependencies (vagrant/artifacts.sh makes one: `pip wheel
#                     'mmmesh[qosd,ctl]'`); installed with pip --no-index
#   --extras LIST     the extras it must provide (default qosd,ctl; the testbed adds demo):
#                     checked after the install (`pip check` of what they require); the
#                     wheelhouse decides what is installed
#   --images DIR      container images saved with `podman save` (*.tar): loaded
#                     into podman's storage unless an image of that id is there
#   --deps-only       the dependencies only, not mmmesh itself, no unit (what a
#                     node image bakes in: vagrant/box/node.sh)
#
# What it does:
# 1. Debian packages the daemon needs and pip cannot bring: python3-bpfcc (bcc),
#    python3-venv, libbpf1, iproute2 (apt only for what is missing);
# 2. checks the kernel headers bcc compiles against (/lib/modules/$(uname -r)/build;
#    installs linux-headers-$(uname -r) when apt has it, never touches a link);
# 3. the virtualenv /opt/mmmesh/.venv made by Debian's python3 with
#    --system-site-packages (bcc is Debian's), every wheel of the wheelhouse into it
#    as it is (--no-deps: the wheelhouse was resolved where it was built), mmmesh's
#    again whenever its sha256 changed (kept in /opt/mmmesh/.venv/.mmmesh-wheel); the
#    BPF C comes in the wheel (<venv>/share/mmmesh/bpf, where the loader finds it);
# 4. the unit the wheel carries (qosd/qosd.service) to /etc/systemd/system,
#    checked with systemd-analyze verify, daemon-reload (enabling and starting
#    it is the caller's: `systemctl enable --now qosd` once /etc/mmmesh/qosd.yaml
#    is written);
# 5. --images: podman load.
#
# Environment: MMMESH_PREFIX (default /opt/mmmesh: the unit's ExecStart is
# /opt/mmmesh/.venv/bin/qosd; another prefix needs a drop-in for ExecStart=),
# MMMESH_INSTALL_ROOT (a directory standing for /, for building images:
# no apt, no systemctl, no kernel checks).
set -euo pipefail

PREFIX="${MMMESH_PREFIX:-/opt/mmmesh}"
VENV="$PREFIX/.venv"
WHEELHOUSE="" EXTRAS="qosd,ctl" IMAGES="" DEPS_ONLY=0
log() { printf '[install-node] %s\n' "$*" >&2; }
die() { printf '[install-node] error: %s\n' "$*" >&2; exit 1; }
while [ $# -gt 0 ]; do
  case "$1" in
    --wheelhouse) WHEELHOUSE="${2:?}"; shift 2 ;;
    --extras) EXTRAS="${2:?}"; shift 2 ;;
    --images) IMAGES="${2:?}"; shift 2 ;;
    --deps-only) DEPS_ONLY=1; shift ;;
    -h | --help) sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (--help)" ;;
  esac
done
[ "$(id -u)" -eq 0 ] || die "run as root"
if [ -z "$WHEELHOUSE" ] || [ ! -d "$WHEELHOUSE" ]; then
  die "--wheelhouse DIR is required (a directory of wheels)"
fi
WHEELHOUSE="$(cd "$WHEELHOUSE" && pwd)"
shopt -s nullglob
wheels=("$WHEELHOUSE"/mmmesh-*.whl)
[ "${#wheels[@]}" -le 1 ] || die "more than one mmmesh wheel in $WHEELHOUSE: ${wheels[*]}"
[ "$DEPS_ONLY" = 1 ] || [ "${#wheels[@]}" -eq 1 ] || die "no mmmesh-*.whl in $WHEELHOUSE"
WHEEL="${wheels[0]:-}"
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

# --- 1. Debian packages ------------------------------------------------------
PKGS=(python3-bpfcc python3-venv libbpf1 iproute2)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- 2. kernel headers (bcc compiles at load time) --------------------------------
if [ "$DEPS_ONLY" = 0 ] && [ -z "${MMMESH_INSTALL_ROOT:-}" ]; then
  KDIR="/lib/modules/$(uname -r)"
  if [ ! -e "$KDIR/build" ]; then
    log "no kernel headers at $KDIR/build: trying linux-headers-$(uname -r)"
    apt-get install -y -qq --no-install-recommends "linux-headers-$(uname -r)" >/dev/null ||
      die "install the headers of the running kernel ($KDIR/build); docs/operations.md, \"Installing on a node\""
  fi
fi

# --- 3. the virtualenv and the wheels --------------------------------------------------
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import bcc" >/dev/null 2>&1; then
  log "creating $VENV (Debian's python3, --system-site-packages: bcc)"
  rm -rf "$VENV"
  mkdir -p "$PREFIX"
  /usr/bin/python3 -m venv --system-site-packages "$VENV"
fi
# The wheelhouse is a complete, consistent set (`pip wheel` resolved it where it was
# built): its wheels are installed as they are, with --no-deps, and pip's resolver
# (minutes under emulation for ~50 wheels) never runs.  What was installed is
# stamped: the dependencies by the names of their wheels, mmmesh by its sha256.
PIP=("$VENV/bin/python" -m pip install --no-index --no-deps -q)
deps=()
for w in "$WHEELHOUSE"/*.whl; do case "$(basename "$w")" in mmmesh-*) ;; *) deps+=("$w") ;; esac; done
deps_stamp="$(for w in "${deps[@]}"; do basename "$w"; done | sort | sha256sum | cut -d' ' -f1)"
t0=$SECONDS
if [ "$(cat "$VENV/.mmmesh-deps" 2>/dev/null)" = "$deps_stamp" ]; then
  log "dependencies: ${#deps[@]} wheels installed already"
else
  [ "${#deps[@]}" -gt 0 ] || die "no dependency wheels in $WHEELHOUSE"
  "${PIP[@]}" "${deps[@]}"
  rm -f "$VENV/.mmmesh-wheel" # mmmesh itself again (and checked) on top of new dependencies
  echo "$deps_stamp" >"$VENV/.mmmesh-deps"
  log "dependencies installed into $VENV: ${#deps[@]} wheels in $((SECONDS - t0)) s"
fi
INSTALLED=0 # something was installed in this run: check it (Python starts are slow emulated)
if [ "$DEPS_ONLY" = 0 ]; then
  sha="$(sha256sum "$WHEEL" | cut -d' ' -f1)"
  t0=$SECONDS
  if [ "$(cat "$VENV/.mmmesh-wheel" 2>/dev/null)" = "$sha" ] && [ "$INSTALLED" = 0 ]; then
    log "$(basename "$WHEEL") is installed already"
  else
    INSTALLED=1
    # a rebuilt wheel has the same version: without --force-reinstall pip keeps the old files
    "${PIP[@]}" --force-reinstall "$WHEEL"
    echo "$sha" >"$VENV/.mmmesh-wheel"
    log "installed $(basename "$WHEEL") into $VENV in $((SECONDS - t0)) s"
  fi
fi
if [ "$INSTALLED" = 1 ]; then
  bpf="$("$VENV/bin/python" -c 'from mmmesh.dataplane._bcc import bpf_dir; print(bpf_dir())')"
  [ -f "$bpf/mm_tc.c" ] || die "the installed wheel has no BPF sources ($bpf)"
  # what mmmesh[EXTRAS] requires is installed, at versions it accepts (no resolver:
  # the installed metadata against the wheel's requirements)
  "$VENV/bin/python" - "$EXTRAS" <<'PY' || die "the wheelhouse lacks what mmmesh[$EXTRAS] needs"
import sys
from importlib.metadata import PackageNotFoundError, requires, version
from pip._vendor.packaging.requirements import Requirement

todo, done, missing = {""} | set(sys.argv[1].split(",")), set(), []
while todo:
    extra = todo.pop()
    done.add(extra)
    for text in requires("mmmesh") or []:
        r = Requirement(text)
        if (r.marker is None) != (extra == ""):
            continue  # the base requirements once (extra ""), each extra's by its marker
        if r.marker is not None and not r.marker.evaluate({"extra": extra}):
            continue
        if r.name == "mmmesh":
            todo |= set(r.extras) - done
            continue
        try:
            v = version(r.name)
        except PackageNotFoundError:
            missing.append(str(r))
            continue
        if r.specifier and not r.specifier.contains(v, prereleases=True):
            missing.append(f"{r} (installed {v})")
if missing:
    sys.exit("missing: " + ", ".join(sorted(set(missing))))
PY
fi

# --- 4. the unit ---------------------------------------------------------------------
if [ "$DEPS_ONLY" = 0 ]; then
  R="${MMMESH_INSTALL_ROOT:-}"
  unit_src="$(find "$VENV"/lib/python3*/site-packages/qosd -maxdepth 1 -name qosd.service | head -1)"
  [ -n "$unit_src" ] || die "the installed wheel has no qosd/qosd.service"
  unit="$R/etc/systemd/system/qosd.service"
  unit_changed=0
  if ! cmp -s "$unit_src" "$unit"; then
    install -D -m 0644 "$unit_src" "$unit"
    log "installed $unit (from the wheel)"
    unit_changed=1
  fi
  if [ -z "$R" ] && [ -d /run/systemd/system ] && [ "$unit_changed" = 1 ]; then
    said="$(systemd-analyze verify "$unit" 2>&1)" || die "systemd-analyze verify $unit: $said"
    if grep -q "qosd.service" <<<"$said"; then die "systemd-analyze verify: $said"; fi
    systemctl daemon-reload
  fi
fi

# --- 5. container images ------------------------------------------------------------
if [ -n "$IMAGES" ]; then
  command -v podman >/dev/null || die "--images needs podman"
  for tar in "$IMAGES"/*.tar; do
    id_file="${tar%.tar}.id" # written beside the archive by vagrant/artifacts.sh
    if [ -s "$id_file" ] && podman image exists "$(cat "$id_file")"; then
      continue
    fi
    t0=$SECONDS
    podman load -q -i "$tar" >/dev/null
    log "podman load $(basename "$tar") in $((SECONDS - t0)) s"
  done
fi
log "done"
