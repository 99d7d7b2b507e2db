"""The node configuration: /etc/tiered-ckpt/config.yaml (written by cloud-init) or a local file.

Frozen dataclasses (the attribute API the toolkit uses: cfg.root, cfg.io.threads, ...) whose
field annotations carry typed rules; pydantic (https://docs.pydantic.dev/latest/concepts/dataclasses/)
checks a whole file against them at once, so a file with five mistakes gets one message listing
five problems, each with the key, the value, what is expected and the fix. Command-line flags
override the file (the CLI passes overrides in).

Booleans are strict: only YAML booleans (true/false; YAML 1.1, which PyYAML reads, also takes
unquoted yes/no/on/off). A quoted "no" is text and is refused, never read as true.
Sizes ("16MiB", "4GiB", "1.5G", plain bytes) go through parse_size and durations ("90s", "30m",
"6h", "7d", plain seconds) through parse_duration, here and for every command-line flag.
"""
from __future__ import annotations

import difflib
import math
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from functools import cache
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import yaml
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, Strict, TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError

from tiered_ckpt import naming
from tiered_ckpt.errors import ConfigError

DEFAULT_PATH = "/etc/tiered-ckpt/config.yaml"
ENV_VAR = "TIERED_CKPT_CONFIG"

# ---------------------------------------------------------------------------------------------
# Sizes and durations: one parser each, for the config file and for every flag.

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?)B?\s*$", re.IGNORECASE)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_DUR_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_SIZE_HINT = "use a number of bytes with an optional unit, e.g. 64MiB, 8GiB, 1.5G"
_DURATION_HINT = "use seconds or a number with a unit s, m, h, d or w, e.g. 90s, 30m, 6h, 7d"


def _size(value: object) -> int:
    """Bytes, or ValueError saying what is wrong (without the key: the caller names it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"is not a size; {_SIZE_HINT}")
    if isinstance(value, (int, float)):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"is not a size (negative or not finite); {_SIZE_HINT}")
        return int(value)
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"is not a size; {_SIZE_HINT}")
    num, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    power = "KMGTP".find(unit) + 1 if unit else 0
    base = 1024 if (binary or not unit) else 1000       # K/M/G are decimal, KiB/MiB/GiB binary
    return int(num * base**power)


def _duration(value: object) -> float:
    """Seconds, or ValueError saying what is wrong."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"is not a duration; {_DURATION_HINT}")
    if isinstance(value, (int, float)):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"is not a duration (negative or not finite); {_DURATION_HINT}")
        return float(value)
    m = _DURATION.match(value)
    if not m:
        raise ValueError(f"is not a duration; {_DURATION_HINT}")
    return float(m.group(1)) * _DUR_UNITS[m.group(2)]


def parse_size(value: str | int | float, key: str = "size") -> int:
    """'8GiB', '512M', '4096', 4096 -> bytes. Binary (KiB) and decimal (KB, K) units both accepted."""
    try:
        return _size(value)
    except ValueError as e:
        raise ConfigError(f"{key}: {value!r} {e}") from None


def parse_duration(value: str | int | float, key: str = "duration") -> float:
    """'90s', '30m', '6h', '7d', '2w', '90' or 90 -> seconds."""
    try:
        return _duration(value)
    except ValueError as e:
        raise ConfigError(f"{key}: {value!r} {e}") from None


def format_size(n: int) -> str:
    """Bytes as parse_size reads them back exactly: 16777216 -> '16MiB', 1000 -> '1000'."""
    for power, unit in ((5, "PiB"), (4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if n and n % 1024**power == 0:
            return f"{n // 1024**power}{unit}"
    return str(n)


def format_duration(seconds: float) -> str:
    """Seconds as parse_duration reads them back exactly: 3600 -> '1h', 90 -> '90s'."""
    for unit in ("w", "d", "h", "m"):
        if seconds and seconds % _DUR_UNITS[unit] == 0:
            return f"{int(seconds // _DUR_UNITS[unit])}{unit}"
    return f"{seconds:g}s"


# ---------------------------------------------------------------------------------------------
# Typed rules. Each rule's message says what is expected and how to fix it; the value and the
# key are added when the problem is reported.

_RULE = "tiered_ckpt_rule"


def _before(convert: Callable[[object], Any]) -> BeforeValidator:
    def run(value: object) -> Any:
        try:
            return convert(value)
        except ValueError as e:
            raise PydanticCustomError(_RULE, str(e)) from None
    return BeforeValidator(run)


def _rule(ok: Callable[[Any], bool], message: str) -> AfterValidator:
    def check(value: Any) -> Any:
        if not ok(value):
            raise PydanticCustomError(_RULE, message)
        return value
    return AfterValidator(check)


def _off_or_duration(value: object) -> float | None:
    return None if value in (None, "", 0) else _duration(value)


def _connection_string_problem(cs: str) -> str | None:
    """Why a connection string cannot be one (without quoting it: it holds secrets)."""
    pairs: dict[str, str] = {}
    for part in cs.strip().strip(";").split(";"):
        if not part.strip():
            continue
        k, eq, v = part.partition("=")
        if not eq or not k.strip():
            return "is not a storage connection string (it must be Key=Value pairs separated by ';')"
        pairs[k.strip().lower()] = v
    if not any(k in pairs for k in ("blobendpoint", "accountname", "usedevelopmentstorage")):
        return "names no account (neither AccountName= nor BlobEndpoint=)"
    return None


def _check_connection_string(cs: str | None) -> str | None:
    why = None if cs is None else _connection_string_problem(cs)
    if why:
        raise PydanticCustomError(_RULE, why + "; copy it from the storage account's Access keys (or Azurite's "
                                  "documented one), or remove it and set archive.account_url")
    return cs


Text = Annotated[str, Strict()]
Flag = Annotated[bool, Strict()]          # YAML true/false only: a quoted "no" is refused
_SIZE_IN, _DURATION_IN, _OFF_DURATION_IN = _before(_size), _before(_duration), _before(_off_or_duration)
Size = Annotated[int, _SIZE_IN]
Duration = Annotated[float, _DURATION_IN]
OffOrDuration = Annotated["float | None", _OFF_DURATION_IN]
Number = Annotated[float, Strict()]       # int or float, never a quoted string
PositiveInt = Annotated[int, Strict(), Field(ge=1)]      # a YAML whole number >= 1, not a quoted one
NonNegativeInt = Annotated[int, Strict(), Field(ge=0)]
Model = Annotated[Text, _rule(lambda v: re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", v) is not None,
                              "must be letters, digits, '.', '_' or '-' (starting with a letter or digit)")]
Root = Annotated[Text, _rule(lambda v: bool(v.strip()), "is empty; set the checkpoint root, e.g. /lustrefs/checkpoints"),
                 _rule(lambda v: "\0" not in v, "contains a NUL character; give a path")]
Naming = Annotated[Text, _rule(lambda v: naming.lookup(v) is not None, f"is not a naming scheme; use one of {naming.choices()}")]
BlockSize = Annotated[Size, _rule(lambda v: v >= 4096 and v % 4096 == 0,
                                  "must be a multiple of 4 KiB (O_DIRECT alignment), e.g. 16MiB")]
Url = Annotated[Text, _rule(lambda v: re.match(r"^https?://[^/?#\s]+", v) is not None,
                            "is not a URL; use https://<account>.blob.core.windows.net")]


def _one_of(*choices: str) -> Any:
    """Text that must be one of `choices` (the attribute stays a str for the code that reads it)."""
    return _rule(lambda v: v in choices, f"is not allowed; use {' or '.join(choices)}")


Backend = Annotated[Text, _one_of("amlfs", "local")]
Action = Annotated[Text, _one_of("delete", "release")]
Port = Annotated[int, Strict(), _rule(lambda v: 1 <= v <= 65535, "must be a TCP port 1-65535 (e.g. 9817)")]
_SECTION = ConfigDict(extra="forbid")    # unknown keys are refused (with a "did you mean")


@dataclass(frozen=True)
class IoConfig:
    __pydantic_config__ = _SECTION
    threads: PositiveInt = 8          # writer threads per process
    files_per_rank: PositiveInt = 8   # shards per rank (one file per writer keeps OSTs busy)
    block_size: BlockSize = 16 << 20  # request size; >= 4 MiB aligned writes suit Lustre
    direct: Flag = True               # O_DIRECT for data files
    staging_bytes: Size = 4 << 30     # budget of the async staging area (mapped as needed, up to this)
    sync_buffer_bytes: Size = 256 << 20  # extra memory a synchronous save may use


@dataclass(frozen=True)
class ArchiveConfig:
    """Where the core storage layer (Blob) keeps what the accelerator layer exports."""

    __pydantic_config__ = _SECTION
    account_url: Url | None = None            # https://<account>.blob.core.windows.net
    container: Annotated[Text, _rule(lambda v: bool(v.strip()), "is empty; name the data container, e.g. checkpoints")] \
        = "checkpoints"
    # Blob name of the checkpoint root: AMLFS exports /lustrefs/<p> to blob <p>.
    prefix: Text = "checkpoints"
    # Local mode (Azurite) only. A secret: messages name this key, never its value.
    connection_string: Annotated[Text | None, AfterValidator(_check_connection_string)] = None
    managed_identity_client_id: Text | None = None
    concurrency: PositiveInt = 8
    retries: NonNegativeInt = 5
    # Seconds one request may wait for the archive (connect, or each read): with `retries` it
    # bounds how long an operation against a frozen server takes, about (retries + 1) x timeout.
    timeout: Annotated[Duration, _rule(lambda v: 0 < v <= 3600, "must be seconds between 0 and 3600 (e.g. 30 or 30s)")] \
        = 30.0


@dataclass(frozen=True)
class AmlfsConfig:
    __pydantic_config__ = _SECTION
    mount: Text = "/lustrefs"
    lfs: Text = "lfs"                 # the lfs binary (PATH lookup unless absolute)
    hsm_batch: PositiveInt = 2000     # files per lfs hsm_* call
    subscription_id: Text | None = None
    resource_group: Text | None = None
    filesystem: Text | None = None
    autoexport_job: Text | None = None
    arm_endpoint: Text | None = None  # override for tests (the local ARM double)
    provisioned_gbps: Annotated[Number, _rule(lambda v: v > 0, "must be > 0 (GB/s), or leave it out")] | None = None


@dataclass(frozen=True)
class RetentionConfig:
    __pydantic_config__ = _SECTION
    keep_last: PositiveInt = 3
    keep_every_steps: NonNegativeInt = 0   # 0 = rule off
    keep_newer_than: OffOrDuration = None  # seconds; None (or 0) = rule off
    min_keep: PositiveInt = 2
    action: Action = "delete"          # delete | release (release needs AMLFS)
    restore_grace: Duration = 3600.0   # seconds a restored checkpoint is kept whatever the rules; 0 = off


@dataclass(frozen=True)
class MetricsConfig:
    __pydantic_config__ = _SECTION
    # node-exporter textfile the retention timer and `tiered-ckpt metrics --textfile` write (None = none);
    # node-exporter's textfile collector reads only *.prom files.
    textfile: Annotated[Text, _rule(lambda v: v.endswith(".prom"), "must end in .prom (node-exporter's textfile "
                                    "collector reads only *.prom files)")] | None = None
    port: Port = 9817                  # `tiered-ckpt metrics --serve` listens here
    addr: Text = "127.0.0.1"           # ... on this address (0.0.0.0 to let a Prometheus on another host scrape)


@dataclass(frozen=True)
class MemoryConfig:
    """The node-local memory tier (tiered_ckpt.tiers.memory, docs/memory.md): a tmpfs directory
    holding each rank's newest checkpoints, replicated to a peer node's, persisted to `root` every
    persist_every-th save. RAM is not durable: whole-cluster loss falls back to AMLFS, then Blob."""

    __pydantic_config__ = _SECTION
    # Node-local tmpfs directory (the node boot mounts and sizes it, e.g. /dev/shm/tiered-ckpt);
    # None = no memory tier (save_training(tier="memory") then asks for it; loads skip it).
    dir: Root | None = None
    keep: PositiveInt = 2                # newest checkpoints kept per rank (own copies; replicas alike)
    # Bytes this node's memory tier may hold (own copies + the peer's replicas); 0 = no limit
    # beyond the tmpfs itself. A save that cannot fit after evicting older copies fails clearly.
    budget_bytes: Size = 0
    persist_every: PositiveInt = 10      # every N-th memory save is also persisted to `root`
    # Nodes between a node and the one holding its replica (ring by node index); 0 = no replica.
    # Pick a distance that puts the peer in another fault domain where the platform says which.
    peer_distance: NonNegativeInt = 1
    # A file whose appearance (the Scheduled Events watcher writes it) makes the next memory save,
    # or tiered_ckpt.memory_tier.flush(), persist the newest memory checkpoint to `root` at once.
    notice_file: Text = "/run/tiered-ckpt/preempt"
    # Seconds a rank waits for the others in a memory save's agreement, a replica transfer or the
    # restore's agreement before giving up (a dead peer fails them after this long, not gloo's 30 min).
    timeout: Annotated[Duration, _rule(lambda v: 0 < v <= 3600, "must be seconds between 0 and 3600 (e.g. 300s)")] \
        = 300.0


# Not settings: where the configuration came from (for messages and help), never read from a file.
_ORIGIN_FIELDS = ("source", "given")


@dataclass(frozen=True)
class NodeConfig:
    __pydantic_config__ = _SECTION
    root: Root = "/lustrefs/checkpoints"
    model: Model = "default"
    backend: Backend = "amlfs"        # amlfs | local
    nodes: PositiveInt = 1
    # How this model's checkpoint directories are named (tiered_ckpt.naming.SCHEMES): the
    # default global_epoch{E}_step{S}, or torchtitan / huggingface / megatron layouts.
    naming: Naming = "global_epoch"
    io: IoConfig = field(default_factory=IoConfig)
    archive: ArchiveConfig = field(default_factory=ArchiveConfig)
    amlfs: AmlfsConfig = field(default_factory=AmlfsConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    source: str | None = None         # the file this was loaded from, for messages
    # The settings that file set ("io.threads", ...): help says which defaults come from it.
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def with_overrides(self, **changes: Any) -> NodeConfig:
        """Apply non-None overrides (from flags); nested sections as dicts."""
        top = {}
        for k, v in changes.items():
            if v is None:
                continue
            cur = getattr(self, k)
            if is_dataclass(cur) and not isinstance(cur, type) and isinstance(v, dict):
                v = replace(cur, **{kk: vv for kk, vv in v.items() if vv is not None})
            top[k] = v
        cfg = replace(self, **top)
        validate(cfg)
        return cfg


# ---------------------------------------------------------------------------------------------
# Checking: every problem at once, each as "key: value <what is wrong>; <fix>".

@cache
def _adapter() -> TypeAdapter[NodeConfig]:
    return TypeAdapter(NodeConfig)


def _show(key: str, value: Any) -> str:
    """The value as the message quotes it; a secret's never (it may be an account key)."""
    return "(value hidden: it may hold a secret)" if key.rsplit(".", 1)[-1] == "connection_string" else repr(value)


def _key_of(loc: tuple[int | str, ...]) -> tuple[str, type | None]:
    """The dotted setting a pydantic error location names, and the section (class) it lies in
    (location parts that are not settings, such as a union member's name, are left out)."""
    cls: Any = NodeConfig
    parts: list[str] = []
    for p in loc:
        names = {f.name for f in fields(cls)} if cls is not None else set()
        if isinstance(p, str) and p in names:
            parts.append(p)
            sub = get_type_hints(cls).get(p)
            cls = sub if isinstance(sub, type) and is_dataclass(sub) else None
        elif not parts or cls is not None:
            if isinstance(p, str) and cls is not None:
                parts.append(p)      # an unknown key: name it as written
            break
    return ".".join(parts), cls


def _message(err: Any) -> str:
    loc = tuple(err["loc"])
    key, section = _key_of(loc)
    value, kind = err["input"], err["type"]
    name = key.rsplit(".", 1)[-1]
    shown = _show(key, value)
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        owner: Any = NodeConfig
        for part in filter(None, parent.split(".")):
            owner = get_type_hints(owner)[part]
        known = sorted(f.name for f in fields(owner) if f.name not in _ORIGIN_FIELDS)
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        # ... or a setting of another section written in the wrong place (threads: at the top).
        elsewhere = [k for k in _all_keys() if k.rsplit(".", 1)[-1] == name and k != key]
        hint = f"; did you mean {close[0]}?" if close else f"; did you mean {elsewhere[0]}?" if elsewhere else ""
        return f"{key}: unknown setting{hint} (known settings {'in ' + parent if parent else 'here'}: {', '.join(known)})"
    if kind in ("dataclass_type", "dataclass_exact_type"):
        if not key:
            return f"the config file: expected a mapping of settings (key: value lines), got {value!r}"
        return f"{key}: {shown} is not a section; write its settings as indented key: value lines under {name}:"
    if kind == _RULE:
        return f"{key}: {shown} {err['msg']}"
    if kind == "string_type":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return f"{key}: {shown} is not text; quote it in YAML (e.g. {name}: \"{value}\")"
        return f"{key}: {shown} is not text; give a string"
    if kind == "bool_type":
        return (f"{key}: {shown} is not true or false; write {name}: true or {name}: false "
                "(a YAML boolean, without quotes)")
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"{key}: {shown} is not a whole number; write it without quotes, e.g. {name}: 8"
    if kind in ("float_type", "float_parsing"):
        return f"{key}: {shown} is not a number; give a plain number without quotes or units, e.g. {name}: 2.0"
    if kind == "greater_than_equal":
        return f"{key}: {shown} must be a whole number >= {err['ctx']['ge']}"
    if kind == "less_than_equal":
        return f"{key}: {shown} must be <= {err['ctx']['le']}"
    if kind == "literal_error":
        return f"{key}: {shown} is not allowed; use {err['ctx']['expected'].replace(chr(39), '')}"
    return f"{key}: {shown}: {err['msg']}"


@cache
def _all_keys(cls: Any = None) -> tuple[str, ...]:
    """Every setting's dotted key: 'root', 'io.threads', ..."""
    out: list[str] = []
    for f in fields(cls or NodeConfig):
        if f.name in _ORIGIN_FIELDS:
            continue
        sub = get_type_hints(cls or NodeConfig).get(f.name)
        out += [f"{f.name}.{k}" for k in _all_keys(sub)] if isinstance(sub, type) and is_dataclass(sub) else [f.name]
    return tuple(out)


def _cross_problems(data: dict[str, Any]) -> list[str]:
    """Rules between settings (each setting on its own is checked by its type)."""
    ret = data.get("retention")
    action = ret.get("action", "delete") if isinstance(ret, dict) else "delete"
    if action == "release" and data.get("backend", "amlfs") != "amlfs":
        return ["retention.action: release frees Lustre data with lfs hsm_release and needs backend amlfs; "
                "use delete with the local back-end"]
    return []


def _check(data: Any) -> tuple[NodeConfig | None, list[str]]:
    """The configuration from a settings mapping, or None and every problem found."""
    if not isinstance(data, dict):
        return None, [f"the config file: expected a mapping of settings (key: value lines), got {data!r}"]
    problems = [_message({"loc": (k,), "input": data[k], "type": "extra_forbidden"})
                for k in _ORIGIN_FIELDS if k in data]
    # A section left empty (`io:` with every setting commented out) is YAML null: its defaults.
    sections = {f.name for f in fields(NodeConfig) if is_dataclass(f.default_factory)}
    data = {k: v for k, v in data.items() if k not in _ORIGIN_FIELDS and not (k in sections and v is None)}
    cfg = None
    try:
        cfg = _adapter().validate_python(data)
    except ValidationError as e:
        problems += [_message(err) for err in e.errors()]
    problems += _cross_problems(data)
    return (cfg if not problems else None), problems


def _settings(cfg: NodeConfig) -> dict[str, Any]:
    d = asdict(cfg)
    for k in _ORIGIN_FIELDS:
        d.pop(k, None)
    return d


def _joined(problems: list[str], source: str | None) -> str:
    where = f" (in {source})" if source else ""
    if len(problems) == 1:
        return problems[0] + where
    return f"{len(problems)} problems in the configuration{where}:\n  - " + "\n  - ".join(problems)


def section_problems(section: str, values: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Every problem of one section's settings given outside a config file (command-line flags, a
    stack's keys), by the section's own rules: (setting, what is wrong and the fix), e.g.
    ("retention.keep_last", "0 must be a whole number >= 1"); the caller names the setting its way."""
    cls = get_type_hints(NodeConfig)[section]
    try:
        TypeAdapter(cls).validate_python(dict(values))
    except ValidationError as e:
        out = []
        for err in e.errors():
            key, _section = _key_of((section, *err["loc"]))
            out.append((key, _message({**err, "loc": (section, *err["loc"])}).removeprefix(f"{key}: ")))
        return out
    return []


def problems_of(cfg: NodeConfig) -> list[str]:
    """Every problem of a configuration, each naming its setting and the fix."""
    return _check(_settings(cfg))[1]


def validate(cfg: NodeConfig) -> None:
    """Raise one ConfigError listing every problem found (each names its setting and the fix)."""
    problems = problems_of(cfg)
    if problems:
        raise ConfigError(_joined(problems, cfg.source))


def _given(data: dict[str, Any], where: str = "") -> frozenset[str]:
    out: set[str] = set()
    for k, v in data.items():
        key = f"{where}.{k}" if where else str(k)
        out |= _given(v, key) if isinstance(v, dict) else {key}
    return frozenset(out)


def config_path(explicit: str | None) -> Path | None:
    """--config, else $TIERED_CKPT_CONFIG, else /etc/tiered-ckpt/config.yaml if present."""
    if explicit:
        return Path(explicit)
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    default = Path(DEFAULT_PATH)
    return default if default.exists() else None


# A node config is a few KiB; anything much larger is not one (and /dev/zero never ends).
CONFIG_LIMIT = 1 << 20


def _read_config(path: Path) -> bytes:
    """The config file's bytes: a regular file (or /dev/null: no settings) of at most CONFIG_LIMIT
    bytes. Opened non-blocking, so a FIFO given as the config is refused instead of waiting for a
    writer (fifo(7)); a device other than /dev/null is refused before it is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(path)
        if not stat.S_ISREG(st.st_mode):
            null = os.stat(os.devnull)
            if (st.st_dev, st.st_ino) == (null.st_dev, null.st_ino):
                return b""
            what = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device"
            raise ConfigError(f"config file {path} is {what}, not a file; pass the YAML file itself (--config PATH)")
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while b := os.read(fd, 1 << 16):
            total += len(b)
            if total > CONFIG_LIMIT:
                raise ConfigError(f"config file {path} is larger than {CONFIG_LIMIT >> 20} MiB, which no node config "
                                  "is; pass the node config's YAML file (--config PATH)")
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


class _Loader(yaml.SafeLoader):
    """yaml.safe_load without aliases: a few nested aliases expand to billions of nodes ("billion
    laughs") when the config is walked, and a node config never needs them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            ev = self.peek_event()
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not accepted in the node config; "
                                              "write the value out", ev.start_mark)
        return super().compose_node(parent, index)


def load(explicit: str | None = None) -> NodeConfig:
    """Load and validate the node config; defaults alone when no file is found."""
    path = config_path(explicit)
    if path is None:
        cfg = NodeConfig()
        validate(cfg)
        return cfg
    try:
        data = yaml.load(_read_config(path).decode("utf-8"), Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found; pass --config PATH or set {ENV_VAR}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
            "save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; pass the YAML file itself (--config PATH)") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}; check its permissions") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    data = {} if data is None else data
    checked, problems = _check(data)
    if checked is None:
        raise ConfigError(_joined(problems, str(path)))
    return replace(checked, source=str(path), given=_given(data))


@cache          # help texts ask for every flag's setting on every parser build
def _field_hint(key: str) -> Any:
    cls: Any = NodeConfig
    hint: Any = None
    for part in key.split("."):
        hint = get_type_hints(cls, include_extras=True)[part]
        cls = hint
    return hint


def _parsed_by(hint: Any, validator: Any) -> bool:
    """Whether a field's value goes through `validator` (e.g. _SIZE_IN: the field is a size)."""
    return validator in getattr(hint, "__metadata__", ())


def show_setting(cfg: NodeConfig, key: str) -> str:
    """A setting's effective value and where it comes from, for help texts:
    '8, io.threads from /etc/tiered-ckpt/config.yaml', or '8, built-in io.threads' when no file sets it."""
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    hint = _field_hint(key)
    if value is None:
        text = "none"
    elif isinstance(value, bool):
        text = str(value).lower()
    elif _parsed_by(hint, _SIZE_IN):
        text = format_size(value)
    elif _parsed_by(hint, _DURATION_IN) or _parsed_by(hint, _OFF_DURATION_IN):
        text = format_duration(value)
    else:
        text = str(value)
    if cfg.source and key in cfg.given:
        return f"{text}, {key} from {cfg.source}"
    return f"{text}, built-in {key}"


def dump(cfg: NodeConfig) -> str:
    """YAML for a NodeConfig (what cloud-init writes to /etc/tiered-ckpt/config.yaml)."""
    d = _settings(cfg)
    if d.get("naming") == naming.DEFAULT:
        d.pop("naming")           # configs written before `naming:` existed stay byte-identical
    if cfg.metrics == MetricsConfig():
        d.pop("metrics")          # likewise before `metrics:`
    if cfg.memory == MemoryConfig():
        d.pop("memory")           # ... and before `memory:`
    return yaml.safe_dump(d, sort_keys=False)
