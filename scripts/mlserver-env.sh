#!/usr/bin/env bash
# Idempotent: a separate virtualenv at .venv-mlserver holding MLServer, the
# real KServe v2 / Open Inference Protocol server that tests/sidecar/test_kserve.py
# runs the kserve runners against.  Separate because MLServer pins its own
# fastapi / uvicorn / pydantic / grpcio versions.  Skips when the stamp file
# matches the wanted requirement set.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-mlserver"
REQS=("mlserver==1.7.1" "kserve==0.16.0")
STAMP="$VENV/.mmmesh-mlserver-installed"
WANT="$(printf '%s\n' "${REQS[@]}" | sha256sum | cut -d' ' -f1)"
log() { printf '[mlserver-env] %s\n' "$*" >&2; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/mlserver" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  /usr/bin/python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
log "installing ${REQS[*]} into $VENV"
"$VENV/bin/python" -m pip install -q "${REQS[@]}"
"$VENV/bin/mlserver" --help >/dev/null
echo "$WANT" > "$STAMP"
log "ready: $("$VENV/bin/python" -m pip show mlserver 2>/dev/null | grep -i '^version')"
