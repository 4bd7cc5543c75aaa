"""Checkpoints in Hugging Face's format: `phalanx consolidate --format hf`, save_safetensors,
save_model.

One 2-rank run (one run_workers call, scenarios in turn) trains a tiny GPT-2
and a tiny BERT (configs built here, nothing downloaded) and a plain tied
module at stages 0 and 3 (GPT-2 at ZeRO-2 too: a model.pt as at stage 0,
beside DCP optimizer pieces), and saves. The tests then run the command a
user runs and reload with the Auto class's `from_pretrained`: the logits must equal
(0.0 difference) those of the model built from the config with the weights of
`phalanx consolidate`'s plain file. A plain module gets safetensors alone.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import phalanx
from phalanx.cli.consolidate_cmd import consolidate_main
from phalanx.train import Trainer, TrainingArguments
from phalanx.train.checkpoint import hf_export
from phalanx.train.checkpoint.consolidate import consolidate, consolidate_hf, model_source
from tests.distributed.test_zero3 import TinyGPT
from tests.harness import run_scenarios, run_workers

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install 'phalanx[hf]'")
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parents[2]
ENV = {"TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
VOCAB = 64
AUTO = {"gpt2": "AutoModelForCausalLM", "bert": "AutoModelForMaskedLM"}
SMALL_SHARDS = "50KB"  # the tiny GPT-2's ~110 KB of weights in 3 files


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


class PlainTied(TinyGPT):
    """A plain nn.Module whose head is tied to its embedding; it returns its own loss."""

    def forward(self, tokens: Tensor, labels: Tensor) -> Tensor:  # type: ignore[override]
        logits = super().forward(tokens)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class Tokens(torch.utils.data.Dataset[dict[str, Tensor]]):
    def __init__(self, names: tuple[str, str], vocab: int) -> None:
        self.names = names
        self.ids = torch.randint(0, vocab, (16, 12), generator=torch.Generator().manual_seed(2))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {self.names[0]: self.ids[i], self.names[1]: self.ids[i]}


def _raw_tokenised(vocab: int) -> Any:
    """What a tokeniser's map() gives: a datasets.Dataset of lists and a text column, with no
    set_format (the Trainer's default batching makes the tensors); Tokens without datasets."""
    try:
        import datasets
    except ImportError:
        return Tokens(("input_ids", "labels"), vocab)
    ids = Tokens(("input_ids", "labels"), vocab).ids.tolist()
    rows = {"input_ids": ids, "labels": ids, "text": [f"sample {i}" for i in range(len(ids))]}
    return datasets.Dataset.from_dict(rows)


def _run(out: Path, model: nn.Module, stage: int, data: Any, **extra: Any) -> str:
    args = TrainingArguments(
        output_dir=str(out), max_steps=2, save_steps=2, zero_stage=stage,  # type: ignore[arg-type]
        per_device_train_batch_size=4, learning_rate=1e-2, report_to=[], disable_tqdm=True,
        ddp_backend="gloo", ddp_timeout=60, **extra,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(out / "final")
    if stage == 0 and isinstance(model, PlainTied):  # a refusal: on every rank, one line
        (out / "a-file").write_text("mine")
        try:
            trainer.save_model(out / "a-file")
        except phalanx.errors.CheckpointError as exc:
            refused = str(exc)
        trainer.close()
        return refused
    trainer.close()
    return "ok"


def _train(rank: int, world_size: int, root: str) -> dict[str, Any]:
    phalanx.init(backend="gloo")
    torch.set_num_threads(1)
    out = Path(root)
    hf_data, plain_data = _raw_tokenised(VOCAB), Tokens(("tokens", "labels"), 24)

    def run(name: str, build: Any, stage: int, data: Any, **extra: Any) -> Any:
        torch.manual_seed(0)
        return lambda: _run(out / name, build(), stage, data, **extra)

    return run_scenarios(
        {
            "gpt2-0": run("gpt2-0", _gpt2, 0, hf_data, save_safetensors=True),
            "gpt2-2": run("gpt2-2", _gpt2, 2, hf_data),
            "gpt2-3": run("gpt2-3", _gpt2, 3, hf_data),
            "bert-0": run("bert-0", _bert, 0, hf_data),
            "bert-3": run("bert-3", _bert, 3, hf_data, save_safetensors=True),
            "plain-0": run("plain-0", PlainTied, 0, plain_data),
            "plain-3": run("plain-3", PlainTied, 3, plain_data),
        },
        rank,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    outcomes = run_workers(_train, 2, str(root), timeout=240, env=ENV)
    for outcome in outcomes:
        refused = outcome.value.pop("plain-0")
        assert outcome.value == dict.fromkeys(outcome.value, "ok"), outcome.value
        assert "a-file is a file" in refused and "\n" not in refused, refused
    assert (root / "plain-0" / "a-file").read_text() == "mine"
    return root


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "phalanx", "consolidate", *args],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, **ENV, "OMP_NUM_THREADS": "1", **(env or {})},
    )  # fmt: skip


def _reference(checkpoint: Path, family: str) -> nn.Module:
    """The model built from its config, holding the weights of the plain consolidated file."""
    whole = consolidate(checkpoint, checkpoint.parent / "consolidated.pt")
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    model = getattr(transformers, AUTO[family]).from_config(config)
    model.load_state_dict(whole["model"])
    return model.eval()


def _logits(model: nn.Module) -> Tensor:
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(input_ids=ids).logits


def _reloaded(directory: Path, family: str) -> nn.Module:
    return getattr(transformers, AUTO[family]).from_pretrained(directory).eval()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("name", "as_a_process"),
    [("gpt2-3", True), ("bert-0", True), ("gpt2-0", False), ("gpt2-2", False), ("bert-3", False)],
)
def test_the_cli_export_reloads_with_from_pretrained_to_identical_logits(
    runs: Path, name: str, as_a_process: bool
) -> None:
    """Two cases run the command as a user does; the other two call its main function in
    this process (a process costs seconds of imports)."""
    checkpoint, out, family = runs / name / "checkpoint-2", runs / name / "hf", name[:4]
    sharded = name == "gpt2-3"
    argv = ["--format", "hf", str(checkpoint), str(out)]
    argv += ["--max-shard-size", SMALL_SHARDS] if sharded else []
    if as_a_process:
        done = _cli(*argv)
        assert done.returncode == 0, done.stderr
    else:
        assert consolidate_main(argv) == 0
    files = sorted(p.name for p in out.iterdir())
    weights = [f for f in files if f.endswith(".safetensors")]
    configs = {"config.json", "generation_config.json"} if family == "gpt2" else {"config.json"}
    assert configs <= set(files)
    if sharded:
        assert weights == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
        index = json.loads((out / hf_export.INDEX).read_text())
        assert sorted(set(index["weight_map"].values())) == weights
        assert "lm_head.weight" not in index["weight_map"]  # tied: from_pretrained ties it back
    else:
        assert weights == ["model.safetensors"] and hf_export.INDEX not in files
    reference = _logits(_reference(checkpoint, family))
    assert (_logits(_reloaded(out, family)) - reference).abs().max().item() == 0.0
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".hf.")]


@pytest.mark.timeout(300)
def test_save_safetensors_checkpoints_and_save_model_load_with_from_pretrained(
    runs: Path,
) -> None:
    """save_safetensors=True: from_pretrained(checkpoint-N) as with HF's Trainer; save_model:
    the model alone, at stages 0 and 3."""
    for name in ("gpt2-0", "bert-3"):
        checkpoint = runs / name / "checkpoint-2"
        reference = _logits(_reference(checkpoint, name[:4]))
        for directory in (checkpoint, runs / name / "final"):
            got = _logits(_reloaded(directory, name[:4]))
            assert (got - reference).abs().max().item() == 0.0, directory
    assert not (runs / "gpt2-3" / "checkpoint-2" / "model.safetensors").exists()  # default off
    assert (runs / "gpt2-3" / "checkpoint-2" / "config.json").exists()  # recorded always
    reference = _logits(_reference(runs / "gpt2-3" / "checkpoint-2", "gpt2"))
    got = _logits(_reloaded(runs / "gpt2-3" / "final", "gpt2"))
    assert (got - reference).abs().max().item() == 0.0
    final = sorted(p.name for p in (runs / "gpt2-3" / "final").iterdir())
    assert final == ["config.json", "generation_config.json", "model.safetensors"]


@pytest.mark.parametrize("name", ["plain-0", "plain-3"])
def test_a_plain_module_gets_safetensors_alone_with_every_key(runs: Path, name: str) -> None:
    from safetensors.torch import load_file

    checkpoint, out = runs / name / "checkpoint-2", runs / name / "hf"
    code = consolidate_main(["--format", "hf", str(checkpoint), str(out)])
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    loaded = load_file(str(out / "model.safetensors"))
    whole = consolidate(checkpoint, runs / name / "consolidated.pt")["model"]
    assert sorted(loaded) == sorted(whole)  # the tied head too: nothing ties it back
    assert all(torch.equal(loaded[k], whole[k]) for k in whole)
    model = PlainTied()
    model.load_state_dict(loaded)
    assert sorted(p.name for p in (runs / name / "final").iterdir()) == ["model.safetensors"]
    saved = load_file(str(runs / name / "final" / "model.safetensors"))
    assert all(torch.equal(saved[k], whole[k]) for k in whole)


class _Recording:
    """A Source that records what each read asked for."""

    def __init__(self, inner: hf_export.Source) -> None:
        self.inner = inner
        self.reads: list[tuple[list[str], int]] = []

    def specs(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return self.inner.specs()

    def read(self, keys: list[str]) -> dict[str, Tensor]:
        tensors = self.inner.read(keys)
        self.reads.append((keys, sum(t.numel() * t.element_size() for t in tensors.values())))
        return tensors


@pytest.mark.parametrize("name", ["gpt2-0", "gpt2-3"])
def test_the_export_reads_one_weight_file_at_a_time(runs: Path, name: str, tmp_path: Path) -> None:
    """model.pt (stage 0) and the DCP pieces (stage 3) are read a weight file's tensors at a
    time, each read no larger than the limit: the model is never whole in memory."""
    checkpoint = runs / name / "checkpoint-2"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    source = _Recording(model_source(checkpoint, manifest["entries"]["model"]))
    limit = 30_000
    written = hf_export.write_hf(source, tmp_path, limit, {"lm_head.weight": "x"})
    assert len(written.files) >= 3
    assert [keys for keys, _ in source.reads] == list(written.plan.values())
    biggest = max(math.prod(shape) * dtype.itemsize for shape, dtype in source.specs().values())
    assert all(size <= max(limit, biggest) for _, size in source.reads)


def test_refusals_are_one_line_and_leave_nothing(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = runs / "gpt2-0" / "checkpoint-2"
    shadow = tmp_path / "shadow"  # an environment without safetensors
    (shadow / "safetensors").mkdir(parents=True)
    (shadow / "safetensors" / "__init__.py").write_text("raise ImportError('not here')\n")
    target = str(tmp_path / "a")
    done = _cli("--format", "hf", str(checkpoint), target, env={"PYTHONPATH": str(shadow)})
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "pip install 'phalanx[hf]'" in done.stderr
    (tmp_path / "file").write_text("mine")
    cases = {
        "is a file": [str(checkpoint), str(tmp_path / "file")],
        "is not a size": [str(checkpoint), str(tmp_path / "b"), "--max-shard-size", "lots"],
        "is a run's output_dir": [str(runs / "gpt2-0"), str(tmp_path / "c")],
    }
    for words, argv in cases.items():
        assert consolidate_main(["--format", "hf", *argv]) == 1, words
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and words in lines[0], lines
    assert (tmp_path / "file").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "shadow"]


def test_into_an_existing_directory_other_files_stay_and_old_shards_go(
    runs: Path, tmp_path: Path
) -> None:
    checkpoint, out = runs / "gpt2-3" / "checkpoint-2", tmp_path / "model"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    assert len(consolidate_hf(checkpoint, out, SMALL_SHARDS).files) == 3
    consolidate_hf(checkpoint, out)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
    ]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize("build", [_gpt2, _bert])
def test_the_tied_copies_are_those_transformers_leaves_out(build: Any) -> None:
    from phalanx.train.checkpoint.hf_save import tied_copies

    model = build()
    ours = tied_copies(model)
    assert ours  # both tie their output layer to the input embedding
    theirs = getattr(transformers.modeling_utils, "remove_tied_weights_from_state_dict", None)
    if theirs is None:
        pytest.skip("this transformers has no remove_tied_weights_from_state_dict")
    kept = theirs(model.state_dict(), model)
    assert set(model.state_dict()) - set(kept) == set(ours)


def test_a_tied_note_changed_by_hand_is_refused_in_one_line(runs: Path, tmp_path: Path) -> None:
    import shutil

    from tests.checkpoints import rehash

    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(runs / "bert-0" / "checkpoint-2", checkpoint)
    (checkpoint / hf_export.TIED_NOTE).write_text("[1, 2]")
    rehash(checkpoint)  # as one who can write the folder can
    with pytest.raises(phalanx.errors.CheckpointError, match="not a mapping of tied names"):
        consolidate_hf(checkpoint, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def test_save_safetensors_without_the_libraries_is_refused_when_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "safetensors" else real(name)
    )
    with pytest.raises(phalanx.errors.ConfigurationError, match=r"pip install 'phalanx\[hf\]'"):
        TrainingArguments(save_safetensors=True)
    TrainingArguments(save_safetensors=False)
