"""An optimizer step over state in files, one window at a time.

`Streamer.step` (made an optimizer's own step by streamed.py's `stream_optimizer`)
walks its parameters in windows of about `window_bytes` of state: while the optimizer's
own step (torch's; hooks run once around the whole step; Adam fused where the
user left the choice to torch) updates window i, a read thread has window
i+1's pages read in and a write thread window i-1's written back and dropped.
Where the files take O_DIRECT, a window's optimizer state and stage 3's shards
are not faulted in but read into a buffer, stepped there and written back
(direct.py); the step returns once those writes are done. Gradients are not
written back: zero_grad drops them unwritten. State tensors the optimizer
creates on its first step are moved into files as each window finishes, so
the whole state never exists in memory; a state loaded from a checkpoint is
moved the same way.

Cutting the step by parameters changes nothing for an elementwise optimizer
(every one ZeRO accepts): each parameter's update reads only its own
gradient and state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from phalanx.errors import OffloadError
from phalanx.offload.direct import DirectMover, entries_of
from phalanx.offload.files import OffloadFiles
from phalanx.offload.fileset import FileSet
from phalanx.offload.fused import fuse_where_default, like, local
from phalanx.offload.held import SaveHold
from phalanx.offload.window import IOStats, Window
from phalanx.parallel.traffic import TimedWait
from phalanx.runtime.agree import raise_on_every_rank

if TYPE_CHECKING:
    from phalanx.diagnostics.timeline import Timeline

__all__ = ["IOStats", "Streamer"]

_WRITES_IN_FLIGHT = 4
"""Windows being written back through mappings at once: the rest wait (a bounded window)."""


def _with_grads(optimizer: Optimizer) -> set[int] | None:
    """The ids of the parameters a step updates, those with a gradient; None: every one that
    trains (a frozen parameter handed to the optimizer does not make each step a partial one,
    which would not read the next step's first window ahead)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = {id(p) for p in params if p.grad is not None}
    trained = {id(p) for p in params if p.requires_grad}
    return None if ids == trained else ids


class Streamer:
    """The windowed step of one optimizer whose state lives in `files`."""

    def __init__(
        self,
        optimizer: Optimizer,
        files: OffloadFiles,
        window_bytes: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.files = files
        """Its own scratch directory: the state it makes goes there."""
        self.all_files = FileSet(files)
        """Its own and those holding its parameters' shards (`streams_from`): a window's
        tensors are read, written back and held for a save through whichever holds them."""
        self.in_files: set[int] | None = None  # fractional offload: only these ids' state
        self.window_bytes = max(1, window_bytes)
        self.group = group
        """Ranks that step together: an offload failure on one is raised on all of them."""
        self.stats = IOStats()
        self.timeline: Timeline | None = None
        # A thread each way: the next window's reads must not queue behind the last one's
        # writes, which are the slower (docs/zero.md, "Offload").
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="phalanx-offload-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="phalanx-offload-write")
        self._writes: list[Future[None]] = []
        self.direct = DirectMover(files.open_file, self._timed_direct, self._wait)
        """The state moved by O_DIRECT where the files take it (direct.py)."""
        self._first_ahead: list[Future[None]] = []
        """The next step's first window, read while forward and backward run."""
        self.hold: SaveHold | None = None
        """The background save in flight's file-backed tensors: copied aside before a
        window's step overwrites those it has not yet written (held.py)."""
        base = type(optimizer).step
        self._raw_step: Callable[[Optimizer], Any] = getattr(base, "__wrapped__", base)

    # ------------------------------------------------------------------- plan
    def windows(
        self, optimizer: Optimizer, only: set[int] | None = None
    ) -> list[list[list[torch.Tensor]]]:
        """The parameters (`only`: those with these ids) cut into windows: for each window,
        each group's members in it."""
        windows: list[list[list[torch.Tensor]]] = []
        current = [[] for _ in optimizer.param_groups]  # type: list[list[torch.Tensor]]
        size = 0
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if only is not None and id(p) not in only:
                    continue
                cost = self._cost(optimizer, p)
                if size and size + cost > self.window_bytes:
                    windows.append(current)
                    current, size = [[] for _ in optimizer.param_groups], 0
                current[g].append(p)
                size += cost
        if size:
            windows.append(current)
        return windows

    def _cost(self, optimizer: Optimizer, p: torch.Tensor) -> int:
        state = optimizer.state.get(p)
        nbytes = local(p).numel() * p.element_size()
        if not state:  # not created yet: Adam's two moments, as a guess
            return 4 * nbytes
        return 2 * nbytes + sum(local(v).nbytes for v in state.values() if torch.is_tensor(v))

    def _plan(self, optimizer: Optimizer, params: list[list[torch.Tensor]]) -> Window:
        """Every file-backed tensor a window's step reads or writes: those it writes through
        mappings, those it only reads (the gradients), and the state and shards it moves by
        O_DIRECT instead (direct.py), where their files take it."""
        flat = [p for members in params for p in members]
        direct = entries_of(optimizer, flat, self.all_files.direct_path)
        by_direct = {local(e.value).data_ptr() for e in direct}
        written, read = [], []
        for p in flat:
            written.append(local(p))
            if p.grad is not None:
                read.append(local(p.grad))
            state = optimizer.state.get(p, {}).values()
            written += [local(v) for v in state if torch.is_tensor(v)]
        return Window(
            params,
            [t for t in written if self.all_files.holds(t) and t.data_ptr() not in by_direct],
            [t for t in read if self.all_files.holds(t)],
            direct,
        )

    # ------------------------------------------------------------------- step
    def step(self, optimizer: Optimizer) -> None:
        """The optimizer's step, window by window, over the parameters with a gradient (no
        torch optimizer steps another, and ZeRO-1/2 step one gather's pieces at a time, the
        rest without: every window read and written each time made a 67M MLP's step move
        nine times its state); an offload failure on any rank of `group` raises on every
        one of them after its own step."""
        start = time.perf_counter()
        failure: str | None = None
        stepped = _with_grads(optimizer)
        try:
            self._step_windows(optimizer, stepped)
            if stepped is None:  # a whole step: the next one begins with the first window
                self._read_first_window_ahead(optimizer)
        except OffloadError as e:
            failure = str(e)
        finally:
            self.stats.step_s += time.perf_counter() - start
        self._agree(failure)

    def _read_first_window_ahead(self, optimizer: Optimizer) -> None:
        """Start reading the next step's first window now: otherwise every step begins by
        waiting for it, the one read nothing else overlaps (its gradients, made by the
        next backward, are read with it then; they are fresh in memory anyway). Its state
        moved by O_DIRECT is read when the step begins: a buffer read now would miss what
        changes the state before then (a checkpoint loaded in place)."""
        windows = self.windows(optimizer)
        if windows:
            self._first_ahead = self._read(self._plan(optimizer, windows[0]), direct=False).reads

    def _step_windows(
        self,
        optimizer: Optimizer,
        only: set[int] | None = None,
        free_grads: list[torch.Tensor] | None = None,
    ) -> None:
        """Step window by window (`only`: these parameters' ids; `free_grads`: drop these
        parameters' gradients once their window is stepped)."""
        groups = optimizer.param_groups
        originals = [g["params"] for g in groups]
        windows = self.windows(optimizer, only)
        drop = {id(p) for p in free_grads or ()}
        fused = fuse_where_default(optimizer)
        early, self._first_ahead = self._first_ahead, []  # read during forward and backward
        failed = True
        try:
            if windows:
                ahead = self._read(self._plan(optimizer, windows[0]), mapped=not early)
                ahead.reads += early
            for i, params in enumerate(windows):
                window = ahead
                for read in window.reads:
                    self._wait(read)
                if i + 1 < len(windows):
                    ahead = self._read(self._plan(optimizer, windows[i + 1]))
                for group, members in zip(groups, params):
                    group["params"] = members
                self._keep_for_save(window.held())
                with window.stepping():
                    self._raw_step(optimizer)
                stepped = [p for members in params for p in members]
                moved = self.adopt(optimizer, stepped)
                for p in stepped:
                    if id(p) in drop:
                        p.grad = None
                self._write(window.written + moved, window.read)
                if window.buffer is not None:
                    self.direct.write(window.buffer)
            failed = False
        finally:
            for group, members in zip(groups, originals):
                group["params"] = members
            for group in fused:
                group["fused"] = None
            self.direct.finish(failed)  # the mappings show this step's state from here on

    def adopt(self, optimizer: Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Move the state of `params` that is still in memory into files; the moved."""
        moved = []
        for p in params:
            state = optimizer.state.get(p)
            if not state or (self.in_files is not None and id(p) not in self.in_files):
                continue
            for key, value in state.items():  # step counts and other scalars stay in memory
                inner = local(value) if torch.is_tensor(value) else None
                if inner is None or inner.numel() <= 1 or self.files.holds(inner):
                    continue
                state[key] = self._in_file(value)
                moved.append(local(state[key]))
        return moved

    def init_state(self, optimizer: Optimizer) -> None:
        """Create every parameter's state, in files, before a checkpoint is loaded into it.

        torch's state-dict tools do this with one step at lr 0 over zero gradients
        for every parameter at once, which would hold every gradient and the whole
        state in memory; here it is the same step, a window at a time. Every rank
        of `group` calls it (it precedes the checkpoint's collective reads), so a
        full disk on one rank raises on all of them here, not as a hang in the read.
        """
        failure: str | None = None
        try:
            self._init_state(optimizer)
        except OffloadError as e:
            failure = str(e)
        self._agree(failure)

    @torch.no_grad()
    def _init_state(self, optimizer: Optimizer) -> None:
        missing = [
            p for g in optimizer.param_groups for p in g["params"] if not optimizer.state.get(p)
        ]
        if not missing:
            return
        lrs = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = 0.0 if not torch.is_tensor(g["lr"]) else torch.zeros_like(g["lr"])
        made: list[torch.Tensor] = []
        try:
            for p in missing:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                    made.append(p)
            self._step_windows(optimizer, only=set(map(id, missing)), free_grads=made)
        finally:
            for g, lr in zip(optimizer.param_groups, lrs):
                g["lr"] = lr
            for p in made:
                p.grad = None
        self.drain()

    def adopt_all(self, optimizer: Optimizer) -> None:
        """Every parameter's state into files, one window at a time (after a load)."""
        for window in self.windows(optimizer):
            moved = self.adopt(optimizer, [p for members in window for p in members])
            self._write(moved)
        self.drain()

    def _in_file(self, value: torch.Tensor) -> torch.Tensor:
        return like(value, self.files.copy(local(value).contiguous()))

    # --------------------------------------------------------------------- io
    def _read(self, window: Window, mapped: bool = True, direct: bool = True) -> Window:
        """Start reading a window on the read thread: its mapped part faulted in (what the
        step writes mapped writable), its O_DIRECT part into a slab."""
        written, read = window.written, window.read

        def populate(_: list[torch.Tensor]) -> None:
            self.all_files.populate(read)
            self.all_files.populate(written, writable=True)
            self._keep_for_save(window.held())  # here, off the training thread, where it can

        if mapped and (written or read):
            nbytes = sum(t.nbytes for t in written + read)
            self.stats.read_bytes += nbytes
            work = self._reader.submit(self._timed, "read", populate, written + read, nbytes)
            window.reads.append(work)
        if direct and window.direct:
            buffer = window.buffer = self.direct.window(window.direct)
            self.stats.read_bytes += buffer.nbytes
            work = self._reader.submit(
                self._timed_direct, "read", lambda: self.direct.read(buffer), buffer.nbytes
            )
            window.reads.append(work)
        return window

    def streams_from(self, files: OffloadFiles) -> None:
        """Its parameters' shards and gradients (some of them) live in `files`, another
        scratch directory than its own (a model sharded with a policy of its own): stream
        them and hold them for saves as its own (fileset.py)."""
        self.all_files.add(files)

    def hold_for_save(self) -> SaveHold:
        """A hold on this optimizer's file-backed tensors for one background save: kept still
        for its writer until it is closed (held.py)."""
        self.hold = SaveHold(self.all_files.holds, self.all_files.release)
        return self.hold

    def _keep_for_save(self, written: list[torch.Tensor]) -> None:
        """`written` is about to be stepped: the save in flight copies aside what it needs."""
        if self.hold is not None:
            self.hold.before_overwrite(written)

    def _write(self, tensors: list[torch.Tensor], grads: list[torch.Tensor] | None = None) -> None:
        """Write a window back and drop it, on the write thread. Its gradients are only
        unmapped where they can be discarded: zero_grad drops them unwritten."""
        dropped = self.all_files.discardable(grads or [])
        unwritten = {id(g) for g in dropped}
        written = tensors + [g for g in grads or [] if id(g) not in unwritten]
        nbytes = sum(t.nbytes for t in written)
        self.stats.written_bytes += nbytes

        def release(_: list[torch.Tensor]) -> None:
            self.all_files.release(written)
            self.all_files.forget(dropped)

        self._writes.append(self._writer.submit(self._timed, "write", release, written, nbytes))
        while len(self._writes) > _WRITES_IN_FLIGHT:
            self._wait(self._writes.pop(0))

    def discard_grads(self, optimizer: Optimizer) -> None:
        """The file-backed gradients are about to be cleared: drop their pages unwritten."""
        grads = [
            local(p.grad)
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        self.all_files.discard([g for g in grads if self.all_files.holds(g)])

    def _timed(
        self,
        what: str,
        work: Callable[[list[torch.Tensor]], None],
        tensors: list[torch.Tensor],
        nbytes: int,
    ) -> None:
        with TimedWait() as io:  # on the reader's or the writer's thread
            work(tensors)
        self.stats.io_s += io.seconds
        if what == "read":
            self.stats.read_s += io.seconds
        if self.timeline is not None:
            self.timeline.add(f"offload {what}", "io", io.start_ns, io.end_ns, bytes=nbytes)

    def _timed_direct(self, what: str, work: Callable[[], None], nbytes: int) -> None:
        self.stats.direct_bytes += nbytes
        if what == "write":
            self.stats.written_bytes += nbytes
        self._timed(what, lambda _: work(), [], nbytes)

    def _wait(self, future: Future[None]) -> None:
        with TimedWait() as waited:
            future.result()
        self.stats.wait_s += waited.seconds
        if self.timeline is not None and waited.end_ns - waited.start_ns > 10_000:
            self.timeline.add("wait for offload", "compute", waited.start_ns, waited.end_ns)

    def drain(self) -> None:
        """Wait for every write in flight (before a checkpoint's files are read, or exit)."""
        while self._writes:
            self._wait(self._writes.pop(0))

    def _agree(self, failure: str | None) -> None:
        """Collective over `group`: a failure on any rank raised on every one (agree.py)."""
        raise_on_every_rank(None if failure is None else OffloadError(failure), self.group)

    def close(self) -> None:
        self.drain()
        self.direct.close()
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
