"""torchtitan itself, trained on CPU under phalanx, equals torch's FSDP2 (issue 35).

torchtitan's entry point (`torchtitan.train.main`) runs its stock llama3 debug model
(`--module llama3 --config llama3_debugmodel`) twice at world 2, with the same seed:
- under torchrun with torch's FSDP2, the reference;
- under `phalanx launch` with phalanx's FSDP2, put in place of torch's names where
  torchtitan imports them.

The recipe is torchtitan's own: bf16 parameters with fp32 reductions
(`MixedPrecisionPolicy`), each block sharded, and the final norm and the output head sharded
as one unit (`fully_shard([model.norm, model.lm_head])`). The loss is chunked, with the
head's gradient summed unsynced over 7 of its 8 chunks
(`set_requires_gradient_sync(False)`). Selective activation checkpointing, AdamW with
warmup, and clipping are on, and there are two accumulation micro-batches per step. The
losses (and gradient norms) logged at each step must agree within 1e-6.
tests/e2e/scripts/torchtitan_cpu.py says what is patched for CPU, and docs/fsdp2.md says why.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.launchkit import LAUNCH, SCRIPTS, TORCHRUN, clean_env, launch

pytest.importorskip("torchtitan", reason="torchtitan is the `titan` extra (Makefile: make venv)")

RUNNER = SCRIPTS / "torchtitan_cpu.py"
# torchtitan's flags. The config is the stock debug model. The data is CPU-sized: 2 sequences
# of 256 tokens per micro-batch and rank, 2 micro-batches per step (global batch 8 at world 2).
# torch 2.13's own FSDP2 refuses the default spmd_types backend at dp_shard 2 (its
# dp_mesh_dims wants DTensor parameters), so both runs take torchtitan's partial_dtensor path.
TITAN_FLAGS = (
    "--module llama3 --config llama3_debugmodel --debug.seed 0"
    " --parallelism.spmd_backend partial_dtensor"
    " --training.seq_len 256 --training.local_batch_size 2 --training.global_batch_size 8"
)
# torch's gloo sometimes aborts at interpreter exit after the work is done (pytorch#190489;
# tests/e2e/test_fsdp2_scripts.py). The torch reference's results stand when all are written.
_UPSTREAM_EXIT_ABORT = "terminate called without an active exception"


def _write_assets(root: Path) -> None:
    """torchtitan's debug config reads ./tests/assets/tokenizer and ./tests/assets/c4_test.
    Neither ships in the wheel, and there is no network. So: a byte-level tokenizer (256
    byte tokens, no merges, BOS/EOS) and 200 documents of seeded random words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer_dir = root / "tests" / "assets" / "tokenizer"
    tokenizer_dir.mkdir(parents=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(special))
    data_dir = root / "tests" / "assets" / "c4_test"
    data_dir.mkdir(parents=True)
    words = ["the", "model", "shard", "gradient", "rank", "loss", "step", "token", "norm", "a"]
    rng = random.Random(0)
    documents = (
        {"text": " ".join(rng.choice(words) for _ in range(rng.randint(50, 400)))}
        for _ in range(200)
    )
    # Not "*test*.json": datasets would call that split "test", and torchtitan reads "train".
    (data_dir / "c4.json").write_text("".join(json.dumps(d) + "\n" for d in documents))


def _train(impl: str, work: Path, steps: int) -> dict[str, Any]:
    """torchtitan for `steps` steps at world 2 with `impl`'s FSDP2. Returns rank 0's record."""
    result = work / f"{impl}.json"
    env = clean_env(
        OMP_NUM_THREADS="1",
        HF_HOME=str(work / "hf"),  # the datasets cache of the local json, not ~/.cache
        HF_DATASETS_OFFLINE="1",
        # torchtitan compiles its mask builder at import (torch.compile(create_block_mask)).
        # On CPU that is 15-35 s of C++ compilation per process. Eager builds the same mask.
        TORCHDYNAMO_DISABLE="1",
    )
    prefix, flags = (TORCHRUN, "--standalone ") if impl == "torch" else (LAUNCH, "")
    titan_flags = [*TITAN_FLAGS.split(), "--training.steps", steps]
    titan_flags += ["--dump_folder", work / f"{impl}-outputs"]
    done = launch(
        f"{flags}--nproc-per-node 2",
        *(RUNNER, impl, result, *titan_flags),
        prefix=prefix,
        env=env,
        cwd=work,
        timeout_s=240 + 15 * steps,
    )
    record: dict[str, Any] = json.loads(result.read_text()) if result.is_file() else {}
    finished = len(record.get("losses", ())) == steps
    aborted_at_exit = impl == "torch" and _UPSTREAM_EXIT_ABORT in done.stderr and finished
    assert done.returncode == 0 or aborted_at_exit, f"{impl}:\n{done.stdout}\n{done.stderr}"
    assert finished, record
    return record


def _phalanx_equals_torch(tmp_path: Path, steps: int) -> None:
    _write_assets(tmp_path)
    theirs, ours = _train("torch", tmp_path, steps), _train("phalanx", tmp_path, steps)
    assert theirs["fully_shard"].startswith("torch.distributed.fsdp")
    assert ours["fully_shard"] == "phalanx.zero3.wrap"
    # torchtitan's calls, the same on both sides: the embedding, the norm and head as one
    # unit, the 6 blocks, then the root.
    assert ours["shards"] == theirs["shards"]
    assert ours["shards"][:2] == [["Embedding"], ["RMSNorm", "Linear"]]
    assert len(ours["shards"]) == 9 and ours["shards"][-1] == ["Llama3Model"]
    for key in ("losses", "norms"):
        gaps = [abs(a - b) for a, b in zip(ours[key], theirs[key], strict=True)]
        assert max(gaps) <= 1e-6, (key, ours[key], theirs[key])
    assert ours["losses"][-1] < ours["losses"][0] - 1.0  # it trains


@pytest.mark.timeout(900)
def test_torchtitan_llama3_debug_model_equals_torch_fsdp2_for_5_steps(tmp_path: Path) -> None:
    _phalanx_equals_torch(tmp_path, 5)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_torchtitan_llama3_debug_model_equals_torch_fsdp2_for_20_steps(tmp_path: Path) -> None:
    _phalanx_equals_torch(tmp_path, 20)
