"""An image double of Microsoft's Ubuntu-HPC 24.04 image (microsoft-dsvm:ubuntu-hpc:2404): a fake root in a
directory plus stand-ins on PATH (tools.py says which source each behaviour comes from), so the VM boot in
scripts/ runs for real: cloud-init's write_files are written under the root, then runcmd runs with
SYSROOT=<root>. A boot that fails on the image fails here.

What the image holds at first boot (Azure/azhpc-images):
  * /etc/apt/preferences.d/slurm-repository-pin-990 = components/slurm-repo/slurm-u.pin (install_pmix.sh),
    and Microsoft's Slurm repository (repos/slurm-ubuntu-noble) in sources.list.d;
  * the AMLFS repository (ubuntu/common/setup_lustre_repo.sh) and the DKMS Lustre client
    amlfs-lustre-client-dkms-<version> (install_lustre_client.sh);
  * no slurm or munge user.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
KERNEL = "6.8.0-1030-azure"
LUSTRE = "2.17.0-19-gbb5310f"
# Azure/azhpc-images components/slurm-repo/slurm-u.pin, as the image installs it.
SLURM_PIN = """Package: slurm-smd*
Pin:  origin "packages.microsoft.com"
Pin-Priority: 990

Package: pmix
Pin: origin "packages.microsoft.com"
Pin-Priority: 990

Package: slurm*
Pin: origin *ubuntu.com*
Pin-Priority: -1

Package: pmix
Pin: origin *ubuntu.com*
Pin-Priority: -1
"""
# Ubuntu noble's Slurm (23.11) and munge; what the image's repositories offer besides.
UBUNTU_REPO = [("slurmd", "23.11.4-1.2ubuntu5"), ("slurmctld", "23.11.4-1.2ubuntu5"), ("slurm-client", "23.11.4-1.2ubuntu5"),
               ("munge", "0.5.15-4build1"), (f"linux-headers-{KERNEL}", KERNEL)]
SLURM_REPO = [(p, v) for v in ("24.11.5-1", "25.05.2-1")
              for p in ("slurm-smd", "slurm-smd-client", "slurm-smd-slurmd", "slurm-smd-slurmctld")]
AMLFS_REPO = [(f"amlfs-lustre-client-dkms-{LUSTRE}", f"{LUSTRE}-1"),
              # the kmod metapackages: version = the kernel they are built for (packages.microsoft.com amlfs-noble)
              (f"amlfs-lustre-client-{LUSTRE}", KERNEL), (f"amlfs-lustre-client-{LUSTRE}", "6.8.0-1029-azure"),
              ("amlfs-lustre-client-2.16.1-14-gbc76088", "6.8.0-1026-azure")]
TOOLS = ("apt-get", "apt-cache", "apt-mark", "dpkg-query", "dpkg", "modprobe", "modinfo", "mokutil", "dkms", "uname",
         "systemctl", "findmnt", "mountpoint", "getent", "groupadd", "useradd", "usermod", "chown", "setfacl",
         "systemd-tmpfiles", "systemd-escape", "hostname", "logger")


@dataclass
class Image:
    root: Path
    bin: Path

    @property
    def state(self) -> dict[str, Any]:
        return dict(json.loads((self.root / ".image" / "state.json").read_text()))

    def update(self, **kw: Any) -> None:
        st = self.state
        st.update(kw)
        (self.root / ".image" / "state.json").write_text(json.dumps(st))

    def env(self, **extra: str) -> dict[str, str]:
        e = {"PATH": f"{self.bin}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "IMAGE_ROOT": str(self.root),
             "SYSROOT": str(self.root), "RETRY_SLEEP": "0", "MOUNT_TRIES": "2", "HOME": str(self.root / "root"),
             "TMPDIR": str(self.root / "tmp"), "LANG": "C.UTF-8"}
        e.update(extra)
        return e

    def write_files(self, cloud_config: str) -> dict[str, Any]:
        """What cloud-init's write_files does with the document (under the fake root); returns the document."""
        doc = yaml.safe_load(cloud_config)
        for f in doc["write_files"]:
            p = self.root / f["path"].lstrip("/")
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(f["content"])
            p.chmod(int(f["permissions"], 8))
        return dict(doc)

    def boot(self, cloud_config: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
        """write_files, then runcmd, as root on the image."""
        doc = self.write_files(cloud_config)
        (cmd,) = doc["runcmd"]
        return subprocess.run([str(self.root / cmd[0].lstrip("/")), *cmd[1:]], capture_output=True, text=True,
                              timeout=timeout, env=self.env(**env))

    def run(self, script: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True,
                              timeout=timeout, env=self.env(**env))


def make_image(base: Path, *, secure_boot: bool, kernel: str = KERNEL, hostname: str = "node7",
               passwd: Mapping[str, int] | None = None) -> Image:
    """A fresh image at first boot. secure_boot: the VM's UEFI Secure Boot (what `mokutil --sb-state` says)."""
    root, bin_dir = base / "root", base / "bin"
    for d in ("etc/apt/preferences.d", "etc/apt/sources.list.d", "etc/systemd/system", "lib/systemd/system", ".image",
              "tmp", "root", "usr/local/bin"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "etc/apt/preferences.d/slurm-repository-pin-990").write_text(SLURM_PIN)
    (root / "etc/apt/sources.list.d/slurm.list").write_text(
        "deb [arch=amd64 signed-by=/usr/share/keyrings/microsoft-prod.gpg] https://packages.microsoft.com/repos/slurm-ubuntu-noble/ stable main\n")
    (root / "etc/apt/sources.list.d/amlfs.list").write_text(
        "deb [arch=amd64] https://packages.microsoft.com/repos/amlfs-noble/ noble main\n")
    (root / "etc/os-release").write_text('ID=ubuntu\nVERSION_ID="24.04"\nVERSION_CODENAME=noble\n')
    (root / "etc/fstab").write_text("UUID=1 / ext4 defaults 0 1\n")
    users = {"root": 0, "azureuser": 1000, **(passwd or {})}
    (root / "etc/passwd").write_text("".join(f"{n}:x:{u}:{u}::/home/{n}:/bin/bash\n" for n, u in users.items()))
    (root / "etc/group").write_text("".join(f"{n}:x:{u}:\n" for n, u in users.items()))
    state = {"kernel": kernel, "secure_boot": secure_boot, "hostname": hostname,
             "packages": {f"amlfs-lustre-client-dkms-{LUSTRE}": f"{LUSTRE}-1", f"lustre-client-{LUSTRE}": f"{LUSTRE}-1"},
             "modules": {"lustre": "dkms"},      # built by DKMS when the image was made: unsigned
             "repo": {"ubuntu": UBUNTU_REPO, "slurm": SLURM_REPO, "amlfs": AMLFS_REPO}}
    (root / ".image" / "state.json").write_text(json.dumps(state))
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in TOOLS:
        _stub(bin_dir / name, f'exec {sys.executable} -S -I {HERE / "tools.py"} {name} "$@"')  # -S: no site (venv .pth files)
    # python3 -m venv: a venv whose pip logs and whose toolkit install gives a tiered-ckpt command; the rest
    # is the real interpreter (munge-key, the token parsing).
    real = shutil.which("python3") or sys.executable
    _stub(bin_dir / "python3", f'''if [ "${{1:-}}" = -m ] && [ "${{2:-}}" = venv ]; then
  mkdir -p "$3/bin"
  printf '#!/bin/bash\\necho "pip $*" >> "$IMAGE_ROOT/.image/pip.log"\\ncase "$*" in *--no-index*) printf "#!/bin/sh\\\\necho tiered-ckpt\\\\n" > "%s/tiered-ckpt"; chmod +x "%s/tiered-ckpt";; esac\\n' "$3/bin" "$3/bin" > "$3/bin/pip"
  chmod +x "$3/bin/pip"; exit 0
fi
exec {real} "$@"''')
    return Image(root, bin_dir)


def _stub(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/bash\n{body}\n")
    os.chmod(path, 0o755)
