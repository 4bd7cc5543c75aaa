"""Objects between ranks without pickle.

torch's `all_gather_object` and `broadcast_object_list` unpickle whatever a peer
sends, so anything that joins the group runs code in every rank (under live
recovery a group is formed again mid-run, from a store anyone on the network can
write). phalanx sends JSON instead: every rank learns the others' sizes, then
the UTF-8 bytes travel as one padded uint8 tensor. State that holds tensors (a
rank's RNG state for its checkpoint) travels through `torch.save` and comes back
through `torch.load(weights_only=True)`, the loader that admits tensors and
plain containers only, as every checkpoint read does. tests/unit/test_wire.py
holds src/phalanx to these, and to no object collective of torch's.
"""

from __future__ import annotations

import io
import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_bytes",
    "all_gather_json",
    "all_gather_state",
    "as_bytes",
    "broadcast_json",
    "broadcast_tensors",
    "group_device",
    "layout",
    "pack",
    "unpack",
]


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's tensors must live: NCCL's on this rank's GPU, others' on the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bytes(data: bytes, group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Every rank's `data`, in rank order, on every rank (sizes first, then one padded gather)."""
    device = group_device(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    mine = torch.zeros(max(longest, 1), dtype=torch.uint8, device=device)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [t[:n].cpu().numpy().tobytes() for t, n in zip(out, lengths, strict=True)]


def all_gather_json(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `obj` (JSON: tuples come back as lists), in rank order, on every rank."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    return [json.loads(b) for b in all_gather_bytes(data, group)]


def broadcast_json(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Group rank `src`'s `obj` (JSON) on every rank."""
    device = group_device(group)
    root = dist.get_global_rank(group, src) if group is not None else src
    data = json.dumps(obj, separators=(",", ":")).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=root, group=group)
    buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == root and data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=root, group=group)
    return json.loads(buffer.cpu().numpy().tobytes())


def all_gather_state(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `obj` of tensors and plain containers, read back with weights_only."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return [
        torch.load(io.BytesIO(b), weights_only=True)
        for b in all_gather_bytes(buffer.getvalue(), group)
    ]


def layout(tensors: dict[str, torch.Tensor]) -> tuple[Any, int]:
    """Where `pack` puts each named tensor: (the JSON header, the bytes in all)."""
    header, offset = [], 0
    for name, tensor in tensors.items():
        header.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset])
        offset += tensor.numel() * tensor.element_size()
    return header, offset


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bytes, flat, on the CPU (a view where it already is one)."""
    return tensor.detach().contiguous().reshape(-1).cpu().view(torch.uint8)


def pack(tensors: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
    """Named CPU tensors as (a JSON header, one flat byte tensor): what travels between
    members (no pickle), and comes back whole with `unpack`."""
    header, _ = layout(tensors)
    parts = [as_bytes(tensor) for tensor in tensors.values()]
    blob = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    return header, blob


def unpack(header: Any, blob: torch.Tensor) -> dict[str, torch.Tensor]:
    """`pack`'s tensors again (copies, so the blob can go)."""
    out: dict[str, torch.Tensor] = {}
    for name, dtype_name, shape, offset in header:
        dtype = getattr(torch, dtype_name)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raw = blob[offset : offset + nbytes].clone()
        out[name] = raw.view(dtype).reshape(shape)
    return out


def broadcast_tensors(
    tensors: dict[str, torch.Tensor] | None, src: int, group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """Group rank `src`'s named tensors on every rank (its header as JSON, its bytes as one
    tensor); the others pass None."""
    header, blob = pack(tensors) if tensors is not None else (None, None)
    header = broadcast_json(header, src, group)
    root = dist.get_global_rank(group, src) if group is not None else src
    size = torch.tensor([0 if blob is None else blob.numel()], dtype=torch.int64)
    dist.broadcast(size, src=root, group=group)
    data = blob if blob is not None else torch.empty(int(size.item()), dtype=torch.uint8)
    if data.numel():
        dist.broadcast(data, src=root, group=group)
    return unpack(header, data)


def all_to_all_tensors(
    outgoing: list[dict[str, torch.Tensor]], group: dist.ProcessGroup | None = None
) -> list[dict[str, torch.Tensor]]:
    """Each rank's named tensors for each other (`outgoing[r]`: what group rank r gets from
    this one), received here per source rank (collective: the headers in one all-gather,
    the bytes in one all-to-all, each pair sending only what is meant for it)."""
    packed = [pack(tensors) for tensors in outgoing]
    sizes = [int(blob.numel()) for _, blob in packed]
    every = all_gather_json([[header, size] for (header, _), size in zip(packed, sizes)], group)
    me = dist.get_rank(group)
    incoming = [int(sent[me][1]) for sent in every]
    send = torch.cat([blob for _, blob in packed]) if packed else torch.zeros(0, dtype=torch.uint8)
    del packed
    received = torch.empty(sum(incoming), dtype=torch.uint8)
    dist.all_to_all_single(received, send, incoming, sizes, group=group)
    del send
    out, start = [], 0
    for sent, size in zip(every, incoming, strict=True):
        out.append(unpack(sent[me][0], received[start : start + size]))
        start += size
    return out
