"""The node configuration: /etc/tiered-ckpt/config.yaml (written by cloud-init) or a local file.

Plain dataclasses, validated once on load. Every error names the key, the value and the fix.
Command-line flags override the file (the CLI passes overrides in).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tiered_ckpt import naming
from tiered_ckpt.errors import ConfigError

DEFAULT_PATH = "/etc/tiered-ckpt/config.yaml"
ENV_VAR = "TIERED_CKPT_CONFIG"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?)B?\s*$", re.IGNORECASE)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_DUR_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_size(value: str | int | float, key: str = "size") -> int:
    """'8GiB', '512M', '4096' -> bytes. Binary and decimal units both accepted."""
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: {value} is negative; give a size such as 8GiB")
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"{key}: {value!r} is not a size; use a number with an optional unit, e.g. 64MiB, 8GiB, 1.5G")
    num, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    power = "KMGTP".find(unit) + 1 if unit else 0
    base = 1024 if (binary or not unit) else 1000
    return int(num * base**power)


def parse_duration(value: str | int | float, key: str = "duration") -> float:
    """'90s', '30m', '6h', '7d', '2w' or seconds -> seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    m = _DURATION.match(str(value))
    if not m:
        raise ConfigError(f"{key}: {value!r} is not a duration; use e.g. 90s, 30m, 6h, 7d")
    return float(m.group(1)) * _DUR_UNITS[m.group(2)]


@dataclass(frozen=True)
class IoConfig:
    threads: int = 8                  # writer threads per process
    files_per_rank: int = 8           # shards per rank (one file per writer keeps OSTs busy)
    block_size: int = 16 << 20        # request size; >= 4 MiB aligned writes suit Lustre
    direct: bool = True               # O_DIRECT for data files
    staging_bytes: int = 4 << 30      # budget of the async staging area (mapped as needed, up to this)
    sync_buffer_bytes: int = 256 << 20  # extra memory a synchronous save may use


@dataclass(frozen=True)
class ArchiveConfig:
    """Where the core storage layer (Blob) keeps what the accelerator layer exports."""

    account_url: str | None = None            # https://<account>.blob.core.windows.net
    container: str = "checkpoints"
    # Blob name of the checkpoint root: AMLFS exports /lustrefs/<p> to blob <p>.
    prefix: str = "checkpoints"
    connection_string: str | None = None      # local mode (Azurite) only
    managed_identity_client_id: str | None = None
    concurrency: int = 8
    retries: int = 5
    # Seconds one request may wait for the archive (connect, or each read): with `retries` it
    # bounds how long an operation against a frozen server takes, about (retries + 1) x timeout.
    timeout: float = 30.0


@dataclass(frozen=True)
class AmlfsConfig:
    mount: str = "/lustrefs"
    lfs: str = "lfs"                  # the lfs binary (PATH lookup unless absolute)
    hsm_batch: int = 2000             # files per lfs hsm_* call
    subscription_id: str | None = None
    resource_group: str | None = None
    filesystem: str | None = None
    autoexport_job: str | None = None
    arm_endpoint: str | None = None   # override for tests (the local ARM double)
    provisioned_gbps: float | None = None


@dataclass(frozen=True)
class RetentionConfig:
    keep_last: int = 3
    keep_every_steps: int = 0         # 0 = rule off
    keep_newer_than: float | None = None  # seconds; None = rule off
    min_keep: int = 2
    action: str = "delete"            # delete | release (release needs AMLFS)
    restore_grace: float = 3600.0     # seconds a restored checkpoint is kept whatever the rules


@dataclass(frozen=True)
class MetricsConfig:
    # node-exporter textfile the retention timer and `tiered-ckpt metrics --textfile` write (None = none)
    textfile: str | None = None
    port: int = 9817                  # `tiered-ckpt metrics --serve` listens here
    addr: str = "127.0.0.1"           # ... on this address (0.0.0.0 to let a Prometheus on another host scrape)


@dataclass(frozen=True)
class NodeConfig:
    root: str = "/lustrefs/checkpoints"
    model: str = "default"
    backend: str = "amlfs"            # amlfs | local
    nodes: int = 1
    # How this model's checkpoint directories are named (tiered_ckpt.naming.SCHEMES): the
    # default global_epoch{E}_step{S}, or torchtitan / huggingface / megatron layouts.
    naming: str = "global_epoch"
    io: IoConfig = field(default_factory=IoConfig)
    archive: ArchiveConfig = field(default_factory=ArchiveConfig)
    amlfs: AmlfsConfig = field(default_factory=AmlfsConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    source: str | None = None         # the file this was loaded from, for messages

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


_SIZE_KEYS = {"block_size", "staging_bytes", "sync_buffer_bytes"}
# Settings whose value is a secret: messages name the key, never the value.
_SECRET_KEYS = {"connection_string"}
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
T = TypeVar("T")


def _show(key: str, value: Any) -> str:
    return "(value hidden: it may hold a secret)" if key.rsplit(".", 1)[-1] in _SECRET_KEYS else repr(value)


def parse_bool(value: Any, key: str) -> bool:
    """true/false, or the words yes/no/on/off/1/0 (a quoted "no" must never read as true)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{key}: {value!r} is not true or false; write {key.rsplit('.', 1)[-1]}: true or false")


def _build(cls: type[T], data: Any, where: str, problems: list[str] | None = None) -> T:
    """The dataclass from a mapping; conversion problems are collected in `problems` (the
    setting then keeps its default so that the remaining settings are still checked)."""
    own = problems is None
    probs: list[str] = [] if problems is None else problems
    if data is None:
        return cls()
    if not isinstance(data, dict):
        probs.append(f"{where or 'the config file'}: expected a mapping of settings (key: value lines), got {data!r}")
        if own:
            raise ConfigError(probs[0])
        return cls()
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{where}.{key}" if where else str(key)
        if key not in known or key == "source":
            probs.append(f"{full}: unknown setting; known settings here: {', '.join(sorted(k for k in known if k != 'source'))}")
            continue
        default = getattr(cls(), key)
        try:
            if is_dataclass(default):
                kwargs[key] = _build(type(default), value, full, probs)
            elif key in _SIZE_KEYS:
                if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                    raise ConfigError(f"{full}: {value!r} is not a size; use a number with an optional unit, e.g. 16MiB")
                kwargs[key] = parse_size(value, full)
            elif key in ("timeout", "restore_grace"):
                kwargs[key] = parse_duration(value, full)
            elif key == "keep_newer_than":
                kwargs[key] = None if value in (None, "", 0) else parse_duration(value, full)
            elif known[key].type == "bool":
                kwargs[key] = parse_bool(value, full)
            else:
                kwargs[key] = value
        except ConfigError as e:
            probs.append(str(e))
    out = cls(**kwargs)
    if own and probs:
        raise ConfigError(_joined(probs, None))
    return out


def _joined(problems: list[str], source: str | None) -> str:
    where = f" (in {source})" if source else ""
    if len(problems) == 1:
        return problems[0] + where
    return f"{len(problems)} problems in the configuration{where}:\n  - " + "\n  - ".join(problems)


def _check_int(value: Any, key: str, minimum: int, problems: list[str] | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        msg = f"{key}: {value!r} must be a whole number >= {minimum}"
        if problems is None:
            raise ConfigError(msg)
        problems.append(msg)


def _check_types(obj: Any, where: str, problems: list[str]) -> Any:
    """Every setting has the type its field declares: text where text is expected, and so on.

    Returns `obj` with each wrongly typed setting back at its default, so that the value
    checks can still run over the rest (and report every problem at once).
    """
    fixed: dict[str, Any] = {}
    default = type(obj)()
    for f in fields(obj):
        if f.name == "source":
            continue
        key = f"{where}.{f.name}" if where else f.name
        value = getattr(obj, f.name)
        kind = str(f.type).replace(" ", "")
        if is_dataclass(value):
            fixed[f.name] = _check_types(value, key, problems)
            continue
        optional = kind.endswith("|None")
        base = kind.removesuffix("|None")
        if value is None and optional:
            continue
        before = len(problems)
        if base == "str" and not isinstance(value, str):
            problems.append(f"{key}: {_show(key, value)} is not text; quote it in YAML (e.g. {f.name}: \"{value}\")"
                            if isinstance(value, (int, float)) and not isinstance(value, bool) else
                            f"{key}: {_show(key, value)} is not text; give a string")
        elif base == "bool" and not isinstance(value, bool):
            problems.append(f"{key}: {value!r} is not true or false")
        elif base == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            problems.append(f"{key}: {value!r} is not a number; give a plain number without quotes or units, e.g. {f.name}: 2.0")
        elif base == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            problems.append(f"{key}: {value!r} is not a whole number")
        if len(problems) > before:
            fixed[f.name] = getattr(default, f.name)
    return replace(obj, **fixed) if fixed else obj


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


def validate(cfg: NodeConfig) -> None:
    """Raise one ConfigError listing every problem found (each names its setting and the fix)."""
    problems = problems_of(cfg)
    if problems:
        raise ConfigError(_joined(problems, cfg.source))


def problems_of(cfg: NodeConfig) -> list[str]:
    """Every problem of a configuration, each naming its setting and the fix."""
    problems: list[str] = []
    # The value checks run on a copy whose wrongly typed settings are back at their defaults.
    cfg = _check_types(cfg, "", problems)
    if cfg.backend not in ("amlfs", "local"):
        problems.append(f"backend: {cfg.backend!r} is not a back-end; use amlfs or local")
    if not str(cfg.root).strip():
        problems.append("root: empty; set the checkpoint root, e.g. /lustrefs/checkpoints")
    elif "\0" in cfg.root:
        problems.append("root: contains a NUL character; give a path")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", cfg.model):
        problems.append(f"model: {cfg.model!r} must be letters, digits, '.', '_' or '-' (starting with a letter or digit)")
    _check_int(cfg.nodes, "nodes", 1, problems)
    if naming.lookup(cfg.naming) is None:
        problems.append(f"naming: {str(cfg.naming)[:80]!r} is not a naming scheme; use one of {naming.choices()}")
    _check_int(cfg.io.threads, "io.threads", 1, problems)
    _check_int(cfg.io.files_per_rank, "io.files_per_rank", 1, problems)
    if cfg.io.block_size < 4096 or cfg.io.block_size % 4096:
        problems.append(f"io.block_size: {cfg.io.block_size} must be a multiple of 4 KiB (O_DIRECT alignment), e.g. 16MiB")
    a = cfg.archive
    _check_int(a.concurrency, "archive.concurrency", 1, problems)
    _check_int(a.retries, "archive.retries", 0, problems)
    if a.connection_string is not None:
        why = _connection_string_problem(a.connection_string)
        if why:
            problems.append(f"archive.connection_string {why}; copy it from the storage account's Access keys (or "
                            "Azurite's documented one), or remove it and set archive.account_url")
    if a.account_url is not None and not re.match(r"^https?://[^/?#\s]+", a.account_url):
        problems.append(f"archive.account_url: {a.account_url!r} is not a URL; use https://<account>.blob.core.windows.net")
    if not a.container.strip():
        problems.append("archive.container: empty; name the data container, e.g. checkpoints")
    t = a.timeout
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t <= 3600:
        problems.append(f"archive.timeout: {t!r} must be seconds between 0 and 3600 (e.g. 30 or 30s)")
    _check_int(cfg.amlfs.hsm_batch, "amlfs.hsm_batch", 1, problems)
    gbps = cfg.amlfs.provisioned_gbps
    if gbps is not None and gbps <= 0:
        problems.append(f"amlfs.provisioned_gbps: {gbps!r} must be > 0 (GB/s), or leave it out")
    mc = cfg.metrics
    if not isinstance(mc.port, int) or isinstance(mc.port, bool) or not 1 <= mc.port <= 65535:
        problems.append(f"metrics.port: {mc.port!r} must be a TCP port 1-65535 (e.g. 9817)")
    if mc.textfile is not None and not str(mc.textfile).endswith(".prom"):
        problems.append(f"metrics.textfile: {mc.textfile!r} must end in .prom (node-exporter's textfile collector "
                        "reads only *.prom files)")
    r = cfg.retention
    _check_int(r.keep_last, "retention.keep_last", 1, problems)
    _check_int(r.keep_every_steps, "retention.keep_every_steps", 0, problems)
    _check_int(r.min_keep, "retention.min_keep", 1, problems)
    g = r.restore_grace
    if not isinstance(g, (int, float)) or isinstance(g, bool) or g < 0:
        problems.append(f"retention.restore_grace: {g!r} must be a duration >= 0 (e.g. 1h; 0 = off)")
    if r.action not in ("delete", "release"):
        problems.append(f"retention.action: {r.action!r}; use delete or release")
    elif r.action == "release" and cfg.backend != "amlfs":
        problems.append("retention.action: release frees Lustre data with lfs hsm_release and needs backend amlfs; "
                        "use delete with the local back-end")
    return problems


def config_path(explicit: str | None) -> Path | None:
    """--config, else $TIERED_CKPT_CONFIG, else /etc/tiered-ckpt/config.yaml if present."""
    if explicit:
        return Path(explicit)
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    default = Path(DEFAULT_PATH)
    return default if default.exists() else None


def load(explicit: str | None = None) -> NodeConfig:
    """Load and validate the node config; defaults alone when no file is found."""
    path = config_path(explicit)
    if path is None:
        cfg = NodeConfig()
        validate(cfg)
        return cfg
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
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
    problems: list[str] = []
    cfg = _build(NodeConfig, {} if data is None else data, "", problems)
    cfg = replace(cfg, source=str(path))
    problems += problems_of(cfg)      # conversion and validation problems, reported together
    if problems:
        raise ConfigError(_joined(problems, str(path)))
    return cfg


def dump(cfg: NodeConfig) -> str:
    """YAML for a NodeConfig (what cloud-init writes to /etc/tiered-ckpt/config.yaml)."""
    from dataclasses import asdict

    d = asdict(cfg)
    d.pop("source", None)
    if d.get("naming") == naming.DEFAULT:
        d.pop("naming")           # configs written before `naming:` existed stay byte-identical
    if cfg.metrics == MetricsConfig():
        d.pop("metrics")          # likewise before `metrics:`
    return yaml.safe_dump(d, sort_keys=False)
