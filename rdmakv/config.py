"""rdmakv's one configuration: a YAML file with ``node``, ``client``, ``tcp`` and ``log`` sections.

The schema below is the single source of truth: :func:`load_config` validates
against it, ``rdmakv serve`` / ``demo`` / ``stats`` and the engine connectors
read it, and ``docs/config.md`` is generated from it
(``python -m rdmakv.config --docs > docs/config.md``). Adding a key is one line
in a section class -- ``name: Type = Field(default=..., description="...")``
(``default=`` by keyword: type checkers read only that) -- and the loader, the
``RDMAKV_<SECTION>_<KEY>`` environment variable and the docs pick it up.

Where a value comes from, highest first: an explicit command-line flag or
connector option (the caller applies those), an ``RDMAKV_<SECTION>_<KEY>``
environment variable, the YAML file (``path`` or ``RDMAKV_CONFIG``), the
schema default. Invariants of a loaded :class:`RdmakvConfig`:

* every key is known (``extra="forbid"`` everywhere: a typo is an error, never
  silently ignored) and every value has its schema type (sizes are ints in
  bytes);
* ``section.model_fields_set`` holds exactly the keys the file or the
  environment set, so a consumer with defaults of its own (``rdmakv demo``'s
  small L1) can tell "set" from "defaulted";
* any problem is ONE :class:`~rdmakv.errors.ConfigError` whose message names
  the file or variable, the dotted key, what was wrong and what is allowed.

This module imports nothing else of rdmakv but :mod:`rdmakv.errors` and
:mod:`rdmakv.defaults` (the defaults it shares with the node and the client,
which import them from there too): the CLI and the connectors import it, never
the reverse. :func:`load_config` alone also loads :mod:`rdmakv.native_core`
(the native core, whose bound it needs), to check the receive-spin variable.
"""

from __future__ import annotations

import os
import re
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union, cast, get_args, get_origin

import annotated_types
import yaml  # type: ignore[import-untyped]  # types-PyYAML is not a dependency
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from rdmakv import defaults
from rdmakv.errors import ConfigError

# -- sizes -----------------------------------------------------------------------------------

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_BINARY_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def parse_size(text: str) -> int:
    """``"1GiB"`` -> 1073741824, ``"256KiB"``, ``"16k"`` (decimal), ``"4096"``; always > 0."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ConfigError(
            f"bad size {text!r}: use a number with an optional unit "
            "(B, KiB, MiB, GiB, TiB, or decimal k/M/G/T)"
        )
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ConfigError(f"size {text!r} must be positive")
    return value


def format_size(nbytes: int) -> str:
    """The shortest exact binary form: ``1073741824`` -> ``"1GiB"``, ``1000`` -> ``"1000"``."""
    for unit, factor in _BINARY_UNITS:
        if nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return str(nbytes)


def _size_value(value: object) -> int:
    # bool is an int subclass; "lock_pool: true" pasted under pool_size must fail.
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"must be a size in bytes: an int or a string like '8GiB', got {value!r}")
    if isinstance(value, str):
        return parse_size(value)
    if value <= 0:
        raise ValueError(f"size must be positive, got {value}")
    return value


class _SizeDoc:
    """Marker in a :data:`Size` field's metadata: the docs show it (and its default) as a size."""


Size = Annotated[int, BeforeValidator(_size_value), _SizeDoc()]
"""Bytes; the file and the environment may say ``8GiB``, ``256KiB``, ``16k`` or ``4096``."""
Port = Annotated[int, Field(ge=0, le=65535)]
Seconds = Annotated[float, Field(gt=0)]
Count = Annotated[int, Field(ge=1)]
Transport = Literal["tcp", "rdma", "auto"]
OffloadMode = Literal["none", "all", "hot", "cold", "reuse"]
"""Mirrors :data:`rdmakv.engine.l1.offload_policies.OFFLOAD_MODES` (a test keeps them equal)."""
TcpSendPlan = Literal["512k-ahead", "512k-after", "128k-ahead", "128k-after"]
"""Mirrors the names of :data:`rdmakv.transport.tcp.loop.SEND_PLANS` (a test keeps them equal)."""
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]


# -- the schema ------------------------------------------------------------------------------


class _Section(BaseModel):
    """Unknown keys are errors; defaults are validated like given values."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class NodeConfig(_Section):
    """``rdmakv serve``: one KV node."""

    host: str = Field(
        default=defaults.DEFAULT_HOST, description="bind address (`0.0.0.0`: every interface)"
    )
    port: Port = Field(
        default=defaults.DEFAULT_PORT,
        description="TCP port clients connect to (0: pick a free one)",
    )
    pool_size: Size = Field(
        default=1 << 30, description="bytes of KV the node holds (its pinned pool)"
    )
    block_size: Size = Field(
        default=256 << 10, description="largest value the node stores; the pool is cut into these"
    )
    transport: Transport = Field(
        default="auto",
        description="`auto`: RDMA too when a usable device exists; TCP always serves",
    )
    lease_timeout_s: Seconds = Field(
        default=defaults.DEFAULT_LEASE_TIMEOUT, description="seconds a client's read lease lasts"
    )
    token_file: str | None = Field(
        default=None, description="file holding the shared-secret token clients must send"
    )
    lock_pool: bool = Field(
        default=True, description="mlock the pool (needs a memlock limit of at least pool_size)"
    )
    metrics_host: str = Field(
        default=defaults.DEFAULT_HOST, description="address of the metrics HTTP server"
    )
    metrics_port: Port | None = Field(
        default=None, description="serve `/metrics`, `/healthz`, `/readyz` on this port (null: off)"
    )
    # Connection and lease limits (docs/security.md).
    handshake_timeout_s: Seconds = Field(
        default=defaults.HANDSHAKE_TIMEOUT_S,
        description="a connection must finish HELLO this long after it was accepted",
    )
    idle_timeout_s: Seconds = Field(
        default=defaults.IDLE_TIMEOUT_S,
        description="close an authenticated connection with no request for this long",
    )
    max_sessions: Count = Field(
        default=defaults.MAX_SESSIONS, description="connections open at once, in all"
    )
    max_sessions_per_source: Count = Field(
        default=defaults.MAX_SESSIONS_PER_SOURCE,
        description="connections open at once from one IP address",
    )
    max_unauthenticated: Count = Field(
        default=defaults.MAX_UNAUTHENTICATED,
        description="connections still in their handshake, in all (the oldest are shed first)",
    )
    max_unauthenticated_per_source: Count = Field(
        default=defaults.MAX_UNAUTHENTICATED_PER_SOURCE,
        description="connections still in their handshake from one IP address",
    )
    lease_quota_bytes: Size | None = Field(
        default=None,
        description="bytes one connection may hold under read lease "
        "(null: half the pool, at least 256 MiB)",
    )
    rdma_confinement: Literal["windows", "none"] = Field(
        default="windows",
        description="`windows`: each RDMA client reaches only its own extents, through "
        "type-2 memory windows (docs/security.md); `none`: the whole pool (only for devices "
        "without memory windows)",
    )
    max_leases_per_block: Count = Field(
        default=defaults.DEFAULT_MAX_LEASES_PER_BLOCK,
        description="live read leases one connection may hold on one value",
    )


class ClientConfig(_Section):
    """``rdmakv demo`` / ``stats`` and the vLLM / SGLang connectors: how to reach the nodes."""

    nodes: str | None = Field(
        default=None, description="`HOST:PORT`, a list `a:7480,b:7480`, or `dns://NAME:PORT`"
    )
    replication: int = Field(
        default=defaults.DEFAULT_REPLICATION, ge=1, description="copies of each block in a cluster"
    )
    streams: int | None = Field(
        default=None,
        ge=1,
        le=defaults.MAX_STREAMS,
        description="connections to one node (unset: 2 over RDMA; over TCP 2 with 2 usable "
        "CPUs or more, else 1); a batch of >= 4 MiB is split across them when its values are "
        ">= 16 KiB over RDMA, a get's over TCP, or a put's over TCP with 4 usable CPUs or "
        "more; a put's >= 64 KiB over TCP otherwise (more bandwidth where one stream or "
        "queue pair is CPU-bound)",
    )
    transport: Transport = Field(
        default="auto", description="`auto`: RDMA when a usable device exists, else TCP"
    )
    timeout_s: Seconds = Field(
        default=defaults.DEFAULT_TIMEOUT, description="seconds any remote wait may take"
    )
    token_file: str | None = Field(default=None, description="file holding the nodes' token")
    l1_size: Size = Field(
        default=defaults.DEFAULT_L1_BYTES, description="the engine process's L1 (pinned slab)"
    )
    offload: OffloadMode = Field(
        # a str there (defaults.py imports nothing, not even typing.Final); validated here
        default=cast(OffloadMode, defaults.DEFAULT_OFFLOAD),
        description="which computed blocks go to the node (docs/offload.md)",
    )
    offload_budget: Annotated[float, Field(gt=0, le=1)] | None = Field(
        default=None,
        description="with `offload: reuse`: share of the bytes `all` would send (null: 1)",
    )
    metrics_port: Port | None = Field(
        default=None, description="client metrics HTTP server in the engine process (null: off)"
    )


class TcpConfig(_Section):
    """The TCP loop of every ``rdmakv`` command and engine process, node and client alike."""

    send_plan: TcpSendPlan = Field(
        default=cast(TcpSendPlan, defaults.DEFAULT_TCP_SEND_PLAN),  # validated, as offload's
        description="how a put's values go out as they are hashed: bytes per `sendmsg` "
        "(`512k` / `128k`), each window hashed before (`ahead`) or after (`after`) it; "
        "which costs least depends on the CPU: `rdmakv doctor --tune` times the four here "
        "and prints the line to set",
    )


class LogConfig(_Section):
    """Logging of every ``rdmakv`` command (``-v`` and ``--log-format`` override it)."""

    level: LogLevel = Field(default="info", description="least severe level logged")
    format: LogFormat = Field(
        default="text", description="`json`: one JSON object per record (ts, level, logger, msg)"
    )


class RdmakvConfig(_Section):
    """The whole file: every section is optional."""

    # Sections are frozen, so one default instance can be shared.
    node: NodeConfig = NodeConfig()
    client: ClientConfig = ClientConfig()
    tcp: TcpConfig = TcpConfig()
    log: LogConfig = LogConfig()


SECTIONS: dict[str, type[_Section]] = {
    name: field.annotation  # type: ignore[misc]
    for name, field in RdmakvConfig.model_fields.items()
}
"""Section name -> its schema class, in file order."""

CONFIG_ENV = "RDMAKV_CONFIG"
"""Names the YAML file when no path is given."""
ENV_PREFIX = "RDMAKV_"
NOT_CONFIG_ENV = frozenset({"RDMAKV_TCP_RECV_SPIN_US", "RDMAKV_TCP_CONGESTION"})
"""Variables that look like ``RDMAKV_TCP_<KEY>`` but are not configuration
(docs/operations.md): left alone, not refused as unknown ``tcp`` keys."""


def env_var(section: str, key: str) -> str:
    """The variable overriding ``section.key``: ``RDMAKV_NODE_PORT``."""
    return f"{ENV_PREFIX}{section.upper()}_{key.upper()}"


# -- loading ---------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]
    """SafeLoader that refuses a key given twice in one mapping (YAML keeps the last)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)  # type: ignore[no-untyped-call]
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice", key_node.start_mark
            )
        seen.add(key)
    mapping: dict[Any, Any] = loader.construct_mapping(node)
    return mapping


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _unique_mapping,  # type: ignore[arg-type]
)


def _read_file(path: Path) -> dict[str, Any]:
    where = f"config file {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(
            f"{where}: cannot read it: {e.strerror or e} (give an existing file with --config "
            f"or {CONFIG_ENV})"
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no objects
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{where}: YAML syntax error{at}: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: YAML syntax error: {e}") from None
    if data is None:  # empty, or comments only: every default
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where}: must be a mapping of sections ({', '.join(SECTIONS)}), got {_kind(data)}"
        )
    return data


def _flat_types(annotation: Any) -> Iterator[Any]:
    """The plain types and Literal forms an annotation admits (Annotated/Optional unwrapped)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        yield from _flat_types(get_args(annotation)[0])
    elif origin is Union or origin is types.UnionType:
        for arg in get_args(annotation):
            yield from _flat_types(arg)
    else:
        yield annotation


def _env_value(raw: str, field: FieldInfo) -> Any:
    """An environment value as the YAML scalar it spells; text fields keep the raw text."""
    admitted = list(_flat_types(field.annotation))
    try:
        parsed = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if parsed is None:
        return None  # "null" / "~": e.g. RDMAKV_NODE_METRICS_PORT=null turns metrics off
    # A host "1234", a token path "007" or a level "off" (YAML 1.1: false) stay text.
    if str in admitted or any(get_origin(t) is Literal for t in admitted):
        return raw
    if isinstance(parsed, dict | list):
        return raw
    return parsed


def _env_overrides(
    env: Mapping[str, str], data: dict[str, Any]
) -> tuple[dict[str, Any], dict[tuple[str, str], str], list[tuple[str, str]]]:
    """``data`` with RDMAKV_<SECTION>_<KEY> applied; which keys came from which variable;
    the (where, what) errors about unknown variables."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    sources: dict[tuple[str, str], str] = {}
    errors: list[tuple[str, str]] = []
    for name in sorted(env):
        raw = env[name]
        if name in NOT_CONFIG_ENV:
            continue
        for section, model in SECTIONS.items():
            prefix = f"{ENV_PREFIX}{section.upper()}_"
            if not name.startswith(prefix):
                continue
            if raw == "":  # an empty variable counts as unset (shells and manifests make them)
                break
            key = name[len(prefix) :].lower()
            field = model.model_fields.get(key)
            if field is None or name != env_var(section, key):
                allowed = ", ".join(env_var(section, k) for k in model.model_fields)
                errors.append(
                    (
                        f"environment variable {name}",
                        f"no such setting in section {section!r}; allowed: {allowed}",
                    )
                )
                break
            target = out.get(section)
            if not isinstance(target, dict):
                target = out[section] = {}  # a bad file section is reported by the file
            target[key] = _env_value(raw, field)
            sources[(section, key)] = name
            break
    return out, sources, errors


def load_config(
    path: str | Path | None = None, env: Mapping[str, str] | None = None
) -> RdmakvConfig:
    """Validate the YAML file (``path``, else ``$RDMAKV_CONFIG``, else none) with the
    ``RDMAKV_<SECTION>_<KEY>`` variables of ``env`` (default: ``os.environ``) applied.

    Variables outside the sections (``RDMAKV_TCP_RECV_SPIN_US``, ...; see
    :data:`NOT_CONFIG_ENV`) are not configuration and are ignored; an unknown
    ``RDMAKV_NODE_*`` / ``RDMAKV_CLIENT_*`` / ``RDMAKV_TCP_*`` / ``RDMAKV_LOG_*``
    variable is an error naming it.
    Raises one :class:`ConfigError` listing every problem.
    """
    env = os.environ if env is None else env
    if path is None or str(path) == "":
        path = env.get(CONFIG_ENV) or None
    file = Path(path) if path is not None else None
    data = _read_file(file) if file is not None else {}
    merged, sources, errors = _env_overrides(env, data)
    # Not configuration, but every command and connector loads the configuration at start-up,
    # so this is where a bad value can stop them. Its bound is rk_tcp.h's, known only by
    # loading the native TCP core: imported here so that importing this module stays cheap.
    from rdmakv import native_core

    spin = native_core.recv_spin_env_problem(env)
    if spin:
        errors.append((f"environment variable {native_core.ENV_RECV_SPIN}", spin))
    try:
        config = RdmakvConfig.model_validate(merged)
    except ValidationError as e:
        errors += [_describe(err, file, sources) for err in e.errors()]
    if errors:
        raise ConfigError(_join(errors))
    return config


def _join(errors: list[tuple[str, str]]) -> str:
    """``WHERE: a; b; OTHER: c``: each source named once, in order of first appearance."""
    by_source: dict[str, list[str]] = {}
    for where, what in errors:
        by_source.setdefault(where, []).append(what)
    return "; ".join(f"{where}: {'; '.join(whats)}" for where, whats in by_source.items())


# -- error messages --------------------------------------------------------------------------


def _kind(value: object) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"


def _model_at(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The schema class holding the key at ``loc`` (None past the schema)."""
    model: type[BaseModel] = RdmakvConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _literal_values(field: FieldInfo | None) -> list[str]:
    if field is None:
        return []
    return [
        str(v)
        for t in _flat_types(field.annotation)
        if get_origin(t) is Literal
        for v in get_args(t)
    ]


def _describe(
    err: Any, file: Path | None, sources: Mapping[tuple[str, str], str]
) -> tuple[str, str]:
    """One pydantic error as (``WHERE``, ``dotted.key: what (allowed)``)."""
    loc = tuple(err["loc"])
    dotted = ".".join(str(p) for p in loc)
    var = sources.get((str(loc[0]), str(loc[1]))) if len(loc) >= 2 else None
    where = (
        f"environment variable {var}"
        if var is not None
        else f"config file {file}"
        if file is not None
        else "defaults"
    )
    model = _model_at(loc)
    field = model.model_fields.get(str(loc[-1])) if model is not None else None
    kind, given = err["type"], err.get("input")
    if kind == "extra_forbidden" and model is not None:
        what = "sections" if model is RdmakvConfig else "keys"
        return where, f"{dotted}: unknown key; allowed {what}: {', '.join(model.model_fields)}"
    if kind == "literal_error":
        return where, f"{dotted}: {given!r} is not one of {', '.join(_literal_values(field))}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        sub = SECTIONS.get(dotted)
        keys = f" ({', '.join(sub.model_fields)})" if sub is not None else ""
        return where, f"{dotted}: must be a mapping of keys{keys}, got {_kind(given)}"
    if kind == "value_error":  # our validators' messages name the value already
        return where, f"{dotted}: {str(err['msg']).removeprefix('Value error, ')}"
    msg = str(err["msg"])
    return where, f"{dotted}: {msg[:1].lower() + msg[1:]} (got {given!r})"


# -- docs ------------------------------------------------------------------------------------

_BOUND_TEXT = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
)


def _bounds(metadata: list[Any]) -> list[str]:
    out = []
    for m in metadata:
        if isinstance(m, FieldInfo):  # Annotated[int, Field(ge=0)] nested in an Optional
            out += _bounds(list(m.metadata))
            continue
        for cls, attr, sign in _BOUND_TEXT:
            if isinstance(m, cls):
                out.append(f"{sign} {getattr(m, attr)}")
    return out


def _type_text(annotation: Any, metadata: list[Any]) -> str:
    """``int (>= 0, <= 65535)``, ``size``, ``tcp | rdma | auto``, ``str or null``."""
    origin = get_origin(annotation)
    if origin is Annotated:
        inner, *more = get_args(annotation)
        return _type_text(inner, [*metadata, *more])
    if origin is Union or origin is types.UnionType:
        args = [a for a in get_args(annotation) if a is not type(None)]
        text = " or ".join(_type_text(a, metadata if len(args) == 1 else []) for a in args)
        return f"{text} or null" if len(args) < len(get_args(annotation)) else text
    if origin is Literal:
        return " \\| ".join(str(v) for v in get_args(annotation))
    if any(isinstance(m, _SizeDoc) for m in metadata):
        return "size"
    name = getattr(annotation, "__name__", str(annotation))
    bounds = _bounds(metadata)
    return f"{name} ({', '.join(bounds)})" if bounds else name


def default_text(section: str, key: str) -> str:
    """``section.key``'s default as docs and ``--help`` show it: ``1GiB``, ``null``, ``true``."""
    return _default_text(SECTIONS[section].model_fields[key])


def _default_text(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if any(isinstance(m, _SizeDoc) for m in field.metadata) and isinstance(value, int):
        return format_size(value)
    return str(value)


_DOCS_INTRO = """\
# Configuration

<!-- Generated by `python -m rdmakv.config --docs > docs/config.md` from the schema in
rdmakv/config.py; tests/test_config.py fails when this file is out of date. -->

One YAML file configures a node (`rdmakv serve`), the clients (`rdmakv demo`,
`rdmakv stats`, the vLLM and SGLang connectors) and logging:

```yaml
node:
  host: 0.0.0.0
  port: 7480
  pool_size: 8GiB
  token_file: /etc/rdmakv/token
  metrics_port: 9480
client:
  nodes: dns://rdmakv-nodes.rdmakv.svc.cluster.local:7480
  token_file: /etc/rdmakv/token
log:
  format: json
```

* Give the file with `--config PATH` (`serve`, `demo`, `stats`) or the
  `RDMAKV_CONFIG` environment variable; the connectors take
  `"rdmakv_config": "PATH"` in vLLM's `kv_connector_extra_config` or SGLang's
  `--hicache-storage-backend-extra-config`. Every section and key is optional.
* Precedence, highest first: a command-line flag (or an explicit connector
  option), an environment variable `RDMAKV_<SECTION>_<KEY>`, the file, the
  default below. Environment values are read as YAML scalars (`7481`, `true`,
  `null`); an empty variable counts as unset.
* Unknown keys and unknown `RDMAKV_NODE_*` / `RDMAKV_CLIENT_*` /
  `RDMAKV_LOG_*` variables are errors that name the key and the allowed ones.
  Other `RDMAKV_*` variables (`RDMAKV_TCP_RECV_SPIN_US`, `RDMAKV_REQUIRE_RDMA`,
  ...) are not configuration (docs/operations.md).
* Sizes are bytes: an int, or a string with a unit: `256KiB`, `8GiB` (binary),
  `16k`, `2MB` (decimal).
* `tcp` is read by every command (`serve` as much as `demo`) and connector, and
  set once as the process starts; an unknown `RDMAKV_TCP_*` variable is an
  error too, but for `RDMAKV_TCP_RECV_SPIN_US` and `RDMAKV_TCP_CONGESTION`.
* `client` keys left unset keep each tool's own default: the defaults below are
  the connectors'; `rdmakv demo` starts with a 32 MiB L1 and local nodes.
* `python -m rdmakv.config --check FILE` validates a file (with the
  environment applied) and prints the values in effect.
"""


def render_docs() -> str:
    """docs/config.md: every key once, with its type, default, variable and description."""
    lines = [_DOCS_INTRO]
    for section, model in SECTIONS.items():
        lines += [
            f"## `{section}`",
            "",
            (model.__doc__ or "").strip(),
            "",
            "| key | type | default | environment | description |",
            "|---|---|---|---|---|",
        ]
        for key, field in model.model_fields.items():
            lines.append(
                f"| `{section}.{key}` | {_type_text(field.annotation, list(field.metadata))} "
                f"| `{_default_text(field)}` | `{env_var(section, key)}` "
                f"| {field.description or ''} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--docs"]:
        sys.stdout.write(render_docs())
        return 0
    if len(args) == 2 and args[0] == "--check":
        # Validate a file (with the environment) and print the effective values.
        try:
            cfg = load_config(args[1])
        except ConfigError as e:
            print(f"rdmakv config: error: {e}", file=sys.stderr)
            return 2
        sys.stdout.write(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
        return 0
    print("usage: python -m rdmakv.config --docs | --check FILE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "CONFIG_ENV",
    "SECTIONS",
    "ClientConfig",
    "LogConfig",
    "NodeConfig",
    "RdmakvConfig",
    "default_text",
    "env_var",
    "format_size",
    "load_config",
    "parse_size",
    "render_docs",
]
