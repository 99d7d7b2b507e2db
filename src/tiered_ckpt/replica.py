"""Moving memory-tier copies between nodes over a torch.distributed process group.

Who holds whose copy: a node is the ranks that share torchrun's LOCAL_WORLD_SIZE (ranks are
numbered node by node, as torchrun and srun number them); rank r of node n replicates to the
rank with the same local rank on node (n + memory.peer_distance) mod nodes. A copy travels as a
list of (file name, size) and then each file in chunks of at most CHUNK bytes, the marker last,
so the receiver writes it with the commit protocol (tiers/memory.write_copy) and a transfer cut
short leaves no marker.

Transport: here a gloo group (TCP: on ND nodes that is the 80 Gb/s Ethernet, or IPoIB when the
rendezvous address is the InfiniBand interface's). In production the copies are host memory,
which NCCL does not send (it moves GPU buffers), so the InfiniBand path for host bytes is gloo
over IPoIB or UCC/UCX (torch's `ucc` backend, which uses RDMA verbs on the 8 x 400 Gb/s HCAs).
The group is the toolkit's own, never the training's NCCL one, so replication in a background
thread never interleaves with the training's collectives.
"""
from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tiered_ckpt.errors import IntegrityError, UserError
from tiered_ckpt.io import commit, fsafe
from tiered_ckpt.io.marker import MARKER

CHUNK = 64 << 20
_MAX_HEADER = 64 << 20


def node_layout(world: int) -> tuple[int, int]:
    """(ranks per node, nodes): LOCAL_WORLD_SIZE as torchrun sets it (1 when unset)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        local = int(raw)
    except ValueError:
        raise UserError(f"LOCAL_WORLD_SIZE={raw!r} is not a whole number (torchrun sets it to the ranks per node)") from None
    if local < 1 or world % local:
        raise UserError(f"LOCAL_WORLD_SIZE={local} does not divide the world size {world}; launch the same number "
                        "of ranks on every node (torchrun --nproc-per-node)")
    return local, world // local


def peer_of(rank: int, world: int, distance: int) -> int | None:
    """The rank holding `rank`'s replica; None when there is no other node (or distance 0)."""
    local, nodes = node_layout(world)
    if distance % nodes == 0:
        return None
    node, lr = divmod(rank, local)
    return ((node + distance) % nodes) * local + lr


def source_of(rank: int, world: int, distance: int) -> int | None:
    """The rank whose replica `rank` holds (inverse of peer_of)."""
    local, nodes = node_layout(world)
    if distance % nodes == 0:
        return None
    node, lr = divmod(rank, local)
    return ((node - distance) % nodes) * local + lr


def same_node(a: int, b: int, world: int) -> bool:
    local, _ = node_layout(world)
    return a // local == b // local


_groups: dict[str, Any] = {}


def group(purpose: str, timeout: float) -> Any:
    """The toolkit's gloo group for `purpose` ("agree": the caller's thread; "copy": background),
    made once per process (new_group is a collective: every rank makes the same ones, in order)."""
    g = _groups.get(purpose)
    if g is None:
        g = _groups[purpose] = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(1.0, timeout)))
    return g


def _send_bytes(data: bytes | memoryview, dst: int, g: Any) -> None:
    n = torch.tensor([len(data)], dtype=torch.int64)
    dist.send(n, dst, group=g)
    if len(data):
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=g)


def _recv_bytes(src: int, g: Any, limit: int) -> bytes:
    n = torch.empty(1, dtype=torch.int64)
    dist.recv(n, src, group=g)
    size = int(n.item())
    if not 0 <= size <= limit:
        raise IntegrityError(f"memory replica from rank {src}: a chunk of {size} bytes (more than {limit}); "
                             "nothing was committed")
    if not size:
        return b""
    buf = torch.empty(size, dtype=torch.uint8)
    dist.recv(buf, src, group=g)
    return buf.numpy().tobytes()


def send_copy(info: commit.CheckpointInfo, dst: int, g: Any) -> int:
    """Send one committed copy to rank `dst`; the bytes sent."""
    assert info.manifest is not None
    listed = [(f.path, f.size) for f in info.manifest.files]
    marker = commit.marker_bytes(info.path, anchor=info.path.parent.parent)
    if marker is None:      # removed since the scan: this copy is not committed any more
        raise FileNotFoundError(f"{info.path / MARKER}: removed since the scan")
    header = pickle.dumps({"name": info.name, "files": listed + [(MARKER, len(marker))]})
    _send_bytes(header, dst, g)
    sent = 0
    for rel, size in listed:
        fd = fsafe.open_file(info.path / rel, anchor=info.path.parent.parent)
        try:
            left = size
            while left > 0:
                b = os.read(fd, min(CHUNK, left))
                if not b:
                    raise IntegrityError(f"{info.path / rel} is shorter than its marker says; the replica was not sent")
                _send_bytes(b, dst, g)
                left -= len(b)
                sent += len(b)
        finally:
            os.close(fd)
    _send_bytes(marker, dst, g)
    return sent + len(marker)


def recv_copy(src: int, g: Any) -> tuple[str, Iterator[tuple[str, Iterator[bytes]]]]:
    """Receive one copy from rank `src`: (checkpoint name, (file, chunks) pairs to write in order)."""
    head = pickle.loads(_recv_bytes(src, g, _MAX_HEADER))   # noqa: S301 - from a rank of the same job
    if not (isinstance(head, dict) and isinstance(head.get("name"), str) and isinstance(head.get("files"), list)):
        raise IntegrityError(f"memory replica from rank {src}: malformed header; nothing was committed")

    def chunks(size: int) -> Iterator[bytes]:
        left = size
        while left > 0:
            b = _recv_bytes(src, g, min(CHUNK, left))
            if not b:
                raise IntegrityError(f"memory replica from rank {src}: an empty chunk; nothing was committed")
            left -= len(b)
            yield b

    def files() -> Iterator[tuple[str, Iterator[bytes]]]:
        for rel, size in head["files"]:
            yield str(rel), chunks(int(size))

    return head["name"], files()


class Sender(threading.Thread):
    """Sends one copy while the calling thread receives another (a ring: everyone sends and
    receives at once, so sends must not block the receive)."""

    def __init__(self, info: commit.CheckpointInfo | None, dst: int, g: Any) -> None:
        super().__init__(daemon=True, name="tiered-ckpt-replica-send")
        self.info, self.dst, self.g = info, dst, g
        self.error: BaseException | None = None
        self.sent = 0

    def run(self) -> None:
        try:
            if self.info is None:      # nothing to send: say so, the peer is waiting for a header
                _send_bytes(pickle.dumps({"name": "", "files": []}), self.dst, self.g)
            else:
                self.sent = send_copy(self.info, self.dst, self.g)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = e
