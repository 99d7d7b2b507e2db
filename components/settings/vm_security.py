"""The security profile of each VM the program creates, and what the node boot must do because of it.

Pure data and functions (no Pulumi): `vm_security(size, mode)` decides, per VM, the security type, Secure
Boot, vTPM, and how the Lustre client module gets loaded; the cluster component renders the decision as the
VM's `securityProfile`, the node boot (scripts/) reads `VmSecurity.boot_env()` and the preview prints
`VmSecurity.describe()`. One decision, three readers.

Why Secure Boot is off on every VM of ours. Both VM kinds run Microsoft's Ubuntu-HPC 24.04 image, which
builds its kernel modules on the VM with DKMS: the NVIDIA driver (`--dkms`), DOCA-OFED (mlnx-ofa_kernel,
InfiniBand) and the AMLFS Lustre client (`amlfs-lustre-client-dkms-<ver>`) (Azure/azhpc-images
`components/install_nvidiagpudriver.sh`, `components/install_doca.sh`, `components/install_lustre_client.sh`). DKMS-built modules are unsigned and load only with Secure Boot off or after
MOK enrolment; only the prebuilt kmod package (`amlfs-lustre-client-<ver>=$(uname -r)`) is signed with
the certificate Trusted Launch trusts (azure-stack-docs `azure-managed-lustre/client-install-plan.md`,
"Choose an install method"; `client-secure-boot.md`). Switching the login VM to the kmod would still
leave the image's DOCA-OFED modules unsigned and would tie the Lustre client to one kernel build, so the
login VM takes the same path as the nodes: Trusted Launch with vTPM, Secure Boot off, DKMS client.

Why the security type is always stated. Compute API 2024-11-01 (pulumi-azure-native 3.29) creates a
Standard VM when `securityProfile` is absent, but Azure is moving new Gen2 VMs to Trusted Launch by default
(azure-compute-docs `articles/virtual-machines/trusted-launch.md`, "Trusted Launch as default"): an
implicit profile would change meaning under the program. `Standard` is sent explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass

TRUSTED_LAUNCH, STANDARD = "TrustedLaunch", "Standard"
LUSTRE_DKMS, LUSTRE_KMOD = "dkms", "kmod"
MODES = ("auto", "on", "off")

# Trusted Launch support per VM size the program knows, from azure-compute-docs
# `articles/virtual-machines/trusted-launch.md`, table "Virtual machines sizes" (ms.date 04/21/2025):
# GPU row: "Supported size families: NC-family, ND-family, NV-family"; "Currently not supported size
# families: NDasrA100_v4-series, NDm_A100_v4-series". General purpose: D-family supported; memory
# optimized: E-family supported. ARM states the same per subscription and region as the SKU capability
# `TrustedLaunchDisabled` (Microsoft.Compute/skus), which the preflight checks at `pulumi up`.
_TL_DOC = "azure-compute-docs articles/virtual-machines/trusted-launch.md, table 'Virtual machines sizes'"


@dataclass(frozen=True)
class SizeSupport:
    size: str
    series: str
    trusted_launch: bool
    source: str


TRUSTED_LAUNCH_SUPPORT: dict[str, SizeSupport] = {s.size: s for s in (
    SizeSupport("Standard_ND96isr_H100_v5", "ND H100 v5 (ND-family)", True, _TL_DOC + ": ND-family supported"),
    SizeSupport("Standard_ND96isr_H200_v5", "ND H200 v5 (ND-family)", True, _TL_DOC + ": ND-family supported"),
    SizeSupport("Standard_ND96amsr_A100_v4", "NDm_A100_v4-series", False, _TL_DOC + ": NDm_A100_v4-series currently not supported"),
    SizeSupport("Standard_ND96asr_v4", "NDasrA100_v4-series", False, _TL_DOC + ": NDasrA100_v4-series currently not supported"),
    *(SizeSupport(f"Standard_{n}", "D-family (general purpose)", True, _TL_DOC + ": D-family supported")
      for n in ("D4s_v5", "D8s_v5", "D16s_v5", "D4ds_v5", "D8ds_v5", "D16ds_v5", "D4as_v5", "D8as_v5", "D16as_v5")),
    *(SizeSupport(f"Standard_{n}", "E-family (memory optimized)", True, _TL_DOC + ": E-family supported")
      for n in ("E4s_v5", "E8s_v5", "E16s_v5")),
)}


@dataclass(frozen=True)
class VmSecurity:
    """What one VM gets: its securityProfile, and what its boot does because of it."""

    security_type: str          # TrustedLaunch | Standard (always sent)
    secure_boot: bool           # uefiSettings.secureBootEnabled (TrustedLaunch only)
    vtpm: bool                  # uefiSettings.vTpmEnabled (TrustedLaunch only)
    lustre_client: str          # dkms: the image's DKMS-built client (needs Secure Boot off) | kmod: the signed package
    why: str                    # one line: the size's support and its source

    @property
    def trusted_launch(self) -> bool:
        return self.security_type == TRUSTED_LAUNCH

    def describe(self) -> str:
        """For plan output: securityType, Secure Boot, vTPM and the Lustre client path."""
        uefi = f" secureBoot={'on' if self.secure_boot else 'off'} vTPM={'on' if self.vtpm else 'off'}" if self.trusted_launch else " secureBoot=off"
        return f"securityType={self.security_type}{uefi} lustreClient={self.lustre_client}"

    def boot_env(self) -> dict[str, str]:
        """What the node's boot reads (environment file): a boot that finds Secure Boot on while it expects
        the DKMS client must stop with this explanation instead of failing at `modprobe lustre`."""
        return {"TIERED_SECURE_BOOT": "true" if self.secure_boot else "false", "TIERED_LUSTRE_CLIENT": self.lustre_client,
                "TIERED_SECURITY_TYPE": self.security_type}


def supports_trusted_launch(size: str) -> bool | None:
    """True/False for a size in the table above, None for one it does not know."""
    known = TRUSTED_LAUNCH_SUPPORT.get(size)
    return None if known is None else known.trusted_launch


def vm_security(size: str, mode: str) -> VmSecurity:
    """The security profile of a VM of `size` under `trustedLaunch: mode` (auto | on | off).

    auto: Trusted Launch where the table says the size supports it, Standard elsewhere (unknown sizes too);
    on: Trusted Launch (settings refuse it for a size the table lists as unsupported; the preflight checks
    ARM's TrustedLaunchDisabled for the rest); off: Standard. Secure Boot is off in every case (module
    docstring): the image's modules are DKMS-built."""
    known = TRUSTED_LAUNCH_SUPPORT.get(size)
    why = f"{size}: {known.source}" if known else f"{size}: not in the known size table (components/settings/vm_security.py)"
    on = mode == "on" or (mode == "auto" and known is not None and known.trusted_launch)
    if on:
        return VmSecurity(TRUSTED_LAUNCH, secure_boot=False, vtpm=True, lustre_client=LUSTRE_DKMS, why=why)
    return VmSecurity(STANDARD, secure_boot=False, vtpm=False, lustre_client=LUSTRE_DKMS, why=why)
