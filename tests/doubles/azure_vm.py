"""A local stand-in for what a VM reaches over HTTP: the Azure Instance Metadata Service (managed identity
tokens, Scheduled Events, the instance name), one Key Vault's secrets API and the toolkit blob.

A real HTTP server answering like them: IMDS needs `Metadata: true` (Azure docs, "Azure Instance Metadata
Service"); Key Vault GET/PUT /secrets/{name}?api-version=7.4 answer 404 for a missing secret and 403 without a
role (Key Vault REST reference); the role table is the deployment's: `writers` hold Secrets Officer, `readers`
Secrets User; the blob answers 403 to an identity without Storage Blob Data Reader.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

SECRET = "munge-key"


class FakeAzure:
    """IMDS + one Key Vault. `readers`/`writers`: client IDs holding Secrets User / Secrets Officer."""

    def __init__(self, log: Path) -> None:
        self.secrets: dict[str, str] = {}
        self.readers: set[str] = set()
        self.writers: set[str] = set()
        self.puts: list[str] = []
        self.events: dict[str, Any] = {"DocumentIncarnation": 1, "Events": []}
        self.acks: list[Any] = []
        self.blobs: dict[str, bytes] = {}          # path -> content (the toolkit blob)
        self.blob_readers: set[str] = set()
        self.log = log
        self.vm_name = "vm0"
        azure = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: Any = None) -> None:
                data = (body if isinstance(body, str) else json.dumps(body or {})).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _client(self) -> str:
                return self.headers.get("Authorization", "").removeprefix("Bearer tok-")

            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                u = urlparse(self.path)
                q = parse_qs(u.query)
                if u.path.startswith("/metadata/"):
                    if self.headers.get("Metadata") != "true":
                        return self._send(400, {"error": "Metadata header required"})
                    if u.path == "/metadata/identity/oauth2/token":
                        assert q["resource"] in (["https://vault.azure.net"], ["https://storage.azure.com/"]), q
                        return self._send(200, {"access_token": "tok-" + q["client_id"][0], "expires_in": "3599"})
                    if u.path == "/metadata/scheduledevents":
                        assert q["api-version"] == ["2020-07-01"]
                        return self._send(200, azure.events)
                    if u.path == "/metadata/instance/compute/name":
                        return self._send(200, azure.vm_name)
                if u.path in azure.blobs:
                    if self._client() not in azure.blob_readers:
                        return self._send(403, {"error": "AuthorizationPermissionMismatch"})
                    data = azure.blobs[u.path]
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return None
                if u.path == f"/secrets/{SECRET}" and q.get("api-version") == ["7.4"]:
                    who = self._client()
                    if who not in azure.readers | azure.writers:
                        return self._send(403, {"error": {"code": "Forbidden"}})
                    if SECRET not in azure.secrets:
                        return self._send(404, {"error": {"code": "SecretNotFound"}})
                    return self._send(200, {"value": azure.secrets[SECRET], "id": "x"})
                self._send(404)

            def do_PUT(self) -> None:  # noqa: N802
                u = urlparse(self.path)
                who = self._client()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                azure.puts.append(who)
                if who not in azure.writers:
                    return self._send(403, {"error": {"code": "Forbidden"}})
                azure.secrets[u.path.rsplit("/", 1)[1]] = body["value"]
                self._send(200, {"value": body["value"]})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.headers.get("Metadata") == "true"
                azure.acks.append(body)
                with open(azure.log, "a") as f:
                    f.write(f"ack {json.dumps(body)}\n")
                self._send(200)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
