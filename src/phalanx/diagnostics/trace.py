"""The timelines' rank files, merged into one Chrome trace (Perfetto, chrome://tracing).

Each recorder of a rank writes its own file (`<path>.rank-<rank>.<pid>-<id>.json`,
timeline.py); rank 0 merges them all into `path`: one track per rank and kind of
work, the files of a rank on the same tracks. Imports no torch: `phalanx bench`
reads the trace.
"""

from __future__ import annotations

import glob
import json
import time
from pathlib import Path
from typing import Any

__all__ = ["MERGE_WAIT_S", "OPTIMIZER_SPAN", "TRACKS", "merge", "rank_files"]

MERGE_WAIT_S = 20.0
"""How long rank 0 waits at exit for the other ranks' files before merging what it has."""
OPTIMIZER_SPAN = "optimizer step"
TRACKS = ("compute", "comm", "io")
"""Each rank's tracks: the training thread, collectives in flight, offload file I/O."""


def rank_files(path: Path, rank: int) -> list[Path]:
    """Every timeline file of `rank` next to `path` (one per recorder)."""
    return sorted(path.parent.glob(f"{glob.escape(path.name)}.rank-{rank}.*.json"))


def merge(path: str | Path, world_size: int, wait_s: float = MERGE_WAIT_S) -> dict[str, Any]:
    """Rank 0: every rank's files into one Chrome trace at `path` (waiting, up to `wait_s`,
    until each rank has written one). A rank's files (one per recorder) share its tracks;
    its steps are put in time order; an optimizer step that two of its recorders both
    timed is kept once."""
    path = Path(path)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(rank_files(path, r) for r in range(world_size)):
        time.sleep(0.1)
    files = {r: [json.loads(f.read_text()) for f in rank_files(path, r)] for r in range(world_size)}
    ranks = {r: parts for r, parts in files.items() if parts}
    base = min((d["origin_ns"] for parts in ranks.values() for d in parts), default=0)
    events: list[dict[str, Any]] = []
    steps: dict[str, list[dict[str, Any]]] = {}
    dropped: dict[str, dict[str, int]] = {}
    for rank, parts in ranks.items():
        spans = [
            (name, track, start + d["origin_ns"] - base, dur, args)
            for d in parts
            for name, track, start, dur, args in d["spans"]
        ]
        spans = _one_optimizer_step_each(sorted(spans, key=lambda span: span[2]))
        used = {"compute", "comm"} | {span[1] for span in spans}
        events += [
            _meta(rank, tid, f"rank {rank} {t}") for tid, t in enumerate(TRACKS) if t in used
        ]
        for name, track, start, dur, args in spans:
            events.append(
                {
                    "name": name,
                    "ph": "X",
                    "pid": rank,
                    "tid": TRACKS.index(track) if track in TRACKS else 0,
                    "ts": start / 1000,
                    "dur": dur / 1000,
                    "args": args,
                }
            )
        records = [
            (step.get("at_ns", 0) + d["origin_ns"], step) for d in parts for step in d["steps"]
        ]
        steps[str(rank)] = [step for _, step in sorted(records, key=lambda r: r[0])]
        dropped[str(rank)] = {
            "spans": sum(d.get("dropped_spans", 0) for d in parts),
            "steps": sum(d.get("dropped_steps", 0) for d in parts),
        }
    trace = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "phalanx": {"ranks": sorted(ranks), "steps": steps, "dropped": dropped},
    }
    path.write_text(json.dumps(trace))
    return trace


def _one_optimizer_step_each(spans: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """`spans` (in start order) without an optimizer step that overlaps the one before it:
    every recorder of a process times each optimizer step (torch's hooks are global)."""
    kept: list[tuple[Any, ...]] = []
    last_end = -1
    for span in spans:
        if span[0] == OPTIMIZER_SPAN:
            if span[2] < last_end:
                continue
            last_end = span[2] + span[3]
        kept.append(span)
    return kept


def _meta(rank: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
