"""Split-backward benchmark: B + W of `StageRunner` against a fused backward of the same stage,
measured side by side in one run on the stages of a split built-in GPT.

Method: for every stage, each repeat runs four variants in turn on the same input, each after a
fresh forward that is not timed unless it is F itself: the runner's F; its B then W (timed
apart); its fused BW; the runner's F when the schedule fuses the backward (`F_unsplit`, no
deferred-W recorder: [Note: a fused backward] in executors/torch/train/stage.py) and the BW after it
(`BW_unsplit`); and plain autograd (`loss.backward()` or `out.backward(grad)`) through the same
stage module with a grad-requiring input, the baseline. Parameter gradients are reset to None
before every backward, so every variant writes them fresh. Figures are medians over repeats, in
milliseconds; `bw_over_fused` is (B + W) / plain backward, per stage and overall (sums of
medians over all stages of all configs); `unsplit_over_split` is (F_unsplit + BW_unsplit) /
(F + BW), what a 1F1B microbatch costs now against a recorded forward.

The minor page faults of each variant come along (`*_faults`, medians): B holds the stash
(every linear/layer-norm input and output gradient) until W, so its peak memory is above a
plain backward's, and where the C allocator has handed the previous round's memory back to the
OS (glibc trims the heap), B pays for touching fresh pages; that, not arithmetic, is most of
what separates B + W from the plain backward on CPU.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

# torch loads in the functions that run, so that importing a bench (`flowkit bench --help`)
# does not take seconds.
if TYPE_CHECKING:
    import torch

__all__ = ["SplitBenchConfig", "hf_config_like", "run_split_backward_bench"]


@attrs.frozen(kw_only=True)
class SplitBenchConfig:
    """One GPT (or a Hugging Face decoder of its size), cut into `stages`, timed on one
    microbatch of (batch, seq) tokens."""

    n_embd: int = 128
    n_layer: int = 4
    n_head: int = 4
    vocab_size: int = 256
    stages: int = 2
    batch: int = 8
    seq: int = 128
    dtype: str = "float32"  # a torch dtype name
    architecture: str = "gpt"  # or a Hugging Face one ("llama", "qwen2"): hf_config_like


DEFAULT_CONFIGS = (
    SplitBenchConfig(n_embd=128, stages=2),
    SplitBenchConfig(n_embd=128, stages=4),
    SplitBenchConfig(n_embd=256, stages=2),
    SplitBenchConfig(n_embd=256, stages=4),
)

_VARIANTS = ("F", "B", "W", "BW", "F_unsplit", "BW_unsplit", "plain")


def run_split_backward_bench(*, configs: Sequence[SplitBenchConfig] = DEFAULT_CONFIGS,
                             repeats: int = 20, warmup: int = 2, threads: int | None = 1,
                             seed: int = 0) -> dict:
    """Times every stage of every config; `threads` sets torch's intra-op threads for the run
    (None leaves them), since 1-thread and many-thread ratios differ."""
    import torch

    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        results = [_bench_config(c, repeats=repeats, warmup=warmup, seed=seed) for c in configs]
    finally:
        torch.set_num_threads(old_threads)
    stages = [s for r in results for s in r["stages"]]
    return {
        "configs": results,
        "repeats": repeats,
        "threads": torch.get_num_threads() if threads is None else threads,
        "torch": torch.__version__,
        "bw_over_fused": _ratio(stages, "B_plus_W", "plain"),
        "runner_bw_over_fused": _ratio(stages, "BW", "plain"),
        "unsplit_over_split": _ratio(stages, "unsplit_step", "split_step"),
    }


def hf_config_like(gpt: dict) -> dict:
    """A Hugging Face decoder config the size of a built-in GPT config: the same width, depth,
    heads (all of them key-value heads), a 4x MLP, vocabulary and context."""
    return {"hidden_size": gpt["n_embd"], "num_hidden_layers": gpt["n_layer"],
            "num_attention_heads": gpt["n_head"], "num_key_value_heads": gpt["n_head"],
            "intermediate_size": 4 * gpt["n_embd"], "vocab_size": gpt["vocab_size"],
            "max_position_embeddings": gpt["block_size"]}


def _ratio(stages: list[dict], num: str, den: str) -> float:
    """Sum of medians over stages, so that a long stage weighs as much as it takes."""
    return sum(s[f"{num}_ms"] for s in stages) / sum(s[f"{den}_ms"] for s in stages)


def _bench_config(config: SplitBenchConfig, *, repeats: int, warmup: int, seed: int) -> dict:
    import torch

    from executors.torch.models.gpt import GPT, GPTConfig, split_gpt

    torch.manual_seed(seed)
    dtype = getattr(torch, config.dtype)
    gpt = {"vocab_size": config.vocab_size, "block_size": config.seq, "n_layer": config.n_layer,
           "n_head": config.n_head, "n_embd": config.n_embd}
    if config.architecture == "gpt":
        whole = GPT(GPTConfig(**gpt))
        modules = [m.to(dtype) for m in split_gpt(whole, config.stages, seq_len=config.seq)]
    else:
        from executors.torch.models.hf import HFCausalLM

        whole = HFCausalLM(architecture=config.architecture, hf_config=hf_config_like(gpt))
        modules = [m.to(dtype) for m in whole.split(config.stages, seq_len=config.seq)]
    idx = torch.randint(0, config.vocab_size, (config.batch, config.seq + 1))
    x, targets = idx[:, :-1], idx[:, 1:]
    stages = []
    for s, module in enumerate(modules):
        stage_in = x if module.first else x.to(dtype)
        extra = (targets,) if module.last else ()
        times = _bench_stage(module, (stage_in, *extra), repeats=repeats, warmup=warmup)
        position = "only" if module.first and module.last else (
            "first" if module.first else "last" if module.last else "middle")
        blocks = len(module.h if config.architecture == "gpt" else module.blocks)
        stages.append({"stage": s, "position": position, "blocks": blocks, **times})
        with torch.no_grad():
            x = module(stage_in)  # the next stage's input
    return {"config": attrs.asdict(config), "stages": stages,
            "bw_over_fused": _ratio(stages, "B_plus_W", "plain")}


def _bench_stage(module: torch.nn.Module, inputs: tuple, *, repeats: int, warmup: int) -> dict:
    from executors.torch import StageRunner

    runner = StageRunner(module)
    grad = None if module.last else _grad_like(module, inputs)
    upstream = () if grad is None else (grad,)
    samples: dict[str, list[tuple[float, int]]] = {k: [] for k in _VARIANTS}
    for rep in range(warmup + repeats):
        got = _one_round(module, runner, inputs, upstream)
        if rep >= warmup:
            for k, v in got.items():
                samples[k].append(v)
    # B + W per round, so that the sum is a sample of the split backward as a schedule pays it
    samples["B_plus_W"] = _summed(samples["B"], samples["W"])
    samples["split_step"] = _summed(samples["F"], samples["BW"])
    samples["unsplit_step"] = _summed(samples["F_unsplit"], samples["BW_unsplit"])
    out: dict[str, Any] = {}
    for k, v in samples.items():
        out[f"{k}_ms"] = statistics.median(t for t, _ in v) * 1e3
        out[f"{k}_faults"] = statistics.median(f for _, f in v)
    out["bw_over_fused"] = out["B_plus_W_ms"] / out["plain_ms"]
    out["runner_bw_over_fused"] = out["BW_ms"] / out["plain_ms"]
    out["unsplit_over_split"] = out["unsplit_step_ms"] / out["split_step_ms"]
    return out


def _summed(first: list, second: list) -> list[tuple[float, int]]:
    """Per round, the two variants' (seconds, faults) added."""
    return [(a + b, fa + fb) for (a, fa), (b, fb) in zip(first, second)]


def _grad_like(module: torch.nn.Module, inputs: tuple) -> torch.Tensor:
    import torch

    with torch.no_grad():
        out = module(*inputs)
    return torch.randn_like(out) * out.numel() ** -0.5


def _one_round(module, runner, inputs: tuple, upstream: tuple) -> dict[str, tuple[float, int]]:
    """One sample (seconds, page faults) of every variant; each backward starts from parameter
    grads of None."""
    got: dict[str, tuple[float, int]] = {}
    _zero(module)
    got["F"] = _timed(lambda: runner.forward("split", *inputs))
    got["B"] = _timed(lambda: runner.backward_input("split", *upstream))
    got["W"] = _timed(lambda: runner.backward_weight("split"))
    _zero(module)
    runner.forward("fused", *inputs)
    got["BW"] = _timed(lambda: runner.backward("fused", *upstream))
    _zero(module)
    got["F_unsplit"] = _timed(lambda: runner.forward("unsplit", *inputs, split=False))
    got["BW_unsplit"] = _timed(lambda: runner.backward("unsplit", *upstream))
    _zero(module)
    got["plain"] = _plain_backward(module, inputs, upstream)
    return got


def _plain_backward(module, inputs: tuple, upstream: tuple) -> tuple[float, int]:
    """The baseline: autograd through the stage as a plain training loop would run it, the
    input gradient included (a pipeline stage must send it on)."""
    import torch

    leaves = [v.detach().requires_grad_(True) if v.is_floating_point() else v for v in inputs]
    with torch.enable_grad():
        out = module(*leaves)
    return _timed(lambda: out.backward(*upstream))


def _zero(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def _timed(fn: Callable[[], Any]) -> tuple[float, int]:
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return elapsed, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
