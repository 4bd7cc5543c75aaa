"""A DistributedSampler that gives torch's index sequences and can resume mid-epoch.

Each rank reads a disjoint shard of the dataset per epoch. The shards must be
index-for-index those of `torch.utils.data.DistributedSampler`, so a script
moving from torch to phalanx sees the very same samples in the same order.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Sampler

from phalanx.data.consumed import ConsumedBatches, drawn_by_loader_with_workers
from phalanx.errors import ConfigurationError

# Keys a saved state must carry; all plain ints/bools so `torch.load(weights_only=True)` accepts it.
_STATE_KEYS = ("epoch", "position", "seed", "num_replicas", "dataset_len", "shuffle", "drop_last")


class DistributedSampler(Sampler[int]):
    """Hand each rank its own shard of the dataset, reshuffled every epoch.

    Arguments and index sequences are torch's: the order is a permutation drawn
    from a generator seeded with `seed + epoch`; with `drop_last` the tail that
    does not divide evenly is dropped, otherwise the order wraps around to pad
    it; rank r takes every `num_replicas`-th index starting at r. So shards are
    disjoint apart from padding, and together cover the dataset.

    `num_replicas`/`rank` default to the initialised `torch.distributed` group,
    else to the `WORLD_SIZE`/`RANK` environment a launcher sets, else 1/0.

    Every rank must pass the same dataset: the shard is worked out of
    `len(dataset)` alone, so ranks given different lengths would read some samples
    twice and others never, or run different numbers of steps. The sampler does
    not ask the other ranks (a collective here would hang where a sampler is made
    on one rank alone); call `phalanx.data.check_same_length(dataset)` on every
    rank first (the Trainer does).

    `pad=False` (keyword only, for evaluation) drops the padding instead: every
    sample is seen exactly once across ranks, ranks differ by at most one
    sample, and `len()` is this rank's true count.

    Resuming mid-epoch: `state_dict(consumed=None)` records the epoch and the
    position in this rank's shard, i.e. how many of this epoch's indices the
    training loop has used, counted from the start of the epoch (samples used
    before an earlier resume included). Without `consumed` it is counted where
    the loop receives its data: by `phalanx.data.DataLoader` (torch's
    DataLoader, counting the batches it hands to the loop), whatever
    `num_workers` and `prefetch_factor` are; or, when the sampler is iterated
    on demand (by hand, or by a DataLoader with `num_workers=0`), by the
    indices handed out. A torch DataLoader with worker processes draws indices
    ahead of the loop, so there `state_dict()` refuses to guess: use
    `phalanx.data.DataLoader`, or pass `consumed=` yourself. After
    `load_state_dict(state)` the next iteration yields the rest of that epoch;
    the iteration after it (or `set_epoch` to another epoch) starts from the
    beginning as usual. Every rank consumes the same count, so the state saved
    on rank 0 can be loaded on every rank; loading it with a different world
    size, dataset length, seed or shuffle/drop_last setting is refused because
    the saved position would point at different samples.
    """

    def __init__(
        self,
        dataset: Dataset[Any] | Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        pad: bool = True,
    ) -> None:
        super().__init__()
        self.dataset = dataset
        # Read once: like torch, the sampler assumes the dataset never changes size.
        self._dataset_len = _dataset_length(dataset)
        self.num_replicas = _default_world_size() if num_replicas is None else num_replicas
        self.rank = _default_rank() if rank is None else rank
        _check_rank(self.rank, self.num_replicas)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad = pad
        self.epoch = 0
        self.base = 0
        """Where in the epoch's order this sharding starts: 0, or after `reshard` the samples
        every rank had used by then."""
        self.total_size = self._epoch_total()
        self.num_samples = _count_from(self.rank, self.total_size, self.num_replicas)
        if drop_last and self.num_samples == 0:
            raise ConfigurationError(
                f"dataset has {self._dataset_len} samples for {self.num_replicas} ranks, and "
                f"drop_last=True leaves rank {self.rank} with nothing to train on — use a "
                "dataset with at least one sample per rank, fewer ranks, or drop_last=False"
            )
        # Where this epoch's iteration stands: indices handed out so far.
        self._position = 0
        # Where the current pass began (the resume position, or 0).
        self._pass_start = 0
        # The loop's own count of what it received in this pass (phalanx.data.DataLoader),
        # and the one attached for the next pass.
        self._consumer: ConsumedBatches | None = None
        self._next_consumer: ConsumedBatches | None = None
        # Whether a torch DataLoader with worker processes draws this pass (ahead of the loop).
        self._drawn_ahead = False
        # Where the next iteration starts; non-zero only right after load_state_dict.
        self._resume_at = 0
        # Epoch of the last iteration begun, to catch a forgotten set_epoch.
        self._last_iterated_epoch: int | None = None
        self._warned_same_epoch = False

    def _epoch_total(self) -> int:
        """Number of indices all ranks read per epoch, padding included."""
        n, world = self._dataset_len, self.num_replicas
        if self.drop_last:
            return n - n % world
        if self.pad:
            return -(-n // world) * world
        return n

    def __len__(self) -> int:
        """This rank's indices per epoch (the whole epoch, also after a resume)."""
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration uses.

        Moving to another epoch forgets a pending resume position; setting the
        epoch that was just loaded keeps it, so a loop that resumes and then
        calls `set_epoch(start_epoch)` continues where it stopped.
        """
        if epoch != self.epoch:
            self._resume_at = 0
            self._start_pass(0)
            self._shard_from(0)
        self.epoch = epoch

    def used_by_all(self, consumed: int) -> int:
        """How many of this epoch's indices all ranks together have used once each has used
        `consumed` of its shard: where this sharding starts plus every rank's share.

        The padding that evens out the last round (repeats of the order's first
        indices) counts as the epoch's end, never past it: a snapshot taken at the
        end of a padded epoch says "all of it", which `reshard` takes after the
        next epoch has begun too.
        """
        share = min(max(consumed, 0), self.num_samples)
        return min(self.base + share * self.num_replicas, self._dataset_len)

    def reshard(self, num_replicas: int, rank: int, used_by_all: int) -> None:
        """Deal the rest of this epoch, from the `used_by_all`-th index of its order on, over
        `num_replicas` ranks (live recovery: the world changed mid-epoch).

        Nothing of the epoch is skipped or dealt twice; the rest is padded (or,
        with drop_last, cut) to a multiple of the new world as torch pads an
        epoch, so every rank has the same count. The next iteration starts there;
        the next epoch is dealt as usual over the new world. `used_by_all` counts
        the epoch's order (`used_by_all()`), padding apart: at most its length.
        """
        _check_rank(rank, num_replicas)
        if not 0 <= used_by_all <= self._dataset_len:
            raise ConfigurationError(
                f"used_by_all={used_by_all} is outside this epoch's {self._dataset_len} "
                "indices — pass how many of the epoch's indices all ranks together have used "
                "(DistributedSampler.used_by_all)"
            )
        self.num_replicas, self.rank = num_replicas, rank
        self._shard_from(used_by_all)
        self._resume_at = 0
        self._start_pass(0)
        self._last_iterated_epoch = None  # the epoch goes on: no forgotten set_epoch

    def _shard_from(self, base: int) -> None:
        """This sharding: the epoch's order from `base` on, over the current world."""
        self.base = base
        if base == 0:
            self.total_size = self._epoch_total()
        else:
            rest, world = self._epoch_total_after(base), self.num_replicas
            self.total_size = base + (
                rest - rest % world if self.drop_last else -(-rest // world) * world
            )
        self.num_samples = _count_from(self.rank, self.total_size - self.base, self.num_replicas)

    def _epoch_total_after(self, base: int) -> int:
        """Indices of the epoch's order (unpadded) left after `base`."""
        return max(0, self._dataset_len - base)

    def __iter__(self) -> Iterator[int]:
        # A generator: nothing happens until the first index is drawn, so an iterator
        # made and dropped (torch's DataLoader makes two of a sampler it draws from
        # directly) neither warns nor moves the position.
        self._warn_if_epoch_repeats()
        start, self._resume_at = self._resume_at, 0
        consumer, self._next_consumer = self._next_consumer, None
        self._start_pass(start)
        self._consumer = consumer
        self._drawn_ahead = consumer is None and drawn_by_loader_with_workers()
        for index in self._shard(start):
            self._position += 1  # handed out: what state_dict() reports without a consumer
            yield index

    def _start_pass(self, start: int) -> None:
        self._position = self._pass_start = start
        self._consumer = None
        self._drawn_ahead = False

    def attach_consumer(self, consumer: ConsumedBatches) -> None:
        """Let `consumer` tell `state_dict()` what the loop receives in the next pass
        (phalanx.data.DataLoader calls this before it draws an index)."""
        self._next_consumer = consumer

    def _shard(self, start: int) -> list[int]:
        """This rank's indices of the current epoch, from position `start` on.

        Position i of the padded epoch order is order[i % n]: wrapping around
        the permutation is exactly how torch pads, and it lets us take this
        rank's strided slice without building the padded list.
        """
        n = self._dataset_len
        first = self.base + self.rank + start * self.num_replicas
        if first >= self.total_size:
            return []
        slots = torch.arange(first, self.total_size, self.num_replicas) % n
        if not self.shuffle:
            return slots.tolist()
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(n, generator=generator)
        return order[slots].tolist()

    def _warn_if_epoch_repeats(self) -> None:
        """Warn once when a shuffled epoch is replayed: the classic forgotten `set_epoch`."""
        repeats = self.shuffle and self._last_iterated_epoch == self.epoch
        if repeats and not self._warned_same_epoch:
            self._warned_same_epoch = True
            warnings.warn(
                f"DistributedSampler iterated again with epoch {self.epoch}, so this pass "
                "repeats the previous order — call sampler.set_epoch(epoch) at the start of "
                "each epoch",
                UserWarning,
                stacklevel=3,
            )
        self._last_iterated_epoch = self.epoch

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where training stands in the epoch; see the class docstring for `consumed`."""
        position = self._consumed_position() if consumed is None else consumed
        if not 0 <= position <= self.num_samples:
            raise ConfigurationError(
                f"consumed={position} is outside this epoch's shard of {self.num_samples} "
                "samples — pass the number of samples this rank used since the epoch began"
            )
        return {
            "epoch": self.epoch,
            "position": position,
            "base": self.base,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "dataset_len": self._dataset_len,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def _consumed_position(self) -> int:
        """How far the loop got, counted where it received the data (class docstring)."""
        if self._consumer is not None:
            return self._consumer.position(self._pass_start, self._position)
        if self._drawn_ahead:
            raise ConfigurationError(
                f"state_dict() cannot tell how many samples the loop used: a DataLoader with "
                f"worker processes has drawn {self._position - self._pass_start} indices ahead "
                "of it — build the loader with phalanx.data.DataLoader (same arguments), which "
                "counts what the loop received, or pass state_dict(consumed=samples_used)"
            )
        return self._position

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the exact next sample of the saved epoch on the next iteration."""
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ConfigurationError(
                f"sampler state lacks {missing} — pass a dict made by "
                "DistributedSampler.state_dict()"
            )
        self._check_same_setup(state)
        position = int(state["position"])
        epoch, base = self.epoch, self.base
        self.epoch = int(state["epoch"])
        self._shard_from(int(state.get("base", 0)))  # checkpoints before live recovery: 0
        if not 0 <= position <= self.num_samples:
            self.epoch = epoch
            self._shard_from(base)
            raise ConfigurationError(
                f"saved sampler position {position} is outside this rank's shard of "
                f"{self.num_samples} samples — the state belongs to another setup"
            )
        self._resume_at = position
        self._start_pass(position)
        self._last_iterated_epoch = None

    def _check_same_setup(self, state: dict[str, Any]) -> None:
        """Refuse a state whose position would name different samples here."""
        if state["num_replicas"] != self.num_replicas:
            raise ConfigurationError(
                f"sampler state was saved with {state['num_replicas']} ranks but this run has "
                f"{self.num_replicas} — resume with the same world size, or start the epoch afresh"
            )
        if state["dataset_len"] != self._dataset_len:
            raise ConfigurationError(
                f"sampler state was saved for a dataset of {state['dataset_len']} samples but "
                f"this one has {self._dataset_len} — resume with the same dataset"
            )
        for key in ("seed", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise ConfigurationError(
                    f"sampler state was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r} — construct it with the saved value to resume"
                )


def _dataset_length(dataset: object) -> int:
    """len(dataset), or an error that says why a sampler needs it."""
    if not isinstance(dataset, Sized):
        raise ConfigurationError(
            f"DistributedSampler needs a dataset with a length, and {type(dataset).__name__} "
            "has no __len__ — give it __len__ (or, to train on a stream, pass it to "
            "phalanx.Trainer as train_dataset, which splits it by rank: docs/data.md)"
        )
    return len(dataset)


def _count_from(rank: int, total: int, world: int) -> int:
    """How many of positions rank, rank + world, ... lie below `total`."""
    return max(0, -(-(total - rank) // world))


def _check_rank(rank: int, world: int) -> None:
    if world < 1:
        raise ConfigurationError(f"num_replicas={world} — it must be at least 1")
    if not 0 <= rank < world:
        raise ConfigurationError(
            f"rank={rank} is outside [0, {world - 1}] for num_replicas={world} — "
            "pass a rank below num_replicas"
        )


def _default_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _int_from_env("WORLD_SIZE", 1)


def _default_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _int_from_env("RANK", 0)


def _int_from_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(
            f"{name}={raw!r} is not an integer — fix or unset the {name} environment variable"
        ) from None
