"""Which snapshot every member restores after a change of members (train/live_snapshots.py):
the present when nobody was lost, else the newest step each old rank is covered at, by
its own snapshot or by the parities of its stripes and the others' snapshots; none when
two of k+1 neighbours went together. And where a member keeps its snapshots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.train.live_snapshots import PieceFiles, Snapshot, Snapshots, choose
from phalanx.zero3.hybrid import hybrid_layout

RING = ("r0", "r1", "r2")


def _held(
    own: list[int], kept: list[int], applied: int = 13, ring: tuple[str, ...] = RING, k: int = 1
) -> dict[str, Any]:
    return {
        "own": [[list(ring), s] for s in own],
        "kept": [[list(ring), s] for s in kept],
        "ring": list(ring),
        "applied": applied,
        "redundancy": k,
    }


def test_nobody_lost_takes_the_present() -> None:
    held: dict[str, dict[str, Any] | None] = {m: _held([10], [10]) for m in RING}
    held["j1"] = None  # a replacement joining
    choice = choose(held)
    assert choice is not None and not choice.rolls_back and choice.step == 13
    assert choice.providers == [("r0", False), ("r1", False), ("r2", False)]


@pytest.mark.parametrize("k", [1, 2])
def test_a_loss_takes_the_newest_step_its_parity_covers(k: int) -> None:
    # r1 died while the step-20 snapshot was passed: r2 kept the step-10 parity only.
    held: dict[str, Any] = {"r0": _held([10, 20], [10, 20], k=k), "r2": _held([10, 20], [10], k=k)}
    choice = choose(held)
    assert choice is not None and choice.rolls_back and choice.step == 10
    assert choice.providers == [("r0", False), ("r2", True), ("r2", False)]
    assert choice.redundancy == k
    held["r2"] = _held([10, 20], [10, 20], k=k)
    assert choose(held).step == 20  # type: ignore[union-attr]
    if k == 2:  # r0's parity holds r1's second stripe: without it, nothing at 20
        held["r0"] = _held([10, 20], [10], k=k)
        assert choose(held).step == 10  # type: ignore[union-attr]


def test_members_that_applied_different_steps_roll_back() -> None:
    held = {m: _held([10], [10], applied=13 + (m == "r2")) for m in RING}
    choice = choose(held)
    assert choice is not None and choice.rolls_back and choice.step == 10


def test_two_neighbours_lost_together_leave_nothing() -> None:
    assert choose({"r0": _held([10], [10])}) is None  # r1's copy was r2's, gone too


@pytest.mark.parametrize(("k", "covered"), [(1, True), (2, False)])
def test_two_losses_two_apart_are_covered_by_one_neighbour_not_by_two(
    k: int, covered: bool
) -> None:
    """Five members, r1 and r3 lost: at k = 1 each one's copy is on a survivor (r2, r4);
    at k = 2 r1's second stripe is in r3's parity, lost with it."""
    ring = ("r0", "r1", "r2", "r3", "r4")
    held = {m: _held([10], [10], ring=ring, k=k) for m in ("r0", "r2", "r4")}
    assert (choose(held) is not None) == covered


def test_a_member_keeps_two_of_its_own_and_two_parities_until_every_member_holds_the_new(
    tmp_path: Path,
) -> None:
    snaps = Snapshots(5, PieceFiles(tmp_path, 0, "TMPDIR"))
    for step in (0, 5, 10):
        _, flat, writing = snaps.files.pack({"p": torch.full((4,), float(step))})
        writing.result()
        snaps.add(_own(step, flat), Snapshot(RING, step, snaps.new_parity(8), {}, 8))
    assert snaps.held()["own"] == [[list(RING), 5], [list(RING), 10]]
    assert snaps.kept_at((RING, 10)) is not None and snaps.kept_at((RING, 0)) is None
    assert snaps.due(10) and not snaps.due(11)
    snaps.settle()  # every member holds step 10's pair: step 5's goes
    assert snaps.held() == {"own": [[list(RING), 10]], "kept": [[list(RING), 10]]}
    snaps.close()


def _own(step: int, flat: torch.Tensor) -> Snapshot:
    return Snapshot(RING, step, flat, {"r0": [[["p", "float32", [4], 0]], 16]}, 8)


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


@pytest.mark.parametrize("parity_in_files", [False, True], ids=["memory", "disk-offload"])
def test_own_snapshots_are_in_files_and_the_parity_in_memory_unless_offloaded(
    tmp_path: Path, parity_in_files: bool
) -> None:
    """A member's own snapshot is read back only by a rollback or a rebuild: it goes to a
    file (the kernel's to keep). The parity it keeps for others is the redundancy: in
    memory, or in a file too under disk offload. Both go with their snapshot."""
    files = PieceFiles(tmp_path, 0, "TMPDIR")
    snapshots = Snapshots(10, files, parity_in_files)
    ring = ("r0", "r1")

    def pair(step: int) -> tuple[Snapshot, Snapshot]:
        pieces = {"p0": torch.full((256,), float(step)), "p1": torch.arange(3)}
        mine, flat, writing = files.pack(pieces)
        writing.result()
        parity = snapshots.new_parity(1048)
        parity.fill_(step)
        own = Snapshot(ring, step, flat, {"r0": mine}, 1048)
        return own, Snapshot(ring, step, parity, {}, 1048)

    snapshots.add(*pair(10))
    snapshots.add(*pair(20))  # an exchange under way: both pairs held
    own_bytes = 2 * (256 * 4 + 3 * 8)
    assert snapshots.nbytes(in_files=True) == own_bytes + parity_in_files * 2 * 1048
    assert snapshots.nbytes(in_files=False) == (not parity_in_files) * 2 * 1048
    directory = files.files.directory
    assert len(list(directory.iterdir())) == 2 + 2 * parity_in_files
    fill = files.reader(snapshots.own[-1].flat)
    head = torch.empty(8, dtype=torch.uint8)
    fill(0, head)
    assert head.view(torch.float32).tolist() == [20.0, 20.0]
    fill(256 * 4 + 3 * 8 - 4, head)  # past the end: zeros
    assert head.tolist() == [0] * 8 and _mapped_kb(snapshots.own[-1].flat) == 0
    snapshots.settle()  # every member holds step 20's pair: step 10's files are spare
    assert len(files.spare) == 1 + parity_in_files
    assert len(list(directory.iterdir())) == 2 + 2 * parity_in_files
    snapshots.add(*pair(30))  # made in the spare files: no new file
    assert len(list(directory.iterdir())) == 2 + 2 * parity_in_files and not files.spare
    snapshots.settle()
    own = snapshots.own_at((ring, 30))
    assert own is not None
    pieces = snapshots.pieces(own, "r0")  # read back through the file
    assert _mapped_kb(own.flat) == 0  # written and read without mapping a page
    assert pieces["p0"].tolist() == [30.0] * 256 and pieces["p1"].tolist() == [0, 1, 2]
    snapshots.close()
    assert not directory.exists()


def _mapped_kb(tensor: torch.Tensor) -> int:
    """Resident kB of the mapping `tensor` lies in (/proc/self/smaps' Rss): this process's
    memory, not the kernel's cache."""
    address, inside = tensor.untyped_storage().data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")
