"""LoRA on Hugging Face models through peft [Note: LoRA in flowkit/dsl/lora.py]: pipeline
training of a tiny Llama and a tied Qwen2 with peft's adapters equals a plain peft loop
(`get_peft_model`, one process) to 1e-10 in float64; the saved adapter folder loads with
`PeftModel.from_pretrained` onto the base model and generates what the plain loop's model does;
a merged save loads with `from_pretrained` alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.harness import requires

requires("transformers", "hf")
requires("peft", "hf")  # imported by the tests that use it

from dataflows.pretrain import pretrain_flow  # noqa: E402
from executors.torch.models.hf import HFCausalLM  # noqa: E402
from flowkit.dsl import Model  # noqa: E402
from tests.harness import per_stage, plain_training, trained_on_executors  # noqa: E402

CORPUS = str(Path(__file__).parents[2] / "examples" / "data" / "corpus.txt")
DEVICES, MICROBATCHES, SEQUENCES, SEQ_LEN, STEPS, SEED = 2, 4, 8, 8, 2, 3
HPARAMS = {"lr": 1e-2, "clip_grad_norm": 0.5}
ROPE = dict(hidden_size=16, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=32, vocab_size=256, max_position_embeddings=32)
LLAMA = {"architecture": "llama", "hf_config": ROPE}
QWEN2_TIED = {"architecture": "qwen2", "hf_config": {**ROPE, "tie_word_embeddings": True}}
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def torch_cluster(pool):
    with pool.shared(DEVICES, kind="torch", tags=("train",)) as (ctl, _):
        yield ctl


def _train_on_executors(ctl, config: dict, schedule: str, name: str, saved: Path,
                        save: str = "adapter", dtype: str = "float64") -> tuple[list, dict]:
    model = Model(name=name, build="hf", config={**config, "dtype": dtype, "seed": SEED},
                  stages=DEVICES, tags=("train",), lora={**LORA, "save": save})
    flow = pretrain_flow(model=model, corpus=CORPUS, microbatches=MICROBATCHES,
                         schedule=schedule, batch_size=SEQUENCES, seq_len=SEQ_LEN, **HPARAMS)
    losses, runner = trained_on_executors(ctl, flow, name, STEPS)
    exported = {}
    for stage_weights in per_stage(ctl, runner, name, "export_weights").values():
        exported.update(stage_weights)
    assert runner.save_weights(saved) == [saved / name]
    return losses, exported


def _base(config: dict, dtype=torch.float64) -> torch.nn.Module:
    """The HF model as every holder builds it (executors/torch/models/built.py), before adapters."""
    torch.manual_seed(SEED)
    return HFCausalLM(**config).to(dtype)._lm[0]


def _train_plain_peft(config: dict, dtype=torch.float64):
    """The reference: peft's own model over the HF model in one process, seeded as the
    holders seed their adapters, the same batches, accumulation, clipping and AdamW."""
    lm = _base(config, dtype)
    torch.manual_seed(SEED)
    import peft

    wrapped = peft.get_peft_model(lm, peft.LoraConfig(
        r=LORA["r"], lora_alpha=LORA["alpha"], target_modules=LORA["target_modules"]))

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        logits = wrapped(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

    trained = [p for p in wrapped.parameters() if p.requires_grad]
    losses = plain_training(trained, loss_of, corpus=CORPUS, steps=STEPS, sequences=SEQUENCES,
                            seq_len=SEQ_LEN, microbatches=MICROBATCHES, **HPARAMS)
    return wrapped, losses


@pytest.mark.parametrize(("config", "schedule"), [(LLAMA, "zb-h1"), (QWEN2_TIED, "1f1b")],
                         ids=["llama-zb-h1", "qwen2-tied-1f1b"])
def test_pipeline_lora_equals_a_plain_peft_loop_and_saves_a_peft_adapter(
        torch_cluster, tmp_path, config, schedule):
    name = f"{config['architecture']}-{schedule}"
    losses, exported = _train_on_executors(torch_cluster, config, schedule, name, tmp_path)
    wrapped, plain_losses = _train_plain_peft(config)
    assert losses == pytest.approx(plain_losses, abs=1e-10)
    want = {n.removeprefix("base_model.model."): p.detach()
            for n, p in wrapped.named_parameters() if p.requires_grad}
    assert set(exported) == set(want)  # the adapters, and only they, leave the stages
    for n, value in exported.items():
        diff = (value - want[n]).abs().max().item()
        assert diff < 1e-10, f"{name}: {n} differs by {diff:.3g}"

    folder = tmp_path / name
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in folder.iterdir()}
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(_base(config), folder)
    idx = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (loaded(input_ids=idx).logits - wrapped(input_ids=idx).logits).abs().max().item()
        assert diff < 1e-10
        generated = loaded.generate(input_ids=idx, max_new_tokens=4, do_sample=False)
        assert torch.equal(generated, wrapped.generate(input_ids=idx, max_new_tokens=4,
                                                       do_sample=False))


def test_a_merged_save_loads_with_from_pretrained_alone(torch_cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    _train_on_executors(torch_cluster, LLAMA, "1f1b", "merged", tmp_path, save="merged")
    merged = AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", local_files_only=True, dtype=torch.float64)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    wrapped, _ = _train_plain_peft(LLAMA)
    idx = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (merged(input_ids=idx).logits - wrapped(input_ids=idx).logits).abs().max().item()
    assert diff < 1e-9


def test_a_bfloat16_models_peft_adapters_train_in_float32_as_get_peft_models_do(torch_cluster,
                                                                              tmp_path):
    """get_peft_model keeps a bfloat16 model's adapters in float32 (autocast_adapter_dtype);
    the executors' injected adapters are float32 too, train as the plain peft loop's and save
    as a folder that loads onto the bfloat16 base. Not to 1e-10: the stages' bfloat16 forward
    rounds in another order than the whole model's, which can turn a near-zero gradient's sign
    and so an AdamW step (at most about lr) the other way."""
    losses, exported = _train_on_executors(torch_cluster, LLAMA, "1f1b", "llama-bf16", tmp_path,
                                           dtype="bfloat16")
    wrapped, plain_losses = _train_plain_peft(LLAMA, torch.bfloat16)
    assert losses == pytest.approx(plain_losses, rel=1e-3)
    want = {n.removeprefix("base_model.model."): p.detach()
            for n, p in wrapped.named_parameters() if p.requires_grad}
    assert set(exported) == set(want)
    for n, value in exported.items():
        assert value.dtype == want[n].dtype == torch.float32, n
        diff = (value - want[n]).abs().max().item()
        assert diff <= 2 * HPARAMS["lr"] * STEPS, f"{n} differs by {diff:.3g}"
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(_base(LLAMA, torch.bfloat16), tmp_path / "llama-bf16")
    assert {p.dtype for n, p in loaded.named_parameters() if "lora_" in n} == {torch.float32}
