"""The O_DIRECT mover's parts (offload/direct.py): its slabs are aligned and bounded, and a
step's end waits for its writes (a mapping read after it must see them)."""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.offload.direct import (
    ALIGN,
    DirectEntry,
    DirectMover,
    DirectWindow,
    Slab,
    SlabPool,
    StatePlace,
    aligned,
    supported,
)


def test_a_slab_is_page_aligned_and_its_tensors_lie_where_asked() -> None:
    slab = Slab(3 * ALIGN + 1)
    assert slab.nbytes == 4 * ALIGN == aligned(3 * ALIGN + 1)
    view = slab.tensor(ALIGN, torch.zeros(2, 3, dtype=torch.float64))
    assert view.shape == (2, 3) and view.dtype == torch.float64
    assert view.data_ptr() % mmap.PAGESIZE == 0
    assert view.data_ptr() - slab.tensor(0, torch.zeros(1)).data_ptr() == ALIGN


def test_the_pool_makes_no_more_than_its_most_and_a_give_wakes_a_take() -> None:
    pool = SlabPool(2)
    a, b = pool.take(ALIGN), pool.take(ALIGN)
    got: list[Slab] = []
    waiter = threading.Thread(target=lambda: got.append(pool.take(ALIGN)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # both slabs out: it waits (it cannot end early)
    pool.give(a)
    waiter.join(10)
    assert got == [a]
    pool.give(b)
    larger = pool.take(3 * ALIGN)  # only a smaller one free: it makes way for a larger
    assert larger is not b and larger.nbytes == 3 * ALIGN
    pool.give(larger)
    pool.give(got[0])
    pool.clear()
    assert pool.take(ALIGN) not in (a, b, larger)


def test_a_window_round_trips_through_its_files_and_the_step_ends_after_its_writes(
    tmp_path: Path,
) -> None:
    if not supported(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    values = [torch.arange(1000, dtype=torch.float32), torch.full((5000,), 2.0)]
    entries = []
    offset = 0
    for i, v in enumerate(values):
        path, length = tmp_path / f"{i}.bin", aligned(v.nbytes)
        path.write_bytes(v.numpy().tobytes() + bytes(length - v.nbytes))
        state: dict[str, Any] = {"exp_avg": v}
        entries.append(DirectEntry(StatePlace(state, "exp_avg"), v, path, offset, length))
        offset += length
    gate = threading.Event()
    opened: list[int] = []

    def opener(path: Path, flags: int) -> int:
        if flags & os.O_WRONLY:
            gate.wait(30)  # writes hold until the test lets them go
        opened.append(flags)
        return os.open(path, flags)

    def timed(what: str, work: Any, nbytes: int) -> None:
        work()

    def wait(future: Future[None]) -> None:
        future.result()

    mover = DirectMover(opener, timed, wait)
    window: DirectWindow = mover.window(entries)
    mover.read(window)
    with window.stepping():
        for e in entries:
            stepped = state_of(e)["exp_avg"]
            assert stepped is not e.value and torch.equal(stepped, e.value)
            stepped.add_(1.0)  # the step, in the slab
    assert all(state_of(e)["exp_avg"] is e.value for e in entries)  # the mapping back in place
    mover.write(window)
    finished = threading.Thread(target=mover.finish, args=(False,))
    finished.start()
    finished.join(0.2)
    assert finished.is_alive()  # the writes are held: the step's end waits for them
    gate.set()
    finished.join(30)
    assert not finished.is_alive()
    for i, v in enumerate(values):
        back = torch.frombuffer(bytearray((tmp_path / f"{i}.bin").read_bytes()), dtype=v.dtype)
        assert torch.equal(back[: v.numel()], v + 1.0)
    mover.close()


def state_of(entry: DirectEntry) -> dict[str, Any]:
    assert isinstance(entry.place, StatePlace)
    return entry.place.state


def test_a_probe_in_flight_beside_it_does_not_make_the_disk_read_as_refusing(
    tmp_path: Path,
) -> None:
    """Ranks sharing a directory probe it at once (the planner's disk probe): another
    process's probe file there must not make this one's answer "refused"."""
    if not supported(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    (tmp_path / "direct-probe").write_bytes(b"")  # the name every process once shared
    (tmp_path / f"direct-probe-{os.getpid() + 1}").write_bytes(b"")  # another rank's, now
    assert supported(tmp_path)
