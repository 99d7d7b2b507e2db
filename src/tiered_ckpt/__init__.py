"""Tiered checkpoints on Azure: the node toolkit.

Training code uses save / async_save / load / latest / release_staging (see tiered_ckpt.api) and IoOptions (see
tiered_ckpt.io.options); they are loaded lazily so the CLI starts fast.
"""
from __future__ import annotations

from typing import Any

__all__ = ["save", "async_save", "load", "latest", "release_staging", "IoOptions"]


def __getattr__(name: str) -> Any:
    if name == "IoOptions":
        from tiered_ckpt.io.options import IoOptions

        return IoOptions
    if name in __all__:
        from tiered_ckpt import api

        return getattr(api, name)
    raise AttributeError(f"module 'tiered_ckpt' has no attribute {name!r}")
