"""Who am I among the writers, and how do ranks wait for each other before the commit.

* torch.distributed initialised (and no explicit rank/world given): its rank and world size;
  barriers run on a gloo group made once for checkpointing, so a barrier from the async
  save's background thread never interleaves with the training's NCCL collectives.
* Explicit rank/world_size > 1 without torch: ranks meet through the checkpoint directory
  itself. Each rank writes its part manifest; rank 0 waits for every part (or a rank's
  failure note), commits, and the others wait for the marker. A `save_id` shared by all ranks
  of one save is required, so parts left by a crashed earlier attempt are never committed.
* Otherwise a single process.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from .errors import UserError


@dataclass
class Comm:
    rank: int
    world_size: int
    group: Any = None            # torch process group when torch.distributed is used
    torch_dist: Any = None       # the torch.distributed module, or None

    @property
    def uses_torch(self) -> bool:
        return self.torch_dist is not None

    def exchange(self, status: str | None) -> list[str | None]:
        """Every rank's status (None = fine, else its error), via torch.distributed on the checkpoint group."""
        if self.torch_dist is None or self.world_size == 1:
            return [status]
        statuses: list[str | None] = [None] * self.world_size
        self.torch_dist.all_gather_object(statuses, status, group=self.group)
        return statuses


_ckpt_group: Any = None


def _torch_dist() -> Any:
    if "torch" not in sys.modules:
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist


def detect(rank: int | None = None, world_size: int | None = None, group: Any = None) -> Comm:
    """Called in the caller's thread (making the gloo group is itself a collective)."""
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise UserError("pass both rank= and world_size= (or neither, to use torch.distributed or a single process)")
        if world_size < 1 or not 0 <= rank < world_size:
            raise UserError(f"rank={rank}, world_size={world_size}: need world_size >= 1 and 0 <= rank < world_size")
        dist = _torch_dist()
        if dist is not None and dist.get_world_size() == world_size and dist.get_rank() == rank:
            return Comm(rank, world_size, group or _gloo_group(dist), dist)
        return Comm(rank, world_size)
    dist = _torch_dist()
    if dist is None:
        return Comm(0, 1)
    group = group if group is not None else _gloo_group(dist)
    return Comm(dist.get_rank(group), dist.get_world_size(group), group, dist)


def _gloo_group(dist: Any) -> Any:
    """The checkpoint group, made once per process: new_group is a collective every rank joins."""
    global _ckpt_group
    if _ckpt_group is None:
        _ckpt_group = dist.new_group(backend="gloo")
    return _ckpt_group
