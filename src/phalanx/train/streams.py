"""Streaming training sets (an `IterableDataset`): sharded by rank, passes agreed, resumed.

A stream has no length, so no sampler can split it: each rank reads its own
part. A Hugging Face `datasets.IterableDataset` is split by the library's own
`split_dataset_by_node` (whole shards per rank when its shard count divides
by the world size, else every world-size-th example), gets `set_epoch` each
pass, and resumes exactly from its own `state_dict()`. Any other
`torch.utils.data.IterableDataset` is split by index (sample i to rank
i mod world size); it trains, but cannot say where it is, so only a
checkpoint at a pass boundary resumes (it reads one step ahead to know one).

The ranks' parts need not be equally long, so before each step the ranks
agree (one all-reduce of one number) whether every rank has the step's
micro-batches; when one has not, the pass ends on every rank there, and the
micro-batches the others had drawn for that step are not trained.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any, TypeGuard

from torch.utils.data import DataLoader, IterableDataset

from phalanx.errors import ConfigurationError
from phalanx.runtime import World
from phalanx.train.checkpoint.stateful import Placement
from phalanx.train.config.args import TrainingArguments
from phalanx.train.trainer_state import TrainState


def is_stream(dataset: object) -> TypeGuard[IterableDataset[Any]]:
    """Whether `dataset` is read by iterating (no length, no indices)."""
    return isinstance(dataset, IterableDataset)


def is_hf_stream(dataset: object) -> bool:
    """A `datasets.IterableDataset` (or a subclass), told apart without importing `datasets`."""
    return any(
        cls.__name__ == "IterableDataset" and cls.__module__.startswith("datasets.")
        for cls in type(dataset).__mro__
    )


class EveryNth(IterableDataset[Any]):
    """A plain stream's part for one rank: its samples rank, rank + world, ..."""

    def __init__(self, dataset: IterableDataset[Any], rank: int, world_size: int) -> None:
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        return islice(iter(self.dataset), self.rank, None, self.world_size)


def check_stream_arguments(dataset: object, args: TrainingArguments) -> None:
    """The arguments a stream cannot take, each refused in one line."""
    name = type(dataset).__name__
    if args.max_steps <= 0:
        raise ConfigurationError(
            f"the train_dataset ({name}) is a stream with no length, so num_train_epochs "
            "cannot say when training ends — set max_steps > 0"
        )
    split = getattr(dataset, "_distributed", None) if is_hf_stream(dataset) else None
    if split is not None:  # split twice, each rank would train on 1/world of its own part
        raise ConfigurationError(
            f"the train_dataset is already this rank's part (split_dataset_by_node: "
            f"{split}) — pass the whole datasets.IterableDataset; the Trainer splits it by rank"
        )
    if args.dataloader_num_workers > 0:
        raise ConfigurationError(
            f"dataloader_num_workers={args.dataloader_num_workers} with a streaming "
            f"train_dataset ({name}): workers read ahead of the loop, so the stream's "
            "position at a step could not be saved — set dataloader_num_workers=0"
        )


class Stream:
    """This rank's part of a streaming training set, its loader, and its passes."""

    def __init__(
        self,
        dataset: IterableDataset[Any],
        world: World,
        args: TrainingArguments,
        collate_fn: Callable[[list[Any]], Any] | None,
    ) -> None:
        check_stream_arguments(dataset, args)
        self.world = world
        self.hf = is_hf_stream(dataset)
        self.name = type(dataset).__name__
        self.part: Any = self._split(dataset)
        """This rank's part: what the loader reads, and whose state is saved."""
        self.pass_ends = False
        """A plain stream, between steps: whether the step just trained was its pass's last."""
        self.loader: DataLoader[Any] = DataLoader(
            self.part,
            batch_size=args.per_device_train_batch_size,
            num_workers=0,  # no read-ahead: the part's state is what the loop consumed
            collate_fn=collate_fn,
            drop_last=args.dataloader_drop_last,
        )

    def _split(self, dataset: IterableDataset[Any]) -> Any:
        rank, world_size = self.world.rank, self.world.world_size
        if self.hf:
            from datasets.distributed import split_dataset_by_node

            return split_dataset_by_node(dataset, rank=rank, world_size=world_size)
        return EveryNth(dataset, rank, world_size)

    def steps(self, epoch: int, accumulation: int) -> Iterator[tuple[list[Any], int]]:
        """This pass's steps from the part's position on, each `accumulation` micro-batches,
        until a rank has fewer: then the pass ends on every rank (agreed before each step)."""
        set_epoch = getattr(self.part, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        batches = iter(self.loader)
        self.pass_ends = False
        group = self._agreed_group(batches, accumulation)
        while group is not None:
            if self.hf:  # no read-ahead: the part's state stays that of the next sample
                yield group, accumulation
                group = self._agreed_group(batches, accumulation)
                continue
            # A plain stream reads one step ahead, so a checkpoint after a pass's last step
            # knows the pass is over and resumes with the next (it has no state to spoil).
            ahead = self._agreed_group(batches, accumulation)
            self.pass_ends = ahead is None
            yield group, accumulation
            group = ahead

    def _agreed_group(self, batches: Iterator[Any], accumulation: int) -> list[Any] | None:
        """The next step's micro-batches, or None on every rank when any rank has fewer."""
        group = list(islice(batches, accumulation))
        short = 0.0 if len(group) == accumulation else 1.0
        if self.world.all_reduce_sum([short])[0] > 0:
            return None
        return group


class StreamPosition:
    """Checkpoint entry "stream", per rank: the pass, the micro-batches of it trained, and
    the part's own state (a `datasets.IterableDataset`'s), or None (a plain stream's).

    Saved only between steps, where the loader (no workers) has read exactly
    what the loop consumed, so the part's state is that of the next sample.
    """

    checkpoint_placement: Placement = "per_rank"

    def __init__(self, stream: Stream, state: TrainState, batch_size: int) -> None:
        self.stream = stream
        self.state = state
        """The loop's TrainState (epoch, batches_done)."""
        self.batch_size = batch_size
        self.approximate: str | None = None
        """Never set: a stream resumes exactly or not at all (the resume warning reads it)."""

    def consumed(self) -> int:
        """Samples this rank has trained on in the current pass."""
        return int(self.state.batches_done) * self.batch_size

    def state_dict(self) -> dict[str, Any]:
        part = self.stream.part.state_dict() if self.stream.hf else None
        return {
            "epoch": self.state.epoch,
            "batches_done": self.state.batches_done,
            "world_size": self.stream.world.world_size,
            "part": part,
            "pass_ended": self.stream.pass_ends,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_world = int(state_dict["world_size"])
        if saved_world != self.stream.world.world_size:
            raise ConfigurationError(
                f"the checkpoint's stream was split over {saved_world} ranks and this run has "
                f"{self.stream.world.world_size}, so each rank's part would be another — resume "
                f"at world size {saved_world}"
            )
        batches_done = int(state_dict["batches_done"])
        part = state_dict["part"]
        if state_dict["pass_ended"]:  # a plain stream's last step of a pass: the next begins
            self.state.epoch = int(state_dict["epoch"]) + 1
            self.state.batches_done = 0
            return
        if batches_done and self.stream.hf and part is not None:
            self.stream.part.load_state_dict(part)
        elif batches_done:
            raise ConfigurationError(
                f"the train_dataset ({self.stream.name}) has no state_dict() — a run over it "
                f"cannot resume mid-pass exactly (this checkpoint is {batches_done} "
                "micro-batches into a pass); use a datasets.IterableDataset, a map-style "
                "dataset, or resume from a checkpoint at a pass boundary"
            )
        self.state.batches_done = batches_done
