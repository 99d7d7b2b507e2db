"""Checkpoint directory names: ``global_epoch{E}_step{S}``, ordered by (epoch, step)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import UserError

_NAME = re.compile(r"^global_epoch(\d+)_step(\d+)$")


@dataclass(frozen=True, order=True)
class CheckpointId:
    epoch: int
    step: int

    @property
    def name(self) -> str:
        return f"global_epoch{self.epoch}_step{self.step}"

    def __str__(self) -> str:
        return self.name


def parse_name(name: str) -> CheckpointId | None:
    """The id of a checkpoint directory name, or None for anything else."""
    m = _NAME.match(name)
    if not m:
        return None
    return CheckpointId(int(m.group(1)), int(m.group(2)))


def require_name(name: str) -> CheckpointId:
    cid = parse_name(name)
    if cid is None:
        raise UserError(
            f"checkpoint name {name!r} is not of the form global_epoch<E>_step<S> "
            "(for example global_epoch3_step12000)"
        )
    return cid
