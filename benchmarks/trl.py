"""flowkit's GRPO beside TRL's GRPOTrainer on the README's Qwen2 example: the same tiny model,
data, reward and settings, on this CPU, one after the other.

Method:

- the tiny Qwen2 and its tokenizer are built offline by examples/qwen2_build.py's own code,
  then warmed up once by the supervised flow of examples/qwen2_sft.py (through the run API,
  `warm_steps` steps), its weights saved as a Hugging Face folder that both sides start from;
- per seed, flowkit's GRPO flow of examples/qwen2_grpo.py (torch executors, 2 data-parallel
  replicas of one microbatch each) and TRL's GRPOTrainer on that folder, the order alternating from
  seed to seed. Both train on the same prompts in the same order (step k's 16 rows of
  examples/data/arithmetic.jsonl as flowkit's `dataset_prompts` reads them, TRL's shuffling
  off), rendered by the same chat template, 8 completions each of at most 4 tokens at
  temperature 1, scored by the same op (dataflows.rewards.exact_match_reward); one AdamW step
  per 128 completions (TRL: 2 accumulated microbatches of 64), the same lr, betas, weight decay
  (matrices only, on both sides), gradient clipping, clip epsilon, KL coefficient (k3 to the
  warm weights), a loss averaged over the step's tokens (TRL's "dapo"), constant lr. What
  differs: group advantages divide by std + 1e-6 (flowkit) or + 1e-4 (TRL), and the random
  draws (each side seeds its own sampler from the seed);
- the same cores on both sides: flowkit's executors (2, one per replica) get `threads` torch
  threads each, and TRL's one process `trl_threads`, by default as many as flowkit's executors
  have together (2 × `threads`); `trl_threads=threads` is the older comparison, which gave TRL
  one process's share of the cores.

Per side: `step_s`, the median of the seconds between consecutive step ends after the first
(the first loads and warms up); `wall_s`, the whole run from before it starts (executors or
trainer, models loaded) to its end; `reward_curve`, each step's mean reward over its 128
completions; `reward_last10`, the mean of the curve's last 10 steps. Per seed and over seeds,
`step_ratio` = flowkit's step_s / TRL's; over seeds, `reward_curve_gap`, the mean over steps of
the two mean curves' absolute difference.
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

__all__ = ["INSTALL_HINT", "GRPOSetup", "TRLMissingError", "grpo_flow", "require_trl",
           "run_trl_bench", "trl_exact_match", "warm_up_flow"]

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
INSTALL_HINT = "pip install -e '.[trl]'"


FLOWKIT_EXECUTORS = 2  # the example's two replicas, one executor each


class TRLMissingError(ImportError):
    """TRL is not installed; the message says how to install it."""


def require_trl() -> str:
    """TRL's version, or TRLMissingError saying how to install it."""
    try:
        import trl
    except ImportError as exc:
        raise TRLMissingError(f"`flowkit bench trl` runs TRL's GRPOTrainer, and TRL is not "
                              f"installed ({exc}): {INSTALL_HINT}") from None
    return str(trl.__version__)


@attrs.frozen(kw_only=True)
class GRPOSetup:
    """examples/qwen2_grpo.py's settings, which both sides train with; clip_ratio is the GRPO
    loss's default and the optimizer's are OptimizerStep's, which that example keeps
    (tests/bench/test_trl_bench.py checks that these are the example flows' values)."""

    prompts: int = 16
    n: int = 8
    replicas: int = 2  # flowkit's data-parallel replicas of the actor, one executor each
    microbatches: int = 2  # flowkit's microbatches over the replicas; TRL's gradient accumulation
    max_new_tokens: int = 4
    temperature: float = 1.0
    kl_coef: float = 0.001
    reference_in_forward: bool = True  # flowkit's: the KL term's reference in its forward
    clip_ratio: float = 0.2
    lr: float = 5e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    clip_grad_norm: float = 1.0
    # examples/qwen2_sft.py's
    warm_stages: int = 2
    warm_microbatches: int = 4
    warm_batch: int = 64
    warm_lr: float = 2e-3
    warm_seq_len: int = 16


# the example's actor as a pipeline instead (`pipeline=True`): what it was before replicas
PIPELINE = {"stages": 2, "replicas": 1, "microbatches": 4}


def run_trl_bench(*, steps: int = 40, seeds: int = 3, warm_steps: int = 600, threads: int = 1,
                  trl_threads: int | None = None, setup: GRPOSetup | None = None,
                  pipeline: bool = False, scored_reference: bool = False) -> dict:
    """`steps` GRPO steps per side and seed (seeds 0 .. seeds - 1) after a `warm_steps` warm-up;
    the figures of the module's docstring. `trl_threads`: None, the cores of flowkit's
    executors together. `pipeline`: another side, flowkit with the actor in `PIPELINE`'s two
    stages (1F1B) on the same two executors, its ratio to TRL as `pipeline_step_ratio`.
    `scored_reference`: another, flowkit with the reference's log-probs scored by a LogProbs op
    rather than in the actor's forward (the example's), as `scored_step_ratio`."""
    trl_version = require_trl()
    if steps < 2:
        raise ValueError(f"the bench measures the steps after the first: needs >= 2, got {steps}")
    if seeds < 1 or warm_steps < 1:
        raise ValueError(f"needs seeds >= 1 and warm_steps >= 1, got {seeds} and {warm_steps}")
    setup = setup or GRPOSetup()
    trl_threads = FLOWKIT_EXECUTORS * threads if trl_threads is None else trl_threads
    figures: dict[str, Any] = {"setup": {
        **attrs.asdict(setup), "steps": steps, "seeds": seeds,
        "threads": {"flowkit_executors": FLOWKIT_EXECUTORS, "flowkit_per_executor": threads,
                    "trl": trl_threads}, "pipeline": PIPELINE if pipeline else None,
        "scored_reference": scored_reference, **_versions(trl_version)}}
    scored = attrs.evolve(setup, reference_in_forward=False)
    with (tempfile.TemporaryDirectory(prefix="flowkit-bench-trl-") as tmp,
          _quiet_transformers()):
        folder = Path(tmp)
        _build(folder / "qwen2-tiny")
        figures["warm_up"] = _warm_up(setup, folder / "qwen2-tiny", folder / "warm", warm_steps,
                                      threads)
        warm = folder / "warm" / "actor"
        runs = []
        for seed in range(seeds):
            sides = {"flowkit": lambda s=seed: _flowkit_side(setup, warm, steps, s, threads),
                     "trl": lambda s=seed: _trl_side(setup, warm, steps, s, folder / "trl",
                                                     trl_threads)}
            if pipeline:
                sides["flowkit_pipeline"] = lambda s=seed: _flowkit_side(
                    setup, warm, steps, s, threads, layout=PIPELINE)
            if scored_reference:
                sides["flowkit_scored"] = lambda s=seed: _flowkit_side(
                    scored, warm, steps, s, threads)
            order = list(sides) if seed % 2 == 0 else list(reversed(sides))
            run = {"seed": seed, "order": order, **{name: sides[name]() for name in order}}
            run.update(_ratios(run))
            runs.append(run)
    figures["runs"] = runs
    figures.update(_over_seeds(runs))
    return figures


def _versions(trl_version: str) -> dict:
    import torch
    import transformers

    return {"trl": trl_version, "transformers": transformers.__version__,
            "torch": torch.__version__}


@contextlib.contextmanager
def _threads(threads: int) -> Iterator[None]:
    """`threads` torch threads in this process (TRL's), as they were afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _build(folder: Path) -> None:
    """The tiny Qwen2 and its tokenizer, by examples/qwen2_build.py's own code (no download)."""
    spec = importlib.util.spec_from_file_location("_qwen2_build", EXAMPLES / "qwen2_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build(folder, data=EXAMPLES / "data")


def _warm_up(setup: GRPOSetup, model: Path, out: Path, steps: int, threads: int) -> dict:
    """examples/qwen2_sft.py's flow on `model` for `steps` steps, its weights saved to
    out/actor (an HF folder with the tokenizer)."""
    from benchmarks.runs import bench_run

    start, losses = time.perf_counter(), []
    with bench_run(warm_up_flow(setup, model), steps=steps, executors="torch",
                   save_weights=out, executor_threads=threads) as run:
        losses = [report.metrics["backprop/loss"] for report in run.steps()]
    return {"steps": steps, "wall_s": time.perf_counter() - start, "first_loss": losses[0],
            "last_loss": losses[-1]}


def _flowkit_side(setup: GRPOSetup, warm: Path, steps: int, seed: int, threads: int,
                  layout: dict | None = None) -> dict:
    """examples/qwen2_grpo.py's flow from `warm`, sampling from `seed`, on torch executors of
    `threads` threads each; `layout`: stages, replicas and microbatches instead of its own."""
    from benchmarks.runs import bench_run

    start, ends, rewards = time.perf_counter(), [], []
    with bench_run(grpo_flow(setup, warm, seed), steps=steps, executors="torch",
                   executor_threads=threads, num_executors=FLOWKIT_EXECUTORS,
                   **(layout or {})) as run:
        for report in run.steps():
            ends.append(time.perf_counter())
            rewards.append(float(report.metrics["reward_mean"]))
    return _side(start, ends, time.perf_counter(), rewards)


def warm_up_flow(setup: GRPOSetup, model: Path) -> Any:
    """examples/qwen2_sft.py's flow on the model folder `model`."""
    from dataflows.datasets import chat_sft_sequences
    from dataflows.pretrain import pretrain_flow

    return pretrain_flow(model=_actor(model, stages=setup.warm_stages), source=chat_sft_sequences,
                         source_config={"path": str(EXAMPLES / "data" / "arithmetic_sft.jsonl"),
                                        "tokenizer": str(model), "seq_len": setup.warm_seq_len},
                         batch_size=setup.warm_batch, microbatches=setup.warm_microbatches,
                         schedule="1f1b", lr=setup.warm_lr, name="qwen2_sft")


def grpo_flow(setup: GRPOSetup, warm: Path, seed: int) -> Any:
    """examples/qwen2_grpo.py's flow from the model folder `warm`, sampling from `seed`."""
    from dataflows.datasets import dataset_prompts
    from dataflows.grpo import grpo_flow as flow
    from dataflows.rewards import exact_match_reward

    return flow(model=_actor(warm, replicas=setup.replicas), prompts=setup.prompts, n=setup.n,
                microbatches=setup.microbatches, schedule="1f1b",
                max_new_tokens=setup.max_new_tokens, temperature=setup.temperature,
                kl_coef=setup.kl_coef, reference_in_forward=setup.reference_in_forward,
                lr=setup.lr, sample_seed=seed, prompt_source=dataset_prompts,
                source_config={"path": str(_prompts_file()), "tokenizer": str(warm)},
                reward=exact_match_reward)


def _actor(folder: Path, *, stages: int = 1, replicas: int = 1) -> Any:
    from flowkit.dsl import Model

    return Model(name="actor", build="hf", config={"path": str(folder)}, stages=stages,
                 replicas=replicas, tags=("train",))


def _prompts_file() -> Path:
    return EXAMPLES / "data" / "arithmetic.jsonl"


def _side(start: float, ends: list[float], end: float, rewards: list[float]) -> dict:
    """One side's figures from its start, its step ends, its end and its step rewards."""
    gaps = [later - earlier for earlier, later in zip(ends, ends[1:])]
    return {"steps": len(ends), "step_s": statistics.median(gaps), "first_step_s": ends[0] - start,
            "wall_s": end - start, "reward_last10": statistics.fmean(rewards[-10:]),
            "reward_curve": rewards}


SIDES = ("flowkit", "trl", "flowkit_pipeline", "flowkit_scored")


def _ratios(figures: dict) -> dict:
    """flowkit's step_s over TRL's (and each other flowkit side's, where it ran: the
    pipeline's as pipeline_step_ratio, the scored reference's as scored_step_ratio)."""
    out = {"step_ratio": figures["flowkit"]["step_s"] / figures["trl"]["step_s"]}
    for side in SIDES[2:]:
        if side in figures:
            out[f"{side.removeprefix('flowkit_')}_step_ratio"] = (
                figures[side]["step_s"] / figures["trl"]["step_s"])
    return out


def _over_seeds(runs: list[dict]) -> dict:
    """Per side the median step_s over seeds, the mean of reward_last10 and the mean curve;
    the ratios of the medians."""
    out: dict[str, Any] = {}
    for side in [name for name in runs[0] if name in SIDES]:
        curves = [run[side]["reward_curve"] for run in runs]
        out[side] = {"step_s": statistics.median(run[side]["step_s"] for run in runs),
                     "wall_s": statistics.median(run[side]["wall_s"] for run in runs),
                     "reward_last10": statistics.fmean(run[side]["reward_last10"]
                                                       for run in runs),
                     "reward_curve": [statistics.fmean(step) for step in zip(*curves)]}
    out.update(_ratios(out))
    out["reward_curve_gap"] = statistics.fmean(
        abs(a - b) for a, b in zip(out["flowkit"]["reward_curve"], out["trl"]["reward_curve"]))
    return out


# -- TRL's side ---------------------------------------------------------------------------------
def _trl_side(setup: GRPOSetup, warm: Path, steps: int, seed: int, out: Path,
              threads: int) -> dict:
    """TRL's GRPOTrainer from `warm`, set up as flowkit's flow (the module's docstring), in this
    process on `threads` torch threads."""
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    clock = _step_clock()
    start = time.perf_counter()
    trainer = GRPOTrainer(model=str(warm), reward_funcs=[trl_exact_match],
                          args=_trl_config(setup, steps, seed, out),
                          train_dataset=_trl_dataset(setup, warm, steps),
                          processing_class=_tokenizer(warm), callbacks=[clock])
    trainer.remove_callback(PrinterCallback)  # it prints every step's logs
    with _threads(threads):
        trainer.train()
    end = time.perf_counter()
    if len(clock.ends) != steps or len(clock.rewards) != steps:
        raise RuntimeError(f"TRL ran {len(clock.ends)} optimizer steps and logged "
                           f"{len(clock.rewards)} rewards, expected {steps} of each")
    return _side(start, clock.ends, end, clock.rewards)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bars and no deprecation warnings from transformers and TRL: a bench prints
    its figures only."""
    import warnings

    from transformers.utils import logging

    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        if bars:
            logging.enable_progress_bar()


def _trl_config(setup: GRPOSetup, steps: int, seed: int, out: Path) -> Any:
    from trl import GRPOConfig

    batch = setup.prompts * setup.n
    return GRPOConfig(
        output_dir=str(out), report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, use_cpu=True, bf16=False, activation_checkpointing=False,
        seed=seed, max_steps=steps, shuffle_dataset=False,
        # one optimizer step per 128 completions, accumulated over flowkit's microbatches
        per_device_train_batch_size=batch // setup.microbatches,
        gradient_accumulation_steps=setup.microbatches, num_generations=setup.n,
        max_completion_length=setup.max_new_tokens, temperature=setup.temperature,
        top_p=1.0, top_k=0, num_iterations=1,
        beta=setup.kl_coef, epsilon=setup.clip_ratio, loss_type="dapo", scale_rewards="group",
        learning_rate=setup.lr, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", weight_decay=setup.weight_decay, adam_beta1=setup.betas[0],
        adam_beta2=setup.betas[1], adam_epsilon=1e-8, max_grad_norm=setup.clip_grad_norm,
        dataloader_num_workers=0)


def _tokenizer(warm: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(warm, local_files_only=True)


def _trl_dataset(setup: GRPOSetup, warm: Path, steps: int) -> Any:
    """The rows flowkit's dataset_prompts reads at steps 0 .. steps - 1, in its order, as chat
    prompts (TRL applies the same template) with their answers."""
    from datasets import Dataset

    from dataflows.datasets import PromptDataset

    rows = PromptDataset(_prompts_file()).rows(0, steps * setup.prompts)
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": r.prompt}] for r in rows],
                              "answer": [r.answer for r in rows]})


def trl_exact_match(prompts: list, completions: list, completion_ids: list,
                    answer: list[str], **_: Any) -> list[float]:
    """TRL's reward function: flowkit's exact_match_reward op on each completion's text (of
    a chat prompt, TRL gives the completion as [{"role": "assistant", "content": text}])."""
    from dataflows.rewards import exact_match_reward
    from flowkit.ops.records import Rollout

    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [exact_match_reward.fn(Rollout(prompt_id=0, sample=0, prompt_tokens=[],
                                          response_tokens=list(ids), logprobs=[], answer=want,
                                          response_text=text)).reward
            for text, ids, want in zip(texts, completion_ids, answer)]


def _step_clock() -> Any:
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """Each optimizer step's end time and its logged mean reward."""

        def __init__(self) -> None:
            self.ends: list[float] = []
            self.rewards: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                   **kwargs: Any) -> None:
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))

    return StepClock()

