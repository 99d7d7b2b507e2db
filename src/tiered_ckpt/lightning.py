"""A Lightning ``CheckpointIO`` plugin: Lightning checkpoints through DCP and the toolkit's commit.

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from tiered_ckpt.lightning import TieredCheckpointIO

    trainer = Trainer(plugins=[TieredCheckpointIO(root="/lustrefs/checkpoints", model="llama-8b")],
                      callbacks=[ModelCheckpoint(every_n_train_steps=500, save_last=True)])
    trainer.fit(module, ckpt_path="last")

Lightning names a checkpoint by a file path its ``ModelCheckpoint`` picks
(``<dirpath>/epoch=0-step=500.ckpt``, ``<dirpath>/last.ckpt``). The data does not go there: it
goes to ``<root>/<model>/<name>``, ``<name>`` in the model's ``naming:`` scheme from the
checkpoint dict's ``"epoch"`` and ``"global_step"`` (``global_epoch0_step500``, ``step-500``,
``checkpoint-500``, ``iter_0000500``), written by :class:`tiered_ckpt.dcp.TieredWriter`
(rename-free, fsynced, ``COMMITTED.json`` last). Every tensor of the checkpoint dict is a DCP
tensor entry; everything else (loop and callback state, hyper-parameters, the dict's structure)
is one DCP bytes entry. At Lightning's path the plugin writes a small JSON *pointer* naming the
committed checkpoint, after the commit: ``ckpt_path="last"`` (Lightning lists ``last*.ckpt``
in the callback's directory) and ``ckpt_path=<pointer>`` resolve through it, and
``ckpt_path=<root>/<model>/<name>`` loads a checkpoint directory directly. Pointers are
Lightning's bookkeeping, replaced atomically; they must not be inside the checkpoint root
(they would be exported and listed there), and on several nodes they must be on a shared file
system (every rank reads the pointer when resuming), like Lightning's own checkpoint directory.

Two saves of one (epoch, step) by one plugin (a top-k checkpoint and ``last.ckpt`` at the same
step) write the checkpoint once and two pointers to it, as Lightning's ``save_last="link"``
links ``last.ckpt`` to the checkpoint just saved. A committed checkpoint of that name saved by
anything else is never overwritten (the writer refuses it).

``remove_checkpoint`` (Lightning's top-k pruning, and the previous ``last.ckpt``) removes the
pointer only and leaves the checkpoint to ``tiered-ckpt retention``: a checkpoint on the
accelerator layer is freed only once it is proven archived in Blob, and proving takes the
archive's listing and the HSM state, which the training loop neither has nor should wait for;
retention's policy (keep_last, keep_every_steps, min_keep) decides which ones go, not the
metric Lightning ranks by. So Lightning's pruning defers to retention: nothing is deleted here.

Only global rank 0 calls ``save_checkpoint`` (Lightning's Strategy does that), so the DCP save
runs in that one process (``no_dist=True``) with the full checkpoint dict Lightning built; every
rank calls ``load_checkpoint`` and reads it itself. Lightning's FSDPStrategy with
``state_dict_type="sharded"`` does not call the CheckpointIO for its sharded save (it calls
``dcp.save(..., checkpoint_id=path)`` itself): see docs/training.md.

Lightning and torch are imported here only.
"""
from __future__ import annotations

import copy
import io
import io as io_mod
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tiered_ckpt.config import NodeConfig
from tiered_ckpt.config import load as load_config
from tiered_ckpt.dcp import TieredReader, TieredWriter
from tiered_ckpt.errors import IntegrityError, UserError
from tiered_ckpt.io import commit
from tiered_ckpt.lifecycle import pins
from tiered_ckpt.naming import CheckpointId, make_id, require_name, require_number, scheme

__all__ = ["POINTER_FORMAT", "TieredCheckpointIO", "TieredModelParallelStrategy"]

POINTER_FORMAT = "tiered-ckpt-lightning-pointer/1"
_STATE_FORMAT = 1
# The DCP entry holding the checkpoint dict with every tensor replaced by a reference.
_STATE_KEY = "lightning.checkpoint"
_TENSORS = "tensors/"
# A reference to a tensor entry: a string no checkpoint holds by accident (NUL-delimited), so the
# structure loads with torch.load(weights_only=True) as well.
_REF = "\0tiered-ckpt-tensor\0"

_MapLocation = Any   # what torch.load accepts: None, str, torch.device, dict, or a callable


def _flatten(obj: Any, path: str, tensors: dict[str, torch.Tensor], seen: dict[int, str]) -> Any:
    """A copy of `obj` with every tensor in dicts, lists and tuples replaced by a reference
    (the user's dict is not changed); one entry per tensor object (tied weights stay tied)."""
    if type(obj) in (torch.Tensor, torch.nn.Parameter):   # subclasses (DTensor) are pickled whole
        key = seen.get(id(obj))
        if key is None:
            key = _TENSORS + path
            n = 1
            while key in tensors:
                n += 1
                key = f"{_TENSORS}{path}#{n}"
            tensors[key] = obj
            seen[id(obj)] = key
        return f"{_REF}{obj.device}\0{key}"
    if isinstance(obj, dict):
        out = copy.copy(obj)          # keeps the type (OrderedDict, AttributeDict, defaultdict)
        for k, v in obj.items():
            out[k] = _flatten(v, f"{path}/{k}" if path else str(k), tensors, seen)
        return out
    if isinstance(obj, list):
        return [_flatten(v, f"{path}/{i}", tensors, seen) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [_flatten(v, f"{path}/{i}", tensors, seen) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj    # anything else is pickled whole into the structure entry (torch.save)


def _unflatten(obj: Any, resolve: Callable[[str], torch.Tensor]) -> Any:
    if isinstance(obj, str) and obj.startswith(_REF):
        return resolve(obj)
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _unflatten(v, resolve)
        return obj
    if isinstance(obj, list):
        return [_unflatten(v, resolve) for v in obj]
    if isinstance(obj, tuple):
        items = [_unflatten(v, resolve) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _place(t: torch.Tensor, saved_on: str, map_location: _MapLocation) -> torch.Tensor:
    """Where torch.load would put a tensor saved on `saved_on` (torch.load's map_location rules)."""
    if callable(map_location):
        storage = map_location(t.untyped_storage(), saved_on)
        if storage is None:
            return t.to(saved_on)
        return torch.empty(0, dtype=t.dtype, device=storage.device).set_(storage, 0, t.shape, t.stride())
    if map_location is None:
        target: str | torch.device = saved_on
    elif isinstance(map_location, dict):
        target = map_location.get(saved_on, saved_on)
    else:
        target = map_location
    return t if torch.device(target) == t.device else t.to(target)


@contextmanager
def _toolkit_errors() -> Iterator[None]:
    """The toolkit's own error (one message naming the path and the fix) rather than DCP's wrapper of it."""
    try:
        yield
    except CheckpointException as e:
        for exc, _ in e.failures.values():
            if isinstance(exc, UserError):
                raise exc from None
        raise


class _RunCheck(Callback):
    """TieredCheckpointIO.run_check(): at train start (after any resume), refuse a colliding run."""

    def __init__(self, io: TieredCheckpointIO) -> None:
        self.io = io

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.io.check_run_start(trainer.current_epoch, trainer.global_step)


class TieredCheckpointIO(CheckpointIO):
    """Lightning's CheckpointIO through tiered_ckpt.dcp (module doc): ``Trainer(plugins=[TieredCheckpointIO(...)])``.

    root/model (or config=NodeConfig, or neither: the node config file) name where checkpoints go;
    the model's ``naming:`` comes from the config. A name committed here or in the config's
    archive (without config=, the node config file's) is never saved again; archive_check as
    for tiered_ckpt.save.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, model: str | None = None, *,
                 config: NodeConfig | None = None, archive_check: str = "required") -> None:
        super().__init__()
        if config is None:
            # root and model given: the default naming, as TieredWriter(root, model) has;
            # otherwise the node config file (default /etc/tiered-ckpt/config.yaml) says it all.
            # Its archive either way: the claim checks every name against it.
            node = load_config()
            config = replace(NodeConfig(), archive=node.archive) if root is not None and model is not None else node
        self.root = Path(root if root is not None else config.root)
        self.model = model if model is not None else config.model
        self.naming = config.naming
        self.archive = config.archive
        self.archive_check = archive_check
        scheme(self.naming)
        # The whole node config (archive included): a checkpoint only the archive holds is restored on load.
        self._node = config.with_overrides(root=str(self.root), model=self.model)
        # Names this plugin committed in this process: a second save of one of them is an alias.
        self._committed: set[str] = set()

    # -- where -----------------------------------------------------------------------------
    def checkpoint_id(self, checkpoint: Mapping[str, Any]) -> CheckpointId:
        """The checkpoint's name in the model's scheme, from Lightning's "epoch" and "global_step"."""
        if "global_step" not in checkpoint:
            raise UserError("the checkpoint dict has no 'global_step': TieredCheckpointIO saves what "
                            "Trainer.save_checkpoint builds (it names the checkpoint by epoch and global_step)")
        step = require_number(checkpoint["global_step"], "global_step")
        epoch = require_number(checkpoint.get("epoch", 0), "epoch") if scheme(self.naming).has_epoch else 0
        return make_id(epoch, step, self.naming)

    def checkpoint_dir(self, cid: CheckpointId) -> Path:
        return self.root / self.model / cid.name

    def _config(self, ckpt_dir: Path | None = None) -> NodeConfig:
        if ckpt_dir is None or (ckpt_dir.parent.parent, ckpt_dir.parent.name) == (self.root, self.model):
            return self._node
        return self._node.with_overrides(root=str(ckpt_dir.parent.parent), model=ckpt_dir.parent.name)

    # -- resume ----------------------------------------------------------------------------
    def resume_path(self) -> str | None:
        """The newest checkpoint on either tier, as a ``ckpt_path`` for ``Trainer.fit``; None: nothing to resume.

        For a restart that lost Lightning's directory too (no ``last.ckpt`` to list): a checkpoint
        only the archive holds is restored first. Every rank may call it (one restores, the others
        wait for the checkpoint's lock)::

            trainer.fit(module, data, ckpt_path=io.resume_path())
        """
        from tiered_ckpt.lifecycle.restore import resume_point
        from tiered_ckpt.tiers.backends import make_backend

        cfg = self._config()
        name = resume_point(cfg, make_backend(cfg))
        return None if name is None else str(self.checkpoint_dir(require_name(name, self.naming)))

    def run_check(self) -> Callback:
        """A Callback that refuses, before the first training step, a run whose saves would collide
        with checkpoints a previous run of this model left (module doc): ``callbacks=[io.run_check(), ...]``."""
        return _RunCheck(self)

    def check_run_start(self, epoch: int, global_step: int) -> None:
        """UserError if checkpoints newer than (epoch, global_step) are committed on either tier."""
        from tiered_ckpt.lifecycle.restore import newest_committed
        from tiered_ckpt.tiers.backends import make_backend

        cfg = self._config()
        here = make_id(epoch if scheme(self.naming).has_epoch else 0, global_step, self.naming)
        newest = newest_committed(cfg, make_backend(cfg))
        if newest is None or newest.id <= here:
            return
        raise UserError(
            f"model {self.model!r} under {self.root} already holds committed checkpoints up to {newest.name}, newer "
            f"than where this run starts ({here.name}): a previous run saved them, and this run's saves would collide "
            "with them (a committed name is never overwritten). To continue that run, resume it: "
            "trainer.fit(..., ckpt_path=\"last\") (or ckpt_path=io.resume_path()). To start a new run, give it a "
            "model name of its own: TieredCheckpointIO(model=\"<model>-run2\") (the old run's checkpoints stay "
            "under their name until retention or `tiered-ckpt archive retention` frees them)")

    def _check_pointer_path(self, path: Path) -> None:
        root = self.root.resolve()
        p = path.absolute().resolve()
        if p == root or root in p.parents:
            raise UserError(f"Lightning checkpoint path {path} is inside the tiered-ckpt root {self.root}: the file "
                            "Lightning names is a pointer to the checkpoint and does not belong there; set "
                            "ModelCheckpoint(dirpath=...) or Trainer(default_root_dir=...) outside the root "
                            "(a shared directory on several nodes)")

    # -- CheckpointIO ----------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("Trainer.save_checkpoint(..., storage_options=...) is not supported by "
                            "TieredCheckpointIO: the checkpoint name comes from the epoch and step")
        pointer = Path(path)
        self._check_pointer_path(pointer)
        cid = self.checkpoint_id(checkpoint)
        if cid.name not in self._committed:
            tensors: dict[str, torch.Tensor] = {}
            structure = _flatten(checkpoint, "", tensors, {})
            buf = io.BytesIO()
            torch.save({"format": _STATE_FORMAT, "checkpoint": structure}, buf)
            state: dict[str, Any] = {**tensors, _STATE_KEY: buf.getvalue()}
            writer = TieredWriter(config=self._config(), name=cid.name, archive_check=self.archive_check)
            with warnings.catch_warnings(), _toolkit_errors():
                # One process saves on purpose (Lightning calls this on global rank 0 only).
                warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
                dcp.save(state, storage_writer=writer, no_dist=True)
            self._committed.add(cid.name)
        # Pinned while this pointer names it: retention never frees a checkpoint ModelCheckpoint
        # still keeps (best-k, last); Lightning's pruning (remove_checkpoint) unpins it.
        pins.pin(self.root, self.model, cid.name, by="lightning", pointer=pointer)
        self._write_pointer(pointer, cid)

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: _MapLocation = "cpu",
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint a pointer (or a checkpoint directory) names; tensors placed per map_location
        (default: the CPU, as Lightning's TorchCheckpointIO; None: where they were saved)."""
        ckpt_dir = self._resolve(Path(path))
        self._resident(ckpt_dir)
        reader = TieredReader(root=ckpt_dir.parent.parent, model=ckpt_dir.parent.name, name=ckpt_dir.name,
                              config=self._config(ckpt_dir))
        md = reader.checked_metadata()
        if _STATE_KEY not in md.state_dict_metadata:
            raise UserError(f"{ckpt_dir} is a DCP checkpoint but not one TieredCheckpointIO saved (no "
                            f"{_STATE_KEY!r} entry); load it with torch.distributed.checkpoint.load")
        template: dict[str, Any] = {_STATE_KEY: b""}
        for key, meta in md.state_dict_metadata.items():
            if key.startswith(_TENSORS) and isinstance(meta, TensorStorageMetadata):
                template[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        with warnings.catch_warnings(), _toolkit_errors():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(template, storage_reader=reader, no_dist=True)
        saved = torch.load(io.BytesIO(template[_STATE_KEY]), map_location=map_location, weights_only=weights_only)
        if not isinstance(saved, dict) or saved.get("format") != _STATE_FORMAT:
            raise UserError(f"{ckpt_dir}: checkpoint format {saved.get('format') if isinstance(saved, dict) else '?'} "
                            f"is not {_STATE_FORMAT}; load it with the tiered-ckpt version that saved it")
        placed: dict[str, torch.Tensor] = {}

        def resolve(ref: str) -> torch.Tensor:
            saved_on, key = ref[len(_REF):].split("\0", 1)
            if key not in placed:
                placed[key] = _place(template[key], saved_on, map_location)
            return placed[key]

        out = _unflatten(saved["checkpoint"], resolve)
        assert isinstance(out, dict)
        return out

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Removes Lightning's pointer only; the checkpoint is freed by tiered-ckpt retention (module doc)."""
        p = Path(path)
        if p.is_file() and self._read_pointer(p, strict=False) is not None:
            p.unlink()
            pins.unpin(self.root, self.model, p)

    def _resident(self, ckpt_dir: Path) -> None:
        """Make the checkpoint readable here: restored from the archive if only the archive holds it;
        otherwise, if it is not committed here, one message saying what to do."""
        from tiered_ckpt.lifecycle import tombstone
        from tiered_ckpt.lifecycle.restore import resume_point
        from tiered_ckpt.tiers.backends import make_backend

        cfg = self._config(ckpt_dir)
        name = ckpt_dir.name
        try:
            require_name(name, cfg.naming)
        except UserError:
            return                  # not one of ours by name: the reader's own message
        backend = make_backend(cfg)
        resume_point(cfg, backend, name)
        if commit.read_marker_checked(ckpt_dir, anchor=cfg.root)[0] is not None:
            return
        restore_hint = (f"`tiered-ckpt restore {name}` brings it back from the archive (with archive: in this "
                        "plugin's config it is restored on load)")
        if backend.archive_configured:
            restore_hint = "the archive does not hold it either (`tiered-ckpt status` lists what exists)"
        if tombstone.tombstone_path(cfg.root, cfg.model, name).exists():
            raise IntegrityError(f"{ckpt_dir} is not a committed checkpoint on the accelerator layer: retention "
                                 f"freed it once it was archived; {restore_hint}")
        if not ckpt_dir.exists():
            raise IntegrityError(f"{ckpt_dir} is not a committed checkpoint on the accelerator layer (no such "
                                 f"directory); if it was archived, {restore_hint}")

    # -- pointers --------------------------------------------------------------------------
    def _write_pointer(self, pointer: Path, cid: CheckpointId) -> None:
        data = json.dumps({"format": POINTER_FORMAT, "root": str(self.root), "model": self.model,
                           "name": cid.name, "epoch": cid.epoch, "step": cid.step}, indent=1).encode()
        pointer.parent.mkdir(parents=True, exist_ok=True)
        # Outside the checkpoint root (checked), so a rename here is atomic and harmless to the archive.
        fd, tmp = tempfile.mkstemp(dir=pointer.parent, prefix=f".{pointer.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, pointer)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _read_pointer(self, p: Path, strict: bool = True) -> Path | None:
        try:
            raw = p.read_bytes()
            d = json.loads(raw) if len(raw) < 65536 else None
        except (OSError, ValueError):
            d = None
        if not isinstance(d, dict) or d.get("format") != POINTER_FORMAT or not all(
                isinstance(d.get(k), str) for k in ("root", "model", "name")):
            if not strict:
                return None
            raise UserError(f"{p} is not a tiered-ckpt checkpoint pointer (a file TieredCheckpointIO writes where "
                            "Lightning names a checkpoint); pass ckpt_path=<root>/<model>/<name> of a committed "
                            "checkpoint (tiered-ckpt list)")
        return Path(d["root"]) / d["model"] / d["name"]

    def _names_checkpoint(self, p: Path) -> bool:
        try:
            require_name(p.name, self.naming)
        except UserError:
            return False
        return True

    def _resolve(self, p: Path) -> Path:
        if p.is_dir():
            return p
        if not p.exists() and self._names_checkpoint(p):
            return p            # a checkpoint directory freed by retention: _resident restores or explains
        if not p.exists():
            raise FileNotFoundError(f"Checkpoint file not found: {p} (neither a TieredCheckpointIO pointer nor a "
                                    "checkpoint directory; tiered-ckpt list shows the committed ones)")
        return self._read_pointer(p)  # type: ignore[return-value]  # strict: never None


_REST_KEY = "lightning.rest"      # the checkpoint dict without its sharded states (rank 0's), torch.save bytes


class TieredModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy (FSDP2 / tensor parallel via ``configure_model``) through the toolkit.

    Lightning's own sharded save bypasses the CheckpointIO (it calls ``dcp.save(checkpoint_id=path)``,
    i.e. DCP's FileSystemWriter, which commits by renaming): this subclass saves the sharded model and
    optimizer states with TieredWriter on every rank (collective; each rank writes its shards), the
    rest of Lightning's checkpoint dict as one bytes entry, and the same pointer and keep-pin as
    TieredCheckpointIO at Lightning's path; it loads them back with TieredReader (resharding is DCP's)::

        io = TieredCheckpointIO(config=cfg)
        Trainer(strategy=TieredModelParallelStrategy(io), callbacks=[ModelCheckpoint(...)])
    """

    def __init__(self, io: TieredCheckpointIO, **kwargs: Any) -> None:
        super().__init__(save_distributed_checkpoint=True, **kwargs)
        self.tiered = io

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("storage_options is not supported by TieredModelParallelStrategy")
        pointer = Path(self.broadcast(str(filepath)))
        io = self.tiered
        io._check_pointer_path(pointer)
        cid = io.checkpoint_id(checkpoint)
        if cid.name not in io._committed:
            rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            buf = io_mod.BytesIO()
            torch.save(rest, buf)
            state: dict[str, Any] = {"state_dict": checkpoint["state_dict"], _REST_KEY: buf.getvalue()}
            state.update({f"optimizer_{i}": o for i, o in enumerate(checkpoint.get("optimizer_states", []))})
            with _toolkit_errors():
                dcp.save(state, storage_writer=TieredWriter(config=io._config(), name=cid.name,
                                                                archive_check=io.archive_check))
            io._committed.add(cid.name)
        if self.global_rank == 0:
            pins.pin(io.root, io.model, cid.name, by="lightning", pointer=pointer)
            io._write_pointer(pointer, cid)
        self.barrier("tiered-ckpt pointer")

    def load_checkpoint(self, checkpoint_path: str | os.PathLike[str],
                        weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        io = self.tiered
        ckpt_dir = io._resolve(Path(self.broadcast(str(checkpoint_path))))
        if self.global_rank == 0:
            io._resident(ckpt_dir)       # restored from the archive when only the archive holds it
        self.barrier("tiered-ckpt resident")
        assert self.model is not None and self.lightning_module is not None
        optims = [getattr(o, "_optimizer", o) for o in self.optimizers]
        state: dict[str, Any] = {"state_dict": get_model_state_dict(self.model), _REST_KEY: b""}
        state.update({f"optimizer_{i}": get_optimizer_state_dict(self.model, o) for i, o in enumerate(optims)})
        reader = TieredReader(root=ckpt_dir.parent.parent, model=ckpt_dir.parent.name, name=ckpt_dir.name,
                              config=io._config(ckpt_dir))
        with _toolkit_errors():
            dcp.load(state, storage_reader=reader)
        set_model_state_dict(self.model, state["state_dict"],
                             options=StateDictOptions(strict=self.lightning_module.strict_loading))
        for i, o in enumerate(optims):
            set_optimizer_state_dict(self.model, o, state[f"optimizer_{i}"])
        rest = torch.load(io_mod.BytesIO(state[_REST_KEY]), weights_only=bool(weights_only))
        assert isinstance(rest, dict)
        return rest

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        if self.global_rank == 0:
            self.tiered.remove_checkpoint(filepath)
