#!/usr/bin/env bash
# Engine test environment: create or refresh .venv-engines (inside the project
# dir, so the soft-RoCE VM and CI see it too) with the real vLLM and SGLang
# classes on CPU, then run tests/engines/ with it.
#
#   bash deploy/engines.sh            # create/refresh the venv, run tests/engines/
#   bash deploy/engines.sh setup      # only create/refresh the venv
#   bash deploy/engines.sh test [ARGS]# only run the tests (pytest ARGS appended)
#
# Why it looks like this (see docs/engines.md):
# * vllm 0.33.0 pins torch==2.14.0 and sglang 0.5.23 pins torch==2.14.1; a normal
#   install pulls several GB of CUDA wheels. Both go in with --no-deps beside the
#   local CPU torch==2.13.0, and a constraints file keeps any dependency from
#   replacing torch. pip's "incompatible torch" warnings are expected.
# * Their runtime deps are pinned to versions checked together on 2026-11-22.
# * torchvision cannot be installed (PyPI wheels fail against the local torch);
#   the SGLang tests work around sglang's unguarded `import torchvision` in test
#   setup code (tests/engines/conftest.py), never by editing site-packages.
#
# Environment: RDMAKV_ENGINES_VENV (default .venv-engines), PYTHON (default python3.11,
# else python3).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${RDMAKV_ENGINES_VENV:-$ROOT/.venv-engines}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3 || echo python3)}
MODE=${1:-all}
[[ $# -gt 0 ]] && shift

log() { echo "[engines $(date -u +%H:%M:%S)] $*"; }
die() { echo "[engines] FAIL: $*" >&2; exit 1; }
trap 'echo "[engines] FAIL: command at line $LINENO exited with $?" >&2' ERR

TORCH_SPEC="torch==2.13.0"   # the local CPU build; any other spec pulls CUDA
ENGINES="vllm==0.33.0 sglang==0.5.23"
# Imported by sglang's host memory pool; their own dependency trees are not needed.
NO_DEPS_EXTRAS="compressed-tensors==0.20.0 gguf==0.19.0 loguru==0.7.3"
RUNTIME_DEPS=(
  pydantic==2.14.3 msgspec==0.22.0 cloudpickle==3.1.2 pyzmq==27.3.0 regex==2026.11.15
  cachetools==8.0.1 psutil==7.2.2 pyyaml==6.0.3 cbor2==6.2.1 blake3==1.0.11 tqdm==4.70.1
  requests==2.34.2 filelock==4.2.11 transformers==5.20.2 sentencepiece==0.2.3
  protobuf==7.36.2 pybase64==1.5.1 setproctitle==1.3.8 openai==3.54.0 aiohttp==3.14.5
  oss-harmony==0.0.11 pillow==13.0.0 uvloop==0.23.0 py-cpuinfo==9.0.0
  prometheus_client==0.26.0 xgrammar==0.2.8 fastapi==0.165.0
  partial_json_parser==0.2.1.1.post7 llguidance==1.7.6 orjson==3.13.0 ipython==9.18.1
  einops==0.8.2 dill==0.4.1
  # bench/serve.py's plots
  matplotlib==3.11.2
  # rdmakv itself and the test runner
  numpy==2.4.6 "cffi>=1.16" "xxhash>=4.1" "pytest>=8" "pytest-timeout>=2.3"
)
# Changing anything above invalidates the stamp and refreshes the venv.
STAMP_TEXT="$TORCH_SPEC|$ENGINES|$NO_DEPS_EXTRAS|${RUNTIME_DEPS[*]}"

# pip install, minus the noise of local mirrors lacking a package (not an error).
pip_install() {
  "$VENV/bin/python" -m pip install --progress-bar off "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

setup() {
  command -v "$PYTHON" >/dev/null || die "$PYTHON not found (set PYTHON=...)"
  if [[ ! -x $VENV/bin/python ]]; then
    log "creating $VENV with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
  fi
  local stamp=$VENV/.rdmakv-engines-stamp
  if [[ -f $stamp && "$(cat "$stamp")" == "$STAMP_TEXT" ]]; then
    log "$VENV is up to date (delete $stamp to force a refresh)"
    return
  fi
  local pip=(pip_install)
  local cons=$VENV/rdmakv-constraints.txt
  echo "$TORCH_SPEC" > "$cons"
  local t0=$SECONDS
  log "1/4 $TORCH_SPEC (CPU)"
  "${pip[@]}" "$TORCH_SPEC"
  log "2/4 $ENGINES and $NO_DEPS_EXTRAS (--no-deps: their torch pins would pull CUDA)"
  # shellcheck disable=SC2086
  "${pip[@]}" --no-deps $ENGINES $NO_DEPS_EXTRAS
  log "3/4 runtime dependencies (pinned; torch held at ${TORCH_SPEC#torch==})"
  "${pip[@]}" -c "$cons" "${RUNTIME_DEPS[@]}"
  log "4/4 checking imports"
  local v=$VENV/bin/python
  "$v" -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__' \
    || die "torch was replaced: $("$v" -c 'import torch; print(torch.__version__)')"
  VLLM_TARGET_DEVICE=cpu "$v" -c '
import vllm.distributed.kv_transfer.kv_connector.v1.base, vllm.config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
print("vllm", vllm.__version__, "imports ok")' || die "vllm does not import"
  "$v" -c '
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
print("sglang hicache imports ok")' || die "sglang does not import"
  echo "$STAMP_TEXT" > "$stamp"
  log "venv ready in $((SECONDS - t0)) s ($(du -sh "$VENV" | cut -f1))"
}

run_tests() {
  [[ -x $VENV/bin/python ]] || die "$VENV missing: run 'bash deploy/engines.sh setup' first"
  log "running tests/engines/ with $VENV"
  cd "$ROOT"
  # rdmakv from this checkout (the node processes inherit PYTHONPATH).
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" VLLM_TARGET_DEVICE=cpu \
    RDMAKV_REQUIRE_ENGINES=1 \
    "$VENV/bin/python" -m pytest -p no:cacheprovider -q -rs tests/engines "$@"
  log "tests/engines passed"
}

case $MODE in
  all) setup; run_tests "$@" ;;
  setup) setup ;;
  test) run_tests "$@" ;;
  *) die "unknown mode '$MODE' (all | setup | test)" ;;
esac
