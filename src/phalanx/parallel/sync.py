"""Wrap-time agreement between ranks: same parameters and buffers everywhere, then rank 0's values.

Ranks that disagree on the parameter list would pair up the wrong tensors in
every all-reduce, or deadlock on the first one; ranks that disagree on the
buffers would break (or wait out) the broadcast of rank 0's. Catching it at
wrap time turns that into one error that names the parameter or buffer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from phalanx.errors import ConfigurationError
from phalanx.parallel.traffic import Collective, Traffic
from phalanx.runtime.wire import all_gather_json

# Broadcast in chunks of this size: large enough for few calls, small enough
# not to double peak memory on a big model (torch DDP uses 250 MiB too).
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024

Signature = list[tuple[str, tuple[int, ...], str]]


def parameter_signature(named: Sequence[tuple[str, torch.Tensor]]) -> Signature:
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in named]


def _entry(sig: Signature | None, i: int) -> tuple[str, tuple[int, ...], str] | None:
    return sig[i] if sig is not None and i < len(sig) else None


def _describe(entry: tuple[str, tuple[int, ...], str] | None, kind: str) -> str:
    if entry is None:
        return f"no such {kind}"
    name, shape, dtype = entry
    return f"{name} {list(shape)} {dtype}"


def verify_same_state(
    params: Sequence[tuple[str, torch.Tensor]],
    buffers: Sequence[tuple[str, torch.Tensor]],
    group: dist.ProcessGroup,
    settings: Mapping[str, object] | None = None,
) -> None:
    """Raise the same error on every rank if any rank's settings, parameters or buffers differ
    from rank 0's (names, shapes, dtypes), with one collective for all three.

    `buffers` are those DDP broadcasts: a buffer of another shape would make
    the broadcast fail or silently leave replicas apart, and a buffer on one
    rank only would wait out the collective timeout. `settings` are what
    shapes the collectives to come (the wrapper, bucket sizes, the sharding):
    ranks that differ there would pair up different collectives and abort in
    the backend, or hang.
    """
    mine = (dict(settings or {}), parameter_signature(params), parameter_signature(buffers))
    everyone: list[Any] = all_gather_json(mine, group)
    raise_if_settings_differ([e[0] if e else {} for e in everyone], "wrap")
    _raise_first_difference("parameter", [e[1] if e else None for e in everyone])
    _raise_first_difference("buffer", [e[2] if e else None for e in everyone])


def raise_if_settings_differ(everyone: Sequence[Mapping[str, object]], where: str) -> None:
    """One line naming the first setting whose value differs across ranks, and each rank's."""
    keys = list(dict.fromkeys(k for settings in everyone for k in settings))
    for key in keys:
        values = [settings.get(key, "(unset)") for settings in everyone]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ConfigurationError(
                f"ranks are configured differently: {key} differs ({per_rank}) — give every "
                f"rank the same {key} (the {where} must shape the same collectives everywhere)"
            )


def _raise_first_difference(kind: str, everyone: list[Signature | None]) -> None:
    longest = max(len(sig or []) for sig in everyone)
    reference = everyone[0]
    first_diff = next(
        (i for i in range(longest) if any(_entry(s, i) != _entry(reference, i) for s in everyone)),
        None,
    )
    if first_diff is None:
        return
    i = first_diff
    ref = _entry(reference, i)
    differing = [r for r, sig in enumerate(everyone) if _entry(sig, i) != ref]
    counts = ", ".join(f"rank {r}: {len(sig or [])}" for r, sig in enumerate(everyone))
    raise ConfigurationError(
        f"{kind}s differ across ranks at position {i}: rank 0 has "
        f"'{_describe(ref, kind)}' but rank(s) {differing} have "
        f"'{_describe(_entry(everyone[differing[0]], i), kind)}' ({kind} counts: {counts}) "
        "— build the same model on every rank before wrapping it in DistributedDataParallel"
    )


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, src: int = 0
) -> Traffic:
    """Copy `src`'s values into `tensors` on every rank with few, large broadcasts.

    The tensors travel as raw bytes, so one broadcast carries every dtype of a
    device (a BatchNorm's float statistics and its int64 step count together;
    torch sends one per dtype). This runs before every forward when buffers are
    synced, and each broadcast is a round trip that all ranks wait for.
    `src` is a rank of `group`. Returns what was sent, for the counters.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = src, 0
    receive = group.rank() != src
    calls = nbytes = 0
    for members in by_device.values():
        # Widest elements first: each tensor's bytes then start at a multiple of its
        # element size in the flat buffer, where they can be viewed as its dtype again.
        members = sorted(members, key=lambda t: -t.element_size())
        chunk: list[torch.Tensor] = []
        size = 0
        for t in members:
            chunk.append(t)
            size += t.numel() * t.element_size()
            if size >= BROADCAST_CHUNK_BYTES:
                _broadcast_chunk(chunk, group, options, receive)
                chunk, nbytes, size, calls = [], nbytes + size, 0, calls + 1
        if chunk:
            _broadcast_chunk(chunk, group, options, receive)
            nbytes, calls = nbytes + size, calls + 1
    return Traffic.of(Collective.BROADCAST, group.size(), other_bytes=nbytes, collectives=calls)


def _broadcast_chunk(
    chunk: list[torch.Tensor], group: dist.ProcessGroup, options: Any, receive: bool
) -> None:
    with torch.no_grad():
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in chunk])
        group.broadcast([flat], options).wait()
        if not receive:
            return
        values = torch.split(flat, [t.numel() * t.element_size() for t in chunk])
        torch._foreach_copy_(chunk, [v.view(t.dtype).view(t.shape) for v, t in zip(values, chunk)])


def rank0_order(
    arrival: list[int], n: int, group: dist.ProcessGroup, device: torch.device
) -> list[int]:
    """Rank 0's `arrival` (distinct indices below `n`), on every rank: the bucket rebuild
    must lay out identical buckets everywhere."""
    order = torch.full((n,), -1, dtype=torch.int64)
    if arrival:
        order[: len(arrival)] = torch.tensor(arrival, dtype=torch.int64)
    order = order.to(device)
    dist.broadcast(order, src=dist.get_global_rank(group, 0), group=group)
    return [i for i in order.tolist() if i >= 0]
