"""Who am I among the writers, and how do ranks agree on every phase of a save.

* torch.distributed initialised (and no explicit rank/world given): its rank and world size;
  collectives run on a gloo group made once for checkpointing (per barrier timeout), so one
  from the async save's background thread never interleaves with the training's NCCL
  collectives. The group is made with ``timeout=barrier_timeout``: a rank that died or never
  arrives fails the others' collective after that long instead of gloo's 30 min default.
* Explicit rank/world_size > 1 without torch ("file mode"): ranks meet through the checkpoint
  directory itself (io/save_commit.py: the part manifests, failure notes and waits). Each rank
  writes its part manifest; rank 0 waits for every part (or a rank's failure note), commits,
  and the others wait for the marker. A `save_id` shared by all ranks of one save is required,
  so parts left by a crashed earlier attempt are never committed; here `Comm.phase` only runs
  each phase and re-raises its failure.
* Otherwise a single process.

`Comm.phase` is the agreement (in the spirit of torch DCP's ``_DistWrapper``): every rank runs
one phase of the save, catching *any* exception, then all ranks exchange their outcome; if any
rank failed, every rank raises, with the failing rank's message and error class. Every rank
therefore runs the same sequence of collectives whatever fails where, so none is left waiting.
`ERROR_CLASSES` and `as_user_error` are how a failure travels to the other ranks: through the
exchange here, and through file mode's failure notes.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from tiered_ckpt.errors import EXIT_UNAVAILABLE, ConfigError, ConflictError, IntegrityError, UnavailableError, UserError

T = TypeVar("T")

# Error classes that keep their class (and exit code) when they travel to the other ranks.
ERROR_CLASSES: dict[str, type[UserError]] = {c.__name__: c for c in (UserError, ConfigError, ConflictError,
                                                                 UnavailableError, IntegrityError)}


def as_user_error(exc: BaseException, rank: int, world_size: int, stage: str, about: str) -> UserError:
    """The error a rank reports for `exc`: a UserError as is, anything else wrapped (cause kept)."""
    if isinstance(exc, UserError):
        return exc
    who = f"rank {rank} failed" if world_size > 1 else "failed"
    err = UserError(f"{who} while {stage} {about}: {exc!r}; nothing was committed")
    err.__cause__ = exc
    return err


@dataclass
class Comm:
    rank: int
    world_size: int
    group: Any = None            # torch process group when torch.distributed is used
    torch_dist: Any = None       # the torch.distributed module, or None
    timeout: float | None = None  # the checkpoint group's collective timeout (s), if we made it

    @property
    def uses_torch(self) -> bool:
        return self.torch_dist is not None

    @property
    def collective(self) -> bool:
        return self.torch_dist is not None and self.world_size > 1

    def exchange(self, status: Any) -> list[Any]:
        """Every rank's `status` (any picklable value), via all_gather_object on the checkpoint group."""
        if not self.collective:
            return [status]
        statuses: list[Any] = [None] * self.world_size
        self.torch_dist.all_gather_object(statuses, status, group=self.group)
        return statuses

    def phase(self, stage: str, about: str, fn: Callable[[], T],
              on_error: Callable[[BaseException], None] | None = None) -> list[T]:
        """Run `fn` on this rank, then agree with every rank: returns every rank's result.

        Raises on every rank when `fn` raised on any rank (any exception type): this rank's own
        error, else a UserError of the failing rank's class with its message. `on_error` runs on
        every rank before it raises (cleanup, failure notes; a failing rank runs it before the
        exchange, so it releases what it holds at once); its own errors are ignored.
        A collective that fails (a rank died, or did not arrive within the group's timeout) is a
        failure too. KeyboardInterrupt and the like are shared with the others, then re-raised.
        """
        def cleanup(err: BaseException) -> None:
            if on_error is not None:
                try:
                    on_error(err)
                except Exception:  # noqa: BLE001 - cleanup is best effort; the original error is what counts
                    pass

        result: Any = None
        exc: BaseException | None = None
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - every exception must reach the agreement
            exc = e
        if exc is not None:
            cleanup(exc)
        if not self.collective:
            if exc is not None:
                _reraise(exc, self.rank, self.world_size, stage, about)
            return [result]
        own = None if exc is None else as_user_error(exc, self.rank, self.world_size, stage, about)
        mine = (None, result) if own is None else ((type(own).__name__, own.exit_code, str(own)), None)
        try:
            outcomes = self.exchange(mine)
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError subclasses for dead or late peers
            if exc is not None:
                _reraise(exc, self.rank, self.world_size, stage, about)
            waited = f" within {self.timeout:g} s" if self.timeout else ""
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            why = re.sub(r"^\[[^\]]*\]\s*", "", why)[:300]     # gloo prefixes its source location
            lost = UserError(f"rank {self.rank}: not every rank took part in {stage} {about}{waited} (a rank died, "
                             f"hung or failed outside the save): {why}; nothing was committed", exit_code=EXIT_UNAVAILABLE)
            cleanup(lost)
            raise lost from None
        if exc is not None:
            _reraise(exc, self.rank, self.world_size, stage, about)
        for r, (failure, _) in enumerate(outcomes):
            if failure is not None:
                cls_name, code, msg = failure
                if not msg.startswith(f"rank {r} "):
                    msg = f"rank {r} failed while {stage} {about}: {msg}"
                if "not committed" not in msg and "nothing was committed" not in msg:
                    msg += "; nothing was committed"
                theirs = ERROR_CLASSES.get(cls_name, UserError)(msg, exit_code=code)
                cleanup(theirs)     # every rank removes its own files of the failed save
                raise theirs
        return [res for _, res in outcomes]


def _reraise(exc: BaseException, rank: int, world_size: int, stage: str, about: str) -> None:
    """Raise this rank's own failure: a UserError as is, any other Exception wrapped (cause kept),
    KeyboardInterrupt / SystemExit unchanged."""
    if not isinstance(exc, Exception) or isinstance(exc, UserError):
        raise exc
    raise as_user_error(exc, rank, world_size, stage, about) from exc


_ckpt_groups: dict[float | None, Any] = {}


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


def detect(rank: int | None = None, world_size: int | None = None, group: Any = None,
           timeout: float | None = None) -> Comm:
    """Called in the caller's thread (making the gloo group is itself a collective).

    timeout: the barrier timeout in seconds: collectives of the checkpoint group fail after it.
    """
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise UserError("pass both rank= and world_size= (or neither, to use torch.distributed or a single process)")
        if isinstance(rank, bool) or isinstance(world_size, bool) or not isinstance(rank, int) or not isinstance(world_size, int):
            raise UserError(f"rank={rank!r}, world_size={world_size!r}: both must be integers")
        if world_size < 1 or not 0 <= rank < world_size:
            raise UserError(f"rank={rank}, world_size={world_size}: need world_size >= 1 and 0 <= rank < world_size")
        dist = _torch_dist()
        if dist is not None and dist.get_world_size() == world_size and dist.get_rank() == rank:
            g = group if group is not None else _gloo_group(dist, timeout)
            return Comm(rank, world_size, g, dist, timeout if group is None else None)
        return Comm(rank, world_size)
    dist = _torch_dist()
    if dist is None:
        return Comm(0, 1)
    g = group if group is not None else _gloo_group(dist, timeout)
    return Comm(dist.get_rank(g), dist.get_world_size(g), g, dist, timeout if group is None else None)


def _gloo_group(dist: Any, timeout: float | None) -> Any:
    """The checkpoint group for this timeout, made once per process: new_group is a collective
    every rank joins (ranks of one job pass the same barrier timeout, so they make the same groups)."""
    key = None if timeout is None else float(timeout)
    g = _ckpt_groups.get(key)
    if g is None:
        kw: dict[str, Any] = {"backend": "gloo"}
        if key is not None:
            kw["timeout"] = timedelta(seconds=max(1.0, key))
        g = _ckpt_groups[key] = dist.new_group(**kw)
    return g
