"""Which snapshot every member restores after a change of members (train/live_snapshots.py):
the present when nobody was lost, else the newest step each old rank is covered at, by
itself or by the neighbour that kept its pieces; none when two neighbours went together."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from phalanx.train.live_snapshots import PieceFiles, Snapshot, Snapshots, choose
from phalanx.zero3.hybrid import hybrid_layout

RING = ("r0", "r1", "r2")


def _held(own: list[int], kept: list[int], whose: str, applied: int = 13) -> dict[str, Any]:
    return {
        "own": [[list(RING), s] for s in own],
        "kept": [[whose, list(RING), s] for s in kept],
        "ring": list(RING),
        "applied": applied,
    }


def test_nobody_lost_takes_the_present() -> None:
    held: dict[str, dict[str, Any] | None] = {
        m: _held([10], [10], RING[i - 1]) for i, m in enumerate(RING)
    }
    held["j1"] = None  # a replacement joining
    choice = choose(held)
    assert choice is not None and not choice.rolls_back and choice.step == 13
    assert choice.providers == [("r0", False), ("r1", False), ("r2", False)]


def test_a_loss_takes_the_newest_step_the_neighbour_kept() -> None:
    # r1 died while the step-20 copies were passed: r2 kept r1's step-10 pieces only.
    held: dict[str, Any] = {
        "r0": _held([10, 20], [10, 20], "r2"),
        "r2": _held([10, 20], [10], "r1"),
    }
    choice = choose(held)
    assert choice is not None and choice.rolls_back and choice.step == 10
    assert choice.providers == [("r0", False), ("r2", True), ("r2", False)]
    held["r2"] = _held([10, 20], [10, 20], "r1")
    assert choose(held).step == 20  # type: ignore[union-attr]


def test_members_that_applied_different_steps_roll_back() -> None:
    held = {m: _held([10], [10], RING[i - 1], applied=13 + (m == "r2")) for i, m in enumerate(RING)}
    choice = choose(held)
    assert choice is not None and choice.rolls_back and choice.step == 10


def test_two_neighbours_lost_together_leave_nothing() -> None:
    assert choose({"r0": _held([10], [10], "r2")}) is None  # r1's copy was r2's, gone too


def test_a_member_keeps_two_of_its_own_and_two_of_its_neighbours() -> None:
    snaps = Snapshots(every=5)
    for step in (0, 5, 10):
        own, kept = Snapshot(RING, step, {}), Snapshot(RING, step, {})
        snaps.add(own, kept, "r2")
    assert snaps.held()["own"] == [[list(RING), 5], [list(RING), 10]]
    assert snaps.kept_at("r2", (RING, 10)) is not None and snaps.kept_at("r1", (RING, 10)) is None
    assert snaps.due(10) and not snaps.due(11)
    snaps.settle()  # every member holds step 10's pair: step 5's goes
    assert snaps.held() == {"own": [[list(RING), 10]], "kept": [["r2", list(RING), 10]]}


def test_hsdp_takes_a_lost_rank_piece_from_its_replica_at_the_present_step() -> None:
    """A 2 x 2 mesh: pieces 0 and 1 held by (r0, r2) and (r1, r3). r1 lost: r3 provides its
    piece now, and nothing rolls back (no snapshot was kept)."""
    ring, slots = ["r0", "r1", "r2", "r3"], [["r0", "r2"], ["r1", "r3"]]
    now = {"own": [], "kept": [], "ring": ring, "applied": 13, "slots": slots}
    held: dict[str, Any] = {"r0": now, "r2": now, "r3": now, "j1": None}
    choice = choose(held)
    assert choice is not None and not choice.rolls_back and choice.step == 13
    assert choice.providers == [("r0", False), ("r3", False)] and choice.owners == ("r0", "r3")
    assert choose({"r0": now, "r2": now}) is None  # both replicas of piece 1 gone


def test_hsdp_rows_follow_the_hosts() -> None:
    # Ranks 0 and 3 on node 0, 1 and 2 on node 1 (a replacement joined at the end).
    assert hybrid_layout([0, 1, 1, 0], 2) == [[0, 3], [1, 2]]
    assert hybrid_layout([0, 0, 1, 1, 2, 2], 2) == [[0, 1], [2, 3], [4, 5]]
    assert hybrid_layout([0, 0, 1], 2) is None  # 3 ranks left of 2 x 2: shard over all
    assert hybrid_layout([0, 0], 2) is None  # one row: FSDP


def test_under_disk_offload_the_pieces_are_in_files_and_go_with_their_snapshot(
    tmp_path: Path,
) -> None:
    files = PieceFiles(tmp_path, 0)
    snapshots = Snapshots(10, files=files)
    ring = ("r0", "r1")

    def pair(step: int) -> tuple[Snapshot, Snapshot]:
        own = Snapshot(ring, step, {"p0": torch.full((256,), float(step))})
        return own, Snapshot(ring, step, {"p0": torch.full((256,), -float(step))})

    snapshots.add(*pair(10), "r1")
    snapshots.add(*pair(20), "r1")  # an exchange under way: both pairs held
    assert snapshots.nbytes(in_files=False) == 0
    assert snapshots.nbytes(in_files=True) == 4 * 256 * 4
    directory = files.files.directory
    assert len(list(directory.iterdir())) == 4
    snapshots.settle()  # every member holds step 20's pair: step 10's files go
    assert len(list(directory.iterdir())) == 2
    own = snapshots.own_at((ring, 20))
    assert own is not None and own.pieces["p0"].tolist() == [20.0] * 256  # read back
    snapshots.close()
    assert not directory.exists()
