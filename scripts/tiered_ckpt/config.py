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

from .errors import ConfigError

DEFAULT_PATH = "/etc/tiered-ckpt/config.yaml"
ENV_VAR = "TIERED_CKPT_CONFIG"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?)B?\s*$", re.IGNORECASE)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_DUR_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_size(value: str | int, key: str = "size") -> int:
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
    staging_bytes: int = 4 << 30      # host staging area for async saves
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
class NodeConfig:
    root: str = "/lustrefs/checkpoints"
    model: str = "default"
    backend: str = "amlfs"            # amlfs | local
    nodes: int = 1
    io: IoConfig = field(default_factory=IoConfig)
    archive: ArchiveConfig = field(default_factory=ArchiveConfig)
    amlfs: AmlfsConfig = field(default_factory=AmlfsConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
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
T = TypeVar("T")


def _build(cls: type[T], data: Any, where: str) -> T:
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of settings, got {data!r}")
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{where}.{key}" if where else key
        if key not in known or key == "source":
            raise ConfigError(f"{full}: unknown setting; known settings here: {', '.join(sorted(k for k in known if k != 'source'))}")
        default = getattr(cls(), key)
        if is_dataclass(default):
            kwargs[key] = _build(type(default), value, full)
        elif key in _SIZE_KEYS:
            kwargs[key] = parse_size(value, full)
        elif key in ("timeout", "restore_grace"):
            kwargs[key] = parse_duration(value, full)
        elif key == "keep_newer_than":
            kwargs[key] = None if value in (None, "", 0) else parse_duration(value, full)
        else:
            kwargs[key] = value
    return cls(**kwargs)


def _check_int(value: Any, key: str, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{key}: {value!r} must be a whole number >= {minimum}")


def validate(cfg: NodeConfig) -> None:
    where = f" (in {cfg.source})" if cfg.source else ""
    if cfg.backend not in ("amlfs", "local"):
        raise ConfigError(f"backend: {cfg.backend!r} is not a back-end{where}; use amlfs or local")
    if not str(cfg.root).strip():
        raise ConfigError(f"root: empty{where}; set the checkpoint root, e.g. /lustrefs/checkpoints")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", cfg.model):
        raise ConfigError(f"model: {cfg.model!r}{where} must be letters, digits, '.', '_' or '-'")
    _check_int(cfg.nodes, "nodes", 1)
    _check_int(cfg.io.threads, "io.threads", 1)
    _check_int(cfg.io.files_per_rank, "io.files_per_rank", 1)
    if cfg.io.block_size < 4096 or cfg.io.block_size % 4096:
        raise ConfigError(f"io.block_size: {cfg.io.block_size} must be a multiple of 4 KiB (O_DIRECT alignment), e.g. 16MiB")
    _check_int(cfg.archive.concurrency, "archive.concurrency", 1)
    _check_int(cfg.archive.retries, "archive.retries", 0)
    t = cfg.archive.timeout
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t <= 3600:
        raise ConfigError(f"archive.timeout: {t!r}{where} must be seconds between 0 and 3600 (e.g. 30 or 30s)")
    _check_int(cfg.amlfs.hsm_batch, "amlfs.hsm_batch", 1)
    r = cfg.retention
    _check_int(r.keep_last, "retention.keep_last", 1)
    _check_int(r.keep_every_steps, "retention.keep_every_steps", 0)
    _check_int(r.min_keep, "retention.min_keep", 1)
    g = r.restore_grace
    if not isinstance(g, (int, float)) or isinstance(g, bool) or g < 0:
        raise ConfigError(f"retention.restore_grace: {g!r}{where} must be a duration >= 0 (e.g. 1h; 0 = off)")
    if r.action not in ("delete", "release"):
        raise ConfigError(f"retention.action: {r.action!r}{where}; use delete or release")
    if r.action == "release" and cfg.backend != "amlfs":
        raise ConfigError("retention.action: release frees Lustre data with lfs hsm_release and needs backend amlfs; use delete with the local back-end")


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
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found; pass --config PATH or set {ENV_VAR}") from None
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"config file {path} cannot be read: {e}") from None
    cfg = _build(NodeConfig, data or {}, "")
    cfg = replace(cfg, source=str(path))
    validate(cfg)
    return cfg


def dump(cfg: NodeConfig) -> str:
    """YAML for a NodeConfig (what cloud-init writes to /etc/tiered-ckpt/config.yaml)."""
    from dataclasses import asdict

    d = asdict(cfg)
    d.pop("source", None)
    return yaml.safe_dump(d, sort_keys=False)
