#!/usr/bin/env bash
# rdmakv's set-up entry point on a fresh machine (see README):
#   deploy/dev.sh demo [ARGS...]   create .venv, install rdmakv (no extras: no torch),
#                                  run `rdmakv demo`
#   deploy/dev.sh test [PYTEST ARGS...]
#                                  install the dev extras (torch among them), run ruff,
#                                  mypy and pytest
#   deploy/dev.sh env              only create/refresh .venv with the dev extras
# The venv lives in the project directory (.venv) so the soft-RoCE VM, which
# mounts only this directory read-write, can use it too.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv

# ensure_venv base|dev: rdmakv alone (what the demo needs), or with the dev extras.
ensure_venv() {
  local want=$1
  if [[ ! -x $VENV/bin/python ]]; then
    echo "[rdmakv] creating $VENV with $($PY --version 2>&1)"
    "$PY" -m venv "$VENV"
  fi
  # Reinstall only when the project metadata or the native sources changed, or the
  # dev extras are wanted where only rdmakv went in; a dev install serves the demo too.
  local stamp=$VENV/.rdmakv-installed sig have spec=.
  sig=$({ cat pyproject.toml setup.py; cat native/* 2>/dev/null || true; } | sha256sum | cut -c1-16)
  have=$(cat "$stamp" 2>/dev/null || true)
  if [[ $have == "$sig dev" || $have == "$sig $want" ]]; then
    return
  fi
  if [[ $want == dev ]]; then
    spec=".[dev]"
    echo "[rdmakv] installing rdmakv[dev] into $VENV (torch==2.13.0: the local CPU build)"
  else
    echo "[rdmakv] installing rdmakv into $VENV"
  fi
  "$VENV/bin/python" -m pip install -q -e "$spec" 2> >(grep -v "is ignored: it is neither" >&2)
  echo "$sig $want" > "$stamp"
}

cmd=${1:-}
shift || true
case "$cmd" in
  demo)
    ensure_venv base
    exec "$VENV/bin/rdmakv" demo "$@"
    ;;
  test)
    ensure_venv dev
    echo "[rdmakv] ruff"
    "$VENV/bin/ruff" check rdmakv tests bench
    echo "[rdmakv] mypy"
    "$VENV/bin/mypy" rdmakv
    echo "[rdmakv] pytest"
    exec "$VENV/bin/python" -m pytest -q "$@"
    ;;
  env)
    ensure_venv dev
    ;;
  *)
    echo "usage: deploy/dev.sh demo|test|env [ARGS...]" >&2
    exit 2
    ;;
esac
