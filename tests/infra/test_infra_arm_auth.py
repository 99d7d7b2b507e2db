"""The program's own ARM calls authenticate like the azure-native provider, and a credential that
cannot work stops `pulumi up` before the file system is created."""
from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest
from pulumi.dynamic.dynamic import serialize_provider

from components.resources import arm_auth
from components.resources.arm_auth import resolve
from components.resources.blob_jobs import ArmClientFactory, ArmCredentialCheckProvider
from components.settings.schema import SettingsError

IDS = {"clientId": "11111111-2222-3333-4444-555555555555", "tenantId": "66666666-7777-8888-9999-000000000000"}


def test_default_is_the_cli_login_on_the_public_cloud() -> None:
    a = resolve({}, {})
    assert (a.mode, a.authority, a.arm_endpoint) == ("default", "login.microsoftonline.com", "https://management.azure.com")


def test_stack_config_wins_over_the_environment_and_env_fills_the_rest() -> None:
    a = resolve({"clientSecret": "from-config", "clientId": IDS["clientId"]},
                {"ARM_CLIENT_SECRET": "from-env", "ARM_TENANT_ID": IDS["tenantId"], "ARM_ENVIRONMENT": "usgovernment"})
    assert a.mode == "client-secret" and a.get("clientSecret") == "from-config" and a.get("tenantId") == IDS["tenantId"]
    assert a.arm_endpoint == "https://management.usgovcloudapi.net" and a.authority == "login.microsoftonline.us"
    assert "from-config" not in a.describe() and IDS["clientId"] in a.describe()


def test_oidc_from_github_actions_variables() -> None:
    a = resolve({"useOidc": "true", **IDS}, {"ACTIONS_ID_TOKEN_REQUEST_TOKEN": "bearer", "ACTIONS_ID_TOKEN_REQUEST_URL": "https://t/x"})
    assert a.mode == "oidc" and a.get("oidcRequestToken") == "bearer" and a.get("oidcRequestUrl") == "https://t/x"


def test_unusable_settings_are_refused_all_at_once_naming_key_and_variable() -> None:
    with pytest.raises(SettingsError) as e:
        resolve({"useOidc": "true", "clientId": IDS["clientId"], "environment": "mars"}, {})
    msg = str(e.value)
    assert "azure-native:environment 'mars'" in msg
    assert "azure-native:tenantId (ARM_TENANT_ID)" in msg
    assert "no token source" in msg and "oidcTokenFilePath" in msg
    with pytest.raises(SettingsError, match="metadataHost"):
        resolve({}, {"ARM_METADATA_HOSTNAME": "management.example"})


def test_each_mode_builds_its_azure_identity_credential(tmp_path: Path) -> None:
    from azure.identity import (
        ClientAssertionCredential,
        ClientSecretCredential,
        DefaultAzureCredential,
        ManagedIdentityCredential,
    )

    def cred(config: dict[str, str], env: dict[str, str] | None = None, **kw: object) -> object:
        return ArmClientFactory.credential(resolve(config, env or {}).props(), **kw)  # type: ignore[arg-type]

    assert isinstance(cred({"clientSecret": "s", **IDS}), ClientSecretCredential)
    assert isinstance(cred({"useMsi": "true"}), ManagedIdentityCredential)
    assert isinstance(cred({}), DefaultAzureCredential)
    token = tmp_path / "token"
    token.write_text("first\n")
    assert isinstance(cred({"useOidc": "true", "oidcTokenFilePath": str(token), **IDS}), ClientAssertionCredential)
    from_file = ArmClientFactory.assertion(resolve({"useOidc": "true", "oidcTokenFilePath": str(token), **IDS}, {}).props())
    assert from_file() == "first"
    token.write_text("rotated\n")
    assert from_file() == "rotated"                      # re-read for every token
    seen: list[tuple[str, str]] = []
    gh = resolve({"useOidc": "true", "oidcRequestToken": "b", "oidcRequestUrl": "https://t/x", **IDS}, {}).props()
    assert ArmClientFactory.assertion(gh, lambda url, bearer: seen.append((url, bearer)) or "jwt")() == "jwt"
    assert seen == [("https://t/x", "b")]


def test_the_check_passes_for_the_operator_and_fails_clearly_for_a_file_system_scoped_role(arm_double) -> None:  # type: ignore[no-untyped-def]
    from azure.mgmt.storagecache import StorageCacheManagementClient

    from tests.doubles.arm_double import NODE_TOKEN, OPERATOR_TOKEN, StaticTokenCredential

    def client(token: str) -> StorageCacheManagementClient:
        return StorageCacheManagementClient(StaticTokenCredential(token), arm_double.subscription_id, base_url=arm_double.endpoint,
                                            connection_verify=str(arm_double.ca_cert), retry_total=0)

    assert ArmCredentialCheckProvider.probe_access(client(OPERATOR_TOKEN), arm_double.resource_group, "default") == 1
    with pytest.raises(RuntimeError) as e:
        ArmCredentialCheckProvider.probe_access(client(NODE_TOKEN), arm_double.resource_group, "client-secret (clientId=x)")
    msg = str(e.value)
    assert "cannot use credential client-secret (clientId=x)" in msg and "AuthorizationFailed" in msg
    assert "Nothing was created after this check" in msg and arm_double.resource_group in msg


def test_program_checks_the_credential_before_creating_the_file_system(plan) -> None:  # type: ignore[no-untyped-def]
    r = plan("prod")
    check = r.one("tiered:index:ArmCredentialCheck") if r.of_type("tiered:index:ArmCredentialCheck") else None
    if check is None:
        found = [x for x in r.resources if x.type.endswith("ArmCredentialCheck")]
        assert len(found) == 1, [x.type for x in r.resources if "tiered" in x.type]
        check = found[0]
    fs = [x for x in r.resources if x.type == "azure-native:storagecache:AmlFilesystem"]
    assert len(fs) == 1 and r.depends_on(fs[0], check)
    assert check.inputs["auth"]["mode"] == "default"


def test_providers_deserialize_without_the_project_on_the_path(tmp_path: Path) -> None:
    blob = serialize_provider(ArmCredentialCheckProvider())
    code = ("import base64, dill, sys; p = dill.loads(base64.b64decode(sys.stdin.read())); "
            "print(type(p).__name__, callable(p.create))")
    r = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, text=True, cwd=tmp_path,
                       env={"PATH": "/usr/bin:/bin"}, timeout=50)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ArmCredentialCheckProvider True"
    assert base64.b64decode(blob) and arm_auth.OIDC == "oidc"
