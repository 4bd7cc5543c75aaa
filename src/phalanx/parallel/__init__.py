"""What DDP, ZeRO-1/2 and stage 3 share, below all three.

- `traffic`: the bytes and collectives a rank sent (`Traffic`, `Collective`), which
  every path counts and the Trainer logs;
- `sharding`: how a tensor is cut over ranks (`piece_of`, the flat wire layout
  of padded chunks, `ShardedFlat`);
- `collectives`: every all-gather and reduce-scatter of the sharded paths, typed
  handles, the 1/N scaling, the collective each backend supports;
- `sync`: the wrap-time agreement (same parameters and buffers on every rank,
  then rank 0's values, broadcast in chunks);
- `autograd`: run a callback when the outermost backward ends; ask whether a
  profiler records.

Nothing here knows a wrapper, an optimizer or the Trainer: `ddp`, `optim` and
`zero3` import it, it imports only `runtime` and `ground`.
"""
