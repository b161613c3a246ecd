"""Checks of the deployment files that schemas alone miss (deploy/check.sh runs them).

kubernetes-validate checks each core manifest against the Kubernetes schema; this
module checks what ties the files together, so a rename in one file cannot leave
another pointing at nothing:

* ``k8s DIR``: every PodMonitor against ``DIR/schemas/podmonitor.json`` (the CRD is
  not in the core schema); kustomization resources == the manifest files; Service
  and PodMonitor selectors match the node pods; named ports, probes, mounts and
  projected keys exist; the ConfigMap's rdmakv.yaml is valid for ``rdmakv.config``
  and agrees with the pods (ports, token path, dns:// name, memory >= pool); the
  engine's ``--kv-transfer-config`` names a real connector class and options the
  connector accepts.
* ``dockerfile FILE``: the structure the image promises (multi-stage, no compiler in
  the runtime stage, non-root numeric USER, ports, HEALTHCHECK, ENTRYPOINT/CMD):
  what hadolint does not know about this project.
* ``config DIR``: print the ConfigMap's rdmakv.yaml (check.sh lints it).
* ``serve DIR METRICS_OUT``: run ``rdmakv serve --config`` on that rdmakv.yaml (made
  local by ``RDMAKV_NODE_*`` overrides: loopback, free ports, a small unlocked pool),
  wait for ``/readyz``, save ``/metrics`` to METRICS_OUT, stop it with SIGTERM and
  require exit status 0.

Every problem is printed as ``FILE: problem``; the exit status is 1 if there was any.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIG_KEY = "rdmakv.yaml"
NODE_LABEL = {"app.kubernetes.io/name": "rdmakv-node"}
POOL_HEADROOM = 512 << 20
"""Memory a node pod needs beyond its pool: the Python process and its sessions."""

Doc = dict[str, Any]
Problems = list[str]


def load_manifests(k8s_dir: Path) -> list[tuple[Path, Doc]]:
    """Every YAML document under ``k8s_dir`` (not recursing) but the kustomization."""
    out: list[tuple[Path, Doc]] = []
    for f in sorted(k8s_dir.glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                out.append((f, doc))
    return out


def _kind(docs: list[tuple[Path, Doc]], kind: str) -> list[tuple[Path, Doc]]:
    return [(f, d) for f, d in docs if d.get("kind") == kind]


def _one(docs: list[tuple[Path, Doc]], kind: str, problems: Problems) -> tuple[Path, Doc] | None:
    found = _kind(docs, kind)
    if len(found) != 1:
        problems.append(f"deploy/k8s: expected one {kind}, found {len(found)}")
        return None
    return found[0]


def parse_quantity(q: str | int) -> int:
    """A Kubernetes memory quantity (``9Gi``, ``512M``, ``1e9``) in bytes."""
    units = {
        "Ki": 1 << 10,
        "Mi": 1 << 20,
        "Gi": 1 << 30,
        "Ti": 1 << 40,
        "Pi": 1 << 50,
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
        "P": 10**15,
    }
    m = re.fullmatch(r"([0-9.eE+-]+?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?", str(q))
    if not m:
        raise ValueError(f"not a quantity: {q!r}")
    return int(float(m.group(1)) * units.get(m.group(2) or "", 1))


def podmonitor_problems(docs: list[tuple[Path, Doc]], schema_path: Path) -> Problems:
    """Each PodMonitor against the vendored CRD schema (jsonschema, draft 2020-12)."""
    import jsonschema  # type: ignore[import-untyped]

    schema = json.loads(schema_path.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    problems: Problems = []
    monitors = _kind(docs, "PodMonitor")
    if not monitors:
        problems.append("deploy/k8s: no PodMonitor found")
    for f, d in monitors:
        for err in sorted(validator.iter_errors(d), key=lambda e: list(e.path)):
            where = ".".join(str(p) for p in err.path) or "(document)"
            problems.append(
                f"{f}: PodMonitor {d.get('metadata', {}).get('name')}: {where}: {err.message}"
            )
    return problems


def kustomization_problems(k8s_dir: Path) -> Problems:
    """The kustomization lists exactly the manifest files, each existing."""
    kfile = k8s_dir / "kustomization.yaml"
    k = yaml.safe_load(kfile.read_text())
    listed = list(k.get("resources", []))
    problems = [
        f"{kfile}: resource {r} does not exist" for r in listed if not (k8s_dir / r).is_file()
    ]
    present = {f.name for f in k8s_dir.glob("*.yaml")} - {"kustomization.yaml"}
    problems += [f"{kfile}: {n} is not listed in resources" for n in sorted(present - set(listed))]
    return problems


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _container(pod_spec: Doc, problems: Problems, where: Path) -> Doc:
    cs = pod_spec.get("containers", [])
    if len(cs) != 1:
        problems.append(f"{where}: expected one container, found {len(cs)}")
    return cs[0] if cs else {}


def _pod_problems(f: Path, pod: Doc, container: Doc) -> Problems:
    """Named ports used by probes exist; every mount has a volume; projected keys exist."""
    problems: Problems = []
    ports = {p.get("name") for p in container.get("ports", [])}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        port = container.get(probe, {}).get("httpGet", {}).get("port")
        if isinstance(port, str) and port not in ports:
            problems.append(f"{f}: {probe} uses port {port!r}, not a container port name")
    volumes = {v["name"] for v in pod.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        if m["name"] not in volumes:
            problems.append(f"{f}: volumeMount {m['name']!r} has no volume")
    if pod.get("enableServiceLinks") is not False:
        problems.append(
            f"{f}: enableServiceLinks must be false (service variables named "
            "RDMAKV_NODE_* would be read as rdmakv config and refused)"
        )
    return problems


def _projected_files(pod: Doc, container: Doc) -> dict[str, tuple[str, str, str]]:
    """Path in the container -> (ConfigMap|Secret, object name, key), from projected volumes."""
    mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
    files: dict[str, tuple[str, str, str]] = {}
    for v in pod.get("volumes", []):
        if v["name"] not in mounts:
            continue
        base = mounts[v["name"]].rstrip("/")
        sources = v.get("projected", {}).get("sources", [])
        for kind, field in (("ConfigMap", "configMap"), ("Secret", "secret")):
            for s in [s[field] for s in sources if field in s] + ([v[field]] if field in v else []):
                for item in s.get("items", []):
                    files[f"{base}/{item['path']}"] = (kind, s["name"], item["key"])
    return files


def _data_keys(docs: list[tuple[Path, Doc]], kind: str, name: str) -> set[str] | None:
    for _, d in _kind(docs, kind):
        if d["metadata"]["name"] == name:
            return set(d.get("data", {})) | set(d.get("stringData", {}))
    return None


def config_text(docs: list[tuple[Path, Doc]]) -> tuple[Path, str]:
    """The rdmakv.yaml carried by the ConfigMap, and the file of that ConfigMap."""
    for f, d in _kind(docs, "ConfigMap"):
        if CONFIG_KEY in d.get("data", {}):
            return f, str(d["data"][CONFIG_KEY])
    raise LookupError(f"no ConfigMap carries {CONFIG_KEY}")


def _load_config(text: str, where: str, problems: Problems) -> Any:
    """rdmakv's own schema (rdmakv.config), with no RDMAKV_* variables applied."""
    import tempfile

    from rdmakv.config import load_config
    from rdmakv.errors import RdmakvError

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, CONFIG_KEY)
        path.write_text(text)
        try:
            return load_config(path, env={})
        except (RdmakvError, TypeError) as e:
            problems.append(f"{where}: {CONFIG_KEY} is not a valid rdmakv config: {e}")
            return None


def k8s_problems(k8s_dir: Path) -> Problems:
    """Everything in the module docstring's ``k8s`` item."""
    docs = load_manifests(k8s_dir)
    problems = podmonitor_problems(docs, k8s_dir / "schemas" / "podmonitor.json")
    problems += kustomization_problems(k8s_dir)

    sts_found = _one(docs, "StatefulSet", problems)
    svc_found = _one(docs, "Service", problems)
    if sts_found is None or svc_found is None:
        return problems
    sf, sts = sts_found
    vf, svc = svc_found
    pod = sts["spec"]["template"]["spec"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    node = _container(pod, problems, sf)
    ports = {p["name"]: p["containerPort"] for p in node.get("ports", [])}

    if not _matches(NODE_LABEL, labels):
        problems.append(f"{sf}: pod labels {labels} lack {NODE_LABEL}")
    if sts["spec"].get("serviceName") != svc["metadata"]["name"]:
        problems.append(
            f"{sf}: serviceName {sts['spec'].get('serviceName')!r} is not "
            f"the headless Service {svc['metadata']['name']!r} ({vf})"
        )
    if svc["spec"].get("clusterIP") != "None":
        problems.append(f"{vf}: clusterIP must be None (headless: one A record per node)")
    if not _matches(svc["spec"].get("selector", {}), labels):
        problems.append(f"{vf}: selector {svc['spec'].get('selector')} does not match {sf}")
    for p in svc["spec"].get("ports", []):
        if isinstance(p.get("targetPort"), str) and p["targetPort"] not in ports:
            problems.append(f"{vf}: targetPort {p['targetPort']!r} is not a port of {sf}")
    for f, pm in _kind(docs, "PodMonitor"):
        if _matches(pm["spec"]["selector"].get("matchLabels", {}), labels):
            for ep in pm["spec"].get("podMetricsEndpoints", []):
                if ep.get("port") not in ports:
                    problems.append(f"{f}: port {ep.get('port')!r} is not a port of {sf}")
    problems += _pod_problems(sf, pod, node)

    # The config the pods read, and that it agrees with the pods.
    try:
        cf, text = config_text(docs)
    except LookupError as e:
        return [*problems, f"deploy/k8s: {e}"]
    files = _projected_files(pod, node)
    args = node.get("command", []) + node.get("args", [])
    cfg_path = args[args.index("--config") + 1] if "--config" in args else None
    if cfg_path is None:
        problems.append(f"{sf}: the node container is not started with --config")
    elif files.get(cfg_path, ("", "", ""))[2] != CONFIG_KEY:
        problems.append(f"{sf}: --config {cfg_path} is not the mounted ConfigMap key {CONFIG_KEY}")
    for path, (kind, name, key) in files.items():
        keys = _data_keys(docs, kind, name)
        if keys is None or key not in keys:
            problems.append(f"{sf}: {path} needs key {key!r} of {kind} {name!r}: not found")
    where = str(cf)
    cfg = _load_config(text, where, problems)
    if cfg is None:
        return problems
    if cfg.node.port != ports.get("kv"):
        problems.append(f"{where}: node.port {cfg.node.port} != port kv {ports.get('kv')} ({sf})")
    if cfg.node.metrics_port != ports.get("metrics"):
        problems.append(
            f"{where}: node.metrics_port {cfg.node.metrics_port} != "
            f"port metrics {ports.get('metrics')} ({sf})"
        )
    for section in (cfg.node, cfg.client):
        if section.token_file is not None and section.token_file not in files:
            problems.append(f"{where}: token_file {section.token_file} is not mounted in {sf}")
    ns = svc["metadata"].get("namespace", "default")
    want = f"dns://{svc['metadata']['name']}.{ns}.svc.cluster.local:{ports.get('kv')}"
    if cfg.client.nodes != want:
        problems.append(f"{where}: client.nodes {cfg.client.nodes!r} should be {want!r}")
    limits = node.get("resources", {}).get("limits", {})
    mem = parse_quantity(limits.get("memory", 0))
    if mem < int(cfg.node.pool_size) + POOL_HEADROOM:
        problems.append(
            f"{sf}: memory limit {limits.get('memory')} < pool_size "
            f"{cfg.node.pool_size} + {POOL_HEADROOM >> 20} MiB (the pool is mlocked)"
        )
    if "rdma/rdma_shared_device_a" not in limits:
        problems.append(f"{sf}: no rdma/rdma_shared_device_a resource (no /dev/infiniband)")
    problems += engine_problems(docs, text)
    return problems


def _connector_classes(module: str) -> set[str]:
    """Class names defined in ``module`` (a file of this repo), without importing it
    (the vLLM connector imports vllm, which the project venv does not have)."""
    path = REPO / (module.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.ClassDef)}


def engine_problems(docs: list[tuple[Path, Doc]], config: str) -> Problems:
    """The engine's --kv-transfer-config: a real connector, options it accepts."""
    import tempfile

    from rdmakv.connectors.group_stores import CONFIG_OPTION, StoreOptions
    from rdmakv.errors import RdmakvError

    problems: Problems = []
    for f, d in _kind(docs, "Deployment"):
        pod = d["spec"]["template"]["spec"]
        c = _container(pod, problems, f)
        problems += _pod_problems(f, pod, c)
        args = c.get("args", [])
        if "--kv-transfer-config" not in args:
            problems.append(f"{f}: no --kv-transfer-config argument")
            continue
        try:
            kv = json.loads(args[args.index("--kv-transfer-config") + 1])
        except (IndexError, ValueError) as e:
            problems.append(f"{f}: --kv-transfer-config is not JSON: {e}")
            continue
        module = kv.get("kv_connector_module_path", "")
        try:
            classes = _connector_classes(module)
        except OSError:
            problems.append(f"{f}: kv_connector_module_path {module!r} is not a module here")
            continue
        if kv.get("kv_connector") not in classes:
            problems.append(f"{f}: {module} has no class {kv.get('kv_connector')!r}")
        extra = dict(kv.get("kv_connector_extra_config", {}))
        files = _projected_files(pod, c)
        with tempfile.TemporaryDirectory() as tmp:
            if CONFIG_OPTION in extra:
                path = extra[CONFIG_OPTION]
                if files.get(path, ("", "", ""))[2] != CONFIG_KEY:
                    problems.append(f"{f}: {CONFIG_OPTION} {path} is not the mounted {CONFIG_KEY}")
                extra[CONFIG_OPTION] = str(Path(tmp, CONFIG_KEY))
                Path(extra[CONFIG_OPTION]).write_text(config)
            try:
                StoreOptions.from_mapping(extra, env={})
            except RdmakvError as e:
                problems.append(f"{f}: the connector refuses kv_connector_extra_config: {e}")
    return problems


def _dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        buf = f"{buf} {s[:-1]}" if s.endswith("\\") else f"{buf} {s}"
        if not s.endswith("\\"):
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def dockerfile_problems(path: Path) -> Problems:
    """The image's promises, checked on the Dockerfile's text."""
    ins = _dockerfile_instructions(path.read_text())
    problems: Problems = []
    stages: list[list[tuple[str, str]]] = []
    for word, rest in ins:
        if word == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((word, rest))
    if len(stages) < 2:
        problems.append(f"{path}: not a multi-stage build ({len(stages)} FROM)")
        return problems
    names: set[str] = set()
    for st in stages:
        words = st[0][1].split()
        image = words[0]
        floating = image.endswith(":latest") or not any(c in image for c in ":@$")
        if floating and image not in names:
            problems.append(f"{path}: FROM {image}: pin a tag, not latest")
        if len(words) == 3 and words[1].upper() == "AS":
            names.add(words[2])
    final = stages[-1]
    final_runs = " ".join(r for w, r in final if w == "RUN")
    if re.search(r"\b(gcc|g\+\+|clang|build-essential|-dev)\b", final_runs):
        problems.append(f"{path}: the runtime stage installs a compiler or headers")
    if "COPY --from=" not in " ".join(f"COPY {r}" for w, r in final if w == "COPY"):
        problems.append(f"{path}: the runtime stage copies nothing from the build stage")
    build_runs = " ".join(r for st in stages[:-1] for w, r in st if w == "RUN")
    for need in ("libibverbs-dev", "gcc", "rdmakv._native_verbs"):
        if need not in build_runs:
            problems.append(f"{path}: the build stage does not mention {need}")
    if re.search(r"\btorch\b", " ".join(r for w, r in ins if w == "RUN")):
        problems.append(
            f"{path}: the image installs torch, which the node and the client do not need "
            "(it is the extra rdmakv[torch], for engine images)"
        )
    for w, r in ins:
        if w == "RUN" and "apt-get install" in r:
            if "--no-install-recommends" not in r:
                problems.append(f"{path}: apt-get install without --no-install-recommends")
            if "rm -rf /var/lib/apt/lists" not in r:
                problems.append(f"{path}: apt lists left in the layer")
    users = [r for w, r in final if w == "USER"]
    if not users or not re.fullmatch(r"[1-9][0-9]*(:[0-9]+)?", users[-1]):
        problems.append(
            f"{path}: the runtime stage must end as a numeric non-root USER "
            "(runAsNonRoot can only verify a number)"
        )
    exposed = {p.split("/")[0] for w, r in final if w == "EXPOSE" for p in r.split()}
    for port in ("7480", "9480"):
        if port not in exposed:
            problems.append(f"{path}: EXPOSE {port} missing")
    hc = [r for w, r in final if w == "HEALTHCHECK"]
    if not hc or "http://127.0.0.1:9480/healthz" not in hc[-1]:
        problems.append(f"{path}: HEALTHCHECK on http://127.0.0.1:9480/healthz missing")
    want = {"ENTRYPOINT": ["rdmakv"], "CMD": ["serve", "--config", "/etc/rdmakv/rdmakv.yaml"]}
    for word, value in want.items():
        got = [r for w, r in final if w == word]
        try:
            parsed = json.loads(got[-1]) if got else None
        except ValueError:
            parsed = shlex.split(got[-1])
        if parsed != value:
            problems.append(
                f"{path}: {word} should be {json.dumps(value)} (exec form), got "
                f"{got[-1] if got else 'none'}"
            )
    return problems


def serve_problems(k8s_dir: Path, metrics_out: Path, timeout: float = 90.0) -> Problems:
    """Start a real node from the ConfigMap's config; see the module docstring."""
    import os
    import signal
    import socket
    import subprocess
    import tempfile
    import time
    import urllib.error
    import urllib.request

    cf, text = config_text(load_manifests(k8s_dir))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp, CONFIG_KEY)
        cfg.write_text(text)
        token = Path(tmp, "token")
        token.write_text("check-token\n")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            mport = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("RDMAKV_")}
        env.update(
            RDMAKV_NODE_HOST="127.0.0.1",
            RDMAKV_NODE_PORT="0",
            RDMAKV_NODE_POOL_SIZE="64MiB",
            RDMAKV_NODE_LOCK_POOL="false",
            RDMAKV_NODE_TOKEN_FILE=str(token),
            RDMAKV_NODE_METRICS_HOST="127.0.0.1",
            RDMAKV_NODE_METRICS_PORT=str(mport),
        )
        rdmakv = Path(sys.executable).with_name("rdmakv")
        log = Path(tmp, "serve.log")
        with log.open("w") as out:
            proc = subprocess.Popen(
                [str(rdmakv), "serve", "--config", str(cfg)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        base = f"http://127.0.0.1:{mport}"
        problems: Problems = []
        try:
            deadline = time.monotonic() + timeout
            ready = False
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"{base}/readyz", timeout=2) as r:
                        ready = r.status == 200
                except (urllib.error.URLError, OSError):
                    pass
                if ready:
                    break
                time.sleep(0.5)
            if not ready:
                problems.append(
                    f"{cf}: rdmakv serve --config did not become ready "
                    f"(/readyz) in {timeout:.0f} s; exit {proc.poll()}"
                )
            else:
                with urllib.request.urlopen(f"{base}/healthz", timeout=5) as r:
                    if r.status != 200:
                        problems.append(f"{cf}: /healthz answered {r.status}")
                with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
                    metrics_out.write_bytes(r.read())
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
                problems.append(f"{cf}: rdmakv serve did not stop within 30 s of SIGTERM")
            if rc != 0 and not problems:
                problems.append(f"{cf}: rdmakv serve exited {rc} after SIGTERM")
            if problems:
                tail = log.read_text().splitlines()[-15:]
                problems.append("rdmakv serve output:\n  " + "\n  ".join(tail))
        return problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    usage = "check_manifests.py k8s DIR | dockerfile FILE | config DIR | serve DIR METRICS_OUT"
    if args[:1] == ["serve"] and len(args) == 3:
        problems = serve_problems(Path(args[1]), Path(args[2]))
        for p in problems:
            print(p, file=sys.stderr)
        if not problems:
            print(f"{args[1]}: rdmakv serve --config: ready, /metrics saved to {args[2]}")
        return 1 if problems else 0
    if len(args) != 2 or args[0] not in ("k8s", "dockerfile", "config"):
        print(f"usage: {usage}", file=sys.stderr)
        return 2
    what, target = args[0], Path(args[1])
    try:
        if what == "config":
            sys.stdout.write(config_text(load_manifests(target))[1])
            return 0
        problems = k8s_problems(target) if what == "k8s" else dockerfile_problems(target)
    except (OSError, yaml.YAMLError, LookupError, KeyError, ValueError) as e:
        print(f"{target}: cannot check: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print(f"{target}: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
