#!/usr/bin/env bash
# flowkit GPU-readiness device check (kept with the code it reads: the copy beside the repository
# predates the executors' reshape; this one follows executors/torch/{train,rollout,models} and
# adds bf16 mixed precision with MFU, `--precision bf16`, executors sharing cuda:0, and the
# refusal of a bare `--device cuda` that asks for more GPUs than the machine has). Self-contained: run from the repository root on a machine
# with one NVIDIA GPU (H200), e.g. through the device tool:
#     bash device_check.sh            (timeout_s ~560; results in $OUT)
# What it does, each part under its own time limit inside an overall budget (FK_BUDGET_S, 470 s):
#   0. finds a python3 whose torch sees the GPU (the H200 image's /opt/torch/.venv has one and no
#      registry); only if none is found does it make a venv and `pip install torch==2.13.0`
#      (PyPI's default Linux wheel is a CUDA build), falling back to `pip install torch`
#   1. installs the project (-e, no deps, offline) and pyzmq from carried wheels (FK_WHEELS,
#      default ./.whl) when the interpreter lacks it
#   a. the device-parametrised tests: tests/torch/test_sampling.py (its CUDA test),
#      packing's varlen kernel (tests/torch/test_packing.py) and a profile's CUDA generator
#      (tests/torch/test_rl_loss.py)
#   b. pipeline F/B/W ops of the built-in GPT (124M) on cuda vs a plain loop: gradients and
#      weights after one AdamW step, ms/step (plain fp32/tf32/autocast, split, fused, bf16),
#      grad_stats and the optimizer step, autocast around the split backward, offload on the
#      device, bf16-parameter updates at an RL learning rate
#   c. the rollout engine vs HF generate on the same model: a tiny Qwen2 (greedy agreement) and a
#      Qwen2.5-0.5B-shaped one in bf16 (tokens/s at batch 64 and 256, a GRPO 16x8 shape, the
#      engine at the model's own 32k context, a profile of one decode step), and the weight
#      sync path (export -> pack -> load) against device-to-device and pinned copies
#   d. the GRPO example through the CLI on cuda:0 (sort_sft warm-up, grpo_sort, its tis_bf16 and
#      second_round variants), `--device cuda` with 2 executors on one GPU, and a CPU reference
#   e. an NCCL group as executors/torch/replicas.py builds it (one rank), and a weight group
#      (connected on joining, an exporter's self-load through it); TF32 flags, to_device,
#      CUDA generator states set back, an idle engine's empty_cache
#   f. weights between two processes on one GPU through CUDA IPC (executors/torch/cuda_share.py)
#      against the host path, and the GRPO example with --weight-sync host beside d_grpo
# FK_SECTIONS='b_|c_' runs only the parts whose names match (install and env always run).
# Output: a compact summary at the end; $OUT/device_check.json, device_check.log,
# engine_profile.txt, grpo_cuda_metrics.jsonl. FK_DRYRUN_CPU=1 FK_PYTHON=... runs it all on
# the CPU with tiny sizes and no installs (to check the script itself).
set -uo pipefail
REPO=$(pwd)
export OUT=${OUT:-$REPO/device-check-out}
mkdir -p "$OUT"
WORK=${FK_WORK:-/tmp/fk-devcheck}
rm -rf "$WORK"
mkdir -p "$WORK/parts" "$WORK/cli" "$WORK/logs"
export FK_PARTS=$WORK/parts PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export FK_DRYRUN_CPU=${FK_DRYRUN_CPU:-0}
DRY=$FK_DRYRUN_CPU
BUDGET=${FK_BUDGET_S:-470}
WHEELS=${FK_WHEELS:-$( [ -d "$REPO/.whl" ] && echo "$REPO/.whl" || echo "$REPO/../shared/gpu/whl")}
START=$(date +%s)
STATUS=$WORK/status.txt
: >"$STATUS"
if [ "$DRY" = 1 ]; then DEV0=cpu; SFT_STEPS=${FK_SFT_STEPS:-30}; GRPO_STEPS=${FK_GRPO_STEPS:-3}
else DEV0=cuda:0; SFT_STEPS=${FK_SFT_STEPS:-150}; GRPO_STEPS=${FK_GRPO_STEPS:-10}; fi

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# section NAME CAP_SECONDS CMD...: run CMD under min(CAP, what the budget has left), its output
# also in $WORK/logs/NAME.log; a shell function runs in this shell, its own commands time-limited
section() {
  local name=$1 cap=$2; shift 2
  local l t t0 rc
  if [ -n "${FK_SECTIONS:-}" ] && [[ ! $name =~ ^(install_|env$) ]] && [[ ! $name =~ $FK_SECTIONS ]]; then
    return 0  # FK_SECTIONS (a regular expression of names) picks the parts a rerun needs
  fi
  l=$(left); t=$(( cap < l - 20 ? cap : l - 20 ))
  if (( t < 15 )); then
    echo "== $name: SKIPPED (overall budget spent)"; echo "$name skipped 0" >>"$STATUS"; return 0
  fi
  echo; echo "== $name (limit ${t}s, $(left)s of the budget left) =="
  t0=$(date +%s.%N)
  if declare -F "$1" >/dev/null; then
    "$@"; rc=$?
  else
    timeout --kill-after=10 "$t" "$@" 2>&1 | tee "$WORK/logs/$name.log"; rc=${PIPESTATUS[0]}
  fi
  (( rc == 124 || rc == 137 )) && echo "== $name: TIMED OUT after ${t}s"
  echo "$name $rc $(awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN{printf "%.1f", a-b}')" >>"$STATUS"
  echo "== $name: rc=$rc"
  return 0
}

pick_python() {
  local c
  for c in ${FK_PYTHON:-} python3 /opt/torch/.venv/bin/python3 python; do
    command -v "$c" >/dev/null 2>&1 || continue
    if [ "$DRY" = 1 ]; then
      "$c" -c 'import torch' 2>/dev/null && { PY=$(realpath -s "$(command -v "$c")"); return 0; }
    else
      "$c" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)' 2>/dev/null \
        && { PY=$(realpath -s "$(command -v "$c")"); return 0; }
    fi
  done
  return 1
}

install_torch() {  # only where no interpreter with a CUDA torch exists (a registry is needed)
  python3 -m venv "$WORK/venv" || return 1
  PY=$WORK/venv/bin/python
  local pipi=("$PY" -m pip install -q --no-compile --prefer-binary --progress-bar off)
  timeout 300 "${pipi[@]}" "torch==${FK_TORCH_VERSION:-2.13.0}" \
    || timeout 300 "${pipi[@]}" torch || return 1
  timeout 150 "${pipi[@]}" transformers safetensors tokenizers pytest hypothesis pyzmq
}

install_project() {
  if ! "$PY" -c 'import zmq' 2>/dev/null; then  # the H200 image has no pyzmq: carry its wheel
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
      timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile "$WHEELS"/*.whl \
        || { timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile \
               --target "$WORK/site" "$WHEELS"/*.whl \
             && export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}; }
    fi
    "$PY" -c 'import zmq' 2>/dev/null || timeout 60 "$PY" -m pip install -q pyzmq \
      || echo "!! pyzmq is missing and could not be installed: carry its wheel in $WHEELS"
  fi
  [ "$DRY" = 1 ] && return 0  # the dry run's interpreter already holds the project
  # the project's own dependencies, where the interpreter lacks them (needs a registry)
  "$PY" -c 'import networkx, msgpack, attrs, rich, click, matplotlib' 2>/dev/null \
    || timeout 120 "$PY" -m pip install -q --no-compile networkx msgpack attrs rich click matplotlib
  if ! timeout 120 "$PY" -m pip install -q --no-deps --no-build-isolation --no-compile \
       -e "$REPO" || ! project_ok; then
    # offline and without a usable setuptools: the sources on the path, and a dist-info that
    # declares the entry points (executor kinds, commands) the way an install would
    echo "editable install failed: the sources on PYTHONPATH with a written dist-info"
    local info=$WORK/site/flowkit-0.1.0.dist-info
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: flowkit\nVersion: 0.1.0\n' >"$info/METADATA"
    "$PY" -c 'import sys, tomllib
eps = tomllib.load(open("pyproject.toml", "rb"))["project"]
out = []
for group, entries in eps.get("entry-points", {}).items():
    out.append(f"[{group}]")
    out += [f"{k} = {v}" for k, v in entries.items()]
out.append("[console_scripts]")
out += [f"{k} = {v}" for k, v in eps.get("scripts", {}).items()]
open(sys.argv[1], "w").write("\n".join(out) + "\n")' "$info/entry_points.txt"
    export PYTHONPATH=$REPO:$WORK/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  project_ok
}

project_ok() {
  "$PY" -c 'import flowkit, executors.torch; from importlib.metadata import entry_points
kinds = {e.name for e in entry_points(group="flowkit.executors")}
assert "torch" in kinds, f"no torch executor kind among {kinds}"
print("flowkit at", flowkit.__file__, "kinds", sorted(kinds))'
}

# flowkit run from the scratch folder (the warm-up's checkpoints land there, where grpo_sort
# looks for them), as an external command so that `timeout` can run it
CLI=(bash -c 'cd "$0" && exec "$@" --no-dashboard' "$WORK/cli")

main() {
  echo "flowkit device check: repo $REPO, out $OUT, budget ${BUDGET}s, dry run $DRY"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used \
    --format=csv || echo "no nvidia-smi"
  echo "cpus: $(nproc)"
  local t0
  t0=$(date +%s)
  if ! pick_python; then
    echo "no python3 whose torch sees a GPU: installing torch (needs PyPI)"
    section install_torch 330 install_torch
    pick_python || { [ -x "$WORK/venv/bin/python" ] && PY=$WORK/venv/bin/python; }
  fi
  echo "python: ${PY:-none}"
  [ -n "${PY:-}" ] || { echo "!! no usable python with torch; stopping"; return 1; }
  write_python_files
  section install_project 200 install_project
  echo "prepare $(( $(date +%s) - t0 ))s"
  section env 60 "$PY" "$WORK/fk_devcheck.py" env
  # (a) the device-parametrised tests: test_sampling.py's, and packing's varlen kernel
  grep -rln --include='*.py' -e 'cuda' tests | sed 's/^/  mentions cuda: /'
  section a_pytest_sampling 60 "$PY" -m pytest -q -p no:cacheprovider -rs \
    --junitxml="$FK_PARTS/junit.xml" tests/torch/test_sampling.py \
    tests/torch/test_packing.py::test_the_varlen_kernel_on_cuda_equals_the_block_mask \
    tests/torch/test_rl_loss.py::test_profiling_on_cuda_leaves_its_generator_as_it_was
  section b_pipeline 150 "$PY" "$WORK/fk_devcheck.py" pipeline
  # (d) the GRPO example on the device: warm-up, GRPO, its bf16 variant (the sampler/trainer
  # mismatch metrics), 2 executors given a bare `--device cuda` on one GPU, a CPU reference
  section d_sft 160 "${CLI[@]}" "$PY" -m flowkit run "$REPO/examples/sort_sft.py" --steps "$SFT_STEPS" \
    --save-weights checkpoints --device "$DEV0" --metrics "$FK_PARTS/sft_cuda.jsonl"
  section d_grpo 150 "${CLI[@]}" "$PY" -m flowkit run "$REPO/examples/grpo_sort.py" --steps "$GRPO_STEPS" \
    --device "$DEV0" --metrics "$FK_PARTS/grpo_cuda.jsonl"
  [ -f "$FK_PARTS/grpo_cuda.jsonl" ] && cp "$FK_PARTS/grpo_cuda.jsonl" "$OUT/grpo_cuda_metrics.jsonl"
  section d_grpo_bf16 100 "${CLI[@]}" "$PY" -m flowkit run "$REPO/examples/grpo_sort.py" --steps "$GRPO_STEPS" \
    --device "$DEV0" --precision bf16 --metrics "$FK_PARTS/grpo_bf16_cuda.jsonl"
  # DARS's second round on the GPU engine: later samples numbered on from the first (first_sample)
  section d_grpo_second_round 80 "${CLI[@]}" "$PY" -m flowkit run \
    "$REPO/examples/grpo_sort.py:second_round" --steps 3 --device "$DEV0" \
    --metrics "$FK_PARTS/grpo_second_round.jsonl"
  if [ "$DRY" != 1 ]; then
    # two executors sharing the one GPU (colocated), and a bare cuda asking for two GPUs
    section d_shared_cuda0 70 "${CLI[@]}" "$PY" -m flowkit run "$REPO/examples/grpo_sort.py" --steps 2 \
      --device cuda:0 --metrics "$FK_PARTS/grpo_shared_cuda0.jsonl"
    section d_bare_cuda 40 "${CLI[@]}" "$PY" -m flowkit run "$REPO/examples/grpo_sort.py" --steps 1 --device cuda
    tail -n 15 "$WORK/logs/d_bare_cuda.log" 2>/dev/null | "$PY" -c 'import json,sys;
json.dump(sys.stdin.read(), open(sys.argv[1], "w"))' "$FK_PARTS/cli_bare_cuda.json"
  fi
  # (f) weights between two processes on one GPU through CUDA IPC, and d_grpo again with the
  # host path (--weight-sync host): its sync bytes and step time beside d_grpo's
  section f_weights_ipc 90 "$PY" "$WORK/fk_devcheck.py" ipc
  section f_grpo_host_sync 120 "${CLI[@]}" "$PY" -m flowkit run \
    "$REPO/examples/grpo_sort.py" --steps "$GRPO_STEPS" --device "$DEV0" --weight-sync host \
    --metrics "$FK_PARTS/grpo_host_sync_cuda.jsonl"
  if [ "$DRY" != 1 ]; then  # a broadcast between executors on one GPU: refused, one line
    section f_broadcast_one_gpu 60 "${CLI[@]}" "$PY" -m flowkit run "$REPO/examples/grpo_sort.py" \
      --steps 1 --device cuda:0 --weight-sync broadcast
    tail -n 4 "$WORK/logs/f_broadcast_one_gpu.log" 2>/dev/null | "$PY" -c 'import json,sys;
json.dump(sys.stdin.read(), open(sys.argv[1], "w"))' "$FK_PARTS/cli_broadcast_one_gpu.json"
  fi
  section c_engine 150 "$PY" "$WORK/fk_devcheck.py" engine
  section e_nccl 40 "$PY" "$WORK/fk_devcheck.py" nccl
  # `flowkit bench train --precision`: bf16 mixed precision against fp32 side by side (tokens/s,
  # the loss gap, MFU on a GPU)
  section d_bench_precision 70 "$PY" -m flowkit bench train --precision bf16,fp32 \
    --device "$DEV0" --json "$FK_PARTS/bench_precision.json"
  section d_grpo_tis_bf16 60 "${CLI[@]}" "$PY" -m flowkit run "$REPO/examples/grpo_sort.py:tis_bf16" --steps 3 \
    --device "$DEV0" --metrics "$FK_PARTS/grpo_tis_bf16_cuda.jsonl"
  [ "$DRY" != 1 ] && section d_grpo_cpu 80 "${CLI[@]}" "$PY" -m flowkit run "$REPO/examples/grpo_sort.py" \
      --steps "$GRPO_STEPS" --device cpu --metrics "$FK_PARTS/grpo_cpu.jsonl"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=memory.used --format=csv
  "$PY" "$WORK/fk_summary.py" "$STATUS"
  echo "total $(( $(date +%s) - START ))s"
}

write_python_files() {
  cat >"$WORK/fk_devcheck.py" <<'FK_PY_EOF'
"""flowkit GPU device checks, run by device_check.sh (one section per process).

    python fk_devcheck.py SECTION      SECTION: env | pipeline | engine | nccl | ipc

Each section writes $FK_PARTS/SECTION.json. FK_DRYRUN_CPU=1 runs the same code on the CPU with
tiny sizes (to check the script itself on a machine without a GPU).
"""
from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback

import torch

DRY = os.environ.get("FK_DRYRUN_CPU") == "1"
DEV = torch.device("cpu" if DRY else "cuda:0")
PARTS = os.environ.get("FK_PARTS", ".")
OUT = os.environ.get("OUT", ".")
RESULT: dict = {}


# dense bf16 peak of the GPU by name (H100/H200 SXM: 989 TFLOP/s), for MFU
PEAK_BF16 = None if DRY else next((v for k, v in {"H200": 989e12, "H100": 989e12,
                                                   "A100": 312e12}.items()
                                   if k in torch.cuda.get_device_name(0)), None)


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def now() -> float:
    sync()
    return time.perf_counter()


def gib(n: float) -> float:
    return round(n / 2**30, 3)


def peak_reset() -> None:
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak() -> float | None:
    return gib(torch.cuda.max_memory_allocated()) if DEV.type == "cuda" else None


def save(name: str) -> None:
    with open(os.path.join(PARTS, f"{name}.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


def guarded(key: str):
    """Run a sub-check; its exception is recorded under key, the section goes on."""
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            RESULT[key] = fn()
        except Exception as exc:  # noqa: BLE001
            RESULT[key] = {"error": f"{type(exc).__name__}: {exc}"[:800],
                           "trace": traceback.format_exc()[-1500:]}
            print(f"[{key}] FAILED: {type(exc).__name__}: {exc}"[:600], flush=True)
        print(f"[{key}] {time.perf_counter() - t0:.1f}s", flush=True)
        save(SECTION)
        return fn
    return wrap


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# -- env ------------------------------------------------------------------------------------------
def env() -> None:
    d = {"python": sys.version.split()[0], "executable": sys.executable, "torch": torch.__version__,
         "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
         "dry_run_cpu": DRY}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        d.update(device=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                 mem_gib=gib(p.total_memory), device_count=torch.cuda.device_count(),
                 allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                 float32_matmul_precision=torch.get_float32_matmul_precision(),
                 sdp={"flash": torch.backends.cuda.flash_sdp_enabled(),
                      "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                      "math": torch.backends.cuda.math_sdp_enabled()})
        try:
            d["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001
            d["nccl"] = f"unavailable: {exc}"
    for mod in ("zmq", "msgpack", "transformers", "hypothesis", "pytest", "flowkit", "vllm"):
        try:
            m = __import__(mod)
            d[mod] = getattr(m, "__version__", getattr(m, "__file__", "?"))
        except Exception as exc:  # noqa: BLE001
            d[mod] = f"MISSING ({type(exc).__name__}: {exc})"
    try:
        from importlib.metadata import entry_points
        d["executor_kinds"] = sorted(e.name for e in entry_points(group="flowkit.executors"))
    except Exception as exc:  # noqa: BLE001
        d["executor_kinds"] = f"error {exc}"
    RESULT.update(d)
    print(json.dumps(d, indent=1, default=str), flush=True)
    save("env")


# -- (b) pipeline F/B/W of the built-in GPT vs a plain loop --------------------------------------
def pipeline() -> None:
    from executors.optable import OpContext
    from executors.torch.train import pipeline_ops as po
    from executors.torch.train.rows import split_tokens
    from executors.torch.models.built import held_model
    from executors.torch.models.gpt import GPT
    from executors.torch.weights import aliases_of

    if DRY:
        cfg = dict(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=32)
        B, T, M, reps = 2, 16, 4, 1
    else:  # GPT-2 small (124M), 4 microbatches of 8 x 512 tokens
        cfg = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
        B, T, M, reps = 8, 512, 4, 3
    RESULT["setup"] = {"gpt": cfg, "microbatch": [B, T], "microbatches": M, "stages": 2,
                       "device": str(DEV)}
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg["vocab_size"], (B, T + 1), generator=gen) for _ in range(M)]
    scale = 1.0 / M
    tokens_per_step = M * B * T
    hp = dict(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad_norm=1.0)
    ctx = OpContext(name="check", device=str(DEV), tags=())

    def spec_of(dtype: str, tag: str = "") -> dict:
        return {"model": f"gpt_{dtype}{tag}", "build": "executors.torch.models.gpt:GPT",
                "model_config": cfg, "seed": 0, "dtype": dtype}

    def pipe_pass(spec: dict, *, split: bool = True, offload: bool = False,
                  measure_mem: bool = False) -> tuple[list, float | None]:
        """F of every microbatch on both stages, then B and W (or BW) of each."""
        stats, outs = [], []
        for mb, tokens in enumerate(data):
            a0 = po._forward(ctx, tokens, stage=0, stages=2, microbatch=mb, loss_scale=scale,
                             fused_backward=not split, offload=offload, **spec)
            st = po._forward(ctx, a0, tokens, stage=1, stages=2, microbatch=mb,
                             loss_scale=scale, fused_backward=not split, offload=offload, **spec)
            stats.append(st)
            outs.append(st)
        mem = None
        if measure_mem and DEV.type == "cuda":
            sync()
            mem = gib(torch.cuda.memory_allocated())
        for mb in range(M):
            if split:
                g1 = po._backward_input(ctx, outs[mb], stage=1, stages=2, microbatch=mb, **spec)
                po._backward_input(ctx, g1, stage=0, stages=2, microbatch=mb, **spec)
                po._backward_weight(ctx, stage=1, stages=2, microbatch=mb, **spec)
                po._backward_weight(ctx, stage=0, stages=2, microbatch=mb, **spec)
            else:
                g1 = po._backward(ctx, outs[mb], stage=1, stages=2, microbatch=mb, **spec)
                po._backward(ctx, g1, stage=0, stages=2, microbatch=mb, **spec)
        return stats, mem

    def pipe_grads(spec: dict) -> dict:
        held = held_model(ctx, {**spec, "stages": 2})
        out: dict = {}
        for s, part in enumerate(held.parts):
            for local, p in part.named_parameters():
                if p.grad is not None:
                    out[held.layout.names[s][local]] = p.grad.detach().clone()
        return out

    def pipe_weights(spec: dict) -> dict:
        held = held_model(ctx, {**spec, "stages": 2})
        return {held.layout.names[s][local]: p.detach().clone()
                for s, part in enumerate(held.parts) for local, p in part.named_parameters()}

    def zero(spec: dict) -> None:
        for s in (0, 1):
            po._zero_grad(ctx, stage=s, stages=2, **spec)

    def plain_model(dtype: torch.dtype) -> torch.nn.Module:
        torch.manual_seed(0)  # as held_model builds it
        return GPT(**cfg).to(device=DEV, dtype=dtype)

    def plain_pass(model, autocast: bool = False) -> list[float]:
        losses = []
        for tokens in data:
            x, y = split_tokens(tokens.to(DEV))
            with torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(x, y)
            (loss * scale).backward()
            losses.append(loss.detach())
        return [float(v) for v in losses]

    def compare_grads(pipe: dict, model) -> dict:
        aliases = aliases_of(model)
        worst, bitwise, n = 0.0, 0, 0
        for name, p in model.named_parameters():
            got = [pipe[a] for a in aliases[name] if a in pipe]
            total = got[0] if len(got) == 1 else torch.stack(got).sum(0)
            worst = max(worst, rel_diff(total, p.grad))
            bitwise += int(torch.equal(total, p.grad))
            n += 1
        return {"max_rel_diff": worst, "bitwise_equal_params": f"{bitwise}/{n}"}

    def adamw_plain(model, lr=hp["lr"]):
        params = list(model.parameters())
        torch.nn.utils.clip_grad_norm_(params, hp["clip_grad_norm"])
        opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2],
                                  "weight_decay": hp["weight_decay"]},
                                 {"params": [p for p in params if p.dim() < 2],
                                  "weight_decay": 0.0}],
                                lr=lr, betas=hp["betas"], eps=hp["eps"], foreach=False)
        opt.step()
        return opt

    def pipe_optimizer(spec: dict, stats: list) -> tuple[float, float]:
        t0 = now()
        s0, tied0 = po._grad_stats(ctx, stage=0, stages=2, **spec)
        s1, tied1 = po._grad_stats(ctx, tied0, stage=1, stages=2, **spec)
        t1 = now()
        rest = {k: v for k, v in spec.items() if k != "model"}
        po._optimizer_step(ctx, stats, s0, s1, tied1, stage=0, stages=2, model=spec["model"],
                           **hp, **rest)
        po._optimizer_step(ctx, stats, s0, s1, stage=1, stages=2, model=spec["model"], **hp,
                           **rest)
        return t1 - t0, now() - t1

    # 1. equality: one step, fp32, pipeline (split B/W) vs plain loop
    @guarded("equality_fp32")
    def _():
        spec = spec_of("float32")
        stats, _ = pipe_pass(spec)
        pgrads = pipe_grads(spec)
        plain = plain_model(torch.float32)
        losses = plain_pass(plain)
        out = {"grads": compare_grads(pgrads, plain),
               "loss_pipeline": [s.loss for s in stats], "loss_plain": losses}
        # AdamW's first step moves a weight by about lr * sign(grad): where a gradient is
        # below the two runs' rounding noise its sign, and so its update, can differ. The
        # optimizer is checked on the pipeline's own gradients (a second plain model given
        # them); the plain loop's own step is reported beside, as the share of weights off
        # by more than lr / 2
        given = copy.deepcopy(plain)
        aliases = aliases_of(plain)
        for name, p in given.named_parameters():
            got = [pgrads[a] for a in aliases[name] if a in pgrads]
            p.grad = (got[0] if len(got) == 1 else torch.stack(got).sum(0)).clone()
        pipe_optimizer(spec, stats)
        adamw_plain(plain)
        adamw_plain(given)
        pw = pipe_weights(spec)
        named = [(n, p, g) for (n, p), (_, g) in zip(
            plain.named_parameters(remove_duplicate=False),
            given.named_parameters(remove_duplicate=False)) if n in pw]
        worst = max(rel_diff(pw[n], g) for n, _, g in named)
        off = sum(int(((pw[n] - p).abs() > hp["lr"] / 2).sum()) for n, p, _ in named)
        total = sum(p.numel() for _, p, _ in named)
        out["weights_after_step_same_grads_max_rel_diff"] = worst
        out["weights_after_own_step_share_off_by_half_lr"] = off / total
        out["ok"] = out["grads"]["max_rel_diff"] < 1e-4 and worst < 1e-5
        return out

    # 2. timing: plain loop vs pipeline ops (one process, both stages), per step F+B(+W)
    def time_it(fn, reset) -> float:
        reset()
        fn()  # warm-up
        times = []
        for _ in range(reps):
            reset()
            t0 = now()
            fn()
            times.append(now() - t0)
        reset()
        return min(times)

    @guarded("timing")
    def _():
        out: dict = {}

        def record(key, seconds):
            out[key] = {"ms_per_step": round(seconds * 1e3, 2),
                        "tokens_per_s": round(tokens_per_step / seconds)}

        plain = plain_model(torch.float32)
        rz = lambda: plain.zero_grad(set_to_none=True)  # noqa: E731
        record("plain_fp32", time_it(lambda: plain_pass(plain), rz))
        if DEV.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            record("plain_fp32_tf32", time_it(lambda: plain_pass(plain), rz))
            torch.backends.cuda.matmul.allow_tf32 = False
        record("plain_autocast_bf16", time_it(lambda: plain_pass(plain, autocast=True), rz))
        del plain
        for dtype in ("float32", "bfloat16"):
            spec = spec_of(dtype)
            record(f"pipeline_split_{dtype}", time_it(lambda: pipe_pass(spec), lambda: zero(spec)))
            record(f"pipeline_fused_{dtype}",
                   time_it(lambda: pipe_pass(spec, split=False), lambda: zero(spec)))
        plain16 = plain_model(torch.bfloat16)
        record("plain_bf16_params", time_it(lambda: plain_pass(plain16),
                                            lambda: plain16.zero_grad(set_to_none=True)))
        del plain16
        # the optimizer step as the pipeline ops make it (per-parameter .item() in grad_stats,
        # AdamW foreach=False) against torch's fused AdamW on the same parameters
        spec = spec_of("float32")
        stats, _ = pipe_pass(spec)
        norms, steps = pipe_optimizer(spec, stats)
        out["grad_stats_ms"] = round(norms * 1e3, 2)
        out["optimizer_step_ms_foreach_false"] = round(steps * 1e3, 2)
        if DEV.type == "cuda":
            params = [p for part in held_model(ctx, {**spec, "stages": 2}).parts
                      for p in part.parameters()]
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            fused = torch.optim.AdamW(params, lr=1e-4, fused=True)
            fused.step()
            t0 = now()
            fused.step()
            out["optimizer_step_ms_torch_fused"] = round((now() - t0) * 1e3, 2)
            for p in params:
                p.grad = None
        return out

    # 3. autocast around the split backward (what a GPU user would add first)
    @guarded("split_backward_under_autocast")
    def _():
        spec = spec_of("float32", "_amp")
        try:
            with torch.autocast(DEV.type, dtype=torch.bfloat16):
                pipe_pass(spec)
            return {"ran": True}
        finally:
            zero(spec)

    # 4. offload on the device (pinned host copies on a side stream: never run before)
    @guarded("offload")
    def _():
        spec = spec_of("float32", "_off")
        zero(spec)
        t0 = now()
        _, mem_plain = pipe_pass(spec, measure_mem=True)
        plain_s = now() - t0
        ref = pipe_grads(spec)
        zero(spec)
        pipe_pass(spec)  # run to run: CUDA's atomics (the embedding's backward) add in any order
        noise = max(rel_diff(g, ref[k]) for k, g in pipe_grads(spec).items())
        zero(spec)
        peak_reset()
        passes = []
        for _ in range(2):  # the first pass pins its host memory; the second reuses it
            t0 = now()
            _, mem_off = pipe_pass(spec, offload=True, measure_mem=True)
            passes.append(round((now() - t0) * 1e3, 1))
            got = pipe_grads(spec)
            zero(spec)
        diff = max(rel_diff(got[k], ref[k]) for k in ref)
        equal = all(torch.equal(got[k], ref[k]) for k in ref)
        return {"grads_bitwise_equal": equal, "max_rel_diff": diff, "run_to_run_rel_diff": noise,
                "allocated_after_all_F_gib": {"no_offload": mem_plain, "offload": mem_off},
                "pass_ms": {"no_offload": round(plain_s * 1e3, 1), "offload_first": passes[0],
                            "offload_second": passes[1]},
                "ok": diff <= max(4 * noise, 1e-6)}

    def flops_per_token() -> float:
        """6N + 12 L H T (PaLM's, nanoGPT's estimate_mfu): forward and backward."""
        n = sum(p.numel() for p in GPT(**cfg).parameters())
        return 6 * n + 12 * cfg["n_layer"] * cfg["n_embd"] * T

    # 6. bf16 mixed precision as flowkit runs it (precision="bf16": fp32 weights, gradients and
    # optimizer states, forwards under autocast): grads vs a plain autocast loop, ms/step, MFU
    @guarded("bf16_mixed_precision")
    def _():
        spec = {**spec_of("float32", "_mixed"), "precision": "bf16"}
        zero(spec)
        pipe_pass(spec)
        pgrads = pipe_grads(spec)
        plain = plain_model(torch.float32)
        plain_pass(plain, autocast=True)
        out = {"grads_vs_plain_autocast": compare_grads(pgrads, plain)}
        del plain
        flops = flops_per_token()
        for split in (True, False):
            seconds = time_it(lambda: pipe_pass(spec, split=split), lambda: zero(spec))
            tps = tokens_per_step / seconds
            out["split" if split else "fused"] = {
                "ms_per_step": round(seconds * 1e3, 2), "tokens_per_s": round(tps),
                "mfu_vs_bf16_peak": round(tps * flops / PEAK_BF16, 4) if PEAK_BF16 else None}
        out["model_flops_per_token"] = flops
        out["peak_flops_assumed"] = PEAK_BF16
        return out

    # 8. cuDNN attention in training at a fixed shape (the executors turn it off for the
    # decode steps' sake: executors/torch/device.py), the bf16 mixed step with it off and on
    @guarded("bf16_mixed_attention_backend")
    def _():
        spec = {**spec_of("float32", "_mixed"), "precision": "bf16"}
        before, out = torch.backends.cuda.cudnn_sdp_enabled(), {}
        try:
            for label, cudnn in (("cudnn_off", False), ("cudnn_on", True)):
                torch.backends.cuda.enable_cudnn_sdp(cudnn)
                seconds = time_it(lambda: pipe_pass(spec, split=False), lambda: zero(spec))
                out[label] = {"ms_per_step": round(seconds * 1e3, 2)}
        finally:
            torch.backends.cuda.enable_cudnn_sdp(before)
        return out

    # 7. where a bf16 mixed-precision pipeline step goes, against a plain autocast loop: the
    # ops by CPU and by device time, and the host syncs (pipeline_profile.txt)
    @guarded("bf16_mixed_profile")
    def _():
        from torch.profiler import ProfilerActivity, profile
        spec = {**spec_of("float32", "_mixed"), "precision": "bf16"}
        plain = plain_model(torch.float32)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV.type == "cuda" else [])
        out, tables = {}, []
        for name, fn, reset in (
                ("pipeline_fused", lambda: pipe_pass(spec, split=False), lambda: zero(spec)),
                # B then W cost 1.30x the fused backward on an H200 (1.04-1.07x on a CPU)
                ("pipeline_split", lambda: pipe_pass(spec), lambda: zero(spec)),
                ("plain_autocast", lambda: plain_pass(plain, autocast=True),
                 lambda: plain.zero_grad(set_to_none=True))):
            reset()
            fn()
            reset()
            sync()
            with profile(activities=acts) as prof:
                fn()
                sync()
            reset()
            events = prof.key_averages()
            syncs = sum(e.count for e in events if e.key in (
                "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
                "aten::item", "aten::_local_scalar_dense"))
            cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
            out[name] = {"syncs_and_copies": syncs, "ops": sum(e.count for e in events),
                         "top_self_cpu_ms": {e.key[:60]: round(e.self_cpu_time_total / 1e3, 2)
                                             for e in cpu}}
            for key in ("self_device_time_total", "self_cpu_time_total"):
                try:
                    tables.append(f"== {name} by {key}\n" + events.table(sort_by=key,
                                                                         row_limit=20))
                except Exception:  # noqa: BLE001
                    pass
        with open(os.path.join(OUT, "pipeline_profile.txt"), "w") as f:
            f.write("\n".join(tables))
        del plain
        return out

    # 5. bf16 parameters (held.py casts the whole model; AdamW then updates bf16 weights):
    # the share of weights one AdamW step leaves unchanged, at an RL post-training lr
    @guarded("bf16_param_updates")
    def _():
        out = {}
        for dtype, lr in ((torch.float32, 1e-6), (torch.bfloat16, 1e-6), (torch.bfloat16, 3e-4)):
            model = plain_model(dtype)
            before = [p.detach().clone() for p in model.parameters()]
            plain_pass(model)
            adamw_plain(model, lr=lr)
            same = sum(int((p.detach() == b).sum()) for p, b in zip(model.parameters(), before))
            total = sum(b.numel() for b in before)
            out[f"{str(dtype).removeprefix('torch.')}_lr{lr:g}_unchanged_fraction"] = round(
                same / total, 4)
            del model, before
        return out

    save("pipeline")


# -- (c) rollout engine vs HF generate -------------------------------------------------------
def engine() -> None:
    from executors.torch.rollout.engine import Engine, Sampling, run_until_done
    from executors.torch.models.hf import HFCausalLM
    from flowkit.ops.records import Prompt

    def prompts_of(count: int, length: int, vocab: int, seed: int = 0) -> list:
        g = torch.Generator().manual_seed(seed)
        return [Prompt(prompt_id=i, tokens=torch.randint(1, vocab, (length,), generator=g).tolist())
                for i in range(count)]

    def run_engine(model, prompts, new, *, max_batch, n=1, budget=512) -> tuple[dict, list]:
        eng = Engine(model, version=lambda: None, max_batch=max_batch, token_budget=budget)
        warm = eng.submit(prompts[:2], Sampling(max_new_tokens=2, temperature=0.0), 1)
        run_until_done({"g": eng}, warm)
        peak_reset()
        t0 = now()
        d = eng.submit(prompts, Sampling(max_new_tokens=new, temperature=0.0), n)
        rollouts = run_until_done({"g": eng}, d)
        seconds = now() - t0
        made = sum(len(r.response_tokens) for r in rollouts)
        steps = eng.stats["steps"]
        out = {"rows": len(prompts) * n, "new_tokens": new, "max_batch": max_batch,
               "cache_positions": eng.max_len, "seconds": round(seconds, 3),
               "tokens_per_s": round(made / seconds), "steps": steps,
               "ms_per_step": round(seconds * 1e3 / max(1, steps), 2), "peak_gib": peak()}
        del eng
        peak_reset()
        return out, sorted(rollouts, key=lambda r: (r.prompt_id, r.sample))

    def run_hf(model, prompts, new) -> tuple[dict, torch.Tensor]:
        hf = model._lm[0].eval()
        ids = torch.tensor([p.tokens for p in prompts], device=DEV)
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                  do_sample=False, pad_token_id=0)
        with torch.no_grad():
            hf.generate(input_ids=ids[:2], **{**kw, "attention_mask": kw["attention_mask"][:2],
                                               "max_new_tokens": 2, "min_new_tokens": 2})
            peak_reset()
            t0 = now()
            out = hf.generate(input_ids=ids, **kw)
            seconds = now() - t0
        made = (out.shape[1] - ids.shape[1]) * out.shape[0]
        res = {"rows": len(prompts), "new_tokens": new, "seconds": round(seconds, 3),
               "tokens_per_s": round(made / seconds), "peak_gib": peak()}
        peak_reset()
        return res, out[:, ids.shape[1]:].cpu()

    def agreement(rollouts, ref: torch.Tensor) -> float:
        """Mean share of each row's tokens before its first disagreement."""
        shares = []
        for r, row in zip(rollouts, ref.tolist()):
            k = 0
            for a, b in zip(r.response_tokens, row):
                if a != b:
                    break
                k += 1
            shares.append(k / max(1, len(row)))
        return round(sum(shares) / len(shares), 4)

    # 1. a tiny Qwen2 in float32: correctness (engine on the device vs HF generate vs the CPU)
    @guarded("tiny_qwen2_fp32")
    def _():
        cfg = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=256, vocab_size=512,
                   max_position_embeddings=256)
        torch.manual_seed(0)
        model = HFCausalLM(architecture="qwen2", hf_config=cfg).to(DEV)
        prompts = prompts_of(16, 16, cfg["vocab_size"])
        e, rollouts = run_engine(model, prompts, 32, max_batch=16)
        h, ref = run_hf(model, prompts, 32)
        out = {"engine": e, "hf_generate": h,
               "greedy_agreement_engine_vs_hf": agreement(rollouts, ref)}
        if DEV.type == "cuda":
            cpu_model = model.to("cpu")
            _, on_cpu = run_engine(cpu_model, prompts, 32, max_batch=16)
            out["greedy_agreement_engine_device_vs_cpu"] = agreement(
                rollouts, torch.tensor([r.response_tokens for r in on_cpu]))
        return out

    @guarded("hf_folder_loads_on_device")
    def _():
        # an HF folder loaded by a build straight in its dtype on its device (building_on)
        import tempfile

        from executors.torch.device import building_on
        cfg = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=128, vocab_size=256)
        folder = tempfile.mkdtemp()
        HFCausalLM(architecture="qwen2", hf_config=cfg)._lm[0].save_pretrained(folder)
        dtype = torch.bfloat16 if DEV.type == "cuda" else torch.float32
        with building_on(DEV, dtype):
            loaded = HFCausalLM(path=folder)
        kinds = {(p.device.type, str(p.dtype)) for p in loaded.parameters()}
        assert kinds == {(DEV.type, str(dtype))}, kinds
        return {"parameters": sorted(kinds)}

    # 2. a Qwen2.5-0.5B-shaped model (random weights, bf16): throughput
    if DRY:
        big = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=128, vocab_size=1000,
                   max_position_embeddings=32768, tie_word_embeddings=True)
        P, NEW, SMALL_CTX, LONG_CTX, LONG_NEW, dtype = 8, 8, 256, 1024, 4, torch.float32
    else:
        big = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                   num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                   max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1e6)
        P, NEW, SMALL_CTX, LONG_CTX, LONG_NEW, dtype = 64, 128, 2048, 32768, 64, torch.bfloat16
    state: dict = {}

    @guarded("qwen05b_build")
    def _():
        t0 = time.perf_counter()
        torch.manual_seed(0)
        model = HFCausalLM(architecture="qwen2", hf_config=big).to(device=DEV, dtype=dtype)
        state["model"] = model
        return {"config": big, "dtype": str(dtype), "seconds": round(time.perf_counter() - t0, 1),
                "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}

    def context(n: int) -> None:
        state["model"].config.max_position_embeddings = n  # what the engine sizes its cache by

    @guarded("qwen05b_attention_backend")
    def _():
        # cuDNN's attention builds a graph for each new shape, and a decode step's keys grow
        # by one: the engine with SDPA's cuDNN backend off, on, and off again (the executors
        # turn it off: executors/torch/device.py), and HF generate with it off
        model, out = state["model"], {}
        context(SMALL_CTX)
        prompts = prompts_of(P, 32, big["vocab_size"], seed=3)
        before = torch.backends.cuda.cudnn_sdp_enabled()
        try:
            for label, cudnn in (("off", False), ("on", True), ("off_again", False)):
                torch.backends.cuda.enable_cudnn_sdp(cudnn)
                out[f"engine_cudnn_{label}"], _ = run_engine(model, prompts, NEW, max_batch=P)
            torch.backends.cuda.enable_cudnn_sdp(False)
            out["hf_generate_cudnn_off"], _ = run_hf(model, prompts, NEW)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(before)
        return out

    @guarded("qwen05b_throughput")
    def _():
        model, out = state["model"], {}
        prompts64 = prompts_of(P, 32, big["vocab_size"])
        prompts256 = prompts_of(4 * P, 32, big["vocab_size"], seed=1)
        out["hf_generate_bs64"], ref = run_hf(model, prompts64, NEW)
        context(SMALL_CTX)
        out[f"engine_ctx{SMALL_CTX}_bs64"], rollouts = run_engine(model, prompts64, NEW,
                                                                  max_batch=P)
        out["greedy_agreement_engine_vs_hf_bs64"] = agreement(rollouts, ref)
        out["hf_generate_bs256"], _ = run_hf(model, prompts256, NEW)
        out[f"engine_ctx{SMALL_CTX}_bs256"], _ = run_engine(model, prompts256, NEW,
                                                            max_batch=4 * P)
        grpo = prompts_of(P // 4, 32, big["vocab_size"], seed=2)  # 16 prompts x 8 samples
        out[f"engine_ctx{SMALL_CTX}_grpo_16x8"], _ = run_engine(model, grpo, NEW,
                                                                max_batch=2 * P, n=8)
        return out

    @guarded("qwen05b_engine_at_model_context")
    def _():
        # the engine sizes its cache by the model's context (32k for Qwen2.5), not the request
        model = state["model"]
        context(LONG_CTX)
        prompts = prompts_of(P, 32, big["vocab_size"])
        out, _ = run_engine(model, prompts, LONG_NEW, max_batch=P)
        return out

    @guarded("qwen05b_engine_profile")
    def _():
        from torch.profiler import ProfilerActivity, profile
        model = state["model"]
        context(LONG_CTX)
        eng = Engine(model, version=lambda: None, max_batch=P, token_budget=512)
        eng.submit(prompts_of(P, 32, big["vocab_size"]), Sampling(max_new_tokens=40,
                                                                  temperature=0.0), 1)
        for _ in range(8):  # past the prefill: every row decodes
            eng.step()
        sync()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(2):
                eng.step()
            sync()
        events = prof.key_averages()
        if DEV.type == "cuda":
            attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") \
                else "self_cuda_time_total"
        else:
            attr = "self_cpu_time_total"
        top = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:15]
        rows = [{"name": e.key[:90], "self_ms_per_step": round(getattr(e, attr) / 2e3, 3),
                 "calls_per_step": e.count // 2} for e in top]
        try:
            table = events.table(sort_by=attr, row_limit=25)
        except Exception:  # noqa: BLE001
            table = events.table(sort_by="self_cpu_time_total", row_limit=25)
        with open(os.path.join(OUT, "engine_profile.txt"), "w") as f:
            f.write(f"engine decode steps at {LONG_CTX} cache positions, batch {P}, by {attr}\n")
            f.write(table)
        del eng
        peak_reset()
        return {"sorted_by": attr, "decode_step_top_ops": rows}

    @guarded("weight_sync_path")
    def _():
        # export_weights -> the wire -> load_weights, as a trainer-to-generator sync goes
        from executors.torch import weights as W
        from flowkit.wire.serialize import pack, unpack
        model = state["model"]
        lay = W.layout(model)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        t0 = now()
        W.export(model, lay.names[0])  # a pageable copy a parameter, as before one_buffer
        pageable = now() - t0
        W.export(model, lay.names[0], one_buffer=True)  # pins its buffer (kept for the next)
        t = [now()]
        exported = W.export(model, lay.names[0], one_buffer=True)  # as export_weights does
        t.append(now())
        named = dict(model.named_parameters())
        one_buffer_equal = all(torch.equal(exported[lay.names[0][k]], p.detach().cpu())
                               for k, p in named.items() if k in lay.names[0])
        body, frames = pack(exported)
        copies = []
        for fr in frames:  # the one memcpy into a shared-memory segment
            buf = bytearray(memoryview(fr).nbytes)
            buf[:] = memoryview(fr).cast("B")
            copies.append(memoryview(buf))
        t.append(now())
        value = unpack(body, copies)
        W.load([model], lay, value)
        t.append(now())
        d2d = [p.detach().clone() for p in model.parameters()]
        t.append(now())
        del d2d
        pinned = None
        if DEV.type == "cuda":
            host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                    for p in model.parameters()]
            t0 = now()
            for h, p in zip(host, model.parameters()):
                h.copy_(p.detach(), non_blocking=True)
            pinned = now() - t0
            del host
        gbps = lambda s: round(nbytes / s / 1e9, 2) if s else None  # noqa: E731
        return {"gbytes": round(nbytes / 1e9, 3),
                "export_d2h_s": round(t[1] - t[0], 3), "export_GBps": gbps(t[1] - t[0]),
                "export_pageable_s": round(pageable, 3), "one_buffer_equal": one_buffer_equal,
                "pack_and_copy_s": round(t[2] - t[1], 3),
                "unpack_and_load_h2d_s": round(t[3] - t[2], 3), "load_GBps": gbps(t[3] - t[2]),
                "total_s": round(t[3] - t[0], 3),
                "device_to_device_clone_s": round(t[4] - t[3], 4),
                "pinned_nonblocking_d2h_s": None if pinned is None else round(pinned, 3),
                "pinned_GBps": gbps(pinned)}

    save("engine")


# -- NCCL group as replicas.py builds it (one rank: a one-GPU machine) -------------------------
def nccl() -> None:
    from executors.optable import OpContext
    from executors.torch.train import replicas as R

    @guarded("replica_group_size1")
    def _():
        ctx = OpContext(name="nccl", device=str(DEV), tags=())
        address = R._replica_store(ctx, group="g", size=1)
        R._replica_group(ctx, address, group="g", rank=0, size=1, timeout_s=60)
        group = R.replica_group(ctx, "g")
        p = torch.nn.Parameter(torch.ones(1 << 20, device=DEV))
        p.grad = torch.full_like(p, 2.0)
        R.all_reduce_grads(group, [p])
        R.broadcast_shards(group, [p])
        sync()
        return {"backend": type(group).__name__, "ok": bool(torch.all(p.grad == 2.0)),
                "note": "two replicas on one GPU (--device cuda:0 --replicas 2) are refused "
                        "before a run starts: NCCL takes one rank a device"}

    # what the CPU tests check only through stubs of torch.cuda
    @guarded("cuda_settings_and_state")
    def _():
        from executors.torch.device import configure_tf32, peak_flops, to_device
        from executors.torch.rollout.engine import free_device_memory
        from executors.torch.state import cuda_rng_states
        out = {"tf32": configure_tf32(), "matmul_precision": torch.get_float32_matmul_precision(),
               "peak_flops": peak_flops(str(DEV))}
        host = torch.arange(1 << 20, dtype=torch.float32)
        out["to_device_equal"] = bool(torch.equal(to_device(host, DEV).cpu(), host))
        if DEV.type == "cuda":
            torch.rand(1, device=DEV)
            states = cuda_rng_states()
            first = torch.rand(4, device=DEV)
            torch.cuda.set_rng_state(states[0], 0)
            out["cuda_rng_restored"] = bool(torch.equal(torch.rand(4, device=DEV), first))
            x = torch.empty(1 << 28, dtype=torch.uint8, device=DEV)
            del x
            before = torch.cuda.memory_reserved()
            free_device_memory(DEV)
            out["empty_cache_released_gib"] = gib(before - torch.cuda.memory_reserved())
        return out

    # a weight group as the runner joins one (weights=True: connected by one small broadcast,
    # NCCL on a GPU) and an exporter's self-load through it (one rank: one GPU)
    @guarded("weight_group_size1")
    def _():
        from executors.torch import weight_broadcast as B
        ctx = OpContext(name="weights", device=str(DEV), tags=())
        address = R._replica_store(ctx, group="w", size=1)
        R._replica_group(ctx, address, group="w", rank=0, size=1, weights=True)
        params = [torch.randn(1 << 20, device=DEV), torch.randn(64, 64, device=DEV)]
        record = B.send(ctx, params, [("a", 0), ("b", 1)], "w", for_self=True)
        got = B.received(ctx, record, DEV, limit=1 << 30)
        sync()
        return {"backend": type(R.replica_group(ctx, "w")).__name__,
                "equal": bool(torch.equal(got["a"], params[0]) and torch.equal(got["b"],
                                                                              params[1])),
                "note": "a broadcast to other ranks needs a GPU each: not on one GPU"}

    save("nccl")

# -- weights between two processes on one GPU (CUDA IPC) against the host path ----------------
IPC_LAYERS, IPC_WIDTH = (2, 256) if DRY else (20, 5000)  # 20 x 5000^2 in bf16: 1.0 GB


def ipc_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(IPC_WIDTH, IPC_WIDTH, bias=True) for _ in range(IPC_LAYERS)]
    return torch.nn.Sequential(*layers).to(DEV, torch.bfloat16)


def checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def ipc() -> None:
    """A trainer-side process shares a 1 GB model through CUDA IPC (cuda_share.share) with a
    reader process that loads it as load_weights does; three rounds, each after a change."""
    import subprocess
    from executors.torch import cuda_share
    from executors.torch import weights as W
    from flowkit.wire.serialize import pack, unpack

    @guarded("weights_ipc")
    def _():
        model = ipc_model()
        lay = W.layout(model)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        reader = "self" if DRY else "reader"  # no IPC on a CPU: the same-process path
        child = None if DRY else subprocess.Popen(
            [sys.executable, __file__, "ipc_reader"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE)
        rounds, allocated = [], []
        for k in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-2)
            t0 = now()
            params, named = W.exported(model, lay.names[0])
            record = cuda_share.share(params, named, [reader], "self")
            del params
            share_s = now() - t0
            body, frames = pack(record)
            if child is None:
                t1 = now()
                got = cuda_share.opened(record, "self", DEV)
                twin = ipc_model()
                W.load([twin], W.layout(twin), got)
                reply = {"load_s": now() - t1, "checksum": checksum(twin)}
                del got, twin
            else:
                child.stdin.write(len(body).to_bytes(8, "little") + body)
                child.stdin.flush()
                reply = json.loads(child.stdout.readline())
            rounds.append({"share_s": round(share_s, 4), "load_s": round(reply["load_s"], 4),
                           "equal": reply["checksum"] == checksum(model),
                           "record_bytes": len(body), "frames": len(frames)})
            del record
            if DEV.type == "cuda":
                torch.cuda.ipc_collect()
                allocated.append(gib(torch.cuda.memory_allocated()))
        if child is not None:
            child.stdin.close()
            child.wait(timeout=60)
        # the host path for the same model in one process: export (one pinned buffer), load
        twin = ipc_model()
        W.export(model, lay.names[0], one_buffer=True)  # pins its buffer once
        t0 = now()
        exported = W.export(model, lay.names[0], one_buffer=True)
        W.load([twin], W.layout(twin), unpack(*pack(exported)))
        host_s = now() - t0
        return {"gbytes": round(nbytes / 1e9, 3), "rounds": rounds,
                "allocated_gib_after_each_round": allocated,
                "host_path_export_and_load_s": round(host_s, 4),
                "host_path_equal": checksum(twin) == checksum(model)}

    save("ipc")


def ipc_reader() -> None:
    """The reader process of ipc(): each record from stdin loaded into its own model."""
    from executors.torch import cuda_share
    from executors.torch import weights as W
    from flowkit.wire.serialize import unpack

    model = ipc_model()
    lay = W.layout(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    while True:
        size = sys.stdin.buffer.read(8)
        if len(size) < 8:
            return
        record = unpack(sys.stdin.buffer.read(int.from_bytes(size, "little")), [])
        t0 = now()
        got = cuda_share.opened(record, "reader", DEV)
        W.load([model], lay, got)
        del got  # releases the exporter's buffer (torch's IPC counter)
        load_s = now() - t0
        print(json.dumps({"load_s": load_s, "checksum": checksum(model)}), flush=True)


if __name__ == "__main__":
    SECTION = sys.argv[1]
    {"env": env, "pipeline": pipeline, "engine": engine, "nccl": nccl, "ipc": ipc,
     "ipc_reader": ipc_reader}[SECTION]()
FK_PY_EOF
  cat >"$WORK/fk_summary.py" <<'FK_PY_EOF'
"""Merge the device check's parts into $OUT/device_check.json and print a compact summary."""
from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET

parts, out, status_file = os.environ["FK_PARTS"], os.environ["OUT"], sys.argv[1]
result: dict = {"sections": {}}
for line in open(status_file):
    name, rc, seconds = line.split()
    result["sections"][name] = {"rc": int(rc) if rc.lstrip("-").isdigit() else rc,
                                "seconds": float(seconds)}
for fname in sorted(os.listdir(parts)):
    path = os.path.join(parts, fname)
    if fname.endswith(".json"):
        try:
            result[fname[:-5]] = json.load(open(path))
        except Exception as exc:  # noqa: BLE001
            result[fname[:-5]] = {"error": f"unreadable: {exc}"}
    elif fname.endswith(".txt"):
        result[fname[:-4]] = open(path, errors="replace").read()[-3000:]


def junit(path: str) -> dict:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    cases = {}
    for case in suite.iter("testcase"):
        state = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                state = f"{tag}: {(node.get('message') or '')[:200]}"
        cases[case.get("name")] = state
    return {"tests": int(suite.get("tests", 0)), "failures": int(suite.get("failures", 0)),
            "errors": int(suite.get("errors", 0)), "skipped": int(suite.get("skipped", 0)),
            "cuda_tests": {k: v for k, v in cases.items() if "cuda" in k.lower()}}


if os.path.exists(os.path.join(parts, "junit.xml")):
    try:
        result["pytest_sampling"] = junit(os.path.join(parts, "junit.xml"))
    except Exception as exc:  # noqa: BLE001
        result["pytest_sampling"] = {"error": str(exc)}


def metrics(path: str) -> dict:
    """Per key of interest: first, median and last over the run's steps."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    keys = ("step_s", "loss", "reward_mean", "tokens_per_s", "mfu", "timing_s/generate",
            "timing_s/update_actor", "timing_s/backprop", "update_actor/mismatch/kl",
            "actor/sync_bytes", "generate/second_rounds", "generate/second_round_samples",
            "grpo_advantages/second_round_kept")
    out = {"steps": len(rows)}
    for key in keys:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if values:
            ordered = sorted(values)
            sig = lambda v: float(f"{v:.4g}")  # noqa: E731
            out[key] = {"first": sig(values[0]), "median": sig(ordered[len(values) // 2]),
                        "last": sig(values[-1])}
    return out


RUNS = ("sft_cuda", "grpo_cuda", "grpo_host_sync_cuda", "grpo_bf16_cuda", "grpo_shared_cuda0",
        "grpo_tis_bf16_cuda", "grpo_second_round", "grpo_cpu")
for name in RUNS:
    path = os.path.join(parts, f"{name}.jsonl")
    if os.path.exists(path):
        try:
            result[f"{name}_metrics"] = metrics(path)
        except Exception as exc:  # noqa: BLE001
            result[f"{name}_metrics"] = {"error": str(exc)}

with open(os.path.join(out, "device_check.json"), "w") as f:
    json.dump(result, f, indent=1, default=str)


# -- the compact summary ----------------------------------------------------------------------
def g(*keys, default="-"):
    node = result
    for k in keys:
        if not isinstance(node, dict) or k not in node:
            return default
        node = node[k]
    if isinstance(node, dict) and "trace" in node:  # the error line only; the JSON has it all
        node = {k: v for k, v in node.items() if k != "trace"}
    return node


print("\n================ flowkit device check: summary ================")
env = result.get("env", {})
print(f"device: {env.get('device', 'n/a')}  torch {env.get('torch')} (cuda {env.get('torch_cuda')})"
      f"  python {env.get('python')}  zmq {env.get('zmq')}  transformers {env.get('transformers')}")
print("sections (rc, s): " + ", ".join(f"{k}={v['rc']}/{v['seconds']:.0f}"
                                          for k, v in result["sections"].items()))
ps = result.get("pytest_sampling", {})
print(f"(a) test_sampling.py + packing's varlen kernel: {ps.get('tests')} tests, {ps.get('failures')} failed,"
      f" {ps.get('errors')} errors, {ps.get('skipped')} skipped; cuda: {ps.get('cuda_tests')}")
pipe = result.get("pipeline", {})
eq = pipe.get("equality_fp32", {})
print(f"(b) pipeline F/B/W vs plain loop (fp32): grads {g('pipeline', 'equality_fp32', 'grads')}"
      f", weights after the step on the same grads, rel diff "
      f"{eq.get('weights_after_step_same_grads_max_rel_diff', eq.get('error'))}; after each's own"
      f" step, share off by lr/2 {eq.get('weights_after_own_step_share_off_by_half_lr')}")
for k, v in g("pipeline", "timing", default={}).items():
    print(f"    {k}: {v}")
print(f"    autocast around split B/W: {g('pipeline', 'split_backward_under_autocast')}")
print(f"    offload on device: {g('pipeline', 'offload')}")
print(f"    bf16 mixed precision: {g('pipeline', 'bf16_mixed_precision')}")
print(f"    bf16 mixed step, cuDNN attention off and on: "
      f"{g('pipeline', 'bf16_mixed_attention_backend')}")
print(f"    bf16 mixed step, profiled: {g('pipeline', 'bf16_mixed_profile')}")
print(f"    bf16 params, weights unchanged by one AdamW step: "
      f"{g('pipeline', 'bf16_param_updates')}")
eng = result.get("engine", {})
print(f"(c) tiny qwen2 fp32: {g('engine', 'tiny_qwen2_fp32')}")
for k, v in g("engine", "qwen05b_attention_backend", default={}).items():
    print(f"    attention backend, {k}: {v}")
for k, v in g("engine", "qwen05b_throughput", default={}).items():
    print(f"    {k}: {v}")
print(f"    engine at the model's context: {g('engine', 'qwen05b_engine_at_model_context')}")
for row in g("engine", "qwen05b_engine_profile", "decode_step_top_ops", default=[])[:6]:
    print(f"    profile: {row}")
print(f"    weight sync path: {g('engine', 'weight_sync_path')}")
print(f"(f) weights through CUDA IPC: {g('ipc', 'weights_ipc')}")
print(f"nccl (replicas.py, one rank): {g('nccl', 'replica_group_size1')}")
print(f"weight group (one rank): {g('nccl', 'weight_group_size1')}")
print(f"cuda settings and state: {g('nccl', 'cuda_settings_and_state')}")
for name in RUNS:
    m = result.get(f"{name}_metrics")
    if m:
        print(f"(d) {name}: {json.dumps(m, default=str)[:600]}")
if "cli_broadcast_one_gpu" in result:
    print(f"(f) --weight-sync broadcast, 2 executors, 1 GPU: ...{str(result['cli_broadcast_one_gpu'])[-400:]}")
if "cli_bare_cuda" in result:
    print(f"(d) --device cuda, 2 executors, 1 GPU: ...{str(result['cli_bare_cuda'])[-500:]}")
print(f"results: {os.path.join(out, 'device_check.json')}")
FK_PY_EOF
}

main "$@" 2>&1 | tee "$OUT/device_check.log"
exit "${PIPESTATUS[0]}"
