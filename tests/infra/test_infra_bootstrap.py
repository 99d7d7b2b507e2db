"""The node bootstrap's Lustre client, fstab and dependency lock: the shell runs against fake package tools."""
from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from components import cloud_init, node_lock

from .conftest import Plan
from .test_infra_cloud_init import ROOT, _inputs, schema_check

pytestmark = pytest.mark.timeout(120)


def _boot() -> str:
    doc = yaml.safe_load(cloud_init.render(_inputs()))
    return next(f["content"] for f in doc["write_files"] if f["path"] == cloud_init.BOOTSTRAP)


def _client_block(tmp_path: Path) -> str:
    boot = _boot()
    block = boot[boot.index("# 1-2. Lustre client"):boot.index("# 3. Mount AMLFS")]
    # The repository files the block writes, moved under tmp_path (the test needs no root).
    return (block.replace("/etc/apt/sources.list.d/amlfs.list", str(tmp_path / "amlfs.list"))
            .replace("/usr/share/keyrings/microsoft-amlfs.gpg", str(tmp_path / "amlfs.gpg")))


def _run_client_block(tmp_path: Path, *, installed: str, modinfo_ok: bool) -> tuple[subprocess.CompletedProcess[str], str]:
    """installed: dpkg-query output of the image's packages ("<name> <status>" lines)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls.log"
    fakes = {
        "uname": "echo 6.8.0-1030-azure",
        "dpkg-query": f"printf '%s' '{installed}'",
        "modinfo": "exit 0" if modinfo_ok else "exit 1",
        # `apt-cache search --names-only REGEX` over names shaped like the AMLFS noble repository's.
        "apt-cache": ('printf "%s\\n" "amlfs-lustre-client-2.16.1-14-gbc76088 - Lustre client" '
                      '"amlfs-lustre-client-dkms-2.16.1-22-g584eedc - Lustre client (DKMS)" '
                      '"amlfs-lustre-client-dkms-2.17.0-19-gbb5310f - Lustre client (DKMS)" '
                      '"kmod-lustre-client-6.8.0-1030-azure-2.17.0-19-gbb5310f - Lustre modules" | grep -E -- "$3"'),
        "curl": "exit 0", "gpg": "exit 0", "apt-get": "exit 0", "apt-mark": "exit 0", "dkms": "exit 0", "modprobe": "exit 0",
    }
    for name, body in fakes.items():
        f = bin_dir / name
        f.write_text(f'#!/bin/bash\necho "{name} $*" >> {calls}\n{body}\n')
        f.chmod(0o755)
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", 'log() { echo "$*"; }\n' + _client_block(tmp_path)],
                         capture_output=True, text=True, timeout=30, env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    return run, calls.read_text() if calls.exists() else ""


def _installs(calls: str) -> list[str]:
    return [ln for ln in calls.splitlines() if ln.startswith("apt-get install")]


def test_an_image_with_the_dkms_client_keeps_it_installs_nothing_and_holds_no_kernel(tmp_path: Path) -> None:
    run, calls = _run_client_block(tmp_path, installed="amlfs-lustre-client-dkms-2.16.1-22-g584eedc ii \n",
                                   modinfo_ok=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "amlfs-lustre-client-dkms-2.16.1-22-g584eedc (DKMS, from the image)" in run.stdout
    assert _installs(calls) == [] and "apt-mark" not in calls       # DKMS rebuilds for new kernels
    assert "modprobe lustre" in calls


def test_an_image_without_a_client_gets_the_newest_dkms_client_never_a_kmod(tmp_path: Path) -> None:
    run, calls = _run_client_block(tmp_path, installed="", modinfo_ok=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert _installs(calls) == ["apt-get install -y -q linux-headers-6.8.0-1030-azure amlfs-lustre-client-dkms-2.17.0-19-gbb5310f"]
    assert "kmod-lustre-client" not in "".join(_installs(calls)) and "apt-mark" not in calls
    assert "https://packages.microsoft.com/repos/amlfs-" in (tmp_path / "amlfs.list").read_text()


def test_a_removed_dkms_package_does_not_count_and_a_kmod_image_holds_its_kernel(tmp_path: Path) -> None:
    # dpkg-query lists removed-but-configured ("rc") packages too: only "ii" is installed.
    run, calls = _run_client_block(tmp_path, installed="amlfs-lustre-client-dkms-2.16.1-22-g584eedc rc \n", modinfo_ok=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "prebuilt kmod from the image" in run.stdout and "apt-mark hold" in calls and _installs(calls) == []


def test_fstab_uses_the_automount_options_and_replaces_an_older_entry(tmp_path: Path) -> None:
    boot = _boot()
    opts = set(cloud_init.FSTAB_OPTIONS.split(","))
    assert {"_netdev", "x-systemd.automount", "nofail", "noatime", "flock"} <= opts
    # A re-run (or an older bootstrap's entry) converges on one line with the current options.
    fstab = tmp_path / "fstab"
    fstab.write_text("UUID=1 / ext4 defaults 0 1\n10.0.0.9@tcp:/lustrefs /lustrefs lustre _netdev,noatime,flock 0 0\n")
    lines = [ln for ln in boot.splitlines() if "/etc/fstab" in ln]
    assert len(lines) == 2, lines
    for _ in range(2):
        subprocess.run(["bash", "-euc", "\n".join(lines).replace("/etc/fstab", str(fstab))], check=True, timeout=30)
    text = fstab.read_text().splitlines()
    assert text == ["UUID=1 / ext4 defaults 0 1", f"10.42.0.4@tcp:/lustrefs /lustrefs lustre {cloud_init.FSTAB_OPTIONS} 0 0"]
    assert "systemctl start lustrefs.automount" in boot


def test_the_lock_hashes_every_wheel_and_matches_pyprojects_pins(tmp_path: Path) -> None:
    pins, locked = node_lock.pyproject_pins(), node_lock.lock_pins()
    assert {n: {v} for n, v in pins.items()} == {n: locked[n] for n in pins}, "regenerate: python -m components.node_lock"
    assert set(node_lock.TOOLING) <= set(locked)
    text = node_lock.LOCK.read_text()
    for entry in re.split(r"\n(?=[a-z0-9])", text.split("\n", 2)[2].strip()):
        assert re.match(r"^[a-z0-9-]+==\S+( ; [^\\]+)? \\\n", entry), entry
        assert re.findall(r"--hash=sha256:[0-9a-f]{64}", entry), entry
    # The rendered custom data ships exactly this lock and installs in hash-checking mode only.
    doc = cloud_init.render(_inputs())
    assert schema_check(doc.encode(), tmp_path).returncode == 0
    files = {f["path"]: f["content"] for f in yaml.safe_load(doc)["write_files"]}
    assert files[cloud_init.NODE_REQUIREMENTS] == text
    pips = [ln for ln in files[cloud_init.BOOTSTRAP].splitlines() if "bin/pip " in ln]
    assert all("--require-hashes" in ln or "--no-deps --no-index" in ln for ln in pips) and len(pips) == 2


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
    real = cloud_init.build_toolkit
    seen: list[tuple[str, str, bool, str]] = []
    for variant in ("a", "b"):
        repo = tmp_path / variant
        (repo / "src").mkdir(parents=True)
        shutil.copytree(ROOT / "src" / "tiered_ckpt", repo / "src" / "tiered_ckpt",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
        (repo / "src" / "tiered_ckpt" / "_variant.py").write_text(f"VARIANT = {variant!r}\n")   # a toolkit change
        monkeypatch.setattr(cloud_init, "build_toolkit", lambda _root, out, repo=repo: real(repo, out))
        p = plan("dev")
        blob = p.one("azure-native:storage:Blob", "toolkit")
        boot = yaml.safe_load(base64.b64decode(
            p.one("azure-native:compute:VirtualMachineScaleSet").inputs["virtualMachineProfile"]["osProfile"]["customData"]))
        script = next(f["content"] for f in boot["write_files"] if f["path"] == cloud_init.BOOTSTRAP)
        seen.append((blob.name, blob.inputs["blobName"], blob.retain_on_delete, script))
    (name_a, blob_a, keep_a, _), (name_b, blob_b, keep_b, script_b) = seen
    assert name_a == name_b and blob_a != blob_b       # same Pulumi resource, new Azure name: a replace
    assert blob_b in script_b and blob_a not in script_b
    assert keep_a and keep_b, "the replaced toolkit blob would be deleted while instances still fetch it"
