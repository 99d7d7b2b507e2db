"""Checkpoint directory names: ``global_epoch{E}_step{S}``, ordered by (epoch, step).

Names are canonical: decimal digits without leading zeros (``step05`` and ``step5`` would
otherwise be two directories with one id), nothing before or after (``re.fullmatch``: ``$``
alone also accepts a trailing newline), and each number below 2**63 (what a signed 64-bit
step counter holds; a 300-digit step is a typo, not a step).
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any

from tiered_ckpt.errors import UserError

_NUM = r"(0|[1-9][0-9]*)"
_NAME = re.compile(rf"global_epoch{_NUM}_step{_NUM}")
_LOOSE = re.compile(r"global_epoch([0-9]+)_step([0-9]+)\s*")
LIMIT = 2**63          # epoch and step must be below this
_EXAMPLE = "for example global_epoch3_step12000"


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
    """The id of a canonical checkpoint directory name, or None for anything else."""
    if not isinstance(name, str) or len(name) > 64:
        return None
    m = _NAME.fullmatch(name)
    if not m:
        return None
    epoch, step = int(m.group(1)), int(m.group(2))
    if epoch >= LIMIT or step >= LIMIT:
        return None
    return CheckpointId(epoch, step)


def require_name(name: str) -> CheckpointId:
    cid = parse_name(name)
    if cid is not None:
        return cid
    loose = _LOOSE.fullmatch(name) if isinstance(name, str) else None
    if loose is not None and (len(loose.group(1)) > 19 or len(loose.group(2)) > 19
                              or int(loose.group(1)) >= LIMIT or int(loose.group(2)) >= LIMIT):
        raise UserError(f"checkpoint name {name[:80]!r}{'...' if len(name) > 80 else ''}: epoch and step must be "
                        f"below 2**63; {_EXAMPLE}")
    if loose is not None:
        canon = f"global_epoch{int(loose.group(1))}_step{int(loose.group(2))}"
        raise UserError(f"checkpoint name {name!r} is not canonical (no leading zeros, nothing around it); "
                        f"use {canon!r}")
    shown = repr(name[:80]) + ("..." if isinstance(name, str) and len(name) > 80 else "")
    raise UserError(f"checkpoint name {shown} is not of the form global_epoch<E>_step<S> ({_EXAMPLE})")


def require_number(value: Any, what: str) -> int:
    """epoch= / step= as given by training code: an integer (int, numpy or 0-d tensor integer), never
    a bool or a float (1.7 must not silently become step 1), 0 <= value < 2**63."""
    if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):
        raise UserError(f"{what}={value!r} is a bool; pass an integer {what} (e.g. {what}=12000)")
    try:
        n = operator.index(value)
    except TypeError:
        raise UserError(f"{what}={value!r} is not an integer ({type(value).__name__}); pass an integer "
                        f"{what} (e.g. {what}=12000), not a float or string") from None
    if n < 0:
        raise UserError(f"{what}={n}: must be >= 0")
    if n >= LIMIT:
        shown = str(n) if n.bit_length() < 100 else f"a {n.bit_length()}-bit number"
        raise UserError(f"{what}={shown}: must be below 2**63 (a step counter, not a typo)")
    return n
