"""GPU node custom data: cloud-init's own schema check, Azure's size limit, no secret, the toolkit's own config."""
from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from components.node import cloud_init, toolkit
from tiered_ckpt import config as node_config
from tiered_ops import mockrun

from .conftest import ROOT, SSH_KEY, Plan, custom_data, login_data, node_inputs, schema_check

pytestmark = pytest.mark.timeout(120)

SECRET_PATTERNS = [
    r"AccountKey=", r"SharedAccessSignature", r"[?&]sig=", r"\bsv=\d{4}-\d{2}-\d{2}&", r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
    r"DefaultEndpointsProtocol=", r"client_secret", r"password\s*[:=]", r"BlobEndpoint=",
]


@pytest.mark.parametrize("stack", ["prod", "dev"])
def test_custom_data_passes_cloud_init_schema_size_and_secret_checks(plan: Plan, stack: str, tmp_path: Path) -> None:
    p = plan(stack)
    for raw in (custom_data(p), login_data(p)):
        r = schema_check(raw, tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "Valid cloud-config" in r.stdout
        assert len(raw) <= cloud_init.CUSTOM_DATA_LIMIT
        text = raw.decode()
        for pat in SECRET_PATTERNS:
            assert not re.search(pat, text, re.IGNORECASE), pat


def test_schema_check_catches_a_broken_document(tmp_path: Path) -> None:
    # The check above is only worth something if cloud-init rejects bad documents in this environment.
    r = schema_check(b"#cloud-config\npackages: 5\nruncmd: {a: 1}\n", tmp_path)
    assert r.returncode != 0 and "packages" in r.stdout + r.stderr


def test_custom_data_mounts_amlfs_installs_toolkit_and_timer(plan: Plan) -> None:
    p = plan("prod")
    doc = yaml.safe_load(custom_data(p))
    files = {f["path"]: f for f in doc["write_files"]}
    env = files[cloud_init.BOOT_ENV]["content"]
    assert f"MGS={mockrun.MOCK_MGS}\n" in env and f"FSTAB_OPTIONS={cloud_init.FSTAB_OPTIONS}\n" in env
    assert doc["runcmd"] == [["/usr/local/sbin/tiered-ckpt-bootstrap"]]
    assert files[cloud_init.BOOTSTRAP]["content"] == (cloud_init.SCRIPTS / "bootstrap-node.sh").read_text()
    # Toolkit: fetched with the node's managed identity via IMDS, verified by sha256 before install.
    uami = p.one("azure-native:managedidentity:UserAssignedIdentity", "gpu-identity")
    blob = p.one("azure-native:storage:Blob")
    tools = p.one("azure-native:storage:StorageAccount", "tools")
    assert f"IDENTITY_CLIENT_ID={uami.state['clientId']}\n" in env and "IMDS=http://169.254.169.254\n" in env
    assert f"TOOLS_URL=https://{tools.state['name']}.blob.core.windows.net/tools/{blob.inputs['blobName']}\n" in env
    sha = re.search(r"TOOLS_SHA256=([0-9a-f]{64})\n", env)
    uploaded = Path(blob.inputs["source"].path).read_bytes()       # the FileAsset the blob is created from
    assert sha and sha.group(1) == hashlib.sha256(uploaded).hexdigest()
    # Retention runs once per cluster: the timer is on the login VM, never on an ND node.
    assert not any("retention" in path for path in files) and "RETENTION=0\n" in env
    login = {f["path"]: f for f in yaml.safe_load(login_data(p))["write_files"]}
    service = login["/etc/systemd/system/tiered-ckpt-retention.service"]["content"]
    assert "ExecStart=/opt/tiered-ckpt/bin/tiered-ckpt retention apply --json --log-format json" in service
    assert "RETENTION_SCHEDULE='*:0/15'\n" in login[cloud_init.BOOT_ENV]["content"]
    assert login[cloud_init.BOOTSTRAP]["content"] == (cloud_init.SCRIPTS / "bootstrap-login.sh").read_text()


def test_node_config_is_the_toolkits_own_schema_with_deployment_values(plan: Plan, tmp_path: Path) -> None:
    p = plan("prod")
    doc = yaml.safe_load(custom_data(p))
    content = next(f["content"] for f in doc["write_files"] if f["path"] == "/etc/tiered-ckpt/config.yaml")
    path = tmp_path / "config.yaml"
    path.write_text(content)
    cfg = node_config.load(str(path))        # the toolkit's own loader and validation
    o = p.outputs
    assert cfg.root == "/lustrefs/checkpoints" and cfg.backend == "amlfs" and cfg.nodes == 8
    assert cfg.archive.account_url == o["storageAccountUrl"].rstrip("/")
    assert cfg.archive.container == o["dataContainer"] and cfg.archive.prefix == "checkpoints"
    assert cfg.archive.connection_string is None
    assert cfg.archive.managed_identity_client_id == p.one("azure-native:managedidentity:UserAssignedIdentity", "gpu-identity").state["clientId"]
    assert (cfg.amlfs.subscription_id, cfg.amlfs.resource_group, cfg.amlfs.filesystem, cfg.amlfs.autoexport_job) == (
        o["subscriptionId"], o["computeResourceGroup"], o["amlfsName"], o["autoExportJobName"])
    assert cfg.amlfs.provisioned_gbps == 64.0 and cfg.amlfs.mount == "/lustrefs"
    assert (cfg.retention.keep_last, cfg.retention.min_keep, cfg.retention.action) == (3, 2, "release")


@pytest.mark.parametrize("stack", ["prod", "dev"])
def test_config_yaml_is_the_one_node_config_mapping_of_settings_and_outputs(plan: Plan, stack: str) -> None:
    """One declaration per node setting: the config.yaml every VM gets is node_config(settings, outputs)
    dumped, and the boot's inputs carry no copy of a NodeConfig field beside it."""
    from dataclasses import fields, is_dataclass

    from components.node.config import node_config as build
    from components.settings import schema

    p = plan(stack)
    o = p.outputs
    s = schema.load(mockrun.stack_config(stack, {"sshPublicKey": SSH_KEY}), stack)
    want = build(s, account_url=o["storageAccountUrl"], container=o["dataContainer"],
                 identity_client_id=p.one("azure-native:managedidentity:UserAssignedIdentity", "gpu-identity").state["clientId"],
                 subscription_id=o["subscriptionId"], resource_group=o["computeResourceGroup"], filesystem=o["amlfsName"],
                 autoexport_job=o["autoExportJobName"], provisioned_gbps=float(o["provisionedGBps"]))
    for raw in (custom_data(p), login_data(p)):
        content = next(f["content"] for f in yaml.safe_load(raw)["write_files"] if f["path"] == cloud_init.CONFIG_PATH)
        assert content == node_config.dump(want)

    def names(cls: type) -> set[str]:
        out = set()
        for f in fields(cls):
            out.add(f.name)
            default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
            if is_dataclass(default):
                out |= names(type(default))
        return out

    copies = {f.name for f in fields(cloud_init.NodeInputs)} & (names(node_config.NodeConfig) | {"keep_last", "action"})
    assert not copies, f"cloud_init.NodeInputs re-declares NodeConfig fields: {sorted(copies)}"


def test_custom_data_size_does_not_grow_with_the_toolkit(tmp_path: Path) -> None:
    # The toolkit travels as a blob, so the custom data stays small whatever the toolkit's size.
    text = cloud_init.render(node_inputs())
    assert len(text.encode()) < cloud_init.CUSTOM_DATA_LIMIT * 3 // 4
    assert schema_check(text.encode(), tmp_path).returncode == 0
    # The largest documents: a node and the login VM with Slurm, the NCCL profile, every script and long
    # names everywhere stay under Azure's limit with room for the scripts to grow (a quarter of it).
    from components.node import slurm_conf
    conf = slurm_conf.SlurmConfInputs("c" * 40, "h" * 63, 100, controller_addr="10.255.255.254", health_check_program=cloud_init.HEALTHCHECK)
    slurm = cloud_init.SlurmInputs(conf=conf, vault_url="https://" + "v" * 24 + ".vault.azure.net", secret_name="munge-key",
                                   vault_client_id="0" * 36)
    for role in (cloud_init.ROLE_NODE, cloud_init.ROLE_LOGIN):
        big = cloud_init.render(node_inputs(role=role, slurm=slurm, nccl_topo_file="/opt/microsoft/ndv5-topo.xml",
                                        training_user="u" * 32, training_group="g" * 32))
        assert len(big.encode()) < cloud_init.CUSTOM_DATA_LIMIT * 4 // 5, (role, len(big.encode()))
        assert len(base64.b64decode(cloud_init.encode(big))) == len(big.encode())
        assert schema_check(big.encode(), tmp_path).returncode == 0
    with pytest.raises(ValueError, match="above Azure's 65535-byte limit"):
        cloud_init.encode("#cloud-config\n" + "#" * 70000)


def test_toolkit_tarball_is_deterministic_and_installable(tmp_path: Path) -> None:
    a = toolkit.build_toolkit(ROOT, tmp_path / "a")
    b = toolkit.build_toolkit(ROOT, tmp_path / "b")
    assert a.sha256 == b.sha256 and a.path.read_bytes() == b.path.read_bytes()
    assert a.blob_name == f"tiered-ckpt-{a.sha256[:16]}.tar.gz"
    with tarfile.open(a.path) as tar:
        names = tar.getnames()
        assert "pyproject.toml" in names and "src/tiered_ckpt/cli/app.py" in names and "src/tiered_ckpt/config.py" in names
        assert not any("__pycache__" in n for n in names)
        assert all(m.mtime == 0 and m.uid == 0 for m in tar.getmembers())
        # Exactly the node toolkit: no operator (teardown, preview, Pulumi driver) or demo module.
        assert all(n == "pyproject.toml" or n.startswith("src/tiered_ckpt/") for n in names), names
        # (The toolkit's own `timeline` command is a node module: it imports matplotlib only to draw.)
        assert not any(k in n for n in names for k in ("tiered_ops", "tiered_demo", "teardown", "azurite"))


@pytest.mark.timeout(600)
def test_a_node_venv_from_the_tarball_runs_the_toolkit_without_the_demo_libraries(tmp_path: Path) -> None:
    """What cloud-init does on a node: a fresh venv, the bootstrap's own pip lines (dependencies from the
    hashed lock in --require-hashes mode, then the toolkit tarball with no resolution), run as rendered."""
    t = toolkit.build_toolkit(ROOT, tmp_path / "t")
    root = tmp_path / "root"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    doc = yaml.safe_load(cloud_init.render(node_inputs()))
    for f in doc["write_files"]:
        if f["path"] in (cloud_init.NODE_REQUIREMENTS, cloud_init.BOOT_ENV, cloud_init.BOOT_LIB):
            (root / f["path"].lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            (root / f["path"].lstrip("/")).write_text(f["content"])
    env["SYSROOT"] = str(root)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"        # python3 -m venv with this interpreter
    lib = root / cloud_init.BOOT_LIB.lstrip("/")
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", f". {lib}; load_settings VENV NODE_REQUIREMENTS; install_toolkit {t.path}"],
                       capture_output=True, text=True, timeout=540, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    venv = root / cloud_init.VENV.lstrip("/")
    py = str(venv / "bin" / "python")
    for absent in ("numpy", "matplotlib", "tiered_ops", "tiered_demo", "components"):
        r = subprocess.run([py, "-c", f"import {absent}"], capture_output=True, text=True, cwd=tmp_path, timeout=60, env=env)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, absent
    assert (root / "usr/local/bin/tiered-ckpt").readlink() == Path(cloud_init.VENV) / "bin" / "tiered-ckpt"
    r = subprocess.run([str(venv / "bin" / "tiered-ckpt"), "--help"], capture_output=True, text=True, cwd=tmp_path, timeout=60,
                       env=env)
    assert r.returncode == 0 and "retention" in r.stdout and "restore" in r.stdout, r.stderr
    assert "demo" not in r.stdout.split("positional arguments")[-1].split("options")[0]


@pytest.mark.parametrize("action", ["release", "delete"])
def test_retention_runs_as_an_unprivileged_user_owning_nothing_but_the_shared_group(action: str, tmp_path: Path) -> None:
    """The retention units as the login VM's boot leaves them: the unit from scripts/systemd plus the drop-in
    scripts/lib/boot-common.sh writes from this deployment's settings, read as systemd merges them."""
    from tests.doubles.image import make_image, systemd
    text = cloud_init.render(node_inputs(action=action, role=cloud_init.ROLE_LOGIN))
    assert schema_check(text.encode(), tmp_path).returncode == 0
    img = make_image(tmp_path / "image", secure_boot=False)
    img.write_files(text)
    run = img.run(f". {img.root / cloud_init.BOOT_LIB.lstrip('/')}; load_settings; users_and_tree; retention_units")
    assert run.returncode == 0, run.stderr
    unit = systemd.load_unit(img.root, f"{cloud_init.UNIT}.service")
    assert unit is not None
    svc = unit.service
    assert (svc["User"], svc["Group"], svc["SupplementaryGroups"], svc["NoNewPrivileges"], svc["UMask"]) == (
        "tiered-ckpt", "tiered-ckpt", "training", "yes", "0002")
    # Only hsm_release needs a capability (Lustre's HSM request masks); nothing bypasses permissions.
    caps = "CAP_SYS_ADMIN" if action == "release" else ""
    assert svc["AmbientCapabilities"] == caps and svc["CapabilityBoundingSet"] == caps
    assert "RequiresMountsFor" in unit.unit and unit.unit["RequiresMountsFor"] == "/lustrefs"
    assert "tiered-ckpt-retention.timer" in img.state["active"]
    passwd = (img.root / "etc/passwd").read_text()
    assert f"tiered-ckpt:x:{cloud_init.SERVICE_ID}:{cloud_init.SERVICE_ID}:" in passwd
    assert img.state["log"].index("systemctl enable --now tiered-ckpt-retention.timer") > 0


def test_the_identity_token_never_appears_on_a_command_line(tmp_path: Path) -> None:
    """Any user on the node sees every process's argv (ps): the bearer token travels in a 0600 file."""
    blob = b"the toolkit tarball"
    lib = cloud_init.SCRIPTS / "lib" / "boot-common.sh"
    bin_dir, tmp = tmp_path / "bin", tmp_path / "tmp"
    bin_dir.mkdir()
    tmp.mkdir()
    (tmp_path / "blob").write_bytes(blob)
    (bin_dir / "curl").write_text(f"""#!/bin/bash
printf '%s\\n' "$*" >> {tmp_path}/argv.log
for a in "$@"; do
  case "$a" in @*) f=${{a#@}}; stat -c %a "$f" >> {tmp_path}/mode.log; cat "$f" >> {tmp_path}/header.log ;; esac
done
case "$*" in *169.254.169.254*) echo '{{"access_token": "SECRET-TOKEN-123", "expires_in": "3599"}}'; exit 0 ;; esac
while [ $# -gt 0 ]; do [ "$1" = -o ] && cp {tmp_path}/blob "$2"; shift; done
""")
    (bin_dir / "curl").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "TMPDIR": str(tmp)}
    env.update(IMDS="http://169.254.169.254", IDENTITY_CLIENT_ID="cid", TOOLS_URL="https://t.blob.core.windows.net/tools/x",
               TOOLS_SHA256=hashlib.sha256(blob).hexdigest())
    run = subprocess.run(["bash", "-euc", f'. {lib}; fetch_toolkit {tmp_path}/out.tar.gz 1\n'],
                         capture_output=True, text=True, timeout=30, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "out.tar.gz").read_bytes() == blob
    argv = (tmp_path / "argv.log").read_text()
    assert "SECRET-TOKEN-123" not in argv and "Authorization" not in argv and argv.count("\n") == 2
    assert (tmp_path / "header.log").read_text() == "Authorization: Bearer SECRET-TOKEN-123\n"
    assert (tmp_path / "mode.log").read_text().split() == ["600"]
    assert list(tmp.iterdir()) == [], "the header file is removed after use"
