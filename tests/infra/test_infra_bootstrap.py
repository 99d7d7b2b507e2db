"""The VM boot, executed: the rendered custom data's files written into an image double of Ubuntu-HPC 24.04
(tests/doubles/image: its slurm* pin and Microsoft's repositories, Secure Boot vs DKMS modules, slurm-smd
creating no users, SchedMD's Type=notify units) and its runcmd run for real, against a local IMDS, Key Vault
and toolkit blob (tests/doubles/azure_vm.py). A boot that fails on the image fails here; the boot of the
previous tree (its exact commands, quoted below) does.
"""
from __future__ import annotations

import base64
import hashlib
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from components.node import cloud_init, node_lock, slurm_conf, toolkit
from tests.doubles.azure_vm import SECRET, FakeAzure
from tests.doubles.image import KERNEL, LUSTRE, Image, make_image
from tiered_ckpt import records

from .conftest import ROOT, Plan, node_inputs, schema_check

pytestmark = pytest.mark.timeout(120)
NODE_ID, LOGIN_ID = "node-identity", "login-identity"


@pytest.fixture
def azure(tmp_path: Path) -> Iterator[FakeAzure]:
    a = FakeAzure(tmp_path / "azure.log")
    a.readers, a.writers, a.blob_readers = {NODE_ID}, {LOGIN_ID}, {NODE_ID}
    a.blobs["/tools/toolkit.tar.gz"] = _tarball(tmp_path)
    yield a
    a.server.shutdown()


def _tarball(tmp_path: Path) -> bytes:
    src = tmp_path / "tk"
    src.mkdir()
    (src / "pyproject.toml").write_text("[project]\nname='tiered-ckpt'\n")
    subprocess.run(["tar", "-czf", str(tmp_path / "tk.tar.gz"), "-C", str(src), "."], check=True, timeout=30)
    return (tmp_path / "tk.tar.gz").read_bytes()


def _cloud_config(azure: FakeAzure, role: str, **over: object) -> str:
    conf = slurm_conf.SlurmConfInputs("tiered", "tckpt-login", 100, controller_addr="10.42.4.4",
                                      health_check_program=cloud_init.HEALTHCHECK, state_dir="/lustrefs/.slurm/slurmctld")
    slurm = cloud_init.SlurmInputs(conf=conf, vault_url=azure.url, secret_name=SECRET,
                                   vault_client_id=LOGIN_ID if role == cloud_init.ROLE_LOGIN else NODE_ID)
    blob = azure.blobs["/tools/toolkit.tar.gz"]
    n = node_inputs(role=role, slurm=slurm, identity_client_id=NODE_ID, tools_url=f"{azure.url}/tools/toolkit.tar.gz",
                tools_sha256=hashlib.sha256(blob).hexdigest(), model="llama3-70b", **over)
    # The VM reaches IMDS at the link-local address; here the local stand-in answers.
    return cloud_init.render(n).replace(f"IMDS={cloud_init.IMDS}", f"IMDS={azure.url}")


def _boot(tmp_path: Path, azure: FakeAzure, role: str, *, secure_boot: bool, **over: object) -> tuple[Image, subprocess.CompletedProcess[str]]:
    img = make_image(tmp_path / "image", secure_boot=secure_boot)
    if role == cloud_init.ROLE_NODE:
        azure.secrets[SECRET] = base64.b64encode(b"k" * 128).decode()       # the controller created it
    return img, img.boot(_cloud_config(azure, role, **over))


def test_an_nd_node_boots_on_the_image_with_secure_boot_off(tmp_path: Path, azure: FakeAzure) -> None:
    img, run = _boot(tmp_path, azure, cloud_init.ROLE_NODE, secure_boot=False)
    assert run.returncode == 0, run.stdout + run.stderr
    st = img.state
    # Lustre: the image's DKMS client, loaded (Secure Boot off), nothing reinstalled, no kernel held.
    assert "lustre" in st["loaded"] and st["modules"]["lustre"] == "dkms"
    assert not any(KERNEL in h or "lustre" in h for h in st["held"])
    assert "Lustre client path: dkms (Secure Boot off" in run.stdout
    # Slurm: Microsoft's slurm-smd* at the one pinned version, held; users with CycleCloud's fixed ids.
    v = slurm_conf.SLURM_VERSION
    assert {p: st["packages"][p] for p in ("slurm-smd", "slurm-smd-client", "slurm-smd-slurmd")} == dict.fromkeys(
        ("slurm-smd", "slurm-smd-client", "slurm-smd-slurmd"), v)
    assert "slurmd" not in st["packages"] and "slurm-smd-slurmctld" not in st["packages"]
    assert {"slurm-smd", "slurm-smd-client", "slurm-smd-slurmd"} <= set(st["held"])
    passwd = (img.root / "etc/passwd").read_text()
    assert f"slurm:x:{slurm_conf.SLURM_UID}:{slurm_conf.SLURM_UID}:" in passwd
    assert f"munge:x:{slurm_conf.MUNGE_UID}:{slurm_conf.MUNGE_UID}:" in passwd
    # slurmd: the packaged notify unit, started with --systemd and the dynamic-node options of /etc/default/slurmd.
    assert st["active"]["slurmd.service"] == ["/usr/sbin/slurmd", "--systemd", "-Z", "--conf", "Gres=gpu:8 Feature=ndv5"]
    assert (img.root / "etc/default/slurmd").read_text() == slurm_conf.render_slurmd_defaults(
        slurm_conf.SlurmConfInputs("tiered", "tckpt-login", 100))
    assert "munge.service" in st["active"] and st["owners"]["/etc/munge/munge.key"] == "munge:munge"
    assert (img.root / "etc/munge/munge.key").read_bytes() == b"k" * 128
    assert "--drain" in (img.root / "etc/default/tiered-ckpt-scheduled-events").read_text()
    assert "tiered-ckpt-scheduled-events.service" in st["active"]
    # The mount, the toolkit, the shared tree (records directory included, issue 21 item 8), no retention here.
    assert "lustrefs.automount" in st["active"]
    fstab = (img.root / "etc/fstab").read_text().splitlines()
    assert fstab[-1] == f"10.42.0.4@tcp:/lustrefs /lustrefs lustre {cloud_init.FSTAB_OPTIONS} 0 0"
    assert (img.root / "opt/tiered-ckpt/src/pyproject.toml").is_file()
    pips = (img.root / ".image/pip.log").read_text().splitlines()
    assert len(pips) == 2 and "--require-hashes" in pips[0] and "--no-deps --no-index" in pips[1]
    rec = str(records.records_dir("/lustrefs/checkpoints", "llama3-70b"))
    assert rec == "/lustrefs/.checkpoints.records/llama3-70b"
    for d in ("/lustrefs/checkpoints", "/lustrefs/checkpoints/llama3-70b", "/lustrefs/.checkpoints.records", rec):
        assert (img.root / d.lstrip("/")).is_dir() and (img.root / d.lstrip("/")).stat().st_mode & 0o7777 == 0o2775, d
        assert st["owners"][d] == "azureuser:training" and "d:g:tiered-ckpt:rwx" in st["acls"][d], d
    assert "tiered-ckpt-retention.timer" not in st["active"]


def test_the_login_vm_boots_under_secure_boot_with_the_signed_lustre_client(tmp_path: Path, azure: FakeAzure) -> None:
    img, run = _boot(tmp_path, azure, cloud_init.ROLE_LOGIN, secure_boot=True)
    assert run.returncode == 0, run.stdout + run.stderr
    st = img.state
    # Secure Boot on: the unsigned DKMS client is replaced by the signed kmod for this kernel, kernel held.
    assert st["modules"]["lustre"] == "kmod" and "lustre" in st["loaded"]
    assert st["packages"][f"amlfs-lustre-client-{LUSTRE}"] == KERNEL
    assert not any("dkms" in p for p in st["packages"])
    assert f"linux-image-{KERNEL}" in st["held"] and f"amlfs-lustre-client-{LUSTRE}" in st["held"]
    # slurmctld: packaged unit (User=slurm exists, uid 11100), --systemd; the key created in the vault.
    assert st["active"]["slurmctld.service"] == ["/usr/sbin/slurmctld", "--systemd"]
    assert st["packages"]["slurm-smd-slurmctld"] == slurm_conf.SLURM_VERSION and "slurm-smd-slurmd" not in st["packages"]
    assert base64.b64decode(azure.secrets[SECRET]) == (img.root / "etc/munge/munge.key").read_bytes()
    assert st["owners"]["/lustrefs/.slurm/slurmctld"] == "slurm:slurm"
    # Retention (once per cluster) with this deployment's schedule and capability; departed nodes cleaned up.
    assert {"tiered-ckpt-retention.timer", "tiered-ckpt-slurm-cleanup.timer"} <= set(st["active"])
    dropin = (img.root / "etc/systemd/system/tiered-ckpt-retention.service.d/10-boot.conf").read_text()
    assert "User=tiered-ckpt" in dropin and "AmbientCapabilities=CAP_SYS_ADMIN" in dropin
    assert "OnCalendar=*:0/15" in (img.root / "etc/systemd/system/tiered-ckpt-retention.timer.d/10-boot.conf").read_text()
    assert "--drain" not in (img.root / "etc/default/tiered-ckpt-scheduled-events").read_text()


def test_secure_boot_without_a_signed_client_for_the_kernel_fails_with_one_message(tmp_path: Path, azure: FakeAzure) -> None:
    img = make_image(tmp_path / "image", secure_boot=True, kernel="6.8.0-2000-azure")
    run = img.boot(_cloud_config(azure, cloud_init.ROLE_LOGIN))
    assert run.returncode == 1
    errors = [ln for ln in run.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "Secure Boot is on" in errors[0] and "6.8.0-2000-azure" in errors[0]
    assert "secureBootEnabled false" in errors[0] and "Traceback" not in run.stderr
    assert "slurm-smd" not in img.state["packages"]           # nothing after the failed step ran


def test_dkms_asked_for_under_secure_boot_is_refused_before_anything_installs(tmp_path: Path, azure: FakeAzure) -> None:
    img, run = _boot(tmp_path, azure, cloud_init.ROLE_NODE, secure_boot=True, lustre_client="dkms")
    assert run.returncode == 1 and "Secure Boot is on and lustreClient is dkms" in run.stderr
    assert img.state.get("log", []) == []


def test_a_vm_whose_slurm_user_has_another_uid_fails_naming_it(tmp_path: Path, azure: FakeAzure) -> None:
    img = make_image(tmp_path / "image", secure_boot=False, passwd={"slurm": 64030})
    azure.secrets[SECRET] = base64.b64encode(b"k" * 128).decode()
    run = img.boot(_cloud_config(azure, cloud_init.ROLE_NODE))
    assert run.returncode == 1
    assert re.search(rf"(user|group) slurm exists with [ug]id 64030, not {slurm_conf.SLURM_UID}; every VM must use the same",
                     run.stderr), run.stderr


# --- what the previous boot (components/node/cloud_init.py before issue 20, commit ead7d6e) did, on the image ---

def test_the_previous_slurm_install_finds_no_candidate_on_the_image(tmp_path: Path) -> None:
    img = make_image(tmp_path / "image", secure_boot=False)
    for line in ("apt-get install -y -q munge slurmd slurm-client", "apt-get install -y -q munge slurmctld slurm-client"):
        run = img.run(line)
        assert run.returncode == 100 and "has no installation candidate" in run.stderr, (line, run.stderr)
    # Without the image's pin (a plain Ubuntu image) the same line would install Ubuntu's Slurm: the pin is
    # what the double encodes, not a refusal of everything.
    (img.root / "etc/apt/preferences.d/slurm-repository-pin-990").unlink()
    assert img.run("apt-get install -y -q slurmd").returncode == 0


def test_the_previous_slurmd_drop_in_never_becomes_active_under_the_packaged_notify_unit(tmp_path: Path) -> None:
    img = make_image(tmp_path / "image", secure_boot=False)
    assert img.run(f"apt-get install -y -q slurm-smd-slurmd={slurm_conf.SLURM_VERSION}").returncode == 0
    dropin = img.root / "etc/systemd/system/slurmd.service.d/tiered-ckpt.conf"
    dropin.parent.mkdir(parents=True)
    # The previous drop-in, verbatim: ExecStart reset to a foreground slurmd without --systemd.
    dropin.write_text('[Unit]\nAfter=munge.service remote-fs.target\nRequiresMountsFor=/lustrefs\n\n[Service]\n'
                      'ExecStart=\nExecStart=/usr/sbin/slurmd -D -s -Z --conf "Gres=gpu:8 Feature=ndv5"\n')
    run = img.run("systemctl daemon-reload && systemctl restart slurmd")
    assert run.returncode == 1 and "timeout was exceeded" in run.stderr
    # The same unit with the options in /etc/default/slurmd (this tree's way) becomes active.
    dropin.unlink()
    (img.root / "etc/default/slurmd").write_text(slurm_conf.render_slurmd_defaults(slurm_conf.SlurmConfInputs("c", "h", 1)))
    assert img.run("systemctl restart slurmd").returncode == 0
    assert img.state["active"]["slurmd.service"] == ["/usr/sbin/slurmd", "--systemd", "-Z", "--conf", "Gres=gpu:8 Feature=ndv5"]


def test_the_previous_lustre_step_fails_under_secure_boot(tmp_path: Path) -> None:
    """The previous boot kept the image's DKMS client and ran `modprobe lustre`: refused under Secure Boot."""
    img = make_image(tmp_path / "image", secure_boot=True)
    run = img.run("modinfo lustre >/dev/null && modprobe lustre")
    assert run.returncode == 1 and "Key was rejected by service" in run.stderr
    assert img.run("mokutil --sb-state").stdout.strip() == "SecureBoot enabled"
    img.update(secure_boot=False)
    assert img.run("modprobe lustre").returncode == 0


def test_slurm_smd_creates_no_users_and_ubuntus_munge_picks_its_own_uid(tmp_path: Path) -> None:
    img = make_image(tmp_path / "image", secure_boot=False)
    assert img.run(f"apt-get install -y -q munge slurm-smd={slurm_conf.SLURM_VERSION} "
                   f"slurm-smd-slurmctld={slurm_conf.SLURM_VERSION}").returncode == 0
    assert img.run("getent passwd slurm").returncode == 2
    munge = img.run("getent passwd munge").stdout.split(":")
    assert munge[2] != str(slurm_conf.MUNGE_UID)                 # why the boot creates both users first
    run = img.run("systemctl restart slurmctld")                 # User=slurm does not exist
    assert run.returncode == 1 and "217/USER" in run.stderr


# --- pieces of the boot on their own ---

def test_fstab_uses_the_automount_options_and_replaces_an_older_entry(tmp_path: Path) -> None:
    img = make_image(tmp_path / "image", secure_boot=False)
    img.write_files(cloud_init.render(node_inputs()))
    (img.root / "etc/fstab").write_text("UUID=1 / ext4 defaults 0 1\n10.0.0.9@tcp:/lustrefs /lustrefs lustre _netdev,noatime,flock 0 0\n")
    lib = img.root / cloud_init.BOOT_LIB.lstrip("/")
    for _ in range(2):      # a re-run converges on one line with the current options
        run = img.run(f". {lib}; load_settings MOUNT MGS FSTAB_OPTIONS; modprobe lustre; mount_amlfs")
        assert run.returncode == 0, run.stderr
    assert (img.root / "etc/fstab").read_text().splitlines() == [
        "UUID=1 / ext4 defaults 0 1", f"10.42.0.4@tcp:/lustrefs /lustrefs lustre {cloud_init.FSTAB_OPTIONS} 0 0"]
    assert "lustrefs.automount" in img.state["active"]
    # Without the Lustre module, the mount never appears: one message naming the file system.
    img.update(loaded=[])
    run = img.run(f". {lib}; load_settings MOUNT MGS FSTAB_OPTIONS; mount_amlfs")
    assert run.returncode == 1 and "could not mount /lustrefs from 10.42.0.4@tcp" in run.stderr


def test_custom_data_holds_the_scripts_unchanged_and_settings_only_in_the_environment_file() -> None:
    for role in (cloud_init.ROLE_NODE, cloud_init.ROLE_LOGIN):
        conf = slurm_conf.SlurmConfInputs("c", "h", 4, health_check_program=cloud_init.HEALTHCHECK)
        n = node_inputs(role=role, slurm=cloud_init.SlurmInputs(conf, "https://v.vault.azure.net", SECRET, "cid"))
        files = {f["path"]: f["content"] for f in yaml.safe_load(cloud_init.render(n))["write_files"]}
        boot = "bootstrap-login.sh" if role == cloud_init.ROLE_LOGIN else "bootstrap-node.sh"
        assert files[cloud_init.BOOTSTRAP] == (cloud_init.SCRIPTS / boot).read_text()
        assert files[cloud_init.BOOT_LIB] == (cloud_init.SCRIPTS / "lib/boot-common.sh").read_text()
        assert files[cloud_init.MUNGE_KEY_TOOL] == (cloud_init.SCRIPTS / "munge-key.py").read_text()
        env = files[cloud_init.BOOT_ENV]
        assert "VAULT_URL=https://v.vault.azure.net" in env and "MGS=10.42.0.4" in env
        assert f"SLURM_VERSION={slurm_conf.SLURM_VERSION}" in env
    with pytest.raises(ValueError, match="line break"):
        cloud_init.render_boot_env(node_inputs(model="a\nb"))


def test_the_plan_shows_each_vms_slurm_packages_and_lustre_client_path() -> None:
    conf = slurm_conf.SlurmConfInputs("c", "h", 4)
    v = slurm_conf.SLURM_VERSION
    for role, sb, daemon, client in ((cloud_init.ROLE_NODE, "off", "slurm-smd-slurmd", "dkms (image)"),
                                     (cloud_init.ROLE_LOGIN, "on", "slurm-smd-slurmctld", "signed kmod")):
        n = node_inputs(role=role, secure_boot=sb, slurm=cloud_init.SlurmInputs(conf, "https://v.vault.azure.net", SECRET, "c"))
        facts = cloud_init.boot_facts(cloud_init.render(n))
        assert facts["slurm"] == f"slurm-smd={v},slurm-smd-client={v},{daemon}={v}" and facts["secureBoot"] == sb
        assert facts["lustreClient"].startswith(client)
    assert cloud_init.boot_facts("#!/bin/bash\n") == {}


def test_the_lock_hashes_every_wheel_and_matches_pyprojects_pins(tmp_path: Path) -> None:
    pins, locked = node_lock.pyproject_pins(), node_lock.lock_pins()
    assert {n: {v} for n, v in pins.items()} == {n: locked[n] for n in pins}, "regenerate: python -m components.node.node_lock"
    assert set(node_lock.TOOLING) <= set(locked)
    text = node_lock.LOCK.read_text()
    for entry in re.split(r"\n(?=[a-z0-9])", text.split("\n", 2)[2].strip()):
        assert re.match(r"^[a-z0-9-]+==\S+( ; [^\\]+)? \\\n", entry), entry
        assert re.findall(r"--hash=sha256:[0-9a-f]{64}", entry), entry
    doc = cloud_init.render(node_inputs())
    assert schema_check(doc.encode(), tmp_path).returncode == 0
    files = {f["path"]: f["content"] for f in yaml.safe_load(doc)["write_files"]}
    assert files[cloud_init.NODE_REQUIREMENTS] == text


def test_a_changed_pin_is_caught(tmp_path: Path) -> None:
    py, lock = tmp_path / "pyproject.toml", tmp_path / "constraints.txt"
    py.write_text('[project]\ndependencies = ["pyyaml>=6"]\n')
    lock.write_text("pyyaml==6.0.3\n")
    assert node_lock.pyproject_pins(py, lock) == {"pyyaml": "6.0.3"} != {"pyyaml": next(iter(node_lock.lock_pins()["pyyaml"]))}
    lock.write_text("rich==13.0\n")
    with pytest.raises(ValueError, match="not pinned"):
        node_lock.pyproject_pins(py, lock)
    lock.write_text("pyyaml==5.4\n")
    with pytest.raises(ValueError, match="outside pyproject.toml's range"):
        node_lock.pyproject_pins(py, lock)


def test_a_toolkit_change_replaces_the_blob_name_and_keeps_the_old_blob(plan: Plan, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Existing instances' custom data name the old blob: the replaced blob must survive `pulumi up`."""
    real = toolkit.build_toolkit
    seen: list[tuple[str, str, bool, str]] = []
    for variant in ("a", "b"):
        repo = tmp_path / variant
        (repo / "src").mkdir(parents=True)
        shutil.copytree(ROOT / "src" / "tiered_ckpt", repo / "src" / "tiered_ckpt",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
        (repo / "src" / "tiered_ckpt" / "_variant.py").write_text(f"VARIANT = {variant!r}\n")   # a toolkit change
        monkeypatch.setattr(toolkit, "build_toolkit", lambda _root, out, repo=repo: real(repo, out))
        p = plan("dev")
        blob = p.one("azure-native:storage:Blob", "toolkit")
        boot = yaml.safe_load(base64.b64decode(
            p.one("azure-native:compute:VirtualMachineScaleSet").inputs["virtualMachineProfile"]["osProfile"]["customData"]))
        env = next(f["content"] for f in boot["write_files"] if f["path"] == cloud_init.BOOT_ENV)
        seen.append((blob.name, blob.inputs["blobName"], blob.retain_on_delete, env))
    (name_a, blob_a, keep_a, _), (name_b, blob_b, keep_b, env_b) = seen
    assert name_a == name_b and blob_a != blob_b       # same Pulumi resource, new Azure name: a replace
    assert blob_b in env_b and blob_a not in env_b
    assert keep_a and keep_b
