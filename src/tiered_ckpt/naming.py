"""Checkpoint directory names, ordered by (epoch, step) parsed from the name.

One model uses one naming scheme (`naming:` in the node config); the built-in ones are the
layouts training stacks already write:

* ``global_epoch{E}_step{S}``, the default (``global_epoch3_step12000``);
* ``step-{N}``, torchtitan's checkpoint folders (``step-12000``);
* ``checkpoint-{N}``, Hugging Face Trainer's (``checkpoint-12000``);
* ``iter_{N:07d}``, Megatron-LM's (``iter_0012000``).

The step-only schemes have epoch 0. Names are canonical: exactly what the scheme's format
gives for the parsed numbers, so decimal digits without leading zeros (``step05`` and
``step5`` would otherwise be two directories with one id) except Megatron's fixed 7-digit
padding, where ``iter_0000005`` is the one spelling of step 5; nothing before or after
(``re.fullmatch``: ``$`` alone also accepts a trailing newline); each number below 2**63
(what a signed 64-bit step counter holds; a 300-digit step is a typo, not a step).
"""
from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tiered_ckpt.errors import UserError

LIMIT = 2**63          # epoch and step must be below this
DEFAULT = "global_epoch"


@dataclass(frozen=True)
class Scheme:
    key: str                                  # the `naming:` value
    pattern: str                              # how users write the layout; also accepted as `naming:`
    regex: re.Pattern[str]                    # digits loosely; canonical form checked by `format`
    format: Callable[[int, int], str]         # (epoch, step) -> name
    has_epoch: bool
    example: str


def _scheme(key: str, pattern: str, regex: str, fmt: Callable[[int, int], str], has_epoch: bool,
            example: str) -> Scheme:
    return Scheme(key, pattern, re.compile(regex), fmt, has_epoch, example)


SCHEMES: dict[str, Scheme] = {s.key: s for s in (
    _scheme(DEFAULT, "global_epoch{E}_step{S}", r"global_epoch([0-9]+)_step([0-9]+)",
            lambda e, s: f"global_epoch{e}_step{s}", True, "global_epoch3_step12000"),
    _scheme("torchtitan", "step-{N}", r"step-([0-9]+)", lambda e, s: f"step-{s}", False, "step-12000"),
    _scheme("huggingface", "checkpoint-{N}", r"checkpoint-([0-9]+)", lambda e, s: f"checkpoint-{s}", False,
            "checkpoint-12000"),
    _scheme("megatron", "iter_{N:07d}", r"iter_([0-9]+)", lambda e, s: f"iter_{s:07d}", False, "iter_0012000"),
)}
_BY_PATTERN = {s.pattern: s for s in SCHEMES.values()}


def choices() -> str:
    """The accepted `naming:` values, for messages."""
    return ", ".join(f"{s.key} ({s.pattern})" for s in SCHEMES.values())


def lookup(naming: str) -> Scheme | None:
    """The scheme a `naming:` value selects (its key or its pattern), or None."""
    if not isinstance(naming, str):
        return None
    return SCHEMES.get(naming) or _BY_PATTERN.get(naming)


def scheme(naming: str) -> Scheme:
    s = lookup(naming)
    if s is None:
        raise UserError(f"naming: {str(naming)[:80]!r} is not a naming scheme; use one of {choices()}")
    return s


@dataclass(frozen=True, order=True)
class CheckpointId:
    epoch: int
    step: int
    # How the directory is spelled; not part of the identity (one model has one scheme).
    naming: str = field(default=DEFAULT, compare=False, repr=False)

    @property
    def name(self) -> str:
        return scheme(self.naming).format(self.epoch, self.step)

    def __str__(self) -> str:
        return self.name


def _numbers(s: Scheme, m: re.Match[str]) -> tuple[int, int] | None:
    groups = m.groups()
    if any(len(g) > 19 for g in groups):      # 2**63 has 19 digits
        return None
    nums = [int(g) for g in groups]
    epoch, step = (nums[0], nums[1]) if s.has_epoch else (0, nums[0])
    if epoch >= LIMIT or step >= LIMIT:
        return None
    return epoch, step


def parse_name(name: str, naming: str = DEFAULT) -> CheckpointId | None:
    """The id of a canonical checkpoint directory name of scheme `naming`, or None for anything else."""
    s = scheme(naming)
    if not isinstance(name, str) or len(name) > 64:
        return None
    m = s.regex.fullmatch(name)
    if not m:
        return None
    nums = _numbers(s, m)
    if nums is None or s.format(*nums) != name:
        return None
    return CheckpointId(nums[0], nums[1], s.key)


def parse_any(name: str) -> CheckpointId | None:
    """The id of a canonical name in any built-in scheme (the patterns are disjoint), or None.

    For readers that serve every model without knowing each one's `naming:` (the teardown gate):
    counting a directory of any scheme as a checkpoint errs on the side of checking more.
    """
    for key in SCHEMES:
        cid = parse_name(name, key)
        if cid is not None:
            return cid
    return None


def parse_in(name: str, naming: str | None) -> CheckpointId | None:
    """parse_name in scheme `naming`, or in any built-in scheme when it is None."""
    return parse_any(name) if naming is None else parse_name(name, naming)


def require_name(name: str, naming: str = DEFAULT) -> CheckpointId:
    s = scheme(naming)
    cid = parse_name(name, naming)
    if cid is not None:
        return cid
    example = f"for example {s.example}"
    loose = re.compile(s.regex.pattern + r"\s*").fullmatch(name) if isinstance(name, str) else None
    if loose is not None:
        nums = _numbers(s, loose)
        if nums is None:
            what = "epoch and step" if s.has_epoch else "the step"
            raise UserError(f"checkpoint name {name[:80]!r}{'...' if len(name) > 80 else ''}: {what} must be "
                            f"below 2**63; {example}")
        canon = s.format(*nums)
        raise UserError(f"checkpoint name {name!r} is not canonical (no leading zeros, nothing around it); "
                        f"use {canon!r}")
    shown = repr(name[:80]) + ("..." if isinstance(name, str) and len(name) > 80 else "")
    form = s.pattern.replace("{E}", "<E>").replace("{S}", "<S>").replace("{N:07d}", "<N>").replace("{N}", "<N>")
    extra = "" if naming == DEFAULT else f"; this model's naming is {s.key}"
    raise UserError(f"checkpoint name {shown} is not of the form {form} ({example}){extra}")


def make_id(epoch: int, step: int, naming: str = DEFAULT) -> CheckpointId:
    """The id of (epoch, step) in scheme `naming`; a step-only scheme cannot hold an epoch."""
    s = scheme(naming)
    if not s.has_epoch and epoch != 0:
        raise UserError(f"epoch={epoch}: this model's naming {s.key} ({s.pattern}) has no epoch in the directory "
                        f"name; pass step= only (or epoch=0), or set naming: {DEFAULT}")
    return CheckpointId(epoch, step, s.key)


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
