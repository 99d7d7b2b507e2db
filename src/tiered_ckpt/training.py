"""Model + optimizer (+ LR scheduler, + extras) through torch.distributed.checkpoint, in two calls.

    from tiered_ckpt.training import load_training, save_training
    save_training(model, optim, scheduler=sched, epoch=0, step=12000, extra={"rng": torch.get_rng_state()})
    ...
    state = load_training(model, optim, scheduler=sched)     # newest committed on either tier, in place
    start_step = 0 if state is None else state.step + 1     # None: nothing to resume (a first start)

Model and optimizer state go through DCP's state-dict utilities (`get_state_dict` /
`set_state_dict` of torch.distributed.checkpoint.state_dict), so a plain, DDP-wrapped, FSDP2 or
tensor-parallel model is saved as DCP's global state dict: parameters by their fully qualified
names without wrapper prefixes, optimizer state keyed by those names (step counters and
param_groups included), DTensors sharded; replicated entries (a DDP model's parameters) are
written once, by whichever rank DCP's planner picks. It is stored by `TieredWriter` (no rename,
fsynced, committed by the marker) and loads at another world size (resharding is DCP's).

The scheduler's state and `extra` (anything torch.save takes: ints, RNG state tensors, a data
loader's position) are per rank: each rank's are saved under their own key, and each rank gets
its own back; at a larger world size than the save's, a rank without saved extras gets rank 0's
(with a warning; load_training(new_rank_extras=...) chooses otherwise).

Why a helper of its own and not `tiered_ckpt.save(model=..., optimizer=...)`: `model=` there
already names the checkpoint directory (the node config's model), and `tiered_ckpt.save` keeps
each rank's state as that rank's (no resharding), whereas this saves DCP's global state dict.
Works with and without an initialised process group (DCP then runs as one process). Torch is
imported here and in tiered_ckpt.dcp only.
"""
from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from tiered_ckpt import config as config_mod
from tiered_ckpt.dcp import TieredReader, TieredWriter
from tiered_ckpt.errors import UserError
from tiered_ckpt.naming import make_id, scheme

__all__ = ["TrainingState", "latest_checkpoint", "load_training", "save_training"]

MODEL, OPTIM = "model", "optim"
# One opaque entry per rank (torch.save bytes: a bytes value is one DCP item, never flattened),
# so ranks' differing extras (RNG state) never collide under DCP's dedup of equal keys.
_PER_RANK = "tiered_ckpt.rank{rank}"
_NEW_RANK_EXTRAS = ("rank0", "none", "error")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingState:
    """What save_training wrote / load_training restored."""

    name: str            # the checkpoint directory's name, e.g. global_epoch0_step12000
    path: str
    epoch: int
    step: int
    extra: dict[str, Any] | None = None    # load: this rank's saved extras (None when none were saved)
    # Where this rank's state went / came from: memory (this node's RAM), peer (the replica another
    # node held), lustre (the checkpoint root) or archive (Blob: restored to the root, then loaded).
    tier: str = "lustre"


def _cfg(config: config_mod.NodeConfig | None, root: str | Path | None,
         model_name: str | None) -> config_mod.NodeConfig:
    cfg = config if config is not None else config_mod.load()
    return cfg.with_overrides(root=str(root) if root is not None else None, model=model_name)


def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: here that is documented intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _rank_world() -> tuple[int, int]:
    if _initialised():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _states(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"save_training/load_training take a torch.nn.Module first; got {type(model).__name__}")
    if optimizer is None:
        return {MODEL: get_model_state_dict(model)}
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"optimizer= must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    msd, osd = get_state_dict(model, optimizer)
    return {MODEL: msd, OPTIM: osd}


def save_training(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                  scheduler: Any = None, extra: Mapping[str, Any] | None = None,
                  epoch: int | None = None, step: int | None = None, name: str | None = None,
                  root: str | Path | None = None, model_name: str | None = None,
                  config: config_mod.NodeConfig | None = None, archive_check: str = "required", tier: str = "lustre",
                  persist: bool | None = None) -> TrainingState:
    """Save model, optimizer, scheduler and `extra` as one committed DCP checkpoint (every rank calls it).

    Where: root= and model_name= (the checkpoint directory's model), else the node config's.
    Which: epoch= and step= (or step= alone for a step-only naming scheme), or name=.
    Returns once the checkpoint is committed on every rank. A name committed here or in the
    config's archive is refused; archive_check as for tiered_ckpt.save.

    tier="memory": into this node's memory tier (memory.dir; tiered_ckpt.memory_tier) instead,
    returning once every rank's copy is committed there; the peer replica and, every
    memory.persist_every-th save (or persist=True), the copy on the root follow in the background.
    """
    if tier not in ("lustre", "memory"):
        raise UserError(f"tier={tier!r}: use tier='lustre' (the checkpoint root) or tier='memory' (node RAM, memory.dir)")
    if persist is not None and tier != "memory":
        raise UserError("persist= applies to tier='memory' saves only (a tier='lustre' save is on the root already)")
    if extra is not None and not isinstance(extra, Mapping):
        raise UserError(f"extra= must be a mapping (e.g. {{'rng': torch.get_rng_state()}}); got {type(extra).__name__}")
    cfg = _cfg(config, root, model_name)
    writer = TieredWriter(cfg.root, cfg.model, name=name, epoch=epoch, step=step, config=cfg,
                          archive_check=archive_check)
    state = _states(model, optimizer)
    rank, _ = _rank_world()
    buf = io.BytesIO()
    torch.save({"scheduler": scheduler.state_dict() if scheduler is not None else None,
                "extra": dict(extra) if extra is not None else None}, buf)
    state[_PER_RANK.format(rank=rank)] = buf.getvalue()
    if tier == "memory":
        from tiered_ckpt import memory_tier

        with _single_process_quiet():
            path = memory_tier.save(state, cfg, writer.cid, persist=persist)
        return TrainingState(writer.cid.name, str(path), writer.cid.epoch, writer.cid.step, tier="memory")
    with _single_process_quiet():
        dcp.save(state, storage_writer=writer, no_dist=not _initialised())
    return TrainingState(writer.cid.name, str(writer.path), writer.cid.epoch, writer.cid.step)


def latest_checkpoint(config: config_mod.NodeConfig | None = None, *, name: str | None = None,
                      root: str | Path | None = None, model_name: str | None = None) -> str | None:
    """The checkpoint a restart resumes from, readable on the accelerator layer; None: nothing to resume.

    `name`, else the newest checkpoint committed on either tier (the accelerator layer or the
    archive). When only the archive holds it (the local tier was lost or retention deleted it), it
    is restored first (lifecycle.restore: hash-checked, marker last). Collective where a process
    group is initialised: rank 0 looks and restores, the other ranks wait for its answer (within
    the process group's timeout), and every rank gets the same name. Use it before a plain
    `dcp.load(state, storage_reader=TieredReader(config=cfg, name=...))`; load_training calls it.
    """
    return _resume(_cfg(config, root, model_name), name)[0]


def _resume(cfg: config_mod.NodeConfig, name: str | None) -> tuple[str | None, str]:
    """latest_checkpoint's (name, where it came from: lustre or archive), the same on every rank."""
    rank, world = _rank_world()
    picked: list[Any] = [None]
    if rank == 0:
        from tiered_ckpt.lifecycle.restore import resume_from
        from tiered_ckpt.tiers.backends import make_backend

        try:
            picked[0] = resume_from(cfg, make_backend(cfg), name)
        except UserError as e:
            picked[0] = e
    if world > 1:
        # Every rank loads the same checkpoint even if one commits while the ranks look (and
        # every rank fails alike when rank 0 cannot tell).
        dist.broadcast_object_list(picked, src=0)
    if isinstance(picked[0], UserError):
        raise type(picked[0])(str(picked[0]), exit_code=picked[0].exit_code)
    if not isinstance(picked[0], tuple):
        raise RuntimeError(f"rank 0 answered {picked[0]!r} for the checkpoint to resume")
    return picked[0]


def load_training(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                  scheduler: Any = None, name: str | None = None, epoch: int | None = None, step: int | None = None,
                  root: str | Path | None = None, model_name: str | None = None,
                  config: config_mod.NodeConfig | None = None, verify_hash: bool = False,
                  new_rank_extras: str = "rank0") -> TrainingState | None:
    """Restore model, optimizer and scheduler in place from a checkpoint save_training wrote.

    Which: name=, or epoch= and step=, else the newest checkpoint committed on either tier
    (latest_checkpoint: rank 0 picks it, restoring it from the archive when only the archive
    holds it; every rank loads that one). Returns its epoch, step and this rank's extras, or
    None when no tier holds a committed checkpoint of the model (a first start: nothing to
    resume, the model is left as it is):

        state = load_training(model, optim, config=cfg)
        start = 0 if state is None else state.step + 1

    new_rank_extras: what a rank gets whose rank did not exist at the save (a larger world
    size): "rank0" (default) rank 0's extras, with a warning logged (RNG state then repeats
    rank 0's: reseed per rank if that matters), "none" no extras (TrainingState.extra is None;
    the scheduler is still rank 0's), or "error" a UserError. The scheduler's state is rank 0's
    in every case: data-parallel ranks step their schedulers alike.
    """
    if new_rank_extras not in _NEW_RANK_EXTRAS:
        raise UserError(f"load_training: new_rank_extras={new_rank_extras!r} is not one of {', '.join(_NEW_RANK_EXTRAS)}")
    cfg = _cfg(config, root, model_name)
    if epoch is not None and step is None and name is None:
        raise UserError("load_training: pass step= with epoch= (or name=, or neither for the newest checkpoint)")
    if name is None and step is None and cfg.memory.dir:
        # The memory tier first (tiered_ckpt.memory_tier): own RAM, else the peer's replica, unless
        # the root holds a newer checkpoint or the world size changed.
        from tiered_ckpt import memory_tier

        def from_memory(mroot: Path, mname: str) -> TrainingState:
            r = TieredReader(mroot, cfg.model, name=mname, config=cfg.with_overrides(io={"direct": False}))
            return _load_into(model, optimizer, scheduler, r, cfg, no_dist=True, new_rank_extras=new_rank_extras)

        got = memory_tier.restore(cfg, from_memory)
        if got is not None:
            where, st = got
            return replace(st, tier=where.tier)
    if name is None and step is not None:
        if epoch is None and scheme(cfg.naming).has_epoch:
            raise UserError(f"load_training: pass epoch= with step= (naming {cfg.naming!r} has an epoch), or name=")
        name = make_id(epoch or 0, step, cfg.naming).name
    name, source = _resume(cfg, name)
    if name is None:
        return None
    reader = TieredReader(cfg.root, cfg.model, name=name, config=cfg,
                          verify_hash=verify_hash)
    st = _load_into(model, optimizer, scheduler, reader, cfg, no_dist=not _initialised(),
                    new_rank_extras=new_rank_extras)
    return replace(st, tier=source)


def _load_into(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any,
               reader: TieredReader, cfg: config_mod.NodeConfig, *, no_dist: bool,
               new_rank_extras: str) -> TrainingState:
    """dcp.load of one checkpoint into the model/optimizer/scheduler in place; this rank's extras."""
    state = _states(model, optimizer)
    # Which entries the checkpoint holds: DCP's metadata, its bytes checked against the marker before
    # they are unpickled. A reader without verify_hash: dcp.load verifies the data files (inside it a
    # mismatch on one rank fails every rank; here it would leave the others waiting).
    keys = set(TieredReader(reader.root, reader.model, name=reader.cid.name, config=cfg).checked_metadata().state_dict_metadata)
    rank, _ = _rank_world()
    own = next((k for k in (_PER_RANK.format(rank=rank), _PER_RANK.format(rank=0)) if k in keys), None)
    borrowed = own is not None and own != _PER_RANK.format(rank=rank)
    if borrowed and new_rank_extras == "error":
        raise UserError(f"{reader.path} was saved by fewer ranks: it holds no extras of rank {rank}; pass "
                        "new_rank_extras='rank0' (rank 0's) or 'none' (no extras) to load_training")
    if own is not None:
        state[own] = b""
    missing = [k for k in state if k != own and not any(s == k or s.startswith(k + ".") for s in keys)]
    if missing:
        raise UserError(f"{reader.path} holds no {' or '.join(missing)} state (it was not written by save_training "
                        f"with {'an optimizer' if OPTIM in missing else 'a model'}); load it with dcp.load instead")
    with _single_process_quiet():
        dcp.load(state, storage_reader=reader, no_dist=no_dist)
    if optimizer is None:
        set_model_state_dict(model, state[MODEL])
    else:
        set_state_dict(model, optimizer, model_state_dict=state[MODEL], optim_state_dict=state[OPTIM])
    extras: dict[str, Any] = {}
    if own is not None:
        extras = torch.load(io.BytesIO(state[own]), weights_only=False)   # written by save_training, like DCP's own
    if borrowed:
        if new_rank_extras == "none":
            extras = {**extras, "extra": None}
        elif extras.get("extra") is not None:
            log.warning("rank %d: %s was saved by fewer ranks; this rank gets rank 0's extras (RNG state included: "
                        "reseed per rank if it must differ; new_rank_extras='none' gives none)", rank, reader.cid.name)
    if scheduler is not None:
        if extras.get("scheduler") is None:
            raise UserError(f"{reader.path} holds no scheduler state (saved without scheduler=); "
                            "load without scheduler= or from another checkpoint")
        scheduler.load_state_dict(extras["scheduler"])
    return TrainingState(reader.cid.name, str(reader.path), reader.cid.epoch, reader.cid.step, extras.get("extra"))
