"""Models from a checkpoint built without a second copy [Note: models from a checkpoint in
executors/torch/models/built.py]: parameters made on the meta device, then once on their
device in their dtype, filled from the mapped file; the same weights as a build-then-load."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from executors.optable import OpContext
from executors.torch.models.built import held_model
from executors.torch.models.gpt import GPT
from tests.harness import tiny_gpt

BUILD = "executors.torch.models.gpt:GPT"
# about 23 M parameters: 93 MB in fp32, large beside the interpreter's own memory
BIG = {"vocab_size": 8192, "block_size": 128, "n_layer": 6, "n_head": 8, "n_embd": 512}

_MEASURE = """
import json, sys, threading, time
import torch
from executors.optable import OpContext
from executors.torch.models.built import held_model

def anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

config = json.loads(sys.argv[1])
peak, stop = [anon_kib()], threading.Event()
def sample():
    while not stop.is_set():
        peak.append(anon_kib()); time.sleep(0.001)
# the first op on a meta tensor imports torch's meta kernels (about 70 MB, once a process)
torch.nn.init.normal_(torch.empty(1, device="meta"))
base = anon_kib()
watcher = threading.Thread(target=sample); watcher.start()
held = held_model(OpContext(name="m", device="cpu", tags=()), config)
stop.set(); watcher.join()
size = sum(p.numel() * p.element_size() for part in held.parts for p in part.parameters())
print(json.dumps({"peak_growth": (max(peak) - base) * 1024, "model_bytes": size}))
"""


def _build_peak(config: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(config)], check=True,
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout)


def test_a_checkpointed_model_takes_about_its_size_to_build(tmp_path):
    path = tmp_path / "big.pt"
    torch.manual_seed(5)
    torch.save(GPT(**BIG).state_dict(), path)
    spec = {"model": "big", "build": BUILD, "stages": 1, "seed": 0}
    fresh = _build_peak({**spec, "model_config": BIG})  # random init: the model, no file
    loaded = _build_peak({**spec, "model_config": {**BIG, "checkpoint": str(path)}})
    size = loaded["model_bytes"]
    assert size > 90e6
    # a build then a load held both the random weights and the file's: about 2x
    assert loaded["peak_growth"] < 1.3 * size, loaded
    assert fresh["peak_growth"] < 1.3 * size, fresh


def test_the_weights_are_the_checkpoints_on_their_device_in_their_dtype(tmp_path):
    config = tiny_gpt()
    torch.manual_seed(7)
    source = GPT(**config)
    path = tmp_path / "tiny.pt"
    torch.save(source.state_dict(), path)
    ctx = OpContext(name="m", device="cpu", tags=())
    for dtype in ("float32", "bfloat16"):
        held = held_model(ctx, {"model": f"tiny_{dtype}", "build": BUILD, "stages": 2,
                                "seed": 0, "dtype": dtype,
                                "model_config": {**config, "checkpoint": str(path)}})
        got = {held.layout.names[s][n]: p for s, part in enumerate(held.parts)
               for n, p in part.named_parameters()}
        for name, want in source.state_dict().items():
            if name in got:
                assert got[name].dtype == getattr(torch, dtype)
                assert torch.equal(got[name], want.to(getattr(torch, dtype))), name
    whole = held_model(ctx, {"model": "tiny_tied", "build": BUILD, "stages": 1, "seed": 0,
                             "model_config": {**config, "checkpoint": str(path)}}).parts[0]
    named = dict(whole.named_parameters(remove_duplicate=False))
    embedding = next(p for n, p in named.items() if n.endswith("wte.weight"))
    assert named["lm_head.weight"] is embedding  # still tied



def test_an_hf_folder_is_loaded_in_the_dtype_and_on_the_device_of_its_build(tmp_path):
    """`from_pretrained` gets the build's dtype (and a GPU as its device_map), so a bf16 model
    never materializes its float32 copy; the weights are the file's, cast."""
    transformers = __import__("pytest").importorskip("transformers")
    from executors.torch.device import building_on
    from executors.torch.models.hf import HFCausalLM

    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(3)
    saved = transformers.Qwen2ForCausalLM(config)
    saved.save_pretrained(tmp_path / "qwen2")
    with building_on(torch.device("cpu"), torch.bfloat16):
        model = HFCausalLM(path=str(tmp_path / "qwen2"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    for (name, got), want in zip(model._lm[0].named_parameters(), saved.parameters()):
        assert torch.equal(got, want.to(torch.bfloat16)), name
    assert {p.dtype for p in HFCausalLM(path=str(tmp_path / "qwen2")).parameters()} == \
        {torch.float32}  # outside a build: as before, float32 on the host
