#!/usr/bin/env python3
"""The cluster's munge key, kept in Azure Key Vault and read with this VM's managed identity.

    tiered-ckpt-munge-key init  --vault URL --secret NAME --client-id ID   (controller: create once, then read)
    tiered-ckpt-munge-key fetch --vault URL --secret NAME --client-id ID   (ND nodes: wait until it exists, read)

Writes the key file (default /etc/munge/munge.key, mode 0400, owner munge: munged(8) refuses a key others can
read). The key travels only between Key Vault and that file: never on a command line, in the environment, in
custom data, in a log line or in Pulumi state. Installed on the VMs by cloud-init (scripts/, components/node/cloud_init.py); standard library only.

Key Vault REST: GET/PUT {vault}/secrets/{name}?api-version=7.4 (REST reference, "Get Secret", "Set Secret");
a token for https://vault.azure.net from IMDS for the user-assigned identity (Azure docs, "How to use managed
identities for Azure resources on an Azure VM to acquire an access token"). A 401/403 right after deployment
is role propagation (it takes minutes): retried until --timeout, like a secret that does not exist yet.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import pwd
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

API_VERSION = "7.4"
KEY_BYTES = 128          # mungekey(8)'s default key: 1024 bits
MIN_KEY, MAX_KEY = 32, 1024


def token(imds: str, client_id: str) -> str:
    q = urllib.parse.urlencode({"api-version": "2018-02-01", "resource": "https://vault.azure.net", "client_id": client_id})
    req = urllib.request.Request(f"{imds}/metadata/identity/oauth2/token?{q}", headers={"Metadata": "true"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return str(json.load(r)["access_token"])


def call(method: str, url: str, tok: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any] | None]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Authorization": f"Bearer {tok}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, None


def write_key(path: str, key: bytes, owner: str) -> None:
    """Create the file 0400 before any byte is written, then rename over the old key."""
    tmp = path + ".tmp"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
        f.flush()
        os.fsync(f.fileno())
    if owner:
        pw = pwd.getpwnam(owner)
        os.chown(tmp, pw.pw_uid, pw.pw_gid)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fetch (or create once) the munge key in Azure Key Vault.")
    ap.add_argument("mode", choices=["init", "fetch"])
    ap.add_argument("--vault", required=True, help="vault URL, https://<name>.vault.azure.net")
    ap.add_argument("--secret", required=True)
    ap.add_argument("--client-id", required=True, help="client ID of the user-assigned identity to use")
    ap.add_argument("--key-file", default="/etc/munge/munge.key")
    ap.add_argument("--owner", default="munge", help="owner of the key file; empty keeps the caller's")
    ap.add_argument("--imds", default="http://169.254.169.254")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds to keep retrying")
    ap.add_argument("--interval", type=float, default=10.0)
    a = ap.parse_args(argv)
    url = f"{a.vault.rstrip('/')}/secrets/{urllib.parse.quote(a.secret)}?api-version={API_VERSION}"
    deadline = time.monotonic() + a.timeout
    while True:
        status = "no answer"
        try:
            tok = token(a.imds, a.client_id)
            code, doc = call("GET", url, tok)
            status = f"HTTP {code}"
            if code == 200 and doc and doc.get("value"):
                key = base64.b64decode(doc["value"], validate=True)
                if not MIN_KEY <= len(key) <= MAX_KEY:
                    print(f"tiered-ckpt-munge-key: secret {a.secret} holds {len(key)} bytes, not a munge key "
                          f"({MIN_KEY}-{MAX_KEY}); delete it in the vault and rerun init", file=sys.stderr)
                    return 1
                write_key(a.key_file, key, a.owner)
                print(f"tiered-ckpt-munge-key: key from secret {a.secret} written to {a.key_file}")
                return 0
            if code == 404 and a.mode == "init":
                body = {"value": base64.b64encode(os.urandom(KEY_BYTES)).decode(), "contentType": "munge key, base64"}
                code, _ = call("PUT", url, tok, body)
                status = f"HTTP {code} creating the secret"
                if code == 200:
                    continue          # read it back: the stored value is the one every node gets
        except (urllib.error.URLError, OSError, ValueError, KeyError) as err:
            status = type(err).__name__   # the type only: a message could quote a response body
        if time.monotonic() >= deadline:
            print(f"tiered-ckpt-munge-key: no munge key from {a.vault} secret {a.secret} after {a.timeout:.0f} s "
                  f"(last: {status}); check the VM identity's Key Vault role on that vault", file=sys.stderr)
            return 1
        time.sleep(a.interval)


if __name__ == "__main__":
    sys.exit(main())
