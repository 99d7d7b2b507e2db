"""The demo's timeline: what happened to each checkpoint, as events and as a PNG.

Pure data in (events), a picture out; matplotlib is imported only when drawing so the
toolkit on the nodes does not need it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Event kinds, one lane per checkpoint.
WRITE = "write"              # start .. committed
ARCHIVE = "archive"          # committed .. every file proven in Blob
RETENTION = "retention"      # retention removed it from the accelerator layer
LOSS = "loss"                # the accelerator layer was wiped (not per checkpoint)
RESTORE = "restore"          # download from Blob .. verified and committed again


@dataclass(frozen=True)
class Event:
    kind: str
    start: float                     # seconds since the run began
    end: float | None = None         # None for an instant
    checkpoint: str | None = None
    detail: str = ""


@dataclass
class Timeline:
    events: list[Event] = field(default_factory=list)

    def add(self, kind: str, start: float, end: float | None = None, checkpoint: str | None = None, detail: str = "") -> Event:
        ev = Event(kind, start, end, checkpoint, detail)
        self.events.append(ev)
        return ev

    def checkpoints(self) -> list[str]:
        seen: dict[str, None] = {}
        for ev in self.events:
            if ev.checkpoint is not None:
                seen.setdefault(ev.checkpoint, None)
        return list(seen)

    def to_json(self) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.events]

    def draw(self, path: str | Path, title: str = "tiered-ckpt demo") -> Path:
        import matplotlib

        matplotlib.use("Agg")  # no display on nodes or CI
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        names = self.checkpoints()
        lane = {n: i for i, n in enumerate(names)}
        colors = {WRITE: "#1f77b4", ARCHIVE: "#2ca02c", RESTORE: "#9467bd"}
        fig, ax = plt.subplots(figsize=(10, 2.0 + 0.45 * max(1, len(names))))
        for ev in self.events:
            if ev.kind == LOSS:
                ax.axvline(ev.start, color="#d62728", linestyle="--", linewidth=1.5)
                ax.text(ev.start, -0.55, " accelerator layer lost", color="#d62728", fontsize=8, va="bottom")
                continue
            if ev.checkpoint is None:
                continue
            y = lane[ev.checkpoint]
            if ev.kind == RETENTION:
                ax.plot([ev.start], [y], marker="x", color="#ff7f0e", markersize=9, markeredgewidth=2)
                continue
            end = ev.end if ev.end is not None else ev.start
            ax.barh(y, max(end - ev.start, 0.02), left=ev.start, height=0.5 if ev.kind != ARCHIVE else 0.25,
                    color=colors.get(ev.kind, "grey"), alpha=0.9)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_ylim(len(names) - 0.5, -0.9)   # first checkpoint on top, room for the loss label
        ax.set_xlim(left=0)
        ax.set_xlabel("seconds since start")
        ax.set_title(title)
        ax.legend(handles=[Patch(color=colors[WRITE], label="write + commit"),
                           Patch(color=colors[ARCHIVE], label="until archived in Blob"),
                           Patch(color=colors[RESTORE], label="restore from Blob"),
                           Patch(color="#ff7f0e", label="retention removed (x)"),
                           Patch(color="#d62728", label="loss of the accelerator layer")],
                  fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=5, frameon=False)
        ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
        plt.close(fig)
        return out
