"""How a stack key reaches /etc/tiered-ckpt/config.yaml (pure): `node_config` is the one mapping from the
stack's settings and the resources' resolved outputs to the toolkit's own NodeConfig, validated by the
toolkit's own rules. The cluster component calls it inside one Output.apply; cloud_init writes its dump.
"""
from __future__ import annotations

from components.settings.schema import Settings
from tiered_ckpt.config import AmlfsConfig, ArchiveConfig, MemoryConfig, NodeConfig, RetentionConfig, validate

from .cloud_init import MEMORY_TIER_DIR, MOUNT


def node_config(s: Settings, *, account_url: str, container: str, identity_client_id: str, subscription_id: str,
                resource_group: str, filesystem: str, autoexport_job: str, provisioned_gbps: float) -> NodeConfig:
    """The node's NodeConfig: stack settings plus the resolved outputs of the storage account (account_url,
    container), the node identity, the compute resource group and the AMLFS file system."""
    cfg = NodeConfig(
        root=s.lustre_root,
        model=s.model_name,
        backend="amlfs",
        nodes=s.node_count,
        archive=ArchiveConfig(account_url=account_url.rstrip("/"), container=container, prefix=s.blob_prefix,
                              managed_identity_client_id=identity_client_id),
        amlfs=AmlfsConfig(mount=MOUNT, subscription_id=subscription_id, resource_group=resource_group,
                          filesystem=filesystem, autoexport_job=autoexport_job, provisioned_gbps=float(provisioned_gbps)),
        retention=RetentionConfig(keep_last=s.retention_keep_last, keep_every_steps=s.retention_keep_every_steps,
                                  min_keep=s.retention_min_keep, action=s.retention_action),
        # The memory tier (memoryKeep 0: off): its budget is keep x 2 (own + the peer's replica) x this node's share.
        memory=MemoryConfig() if not s.memory_keep else MemoryConfig(
            dir=MEMORY_TIER_DIR, keep=s.memory_keep,
            budget_bytes=int(s.memory_keep * 2 * s.checkpoint_size_gib * (1 << 30) // max(1, s.node_count))),
    )
    validate(cfg)
    return cfg
