"""The core storage layer (Blob) through azure-storage-blob: list, upload, download, retries.

The SDK's own retry policy is switched off so that the retry schedule is ours (a fixed
number of attempts with exponential backoff, then UnavailableError naming the account):
an unreachable archive must end in one clear message, never a hang or a traceback.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceNotFoundError,
)
from azure.storage.blob import BlobServiceClient, ContainerClient

from .config import ArchiveConfig
from .errors import ConfigError, UnavailableError, UserError
from .hashing import new_hasher
from .manifest import MARKER, Manifest
from .naming import parse_name
from .redact import redact, safe_url

T = TypeVar("T")

# Blob metadata the local exporter writes (AMLFS auto-export writes its own, without these).
META_HASH = "xxh3_128"
META_SIZE = "src_size"
META_MTIME = "src_mtime_ns"


@dataclass(frozen=True)
class BlobInfo:
    name: str
    size: int
    metadata: dict[str, str]

    @property
    def xxh3(self) -> str | None:
        return self.metadata.get(META_HASH)


def configured(cfg: ArchiveConfig) -> bool:
    return bool(cfg.connection_string or cfg.account_url)


def blob_name(prefix: str, rel: str) -> str:
    """Blob name of a path relative to the checkpoint root (AMLFS: /lustrefs/<p> -> <p>)."""
    prefix = prefix.strip("/")
    rel = rel.strip("/")
    return f"{prefix}/{rel}" if prefix else rel


class _HashingReader:
    """A read-only, non-seekable view of a file that hashes what it hands out.

    Non-seekable on purpose: the SDK then reads chunks in order (one reader) and uploads
    them in parallel, so the hash is of exactly the bytes uploaded.
    """

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.hasher = new_hasher()

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.hasher.update(data)
        return data

    def seekable(self) -> bool:
        return False


class BlobStore:
    """One container of the archive, with retries and clear errors."""

    def __init__(self, cfg: ArchiveConfig, *, backoff: float = 0.5, max_backoff: float = 8.0,
                 connection_timeout: float = 10.0, read_timeout: float = 60.0) -> None:
        if not configured(cfg):
            raise ConfigError(
                "archive: neither archive.account_url nor archive.connection_string is set; "
                "set archive.account_url (https://<account>.blob.core.windows.net) or, for Azurite, archive.connection_string"
            )
        self.cfg = cfg
        self.prefix = cfg.prefix.strip("/")
        self.backoff = backoff
        self.max_backoff = max_backoff
        kw: dict[str, Any] = {
            "retry_total": 0,
            "connection_timeout": connection_timeout,
            "read_timeout": read_timeout,
        }
        # `where` names the archive in messages: scheme://host/path only, because the service
        # URL of a SAS connection string carries the token in its query string.
        if cfg.connection_string:
            try:
                svc = BlobServiceClient.from_connection_string(cfg.connection_string, **kw)
            except ValueError:
                # The SDK's own message may quote the string; never show its secrets.
                raise ConfigError(
                    "archive.connection_string is not a storage connection string (Key=Value pairs separated by ';', "
                    "e.g. DefaultEndpointsProtocol=https;AccountName=...;AccountKey=...;EndpointSuffix=core.windows.net, "
                    "or BlobEndpoint=...;SharedAccessSignature=...); copy it from the storage account's Access keys, "
                    "or set archive.account_url instead"
                ) from None
            self.where = f"container {cfg.container!r} at {safe_url(svc.url)}"
        else:
            from azure.identity import DefaultAzureCredential

            cred = DefaultAzureCredential(managed_identity_client_id=cfg.managed_identity_client_id)
            svc = BlobServiceClient(str(cfg.account_url), credential=cred, **kw)
            self.where = f"container {cfg.container!r} at {safe_url(str(cfg.account_url))}"
        self.service = svc
        self.container: ContainerClient = svc.get_container_client(cfg.container)

    # -- retries ---------------------------------------------------------------------------
    def retry(self, what: str, fn: Callable[[], T]) -> T:
        """Run fn with backoff on transient errors; UnavailableError after archive.retries."""
        attempts = self.cfg.retries + 1
        delay = self.backoff
        for i in range(attempts):
            try:
                return fn()
            except ResourceNotFoundError as e:
                if "ContainerNotFound" in str(getattr(e, "error_code", "") or e):
                    raise UserError(
                        f"the archive {self.where} does not exist (archive.container); create it or fix the setting",
                        exit_code=1,
                    ) from None
                raise
            except ClientAuthenticationError as e:
                raise UserError(
                    f"access to the archive {self.where} was denied: {redact(str(e.message if hasattr(e, 'message') else e))}; "
                    "grant the node's identity Storage Blob Data Contributor or fix archive.connection_string",
                    exit_code=3,
                ) from None
            except HttpResponseError as e:
                status = getattr(e, "status_code", None) or 0
                if status and status < 500 and status not in (408, 429):
                    msg = redact(str(getattr(e, "message", "") or e)).splitlines()[0][:300]
                    raise UserError(f"the archive {self.where} refused {what}: {msg} (HTTP {status})", exit_code=1) from None
                last: Exception = e
            except (AzureError, ConnectionError, TimeoutError) as e:
                # Local file errors (FileNotFoundError, ...) are not the archive's: they propagate.
                last = e
            if i + 1 < attempts:
                time.sleep(delay)
                delay = min(delay * 2, self.max_backoff)
        # SDK and urllib3 errors quote the request URL, SAS query string included.
        reason = redact(str(last)).splitlines()[0][:200] if str(last) else type(last).__name__
        raise UnavailableError(
            f"the archive {self.where} is unreachable: {what} failed {attempts} times ({reason}); "
            "check that the storage account (or Azurite) is up and reachable, then re-run — nothing was deleted"
        )

    # -- names -----------------------------------------------------------------------------
    def name(self, rel: str) -> str:
        return blob_name(self.prefix, rel)

    def rel(self, name: str) -> str:
        return name[len(self.prefix) + 1:] if self.prefix else name

    # -- listing ---------------------------------------------------------------------------
    def listing(self, rel_prefix: str) -> dict[str, BlobInfo]:
        """Every blob under a path prefix (relative to the root), keyed by relative path."""
        start = self.name(rel_prefix).strip("/")
        start = start + "/" if start else ""

        def go() -> dict[str, BlobInfo]:
            out: dict[str, BlobInfo] = {}
            for b in self.container.list_blobs(name_starts_with=start, include=["metadata"]):
                out[self.rel(b.name)] = BlobInfo(b.name, int(b.size or 0), dict(b.metadata or {}))
            return out

        return self.retry(f"listing {start}", go)

    def get_bytes(self, rel: str) -> bytes | None:
        def go() -> bytes | None:
            try:
                return self.container.download_blob(self.name(rel), max_concurrency=1).readall()
            except ResourceNotFoundError as e:
                if "ContainerNotFound" in str(getattr(e, "error_code", "") or ""):
                    raise
                return None

        return self.retry(f"reading {self.name(rel)}", go)

    # -- transfer --------------------------------------------------------------------------
    def upload_file(self, path: str, rel: str, metadata: dict[str, str] | None = None,
                    length: int | None = None, concurrency: int | None = None) -> tuple[int, str]:
        """Upload under the blob name of `rel`; returns (bytes, xxh3-128 of what was sent)."""
        name = self.name(rel)

        def go() -> tuple[int, str]:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size if length is None else length
                reader = _HashingReader(f)
                self.container.upload_blob(
                    name, reader, length=size, overwrite=True,  # type: ignore[arg-type]
                    max_concurrency=concurrency or self.cfg.concurrency,
                    metadata=metadata,
                )
                return size, reader.hasher.hexdigest()

        return self.retry(f"uploading {name}", go)

    def set_metadata(self, rel: str, metadata: dict[str, str]) -> None:
        name = self.name(rel)
        self.retry(f"setting metadata of {name}", lambda: self.container.get_blob_client(name).set_blob_metadata(metadata))

    def download_file(self, rel: str, dest: str, progress: Callable[[int], None] | None = None,
                      concurrency: int | None = None) -> int:
        """Download one blob to `dest` (final name, truncated first), fsynced. Returns bytes."""
        name = self.name(rel)

        def go() -> int:
            done = [0]

            def hook(current: int, total: int | None) -> None:
                if progress is not None and current > done[0]:
                    progress(current - done[0])
                    done[0] = current

            os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
            with open(dest, "wb") as f:
                n = self.container.download_blob(
                    name, max_concurrency=concurrency or self.cfg.concurrency, progress_hook=hook
                ).readinto(f)
                f.flush()
                os.fsync(f.fileno())
            return int(n)

        return self.retry(f"downloading {name}", go)

    def download_many(self, items: list[tuple[str, str]], progress: Callable[[int], None] | None = None) -> dict[str, int]:
        """Download (rel, dest) pairs with archive.concurrency files in flight."""
        workers = max(1, min(self.cfg.concurrency, len(items)))
        per_file = max(1, self.cfg.concurrency // workers)
        with ThreadPoolExecutor(workers) as ex:
            sizes = list(ex.map(lambda it: self.download_file(it[0], it[1], progress, per_file), items))
        return {rel: n for (rel, _), n in zip(items, sizes, strict=True)}

    def ensure_container(self) -> None:
        from azure.core.exceptions import ResourceExistsError

        def go() -> None:
            try:
                self.container.create_container()
            except ResourceExistsError:
                pass

        self.retry(f"creating {self.where}", go)



@dataclass(frozen=True)
class ArchivedMarker:
    """A commit marker found in Blob: `<model>/<name>/COMMITTED.json` under the prefix."""

    rel: str
    model: str
    name: str
    size: int
    manifest: Manifest | None     # None when it does not count; `problem` says why
    problem: str = ""


def archived_markers(store: BlobStore, listing: Mapping[str, BlobInfo]) -> Iterator[ArchivedMarker]:
    """Every marker in a listing, parsed: the archive side of "scan markers, trust no pointer"."""
    for rel in sorted(listing):
        parts = rel.split("/")
        if len(parts) != 3 or parts[2] != MARKER or parse_name(parts[1]) is None:
            continue
        data = store.get_bytes(rel)
        if data is None:       # deleted since the listing
            continue
        try:
            m = Manifest.from_json(data)
        except ValueError as e:
            yield ArchivedMarker(rel, parts[0], parts[1], len(data), None, f"does not parse ({e})")
            continue
        if m.name != parts[1]:
            yield ArchivedMarker(rel, parts[0], parts[1], len(data), None, f"names checkpoint {m.name}, not {parts[1]}")
            continue
        yield ArchivedMarker(rel, parts[0], parts[1], len(data), m)
