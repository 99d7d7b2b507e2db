"""Start and stop Azurite (Microsoft's Blob emulator) on 127.0.0.1 for local mode and tests.

Azurite is installed inside the project by `make` (npm, package.json). It is a real Blob
server: the same azure-storage-blob client code talks to it and to Azure.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from tiered_ckpt.errors import UnavailableError, UserError

# Azurite's documented well-known development account (public, not a secret).
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def find_binary() -> str:
    """$AZURITE_BIN, the project's node_modules/.bin/azurite-blob, or one on PATH."""
    env = os.environ.get("AZURITE_BIN")
    if env:
        return env
    here = Path(__file__).resolve()
    for parent in here.parents:
        cand = parent / "node_modules" / ".bin" / "azurite-blob"
        if cand.exists():
            return str(cand)
    found = shutil.which("azurite-blob")
    if found:
        return found
    raise UserError(
        "Azurite is not installed: run `make demo` or `make test` (they install it with npm "
        "into node_modules/), or set AZURITE_BIN to an azurite-blob executable"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def connection_string(port: int, host: str = "127.0.0.1") -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
        f"BlobEndpoint=http://{host}:{port}/{ACCOUNT};"
    )


class Azurite:
    """A private Azurite blob server; a context manager that always stops it."""

    def __init__(self, location: str | None = None, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.requested_port = port
        self.port = 0
        self._own_dir = location is None
        self.location = location or tempfile.mkdtemp(prefix="azurite-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(self.location) / "azurite.log"

    @property
    def connection_string(self) -> str:
        return connection_string(self.port, self.host)

    def start(self, timeout: float = 30.0) -> Azurite:
        binary = find_binary()
        # A taken port (ours was raced, or the user asked for a busy one) just means: next port.
        for attempt in range(5):
            self.port = self.requested_port if (self.requested_port and attempt == 0) else free_port(self.host)
            log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(
                [binary, "--blobHost", self.host, "--blobPort", str(self.port), "--location", self.location,
                 "--skipApiVersionCheck", "--loose", "--silent",
                 # Local mode stays local: Azurite otherwise sends usage telemetry to Microsoft.
                 "--disableTelemetry"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            log.close()
            if self._wait_ready(timeout):
                return self
            self.stop()
        raise UnavailableError(f"Azurite did not start (see {self.log_path}); check that Node.js works and ports on {self.host} are free")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return True
            except OSError:
                time.sleep(0.1)
        return False

    def stop(self) -> None:
        """Stop the server and every process it started (the whole process group)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.location, ignore_errors=True)

    def __enter__(self) -> Azurite:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.cleanup()
