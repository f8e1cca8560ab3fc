#!/usr/bin/env bash
# Builds, on the host, what the testbed's VMs install (vagrant/README.md,
# "What is installed, and from what"): idempotent, root.
#
#   artifacts.sh            build what changed; print nothing on stdout
#   artifacts.sh --key      print the dependency key (the node box's, vagrant/box/node.sh)
#
# Into vagrant/.artifacts/ (git-ignored; synced to /opt/mmmesh-artifacts in every VM):
#   wheelhouse/   mmmesh-<version>-<tags>.whl, built from this checkout (with
#                 the BPF sources and the unit: pyproject.toml), and the wheels of
#                 every dependency of mmmesh[qosd,ctl,demo] for the VMs' Python
#                 (Debian 12's 3.11, as the host's .venv): deploy/install-node.sh
#                 installs them with pip --no-index, nothing comes from PyPI in a VM
#   images/sidecar.tar, .id   the sidecar image (sidecar/Dockerfile) built with podman
#                 FROM a Debian base made here from Debian packages (mmdebstrap |
#                 podman import; no registry), `podman save`d
#   KEYS          the dependency key, the wheel's sha256, the image id
#
# Caches under $MMMESH_VM_CACHE (default /var/cache/mmmesh-vm):
#   wheels/<deps key>/   the dependency wheels, keyed by pyproject.toml's dependency
#                        tables and the extras (a code change rebuilds only mmmesh's wheel)
#   images/base-<key>.tar  the base image's root file system (mmdebstrap)
# and podman's own layer cache: a code change rebuilds the image's last layers only.
#
# Environment: MMMESH_VM_CACHE, MMMESH_MIRROR (Debian mirror for the base image),
# MMMESH_ARTIFACTS (output directory, default vagrant/.artifacts).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
CACHE="${MMMESH_VM_CACHE:-/var/cache/mmmesh-vm}"
OUT="${MMMESH_ARTIFACTS:-$HERE/.artifacts}"
MIRROR="${MMMESH_MIRROR:-http://deb.debian.org/debian}"
EXTRAS=qosd,ctl,demo
PY="$REPO/.venv/bin/python" # Debian's python3.11 venv (scripts/bootstrap.sh): the VMs' Python
BASE_TAG=bookworm-mm-slim    # localhost/debian:<this>: sidecar/Dockerfile's DEBIAN build argument
BASE_PKGS=ca-certificates    # minbase + these; the Dockerfile installs python3 itself
SIDECAR_IMAGE=localhost/mmmesh/sidecar:0.1.0
T0=$SECONDS

log() { printf '[artifacts.sh %3ds] %s\n' "$((SECONDS - T0))" "$*" >&2; }
die() { printf '[artifacts.sh] error: %s\n' "$*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "run as root (podman, mmdebstrap)"
[ -x "$PY" ] || die "$PY is missing: run scripts/bootstrap.sh first"

# The dependency key: pyproject.toml's dependency tables (not the rest: a version
# of setuptools' data-files changes no dependency), the extras, the Python.
deps_key() {
  "$PY" - "$REPO/pyproject.toml" "$EXTRAS" <<'EOF'
import hashlib, json, sys, sysconfig, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
doc = {"deps": p.get("dependencies"), "extras": p.get("optional-dependencies"),
       "want": sys.argv[2], "py": sysconfig.get_platform() + sys.version.split()[0]}
print(hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16])
EOF
}
KEY="$(deps_key)"
if [ "${1:-}" = --key ]; then echo "$KEY"; exit 0; fi

exec 9>"$CACHE/artifacts.lock"
flock -w 1800 9 || die "another artifacts.sh holds $CACHE/artifacts.lock"
mkdir -p "$CACHE/wheels" "$CACHE/images" "$OUT/wheelhouse" "$OUT/images"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# --- the mmmesh wheel (every time: seconds) --------------------------------------------
# built from a copy of what the wheel holds, so the checkout gets no build/ or egg-info
mkdir -p "$TMP/src"
(cd "$REPO" && cp -r pyproject.toml README.md bpf mmmesh qosd sidecar mmmeshctl demo "$TMP/src/")
find "$TMP/src" -name __pycache__ -prune -exec rm -rf {} +
find "$TMP/src" -name '*.so' -delete # in-tree builds: the wheel compiles its own
(cd "$TMP/src" && "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$TMP/wheel" . \
  >"$TMP/wheel.log" 2>&1) || { cat "$TMP/wheel.log" >&2; die "building the mmmesh wheel failed"; }
WHEEL="$(ls "$TMP"/wheel/mmmesh-*.whl)"
SHA="$(sha256sum "$WHEEL" | cut -d' ' -f1)"
# the same content gives another zip (timestamps): keep the old file when RECORD agrees
# (rsync to the VMs and install-node.sh then skip it)
record() { unzip -p "$1" '*.dist-info/RECORD' | sort; }
old="$(find "$OUT/wheelhouse" -name "mmmesh-*.whl" | head -1)"
if [ -n "$old" ] && [ "$(record "$old")" = "$(record "$WHEEL")" ]; then
  SHA="$(sha256sum "$old" | cut -d' ' -f1)"
  log "mmmesh wheel unchanged: $(basename "$old")"
else
  rm -f "$OUT"/wheelhouse/mmmesh-*.whl
  cp "$WHEEL" "$OUT/wheelhouse/"
  log "mmmesh wheel: $(basename "$WHEEL") (sha256 ${SHA:0:12})"
fi

# --- the dependency wheels (once per key) -------------------------------------------------
DEPS="$CACHE/wheels/$KEY"
if [ ! -f "$DEPS/.complete" ]; then
  log "dependency wheels for mmmesh[$EXTRAS] (key $KEY): pip wheel ..."
  rm -rf "$DEPS.tmp"
  "$PY" -m pip wheel -q --wheel-dir "$DEPS.tmp" "${WHEEL}[${EXTRAS}]" >"$TMP/deps.log" 2>&1 ||
    { tail -30 "$TMP/deps.log" >&2; die "pip wheel failed"; }
  rm -f "$DEPS.tmp"/mmmesh-*.whl
  touch "$DEPS.tmp/.complete"
  rm -rf "$DEPS"
  mv "$DEPS.tmp" "$DEPS"
  find "$CACHE/wheels" -mindepth 1 -maxdepth 1 ! -name "$KEY" ! -name "$KEY.image" -exec rm -rf {} +
  log "dependency wheels: $(find "$DEPS" -name '*.whl' | wc -l) wheels, $(du -sh "$DEPS" | cut -f1)"
fi
# the wheelhouse = mmmesh's wheel + hard links to the cached dependencies (mtimes kept:
# rsync leaves the copies a node box baked in alone)
for w in "$DEPS"/*.whl; do
  [ -e "$OUT/wheelhouse/$(basename "$w")" ] || ln "$w" "$OUT/wheelhouse/" 2>/dev/null ||
    cp -p "$w" "$OUT/wheelhouse/"
done
for w in "$OUT"/wheelhouse/*.whl; do
  b="$(basename "$w")"
  case "$b" in mmmesh-*) continue ;; esac
  [ -e "$DEPS/$b" ] || rm -f "$w"
done

# the sidecar image's wheels (its build installs from them, offline: the build
# containers do not trust this host's TLS interception, and need no registry)
IMAGE_WHEELS="$CACHE/wheels/$KEY.image"
if [ ! -f "$IMAGE_WHEELS/.complete" ]; then
  log "the sidecar image's wheels: pip wheel mmmesh[sidecar,sidecar-kserve] pip setuptools wheel ..."
  rm -rf "$IMAGE_WHEELS.tmp"
  "$PY" -m pip wheel -q --wheel-dir "$IMAGE_WHEELS.tmp" "${WHEEL}[sidecar,sidecar-kserve]" \
    pip setuptools wheel >"$TMP/image-wheels.log" 2>&1 ||
    { tail -30 "$TMP/image-wheels.log" >&2; die "pip wheel (image) failed"; }
  rm -f "$IMAGE_WHEELS.tmp"/mmmesh-*.whl
  touch "$IMAGE_WHEELS.tmp/.complete"
  rm -rf "$IMAGE_WHEELS"
  mv "$IMAGE_WHEELS.tmp" "$IMAGE_WHEELS"
fi

# --- the base image (Debian packages, no registry) ---------------------------------------
command -v podman >/dev/null || die "podman is missing (scripts/bootstrap.sh test installs it)"
command -v mmdebstrap >/dev/null || die "mmdebstrap is missing (scripts/bootstrap.sh test installs it)"
BASE_RECIPE=2 # bump when the mmdebstrap command below changes
BASE_KEY="$(printf '%s\n' "$MIRROR" "$BASE_PKGS" "$BASE_RECIPE" | sha256sum | cut -c1-16)"
BASE_TAR="$CACHE/images/base-$BASE_KEY.tar"
if [ ! -s "$BASE_TAR" ]; then
  log "base image: mmdebstrap --variant=minbase bookworm ..."
  # what a slim image leaves out: docs, man pages, locales (dpkg path-excludes), and
  # apt's downloads and caches after every run (as Debian's official images do;
  # mmdebstrap keeps --aptopt and --dpkgopt in the image)
  APT_CLEAN='rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true' 
  mmdebstrap --variant=minbase --mode=root --format=tar --include="$BASE_PKGS" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --aptopt='Acquire::Retries "3"' \
    --aptopt="DPkg::Post-Invoke {\"$APT_CLEAN\";}" --aptopt="APT::Update::Post-Invoke {\"$APT_CLEAN\";}" \
    --aptopt='Dir::Cache::pkgcache ""' --aptopt='Dir::Cache::srcpkgcache ""' \
    bookworm "$BASE_TAR.tmp" "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
    >"$TMP/mmdebstrap.log" 2>&1 || { tail -20 "$TMP/mmdebstrap.log" >&2; die "mmdebstrap failed"; }
  mv "$BASE_TAR.tmp" "$BASE_TAR"
  find "$CACHE/images" -name 'base-*.tar' ! -name "base-$BASE_KEY.tar" -delete
fi
if [ "$(podman image inspect -f '{{index .Labels "org.mmmesh.base-key"}}' \
  "localhost/debian:$BASE_TAG" 2>/dev/null)" != "$BASE_KEY" ]; then
  podman import -q --change "LABEL org.mmmesh.base-key=$BASE_KEY" --change 'CMD ["bash"]' \
    "$BASE_TAR" "localhost/debian:$BASE_TAG" >/dev/null
  log "base image localhost/debian:$BASE_TAG imported (key $BASE_KEY)"
fi

# --- the sidecar image (podman's layer cache: only what changed is rebuilt) ---------------
podman build -q --pull=never --network=host --isolation=chroot --layers \
  -v "$IMAGE_WHEELS:/wheels:ro" --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/wheels \
  --build-arg "DEBIAN=$BASE_TAG" -f "$REPO/sidecar/Dockerfile" -t "$SIDECAR_IMAGE" "$REPO" \
  >"$TMP/build.log" 2>&1 || { tail -30 "$TMP/build.log" >&2; die "podman build (sidecar) failed"; }
IMAGE_ID="$(podman image inspect -f '{{.Id}}' "$SIDECAR_IMAGE")"
if [ "$(cat "$OUT/images/sidecar.id" 2>/dev/null)" != "$IMAGE_ID" ] || [ ! -s "$OUT/images/sidecar.tar" ]; then
  rm -f "$OUT/images/sidecar.tar"
  podman save -q --format docker-archive -o "$OUT/images/sidecar.tar" "$SIDECAR_IMAGE"
  echo "$IMAGE_ID" >"$OUT/images/sidecar.id"
  log "sidecar image $SIDECAR_IMAGE (${IMAGE_ID:0:12}) saved: $(du -h "$OUT/images/sidecar.tar" | cut -f1)"
fi
# untagged images this script made earlier (they carry the base's label)
podman image prune -f --filter label=org.mmmesh.base-key >/dev/null 2>&1 || true

printf 'deps %s\nwheel %s\nimage %s\n' "$KEY" "$SHA" "$IMAGE_ID" >"$OUT/KEYS"
log "done: $OUT (deps $KEY, wheel ${SHA:0:12}, image ${IMAGE_ID:0:12})"
