"""Which models a checkpoint root holds, so that a mistyped --model is named as such (not an empty listing)."""
from __future__ import annotations

import os
from pathlib import Path

from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import UserError
from tiered_ckpt.io import fsafe


def models_under(root: str | os.PathLike[str]) -> list[str]:
    """The model directories under the root (real directories, dot-names skipped), sorted."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    return sorted(e.name for e in entries if not e.name.startswith(".") and fsafe.is_real_dir(e.path))


def require_model(cfg: NodeConfig) -> None:
    """UserError naming the models that exist when the root holds models but not cfg.model.

    A root with no model at all is a fresh one (nothing saved yet): not an error here.
    """
    if fsafe.is_real_dir(Path(cfg.root) / cfg.model):
        return
    there = models_under(cfg.root)
    if there:
        raise UserError(f"model {cfg.model!r} has no directory under {cfg.root}; the models there are: "
                        f"{', '.join(there)} (pass --model NAME, or set model: in the node config)")
