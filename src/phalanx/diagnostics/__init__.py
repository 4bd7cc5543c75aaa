"""What a run can tell about itself: replica checks and timelines.

Below ddp, optim, zero3 and offload (they record into a timeline; `optimizer_spans`
times every optimizer step through torch's global hooks; `trace` merges the
recorders' rank files into one Chrome trace); the ranks' progress record, which
the torch-free launcher reads, is `phalanx.ground.progress_record`.
"""
