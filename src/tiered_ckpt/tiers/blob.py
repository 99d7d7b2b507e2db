"""The core storage layer (Blob) through azure-storage-blob: list, upload, download, retries.

The SDK's own retry policy is switched off so that the retry schedule is ours (a fixed
number of attempts with exponential backoff, then UnavailableError naming the account):
an unreachable archive must end in one clear message, never a hang or a traceback.
"""
from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Any, BinaryIO, TypeVar

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceNotFoundError,
)
from azure.storage.blob import BlobServiceClient, ContainerClient

from tiered_ckpt.config import ArchiveConfig
from tiered_ckpt.errors import EXIT_FAILED, EXIT_UNAVAILABLE, ConfigError, UnavailableError, UserError
from tiered_ckpt.io import fsafe
from tiered_ckpt.io.hashing import new_hasher
from tiered_ckpt.io.marker import MARKER, Manifest
from tiered_ckpt.naming import DEFAULT as DEFAULT_NAMING
from tiered_ckpt.naming import parse_in
from tiered_ckpt.redact import redact, safe_url

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
    # Last-Modified (Unix time): any write, a metadata update included, moves it (Get Blob Properties,
    # Blob service REST reference), so the newest of a checkpoint's blobs says when it became provable.
    last_modified: float | None = None

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


class _Cancelled(Exception):
    """A transfer stopped because another one of the same operation failed (not an error of its own)."""


class _HashingReader:
    """A read-only, non-seekable view of a file that hashes what it hands out.

    Non-seekable on purpose: the SDK then reads chunks in order (one reader) and uploads
    them in parallel, so the hash is of exactly the bytes uploaded.
    """

    def __init__(self, f: BinaryIO, activity: list[float] | None = None) -> None:
        self._f = f
        self.hasher = new_hasher()
        self._activity = activity

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.hasher.update(data)
        if self._activity is not None:
            # The SDK reads the next block once the previous ones went out: progress.
            self._activity[0] = time.monotonic()
        return data

    def seekable(self) -> bool:
        return False


class BlobStore:
    """One container of the archive, with retries and clear errors."""

    def __init__(self, cfg: ArchiveConfig, *, backoff: float = 0.5, max_backoff: float = 8.0,
                 connection_timeout: float | None = None, read_timeout: float | None = None) -> None:
        if not configured(cfg):
            raise ConfigError(
                "archive: neither archive.account_url nor archive.connection_string is set; "
                "set archive.account_url (https://<account>.blob.core.windows.net) or, for Azurite, archive.connection_string"
            )
        self.cfg = cfg
        self.prefix = cfg.prefix.strip("/")
        self.backoff = backoff
        self.max_backoff = max_backoff
        # Per request (archive.timeout): the connect, and each socket read. The SDK's download
        # code re-sends a request whose body stalled (up to 3 times, outside its retry policy),
        # so one attempt can wait about twice this; retry() bounds the whole operation.
        self.timeout = float(read_timeout if read_timeout is not None else getattr(cfg, "timeout", 30.0))
        kw: dict[str, Any] = {
            "retry_total": 0,
            "connection_timeout": connection_timeout if connection_timeout is not None else min(10.0, self.timeout),
            "read_timeout": self.timeout,
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
    def retry(self, what: str, fn: Callable[[], T], *, cancel: threading.Event | None = None,
              activity: list[float] | None = None) -> T:
        """Run fn with backoff on transient errors; UnavailableError after archive.retries.

        Budget: (retries + 1) x archive.timeout without progress. A frozen server makes each
        attempt wait out its read timeout (sometimes twice, see __init__); once the operation
        has gone that long without progress it fails, whatever attempts are left. `activity[0]`
        (monotonic time of the last bytes received, kept by the caller) resets that clock, so
        a long healthy transfer that then fails still gets its retries. `cancel`: another part
        of the same operation failed already; stop before the next attempt.
        """
        attempts = self.cfg.retries + 1
        budget = attempts * self.timeout
        start = time.monotonic()
        delay = self.backoff
        last: Exception | None = None
        tried = 0
        for i in range(attempts):
            if cancel is not None and cancel.is_set():
                raise _Cancelled()
            tried += 1
            try:
                return fn()
            except ResourceNotFoundError as e:
                if "ContainerNotFound" in str(getattr(e, "error_code", "") or e):
                    raise UserError(
                        f"the archive {self.where} does not exist (archive.container); create it or fix the setting",
                        exit_code=EXIT_FAILED,
                    ) from None
                raise
            except ClientAuthenticationError as e:
                raise UserError(
                    f"access to the archive {self.where} was denied: {redact(str(e.message if hasattr(e, 'message') else e))}; "
                    "grant the node's identity Storage Blob Data Contributor or fix archive.connection_string",
                    exit_code=EXIT_UNAVAILABLE,
                ) from None
            except HttpResponseError as e:
                status = getattr(e, "status_code", None) or 0
                if status and status < 500 and status not in (408, 429):
                    msg = redact(str(getattr(e, "message", "") or e)).splitlines()[0][:300]
                    raise UserError(f"the archive {self.where} refused {what}: {msg} (HTTP {status})", exit_code=EXIT_FAILED) from None
                last = e
            except (AzureError, ConnectionError, TimeoutError) as e:
                # Local file errors (FileNotFoundError, ...) are not the archive's: they propagate.
                last = e
            if i + 1 < attempts:
                quiet_since = max(start, activity[0]) if activity else start
                if time.monotonic() + delay - quiet_since >= budget:
                    break           # out of budget: no attempt left would finish in time
                time.sleep(delay)
                delay = min(delay * 2, self.max_backoff)
        # SDK and urllib3 errors quote the request URL, SAS query string included.
        reason = (redact(str(last)).splitlines()[0][:200] if str(last) else type(last).__name__) if last else "no answer"
        raise UnavailableError(
            f"the archive {self.where} is unreachable: {what} failed {tried} times ({reason}; archive.timeout "
            f"{self.timeout:g}s, archive.retries {self.cfg.retries}); "
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

        activity = [0.0]

        def go() -> dict[str, BlobInfo]:
            out: dict[str, BlobInfo] = {}
            for b in self.container.list_blobs(name_starts_with=start, include=["metadata"]):
                out[self.rel(b.name)] = BlobInfo(b.name, int(b.size or 0), dict(b.metadata or {}),
                                                 b.last_modified.timestamp() if b.last_modified else None)
                activity[0] = time.monotonic()        # pages keep arriving: progress
            return out

        return self.retry(f"listing {start}", go, activity=activity)

    def exists(self, rel: str) -> bool:
        """Whether the blob of `rel` exists: one request per attempt (archive.retries + 1 attempts)."""
        name = self.name(rel)
        return bool(self.retry(f"checking {name}", lambda: self.container.get_blob_client(name).exists()))

    def get_bytes(self, rel: str) -> bytes | None:
        def go() -> bytes | None:
            try:
                return self.container.download_blob(self.name(rel), max_concurrency=1).readall()
            except ResourceNotFoundError as e:
                if "ContainerNotFound" in str(getattr(e, "error_code", "") or ""):
                    raise
                return None

        return self.retry(f"reading {self.name(rel)}", go)

    def get_with_etag(self, rel: str) -> tuple[bytes, str] | None:
        """(content, ETag) of a blob, or None if it does not exist."""
        def go() -> tuple[bytes, str] | None:
            try:
                d = self.container.download_blob(self.name(rel), max_concurrency=1)
                return d.readall(), str(d.properties.etag)
            except ResourceNotFoundError as e:
                if "ContainerNotFound" in str(getattr(e, "error_code", "") or ""):
                    raise
                return None

        return self.retry(f"reading {self.name(rel)}", go)

    def put_bytes(self, rel: str, data: bytes) -> None:
        name = self.name(rel)
        self.retry(f"writing {name}", lambda: self.container.upload_blob(name, data, overwrite=True))

    def delete(self, rel: str, etag: str | None = None) -> str:
        """Delete one blob; with `etag`, only if it is still that version (If-Match).

        "deleted", "gone" (it did not exist) or "changed" (a newer version than `etag` is there:
        nothing was deleted; the caller decided on bytes that are no longer current).
        """
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceModifiedError

        name = self.name(rel)

        def go() -> str:
            try:
                if etag is None:
                    self.container.delete_blob(name)
                else:
                    self.container.delete_blob(name, etag=etag, match_condition=MatchConditions.IfNotModified)
                return "deleted"
            except ResourceNotFoundError:
                return "gone"
            except ResourceModifiedError:
                return "changed"

        return self.retry(f"deleting {name}", go)

    def at(self, prefix: str) -> BlobStore:
        """The same container and clients, rooted at another blob prefix."""
        other = copy.copy(self)
        other.prefix = prefix.strip("/")
        return other

    # -- transfer --------------------------------------------------------------------------
    def upload_file(self, path: str, rel: str, metadata: dict[str, str] | None = None,
                    length: int | None = None, concurrency: int | None = None) -> tuple[int, str]:
        """Upload under the blob name of `rel`; returns (bytes, xxh3-128 of what was sent)."""
        name = self.name(rel)
        activity = [0.0]

        def go() -> tuple[int, str]:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size if length is None else length
                reader = _HashingReader(f, activity)
                self.container.upload_blob(
                    name, reader, length=size, overwrite=True,  # type: ignore[arg-type]
                    max_concurrency=concurrency or self.cfg.concurrency,
                    metadata=metadata,
                )
                return size, reader.hasher.hexdigest()

        return self.retry(f"uploading {name}", go, activity=activity)

    def upload_fileobj(self, f: BinaryIO, rel: str, metadata: dict[str, str] | None = None,
                       length: int | None = None, concurrency: int | None = None) -> tuple[int, str]:
        """upload_file from a file the caller opened (and checked): each attempt re-reads it
        from where it stood at the call."""
        name = self.name(rel)
        start = f.tell()

        def go() -> tuple[int, str]:
            f.seek(start)
            size = os.fstat(f.fileno()).st_size - start if length is None else length
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
                      concurrency: int | None = None, *, fd: int | None = None,
                      cancel: threading.Event | None = None) -> int:
        """Download one blob, fsynced; returns its bytes.

        fd: an open, writable descriptor of a file the caller created for this download (it is
        truncated before each attempt; `dest` then only names it in messages). Without fd,
        `dest` is opened with O_NOFOLLOW and must be a regular file or absent.
        """
        name = self.name(rel)
        activity = [0.0]

        def go() -> int:
            done = [0]

            def hook(current: int, total: int | None) -> None:
                activity[0] = time.monotonic()
                if progress is not None and current > done[0]:
                    progress(current - done[0])
                    done[0] = current

            own = fd is None
            if own:
                os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
                target = fsafe.open_file(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            else:
                assert fd is not None
                target = fd
                os.ftruncate(target, 0)
            try:
                with os.fdopen(target, "wb", closefd=False) as f:
                    f.seek(0)
                    n = self.container.download_blob(
                        name, max_concurrency=concurrency or self.cfg.concurrency, progress_hook=hook
                    ).readinto(f)
                    f.flush()
                os.fsync(target)
            finally:
                if own:
                    os.close(target)
            return int(n)

        return self.retry(f"downloading {name}", go, cancel=cancel, activity=activity)

    def download_many(self, items: list[tuple[str, str]], progress: Callable[[int], None] | None = None,
                      *, fds: Mapping[str, int] | None = None) -> dict[str, int]:
        """Download (rel, dest) pairs with archive.concurrency files in flight.

        `fds`: dest -> open descriptor to download into (see download_file). The first failure
        stops the rest (files not started are not started, running ones stop before their
        next attempt), so a dead archive fails the operation once, not once per file.
        """
        workers = max(1, min(self.cfg.concurrency, len(items)))
        per_file = max(1, self.cfg.concurrency // workers)
        cancel = threading.Event()

        def one(it: tuple[str, str]) -> int:
            if cancel.is_set():
                raise _Cancelled()
            try:
                if fds is not None:
                    return self.download_file(it[0], it[1], progress, per_file, fd=fds[it[1]], cancel=cancel)
                return self.download_file(it[0], it[1], progress, per_file, cancel=cancel)
            except BaseException:
                cancel.set()
                raise

        first: BaseException | None = None
        sizes: dict[str, int] = {}
        with ThreadPoolExecutor(workers) as ex:
            futures = {ex.submit(one, it): it for it in items}
            for fut in as_completed(futures):
                e = fut.exception()
                if e is None:
                    sizes[futures[fut][0]] = fut.result()
                elif not isinstance(e, _Cancelled) and first is None:
                    first = e
        if first is not None:
            raise first
        return sizes

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
    data: bytes = b""             # the marker blob's bytes, as read


def archived_markers(store: BlobStore, listing: Mapping[str, BlobInfo],
                     naming: str | None = DEFAULT_NAMING) -> Iterator[ArchivedMarker]:
    """Every marker in a listing, parsed: the archive side of "scan markers, trust no pointer".

    Only directories named in scheme `naming` (the model's) count: another scheme's name is not
    a checkpoint of this model (None: any built-in scheme).
    """
    for rel in sorted(listing):
        parts = rel.split("/")
        if len(parts) != 3 or parts[2] != MARKER or (cid := parse_in(parts[1], naming)) is None:
            continue
        data = store.get_bytes(rel)
        if data is None:       # deleted since the listing
            continue
        try:
            m = Manifest.from_json(data)
        except ValueError as e:
            yield ArchivedMarker(rel, parts[0], parts[1], len(data), None, f"does not parse ({e})", data)
            continue
        m = replace(m, naming=cid.naming)
        if m.name != parts[1]:
            yield ArchivedMarker(rel, parts[0], parts[1], len(data), None, f"names checkpoint {m.name}, not {parts[1]}", data)
            continue
        yield ArchivedMarker(rel, parts[0], parts[1], len(data), m, "", data)
