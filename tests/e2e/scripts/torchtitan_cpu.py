"""torchtitan's own trainer, in one rank, on CPU: with torch's FSDP2, or with phalanx's.

Usage, from a directory that holds torchtitan's test assets (tests/assets/tokenizer,
tests/assets/c4_test; the test makes small ones), launched like torchtitan's run_train.sh:

    torchtitan_cpu.py {torch,phalanx} RESULT_JSON <torchtitan's flags>
    e.g. torchtitan_cpu.py phalanx out.json --module llama3 --config llama3_debugmodel ...

It runs `torchtitan.train.main`, torchtitan's entry point, with torchtitan's flags. Nothing in
torchtitan's files is changed. What is changed at import, and nothing else (docs/fsdp2.md,
"torchtitan on CPU", gives the reason for each):

- phalanx (`use_phalanx`): the FSDP2 names that torchtitan imports from `torch.distributed.fsdp`
  and `torch.distributed._composable.fsdp` (`fully_shard`, `FSDPModule`,
  `MixedPrecisionPolicy`, `CPUOffloadPolicy`) are phalanx's. torchtitan's `from torch.distributed...
  import` lines get them: only its torch.distributed imports change (DESIGN.md).
- torch (`gloo_reduce_scatter`), in torch's FSDP2 internals: gloo has no PREMUL_SUM.
- both, CPU and torch 2.13 (`on_cpu`): the device module, the attention kernel, the MoE
  Triton kernels that torchtitan imports, and `torch.distributed.set_timeout`.

Rank 0 writes RESULT_JSON after every logged step: the loss and gradient norm that torchtitan
logs (at full precision: its console line rounds them), the `fully_shard` calls it made
(the classes of the modules it passed), and the module that `fully_shard` came from.
"""

from __future__ import annotations

import json
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

FSDP2_NAMES = ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy")
TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def use_phalanx() -> None:
    """phalanx's FSDP2 names where torchtitan imports torch's. This must run before
    torchtitan is imported: its modules bind the names when they are imported. Both paths
    matter: torchtitan's isinstance checks import `FSDPModule` from `_composable.fsdp`
    (the gradient divide factor, the chunked loss's no-sync)."""
    import torch.distributed._composable.fsdp as composable
    import torch.distributed.fsdp as fsdp

    import phalanx

    for module in (fsdp, composable):
        for name in FSDP2_NAMES:
            setattr(module, name, getattr(phalanx, name))


def gloo_reduce_scatter() -> None:
    """torch's FSDP2 reduce-scatters with PREMUL_SUM(1/factor) once a divide factor is set
    (torchtitan sets 1.0), and gloo has no PREMUL_SUM. FSDP2's own force-sum path instead
    sums, then divides by the factor. At factor 1.0 that is the same arithmetic."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    choose = collectives._get_gradient_divide_factors

    def summed_then_divided(*args: Any) -> Any:
        group, all_reduce_group, dtype, device_type, factor, force_sum = args
        force_sum = force_sum or factor is not None
        return choose(group, all_reduce_group, dtype, device_type, factor, force_sum)

    collectives._get_gradient_divide_factors = summed_then_divided  # type: ignore[assignment]


def record_shards(record: dict[str, Any]) -> None:
    """Each `fully_shard` call's modules, by class, and where `fully_shard` came from. This
    is how the test sees that torchtitan's calls reached the intended implementation."""
    import torch.distributed.fsdp as fsdp

    shard = fsdp.fully_shard
    record["fully_shard"], record["shards"] = shard.__module__, []

    def recorded(module: Any, *args: Any, **kwargs: Any) -> Any:
        modules = module if isinstance(module, list) else [module]
        record["shards"].append([type(m).__name__ for m in modules])
        return shard(module, *args, **kwargs)

    fsdp.fully_shard = recorded


def no_triton_kernels() -> None:
    """torchtitan imports its MoE expert-parallel Triton kernels whenever its models are
    imported (models.common -> token_dispatcher -> minimal_async_ep). CPU torch has no
    triton, and a dense llama3 never calls those kernels. So that one module is replaced by
    one whose kernels raise if called. torch still sees no triton (no stub `triton`)."""

    def kernel(name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)

        def missing(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{name} is a Triton (CUDA) kernel: not on CPU")

        return missing

    stub = types.ModuleType(TRITON_KERNELS)
    stub.__getattr__ = kernel  # type: ignore[method-assign]
    sys.modules[TRITON_KERNELS] = stub


class CPUDevice:
    """torch.cpu, plus what torchtitan asks of a device module (its memory monitor,
    `current_device()` as an index for barrier's device_ids). torchtitan takes the device
    from torch's available accelerator or falls back to "cuda"."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def get_device_name(self, device: object = None) -> str:
        return "cpu"

    def get_device_properties(self, device: object = None) -> types.SimpleNamespace:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(total_memory=memory)

    def memory_stats(self, device: object = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: object = None) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def current_device(self) -> int:
        return 0


def dense_flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """FlexAttention has no backward on CPU in torch 2.13. This is the same attention (the
    BlockMask's mask_mod, torchtitan's block-causal document mask, made dense) through
    scaled_dot_product_attention. Taken by both runs, so their comparison is unaffected."""
    from torch.nn.attention.flex_attention import create_mask

    assert kwargs["score_mod"] is None and not kwargs["return_aux"].lse
    batch, queries, keys = q.shape[0], q.shape[-2], k.shape[-2]
    mask = create_mask(kwargs["block_mask"].mask_mod, batch, 1, queries, keys, device=q.device)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=kwargs["scale"], enable_gqa=kwargs["enable_gqa"]
    )
    return out, None


def on_cpu() -> None:
    """The device, the attention kernel and torch 2.13's name for a group's timeout.
    torchtitan 0.3.0 calls `torch.distributed.set_timeout`, which torch 2.13 does not have
    (its `_set_pg_timeout` is the same)."""
    import torch.distributed as dist
    import torchtitan.tools.utils as titan_utils
    from torch.distributed.distributed_c10d import _set_pg_timeout

    titan_utils.device_type, titan_utils.device_module = "cpu", CPUDevice()
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = staticmethod(dense_flex_attention)
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = _set_pg_timeout  # type: ignore[attr-defined]


def record_metrics(result: Path, record: dict[str, Any]) -> None:
    """What torchtitan logs each step (`MetricsProcessor.log`), kept unrounded in RESULT_JSON."""
    from torchtitan.components.metrics import MetricsProcessor

    log = MetricsProcessor.log
    record["losses"], record["norms"] = [], []

    def logged(self: Any, step: int, loss: float, max_loss: float, norm: float, **kw: Any) -> Any:
        record["losses"].append(float(loss))
        record["norms"].append(float(norm))
        if int(os.environ["RANK"]) == 0:
            partial = result.with_suffix(".partial")
            partial.write_text(json.dumps(record))
            partial.replace(result)
        return log(self, step, loss, max_loss, norm, **kw)

    MetricsProcessor.log = logged


def main() -> None:
    impl, result, titan_flags = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    assert impl in ("torch", "phalanx"), impl
    if impl == "phalanx":
        use_phalanx()  # first: before anything imports torchtitan
    else:
        gloo_reduce_scatter()
    record: dict[str, Any] = {}
    record_shards(record)
    no_triton_kernels()
    on_cpu()
    record_metrics(result, record)
    from torchtitan.train import main as train

    sys.argv = [sys.argv[0], *titan_flags]
    train()


if __name__ == "__main__":
    main()
