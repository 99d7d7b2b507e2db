"""pytest fixtures for the ARM double (imported by tests/conftest.py).

    def test_restore(arm_double, arm_jobs):
        arm_double.scenario.import_result = "CompletedPartial"
        jobs = arm_jobs()                       # AmlfsJobs -> the double, fast polls, short retries
        ...
        assert arm_double.kinds("autoexport.patch") == ["autoexport.patch:Disable", "autoexport.patch:Enable"]

    def test_cli(arm_env, tmp_path):            # code that builds AmlfsJobs from a NodeConfig
        cfg = {"amlfs": arm_env.config_values(), ...}   # arm_endpoint etc.; credential, TLS trust,
        ...                                              # polls and retries are patched in tiered_ckpt.tiers.arm
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.doubles.arm_double import NODE_TOKEN, ArmDouble, StaticTokenCredential, make_tls_cert
from tests.doubles.program_roles import node_grants

FAST_CLIENT = {"retry_total": 2, "retry_backoff_factor": 0.01, "retry_backoff_max": 0.05,
               "connection_timeout": 2, "read_timeout": 5}


@pytest.fixture(scope="session")
def arm_tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cert.pem, key.pem): one throwaway self-signed certificate for the session."""
    return make_tls_cert(tmp_path_factory.mktemp("arm-tls"))


@pytest.fixture
def arm_double(arm_tls: tuple[Path, Path]) -> Iterator[ArmDouble]:
    """A fresh ARM double (one file system `fs1`, auto-export job `job1`, enabled) on HTTPS."""
    double = ArmDouble(*arm_tls).start()
    # RBAC as deployed: the node identity (the static token's default) holds exactly the roles the
    # Pulumi program assigns it; OPERATOR_TOKEN is Contributor on the subscription.
    for g in node_grants(double):
        double.grant(NODE_TOKEN, g.actions, g.scope, g.not_actions)
    double.grant_operator()
    try:
        yield double
    finally:
        double.stop()


@pytest.fixture
def arm_jobs(arm_double: ArmDouble) -> Callable[..., Any]:
    """Factory: arm_jobs(target=None, **AmlfsJobs kwargs) -> AmlfsJobs against the double with the
    real client, a static token (the node identity's unless token=OPERATOR_TOKEN), 10 ms polls, a 10 s timeout and short retries."""
    from tiered_ckpt.tiers.arm import AmlfsJobs

    def make(target: Any = None, token: str = NODE_TOKEN, **kwargs: Any) -> AmlfsJobs:
        options = dict(FAST_CLIENT, connection_verify=str(arm_double.ca_cert))
        options.update(kwargs.pop("client_options", {}) or {})
        kwargs.setdefault("poll_interval", 0.01)
        kwargs.setdefault("timeout", 10.0)
        return AmlfsJobs(target or arm_double.target(), StaticTokenCredential(token), client_options=options, **kwargs)

    return make


@pytest.fixture
def arm_env(arm_double: ArmDouble, monkeypatch: pytest.MonkeyPatch) -> ArmDouble:
    """The double, with tiered_ckpt.tiers.arm's defaults patched so that code building AmlfsJobs from a
    NodeConfig (amlfs.arm_endpoint = arm_env.endpoint) reaches it: static token, trust in the
    double's certificate, 10 ms polls, short retries."""
    import tiered_ckpt.tiers.arm as arm

    use_identity(monkeypatch, NODE_TOKEN)
    monkeypatch.setattr(arm, "CLIENT_DEFAULTS", dict(FAST_CLIENT, connection_verify=str(arm_double.ca_cert)))
    monkeypatch.setattr(arm, "DEFAULT_POLL_INTERVAL", 0.01)
    monkeypatch.setattr(arm, "DEFAULT_TIMEOUT", 10.0)
    return arm_double


def use_identity(monkeypatch: pytest.MonkeyPatch, token: str) -> None:
    """Code that builds AmlfsJobs from a NodeConfig or stack outputs authenticates as `token`
    (NODE_TOKEN: the nodes' managed identity; OPERATOR_TOKEN: a Contributor on the subscription)."""
    import tiered_ckpt.tiers.arm as arm

    monkeypatch.setattr(arm, "default_credential", lambda target: StaticTokenCredential(token))
