"""Nested state: `{"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}`.

A nested state is split into a flat mapping of buffer names to buffers (what the writer
saves, as for a flat state) and a JSON *structure* tree recorded in the rank's part manifest
and in the marker's index (`index.structure[<rank>]`). On load the tree rebuilds the state.

Tree nodes (each a one-key JSON object):
  {"dict": [[key, node], ...]}    a mapping (key order kept); a key is a JSON string or integer,
  {"odict": [[key, node], ...]}   so an optimizer's integer state keys come back as ints
  {"list": [node, ...]} / {"tuple": [node, ...]}
  {"buf": "<buffer name>"}        a buffer of this rank's index
  {"rbuf": [<rank>, "<name>"]}    a buffer of another rank's index: an entry the save declared
                                  replicated (save(replicated=)), written by that rank only
  {"val": <null|bool|int|float|str>}
  {"float": "nan"|"inf"|"-inf"}   a non-finite float (JSON has none)
  {"int": "<decimal digits>"}     an int outside the signed 64-bit range (the index is written
                                  and read with orjson, which holds 64-bit integers only)

What comes back: dict as dict, OrderedDict as OrderedDict (a state dict's `_metadata`
attribute is not kept; `load_state_dict` works without it), list as list, tuple as tuple (a
tuple subclass such as torch.Size as a plain tuple), a str/int/float subclass (an enum) as its
plain value (so a numpy float64, a float subclass, comes back as a float; other numpy
scalars are buffers and come back as 0-d arrays). A buffer referenced twice is saved twice and loads as two buffers.

A flat mapping of string keys to buffers (the original API) records no tree: its marker is
byte-for-byte what it always was (unless some of it is declared replicated). Pure: no I/O, no
numpy or torch import.

Replicated entries (save(state, replicated=["model"]) on several ranks): every rank flattens its
whole state; the buffers under the declared top-level keys are assigned to ranks (`assign`,
largest first to the least-loaded rank, the same on every rank since the entries are the same),
each rank writes only the ones assigned to it, and its tree names the others as {"rbuf": [owner,
name]} (`to_remote`). Load reads those from the owner's files.
"""
from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from tiered_ckpt.errors import UserError

MAX_DEPTH = 64               # deeper trees are not state dicts; a bound keeps recursion safe
_SCALARS = (type(None), bool, int, float, str)
_NODE_KINDS = {"dict", "odict", "list", "tuple", "buf", "rbuf", "val", "float", "int"}
_INT64 = range(-(2 ** 63), 2 ** 63)
_BIG_INT = re.compile(r"-?[1-9][0-9]{0,4300}")   # 4300: Python's default int-to-str digit limit
# A loaded buffer's key: its name in this rank's index, or (owner rank, name) for an rbuf node.
BufferKey = str | tuple[int, str]
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _is_container(v: Any) -> bool:
    return isinstance(v, (Mapping, list, tuple))


def is_flat(state: Mapping[Any, Any]) -> bool:
    """The original API's shape: string keys, every value a buffer (no container, no scalar)."""
    return all(isinstance(k, str) for k in state) and not any(
        _is_container(v) or isinstance(v, _SCALARS) for v in state.values())


def _path(parts: list[str]) -> str:
    return ".".join(parts) or "<top>"


def flatten_state(state: Any, tree: bool = False) -> tuple[Mapping[str, Any], dict[str, Any] | None]:
    """(name -> buffer, structure tree or None for a flat state); UserError names the bad path.

    tree=True: a tree even for a flat state (replicated entries are recorded in it)."""
    if not isinstance(state, Mapping):
        raise UserError(f"save() takes a mapping of names to buffers (nested dicts/lists allowed); "
                        f"got {type(state).__name__}")
    if is_flat(state) and not tree:
        return state, None
    flat: dict[str, Any] = {}
    active: set[int] = set()

    def name_for(parts: list[str]) -> str:
        base = ".".join(parts) or "_"
        name, n = base, 1
        while name in flat:        # {"a.b": x, "a": {"b": y}}: both would be "a.b"
            name, n = f"{base}~{n}", n + 1
        return name

    def walk(v: Any, parts: list[str]) -> dict[str, Any]:
        if len(parts) > MAX_DEPTH:
            raise UserError(f"state is nested more than {MAX_DEPTH} levels deep at {_path(parts[:8])}...")
        if _is_container(v):
            if id(v) in active:
                raise UserError(f"state at {_path(parts)} contains itself (a reference cycle); it cannot be saved")
            active.add(id(v))
            try:
                if isinstance(v, Mapping):
                    items = []
                    for k, sub in list(v.items()):
                        if type(k) is bool or not isinstance(k, (str, int)):
                            raise UserError(f"state key {k!r} ({type(k).__name__}) at {_path(parts + [str(k)])}: "
                                            "keys must be str or int; convert it (e.g. str(key))")
                        if not isinstance(k, str) and int(k) not in _INT64:
                            raise UserError(f"state key {k} at {_path(parts)} is outside the signed 64-bit range; "
                                            "use a smaller int or a str key")
                        items.append([k if isinstance(k, str) else int(k), walk(sub, parts + [str(k)])])
                    return {"odict" if isinstance(v, OrderedDict) else "dict": items}
                kind = "tuple" if isinstance(v, tuple) else "list"
                return {kind: [walk(sub, parts + [str(i)]) for i, sub in enumerate(v)]}
            finally:
                active.discard(id(v))
        if isinstance(v, float) and not math.isfinite(v):
            return {"float": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if isinstance(v, _SCALARS):
            # subclasses (an IntEnum, a numpy bool is not one) are stored as their plain value
            if type(v) not in _SCALARS:
                v = str.__str__(v) if isinstance(v, str) else int(v) if isinstance(v, int) else float(v)  # type: ignore[arg-type]
            if type(v) is int and v not in _INT64:
                return {"int": str(v)}
            return {"val": v}
        name = name_for(parts)
        flat[name] = v            # a buffer: sources.to_source checks it and names the path in errors
        return {"buf": name}

    return flat, walk(state, [])


def under_keys(tree: dict[str, Any], keys: list[str]) -> list[str]:
    """The buffer names under the top-level `keys` of a tree flatten_state made, in tree order."""
    out: list[str] = []

    def walk(node: dict[str, Any]) -> None:
        kind, body = next(iter(node.items()))
        if kind == "buf":
            out.append(body)
        elif kind in ("dict", "odict"):
            for _, sub in body:
                walk(sub)
        elif kind in ("list", "tuple"):
            for sub in body:
                walk(sub)

    top = dict(next(iter(tree.values())))
    for k in keys:
        walk(top[k])
    return out


def assign(sizes: list[tuple[str, int]], world_size: int) -> dict[str, int]:
    """Owner rank of each replicated buffer: largest first, each to the least-loaded rank.

    Deterministic in its input alone, so every rank holding the same entries computes the same
    owners without communicating (ranks whose entries differ are caught at commit)."""
    load = [0] * world_size
    owners: dict[str, int] = {}
    for name, n in sorted(sizes, key=lambda s: (-s[1], s[0])):
        r = min(range(world_size), key=lambda i: (load[i], i))
        owners[name] = r
        load[r] += n
    return owners


def to_remote(tree: dict[str, Any], owners: Mapping[str, int], rank: int) -> dict[str, Any]:
    """The tree with every buffer another rank owns as {"rbuf": [owner, name]}."""
    kind, body = next(iter(tree.items()))
    if kind == "buf":
        owner = owners.get(body, rank)
        return tree if owner == rank else {"rbuf": [owner, body]}
    if kind in ("dict", "odict"):
        return {kind: [[k, to_remote(sub, owners, rank)] for k, sub in body]}
    if kind in ("list", "tuple"):
        return {kind: [to_remote(sub, owners, rank) for sub in body]}
    return tree


def remote_refs(tree: dict[str, Any]) -> list[tuple[int, str]]:
    """Every (owner rank, name) an rbuf node of the tree names."""
    out: list[tuple[int, str]] = []

    def walk(node: dict[str, Any]) -> None:
        kind, body = next(iter(node.items()))
        if kind == "rbuf":
            out.append((body[0], body[1]))
        elif kind in ("dict", "odict"):
            for _, sub in body:
                walk(sub)
        elif kind in ("list", "tuple"):
            for sub in body:
                walk(sub)

    walk(tree)
    return out


def unflatten(tree: dict[str, Any], buffers: Mapping[BufferKey, Any]) -> Any:
    """The saved state rebuilt from its tree and the loaded buffers (validated by the marker)."""
    kind, body = next(iter(tree.items()))
    if kind == "buf":
        return buffers[body]
    if kind == "rbuf":
        return buffers[(body[0], body[1])]
    if kind == "val":
        return body
    if kind == "float":
        return _NONFINITE[body]
    if kind == "int":
        return int(body)
    if kind in ("dict", "odict"):
        d = OrderedDict() if kind == "odict" else {}
        for k, sub in body:
            d[k] = unflatten(sub, buffers)
        return d
    items = [unflatten(sub, buffers) for sub in body]
    return tuple(items) if kind == "tuple" else items


def destinations(tree: dict[str, Any], into: Any, where: str) -> dict[BufferKey, Any]:
    """load(into=nested): buffer name -> destination buffer, walking `into` along the tree.

    `into` may hold only some of the buffers; a path it names that the checkpoint lacks (or
    where the checkpoint holds no buffer) is a UserError naming that path.
    """
    out: dict[BufferKey, Any] = {}

    def walk(node: dict[str, Any], dest: Any, parts: list[str]) -> None:
        kind, body = next(iter(node.items()))
        if kind in ("buf", "rbuf"):
            if _is_container(dest):
                raise UserError(f"load into {_path(parts)}: {where} holds a buffer there, not a "
                                f"{type(dest).__name__}")
            if dest is not None:       # None: allocate this one
                out[body if kind == "buf" else (body[0], body[1])] = dest
        elif kind in ("dict", "odict"):
            if not isinstance(dest, Mapping):
                raise UserError(f"load into {_path(parts)}: {where} holds a mapping there; got {type(dest).__name__}")
            saved = {k: sub for k, sub in body}
            for k, sub_dest in dest.items():
                if k not in saved:
                    raise UserError(f"load into {_path(parts + [str(k)])}: not in {where} "
                                    f"(it holds {[str(s) for s in list(saved)[:10]]} there)")
                walk(saved[k], sub_dest, parts + [str(k)])
        elif kind in ("list", "tuple"):
            if not isinstance(dest, (list, tuple)) or len(dest) != len(body):
                raise UserError(f"load into {_path(parts)}: {where} holds a sequence of {len(body)} there; "
                                f"got {type(dest).__name__}" + (f" of {len(dest)}" if isinstance(dest, (list, tuple)) else ""))
            for i, (sub, sub_dest) in enumerate(zip(body, dest, strict=True)):
                walk(sub, sub_dest, parts + [str(i)])
        elif dest is not None and not isinstance(dest, _SCALARS):
            raise UserError(f"load into {_path(parts)}: {where} holds a scalar there, not a buffer")

    walk(tree, into, [])
    return out


def check_tree(tree: Any, where: str, names: Mapping[str, Any], depth: int = 0, *, rank: int = 0,
               ranks: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Marker validation of a structure tree; raises ValueError(why) (marker.py rewraps it).

    names: the buffers of the tree's rank (`rank`); ranks: every rank's, which rbuf nodes name."""
    if depth > MAX_DEPTH:
        raise ValueError(f"{where} is nested more than {MAX_DEPTH} levels deep")
    if not isinstance(tree, dict) or len(tree) != 1 or next(iter(tree)) not in _NODE_KINDS:
        raise ValueError(f"{where} has a node {str(tree)[:80]!r}, not one of {sorted(_NODE_KINDS)}")
    kind, body = next(iter(tree.items()))
    if kind == "buf":
        if not isinstance(body, str) or body not in names:
            raise ValueError(f"{where} names buffer {str(body)[:80]!r}, which the rank's index does not hold")
    elif kind == "rbuf":
        if not (isinstance(body, list) and len(body) == 2 and type(body[0]) is int and isinstance(body[1], str)):
            raise ValueError(f"{where} has an rbuf {str(body)[:80]!r}, not [rank, buffer name]")
        owner = (ranks or {}).get(str(body[0]))
        if body[0] == rank or owner is None or body[1] not in owner:
            raise ValueError(f"{where} names buffer {str(body[1])[:80]!r} of rank {body[0]}, which "
                             + ("is the tree's own rank" if body[0] == rank else "that rank's index does not hold"))
    elif kind == "val":
        if not (body is None or isinstance(body, (bool, int, str))
                or (isinstance(body, float) and math.isfinite(body))):
            raise ValueError(f"{where} has a value {str(body)[:80]!r}, not a JSON scalar")
    elif kind == "float":
        if body not in _NONFINITE:
            raise ValueError(f"{where} has a float {str(body)[:80]!r}, not one of {sorted(_NONFINITE)}")
    elif kind == "int":
        if not (isinstance(body, str) and _BIG_INT.fullmatch(body)):
            raise ValueError(f"{where} has an int {str(body)[:80]!r}, not a string of decimal digits")
    elif kind in ("dict", "odict"):
        if not isinstance(body, list):
            raise ValueError(f"{where} has a {kind} that is not a list of [key, node]")
        seen: set[Any] = set()
        for item in body:
            if not (isinstance(item, list) and len(item) == 2 and type(item[0]) in (str, int)):
                raise ValueError(f"{where} has a {kind} item {str(item)[:80]!r}, not [str or int key, node]")
            if item[0] in seen:
                raise ValueError(f"{where} has key {str(item[0])[:80]!r} twice")
            seen.add(item[0])
            check_tree(item[1], where, names, depth + 1, rank=rank, ranks=ranks)
    else:
        if not isinstance(body, list):
            raise ValueError(f"{where} has a {kind} that is not a list")
        for sub in body:
            check_tree(sub, where, names, depth + 1, rank=rank, ranks=ranks)
