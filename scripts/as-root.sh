# Sourced by the README's commands: run the calling script as root.  From a
# root shell (minimal images and CI containers often have no sudo) it does
# nothing; otherwise it re-runs the script through sudo when there is one.
# Usage: . "$(dirname "$0")/as-root.sh" "$0" "$@"
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    exec sudo --preserve-env=CI "$@"
  fi
  echo "$(basename "$1"): run as root (BPF, qdiscs and network namespaces need it)" >&2
  exit 1
fi
