"""One model in several shapes: names by the unsplit GPT, a trainer's two stages exported into a
whole copy that generates (on one executor or another), checkpoints, and the errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from executors.optable import Deferred, OpContext, OpTable
from executors.torch import register as register_torch
from executors.torch import weights
from executors.torch.errors import StageError
from executors.torch.rollout.engine import run_until_done
from flowkit.ops.records import Prompt, Rollout, WeightsVersion
from tests.harness import gpt_spec, op_context, seeded_gpt, tiny_gpt


# Weights by name between one split's stages and the unsplit model, which the round trip below
# checks export and load against.
def to_unsplit(tensors: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """One stage's values by its local names -> by the unsplit model's names."""
    unknown = sorted(set(tensors) - set(names))
    if unknown:
        raise StageError(f"this stage has no parameters named {weights._few(unknown)}")
    return {names[local]: value for local, value in tensors.items()}


def to_local(tensors: Mapping[str, Any], names: Sequence[Mapping[str, str]],
             aliases: Mapping[str, Sequence[str]] | None = None) -> list[dict[str, Any]]:
    """Values by unsplit name -> per stage of a split named by `names`, by its local names.
    A tied weight given under any of its `aliases` fills every local copy; names the values
    lack are left out."""
    out = []
    for mapping in names:
        stage = {}
        for local, unsplit in mapping.items():
            source = weights._source(unsplit, tensors, aliases or {})
            if source is not None:
                stage[local] = tensors[source]
        out.append(stage)
    return out


GPT_CONFIG = tiny_gpt(n_layer=4)
SPEC = gpt_spec("actor", GPT_CONFIG, seed=3)
LR = {"lr": 1e-2, "clip_grad_norm": 1.0}

_TABLE = OpTable()
register_torch(_TABLE)


def _op(name: str, ctx: OpContext, *inputs, **config):
    result = _TABLE.get(name)(ctx, *inputs, **config)
    # a deferred op (generate: a request to the engine) runs to its end, as on an executor
    return run_until_done(ctx.background, result) if isinstance(result, Deferred) else result


def _batches(step: int, microbatches: int = 2, rows: int = 3, seq: int = 12) -> list:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randint(0, 64, (rows, seq + 1), generator=g) for _ in range(microbatches)]


def _train_step(ctx: OpContext, step: int, spec: dict = SPEC) -> WeightsVersion:
    """One step of the 2-stage split on `ctx` through the ops (F, B, W, grad stats, AdamW)."""
    batches = _batches(step)
    two = {**spec, "stages": 2}
    stats = []
    for mb, tokens in enumerate(batches):
        act = _op("F", ctx, tokens, stage=0, microbatch=mb, **two)
        out = _op("F", ctx, act, tokens, stage=1, microbatch=mb, loss_scale=1 / len(batches),
                  **two)
        stats.append(out)
        grad = _op("B", ctx, out, stage=1, microbatch=mb, **two)
        _op("B", ctx, grad, stage=0, microbatch=mb, **two)
        _op("W", ctx, stage=1, microbatch=mb, **two)
        _op("W", ctx, stage=0, microbatch=mb, **two)
    s0, tied = _op("grad_stats", ctx, stage=0, **two)
    s1, summed = _op("grad_stats", ctx, tied, stage=1, **two)
    _op("optimizer_step", ctx, s0, s1, stage=1, step=step, **LR, **two)
    _, version = _op("optimizer_step", ctx, stats, s0, s1, summed, stage=0, step=step,
                     report=True, **LR, **two)
    return version


def _export(ctx: OpContext, stages: int, spec: dict = SPEC) -> list[dict]:
    return [_op("export_weights", ctx, stage=s, stages=stages, **spec) for s in range(stages)]


def _held(ctx: OpContext, stages: int, name: str = "actor"):
    return ctx.state["torch_models"][(name, stages)]


def _assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


# -- names ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seq_len", [None, 4])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_stage_names_name_every_split_parameter_by_the_unsplit_model(stages, seq_len):
    model = seeded_gpt(GPT_CONFIG)
    whole = dict(model.named_parameters(remove_duplicate=False))
    names = model.stage_names(stages, seq_len=seq_len)
    covered = set()
    for s, part in enumerate(model.split(stages, seq_len=seq_len)):
        params = dict(part.named_parameters(remove_duplicate=False))
        assert set(params) == set(names[s])
        for local, p in params.items():
            unsplit = names[s][local]
            if stages > 1 and local == "lm_head.weight":  # the last stage's untied copy
                assert p is not whole[unsplit] and torch.equal(p, whole[unsplit])
            else:
                assert p is whole[unsplit], (s, local, unsplit)
            covered.add(unsplit)
    assert covered == set(model.state_dict())
    if stages > 1:
        assert names[0]["h.0.attn.c_attn.weight"] == "transformer.h.0.attn.c_attn.weight"
        first = sum(1 for n in names[0] if n.endswith(".attn.c_attn.weight"))
        assert names[1]["h.0.ln_1.weight"] == f"transformer.h.{first}.ln_1.weight"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_weights_round_trip_from_any_split_to_any_other(n):
    source = seeded_gpt(GPT_CONFIG)
    parts = source.split(n)
    lay = weights.layout(source, parts)
    exported = [weights.export(part, lay.names[s]) for s, part in enumerate(parts)]
    for s, part in enumerate(parts):
        local = {k: v.detach() for k, v in part.named_parameters(remove_duplicate=False)}
        _assert_same(to_unsplit(local, lay.names[s]), exported[s])
    merged = weights.merge(exported)
    _assert_same(merged, {k: v for k, v in source.state_dict().items()})
    idx = torch.randint(0, 64, (2, 10))
    for m in range(1, 5):
        target = seeded_gpt(GPT_CONFIG, seed=1)  # other weights, to be overwritten
        tparts = target.split(m)
        tlay = weights.layout(target, tparts)
        mine = to_local(merged, tlay.names, tlay.aliases)
        for s, part in enumerate(tparts):
            assert set(mine[s]) == {k for k, _ in part.named_parameters(remove_duplicate=False)}
            _assert_same(to_unsplit(mine[s], tlay.names[s]),
                         {tlay.names[s][k]: merged[tlay.names[s][k]] for k in mine[s]})
        weights.load(tparts, tlay, merged, complete=True)
        for s, part in enumerate(tparts):
            _assert_same(weights.export(part, tlay.names[s]),
                         {u: merged[u] for u in tlay.names[s].values()})
        with torch.no_grad():
            x = idx
            for part in tparts:
                x = part(x)
            torch.testing.assert_close(x, source(idx), rtol=0, atol=1e-6)


def test_one_name_of_a_tied_weight_sets_every_copy():
    model = seeded_gpt(GPT_CONFIG)
    parts = model.split(2)
    lay = weights.layout(model, parts)
    new = torch.randn(64, 32)
    assert weights.load(parts, lay, {"transformer.wte.weight": new}) == 2
    assert torch.equal(parts[0].wte.weight, new) and torch.equal(parts[1].lm_head.weight, new)
    whole = model.split(1)
    lay1 = weights.layout(model, whole)
    weights.load(whole, lay1, {"lm_head.weight": new * 2})
    assert torch.equal(whole[0].wte.weight, new * 2)  # one tensor there


# -- on executors -----------------------------------------------------------------------------
def test_a_two_stage_split_and_a_whole_copy_coexist_and_start_equal():
    ctx = op_context()
    whole = _export(ctx, 1)[0]
    two = _export(ctx, 2)
    assert set(ctx.state["torch_models"]) == {("actor", 1), ("actor", 2)}
    _assert_same(weights.merge(two), whole)
    assert _held(ctx, 1).parts[0].wte.weight is not _held(ctx, 2).parts[0].wte.weight
    with pytest.raises(StageError, match="declare one model two ways"):
        _op("export_weights", ctx, stage=0, stages=1, **{**SPEC, "seed": 4})
    with pytest.raises(StageError, match="declare one model two ways"):
        _op("export_weights", ctx, stage=0, stages=3, **{**SPEC, "dtype": "float32"})


def test_trained_stages_exported_into_a_whole_copy_give_the_same_model():
    ctx = op_context()
    before = _export(ctx, 1)[0]  # the whole copy, built before training
    version = _train_step(ctx, 0)
    e0, e1 = _export(ctx, 2)
    assert torch.equal(e0["transformer.wte.weight"], e1["lm_head.weight"])  # tied copies agree
    assert not torch.equal(e0["transformer.wte.weight"], before["transformer.wte.weight"])
    _assert_same(_export(ctx, 1)[0], before)  # training one split leaves the other alone

    loaded = _op("load_weights", ctx, e0, e1, version, stages=1, complete=True, **SPEC)
    assert loaded == WeightsVersion(model="actor", version=1)
    assert _held(ctx, 1).version == 1
    _assert_same(_export(ctx, 1)[0], weights.merge([e0, e1]))
    trained = _held(ctx, 2).parts
    for s, part in enumerate(trained):  # equal to the trained parameters themselves
        for local, p in part.named_parameters():
            unsplit = _held(ctx, 2).layout.names[s][local]
            assert torch.equal(_export(ctx, 1)[0][unsplit], p.detach())

    idx = torch.randint(0, 64, (3, 20))
    with torch.no_grad():
        split_logits = trained[1](trained[0](idx))
        whole_logits = _held(ctx, 1).parts[0](idx)
    torch.testing.assert_close(whole_logits, split_logits, rtol=0, atol=1e-12)

    # another executor's whole copy takes the same dicts; generation there equals this one's
    other = op_context("exec1")
    assert _op("load_weights", other, e0, e1, stages=1, version=1, **SPEC).version == 1
    prompts = [Prompt(prompt_id=i, tokens=[3 + i, 7, 9]) for i in range(3)]
    rollouts = _op("generate", ctx, prompts, loaded, n=2, max_new_tokens=5, eos=None, **SPEC)
    again = _op("generate", other, prompts, n=2, max_new_tokens=5, eos=None, **SPEC)
    assert [r.response_tokens for r in rollouts] == [r.response_tokens for r in again]
    scores = _op("logprobs", other, rollouts, **SPEC)
    for r, s in zip(rollouts, scores):
        assert s.values == pytest.approx(r.logprobs, rel=0, abs=1e-9)


def test_a_second_step_syncs_again_and_the_version_comes_from_the_step():
    ctx = op_context()
    for step in range(2):
        version = _train_step(ctx, step)
        loaded = _op("load_weights", ctx, *_export(ctx, 2), version, stages=1, **SPEC)
        assert loaded.version == step + 1 == _held(ctx, 1).version
        _assert_same(_export(ctx, 1)[0], weights.merge(_export(ctx, 2)))


def test_loading_one_stage_into_a_split_sets_only_that_stage():
    ctx, trainer = op_context(), op_context("trainer")
    _train_step(trainer, 0)
    e0, e1 = _export(trainer, 2)
    start = _export(ctx, 2)
    _op("load_weights", ctx, e1, stages=2, stage=1, **SPEC)
    got = _export(ctx, 2)
    _assert_same(got[0], start[0])
    _assert_same(got[1], e1)
    _op("load_weights", ctx, e0, e1, stages=2, complete=True, **SPEC)
    _assert_same(weights.merge(_export(ctx, 2)), weights.merge([e0, e1]))


# -- one host buffer [Note: one host buffer in executors/torch/weights.py] ------------------------
def _mixed_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 5, generator=g),
            torch.randn(7, generator=g).to(torch.bfloat16),
            torch.randint(0, 9, (2, 3), generator=g),
            torch.randn(4, 6, generator=g).t(),  # not contiguous
            torch.zeros(0, 4),
            torch.tensor(2.5, dtype=torch.float64),
            torch.tensor([True, False, True])]


def test_host_views_copy_every_tensor_into_one_aligned_buffer():
    tensors = _mixed_tensors()
    views = weights.host_views(tensors, pinned=False)
    base = views[0].untyped_storage().data_ptr()
    spans = []
    for t, v in zip(tensors, views):
        assert v.dtype == t.dtype and v.shape == t.shape and torch.equal(v, t)
        assert v.untyped_storage().data_ptr() == base and v.is_contiguous()  # one buffer
        if v.numel() == 0:  # an empty tensor has no address
            continue
        assert (v.data_ptr() - base) % 64 == 0
        spans.append((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # in order, no overlap
    tensors[0].add_(1.0)  # copies, not the sources
    assert not torch.equal(views[0], tensors[0])


def test_a_checkpoint_of_one_buffers_views_loads_back_equal(tmp_path):
    model = seeded_gpt(tiny_gpt())
    lay = weights.layout(model)
    params = [p.detach() for p in model.parameters()]
    views = dict(zip([lay.names[0][n] for n, _ in model.named_parameters()],
                     weights.host_views(params, pinned=False)))
    path = weights.save_checkpoint(tmp_path / "actor.pt", views)
    fresh = seeded_gpt(tiny_gpt(), seed=1)
    weights.load_checkpoint(fresh, path)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_an_export_of_a_cpu_module_with_one_buffer_is_plain_copies():
    model = seeded_gpt(tiny_gpt())
    lay = weights.layout(model)
    plain = weights.export(model, lay.names[0])
    one = weights.export(model, lay.names[0], one_buffer=True)
    assert plain.keys() == one.keys()
    assert all(torch.equal(plain[k], one[k]) for k in plain)
    storages = {t.untyped_storage().data_ptr() for t in one.values()}
    assert len(storages) == len({id(p) for p in model.parameters()})  # tied: one copy


class _Engine:
    """A background that can hand memory back, as the vLLM engine does when idle."""

    def __init__(self) -> None:
        self.asked = 0

    def busy(self) -> bool:
        return False

    def step(self) -> None:
        pass

    def make_room(self) -> None:
        self.asked += 1


def test_every_training_forward_first_asks_the_executors_engines_for_room():
    ctx = op_context()
    engine = ctx.background["generate:actor"] = _Engine()
    ctx.background["countdown"] = object()  # a background with no memory to give: left alone
    _train_step(ctx, 0)
    assert engine.asked == 2 * len(_batches(0))  # each F of both stages


# -- checkpoints ------------------------------------------------------------------------------
def test_a_checkpoint_of_the_exports_starts_every_holder_from_it(tmp_path):
    trainer = op_context()
    _train_step(trainer, 0)
    exports = _export(trainer, 2)
    path = weights.save_checkpoint(tmp_path / "ckpt" / "actor.pt", exports)
    assert path.is_file() and not list(path.parent.glob("*.tmp"))
    spec = {**SPEC, "model_config": {**GPT_CONFIG, "checkpoint": str(path)}}
    fresh = op_context("fresh")  # a new executor
    _assert_same(_export(fresh, 1, spec)[0], weights.merge(exports))
    for got, want in zip(_export(fresh, 2, spec), exports):
        _assert_same(got, want)
    # generation from the checkpoint equals generation from the synced copy
    _op("load_weights", trainer, *exports, stages=1, **SPEC)
    prompts = [Prompt(prompt_id=0, tokens=[1, 2, 3])]
    a = _op("generate", fresh, prompts, max_new_tokens=6, eos=None, **spec)
    b = _op("generate", trainer, prompts, max_new_tokens=6, eos=None, **SPEC)
    assert a[0].response_tokens == b[0].response_tokens


def test_a_state_dict_checkpoint_works_too(tmp_path):
    model = seeded_gpt(GPT_CONFIG, seed=11)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    spec = {**SPEC, "model_config": {**GPT_CONFIG, "checkpoint": str(tmp_path / "sd.pt")}}
    got = weights.merge(_export(op_context(), 3, spec))
    _assert_same(got, {k: v.double() for k, v in model.state_dict().items()})


def test_checkpoint_errors(tmp_path):
    with pytest.raises(StageError, match="is not a file"):
        _export(op_context(), 1,
                {**SPEC, "model_config": {**GPT_CONFIG, "checkpoint": "/no/such.pt"}})
    e0, _ = _export(op_context(), 2)
    partial = weights.save_checkpoint(tmp_path / "stage0.pt", [e0])
    with pytest.raises(StageError, match=r"lack 26 of its parameters: .transformer.h.2"):
        _export(op_context(), 1,
                {**SPEC, "model_config": {**GPT_CONFIG, "checkpoint": str(partial)}})
    with pytest.raises(StageError, match="given twice with different values"):
        weights.save_checkpoint(tmp_path / "x.pt", [e0, {"transformer.wpe.weight":
                                                          torch.zeros(32, 32)}])


# -- errors -----------------------------------------------------------------------------------
def test_load_errors_are_clear_and_copy_nothing():
    ctx = op_context()
    whole = _export(ctx, 1)[0]
    good = {"transformer.wpe.weight": torch.ones(32, 32)}
    with pytest.raises(StageError, match=r"no weights named 'transformer.h.9.ln_1.weight'"):
        _op("load_weights", ctx, {**good, "transformer.h.9.ln_1.weight": torch.ones(32)},
            stages=1, **SPEC)
    with pytest.raises(StageError, match=r"do not fit.*transformer.wte.weight is \(64, 16\)"):
        _op("load_weights", ctx, {**good, "transformer.wte.weight": torch.ones(64, 16)},
            stages=1, **SPEC)
    with pytest.raises(StageError, match="lack .* of its parameters"):
        _op("load_weights", ctx, good, stages=1, complete=True, **SPEC)
    with pytest.raises(StageError, match="not a tensor"):
        _op("load_weights", ctx, {"transformer.wpe.weight": [1.0]}, stages=1, **SPEC)
    with pytest.raises(StageError, match="expected dicts of weights"):
        _op("load_weights", ctx, "weights", stages=1, **SPEC)
    with pytest.raises(StageError, match=r"stages 0..1, not 2"):
        _op("export_weights", ctx, stage=2, stages=2, **SPEC)
    _assert_same(_export(ctx, 1)[0], whole)  # nothing was copied
    assert _op("load_weights", ctx, good, stages=1, **SPEC) is None  # partial: fine, no version
    assert torch.equal(_export(ctx, 1)[0]["transformer.wpe.weight"], torch.ones(32, 32))


def test_a_model_without_stage_names_is_named_through_its_split():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)

        def split(self, stages, *, seq_len=None):
            return [torch.nn.ModuleDict({"first": self.a}), torch.nn.ModuleDict({"last": self.b})]

    model = Two()
    lay = weights.layout(model, model.split(2))
    assert lay.names == ({"first.weight": "a.weight", "first.bias": "a.bias"},
                         {"last.weight": "b.weight", "last.bias": "b.bias"})
    odd = weights.layout(model, [torch.nn.Linear(3, 3)])
    with pytest.raises(StageError, match="give the model a method stage_names"):
        odd.check()


# -- real executors ---------------------------------------------------------------------------
def test_trainer_stages_sync_into_a_generator_on_real_executors(pool, tmp_path):
    """Stage 0 on one executor, stage 1 on another that also holds the whole copy: its
    exports there, generation after the load; a checkpoint then starts a third holder."""
    with pool.shared(2, kind="torch", tags=("train",)) as (ctl, infos):
        ex = [info.id for info in infos]
        two = {**SPEC, "stages": 2}

        def submit(op, stage, *inputs, outputs=1, **config):
            return ctl.submit(op, *inputs, config={**two, "stage": stage, **config},
                              executor=ex[stage], lane=f"train/{stage}", outputs=outputs)

        batches = _batches(0)
        for mb, tokens in enumerate(batches):
            act = submit("F", 0, tokens, microbatch=mb)
            out = submit("F", 1, act, tokens, microbatch=mb, loss_scale=1 / len(batches))
            grad = submit("B", 1, out, microbatch=mb)
            submit("B", 0, grad, microbatch=mb)
            submit("W", 1, microbatch=mb)
            submit("W", 0, microbatch=mb)
        s0, tied = submit("grad_stats", 0, outputs=2)
        s1, summed = submit("grad_stats", 1, tied, outputs=2)
        submit("optimizer_step", 1, s0, s1, **LR)
        submit("optimizer_step", 0, s0, s1, summed, **LR)
        e0, e1 = submit("export_weights", 0), submit("export_weights", 1)
        loaded = ctl.submit("load_weights", e0, e1, config={**SPEC, "stages": 1, "version": 1},
                            executor=ex[1], lane="train/1")
        rollouts = [Rollout(prompt_id=0, sample=0, prompt_tokens=[1, 2, 3],
                            response_tokens=[4, 5, 6, 7], logprobs=[0.0] * 4, finished=False)]
        remote = ctl.submit("logprobs", rollouts, loaded, config=SPEC, executor=ex[1],
                            lane="train/1").result(timeout=60)
        assert loaded.result(timeout=60) == WeightsVersion(model="actor", version=1)
        exports = [e0.result(timeout=60), e1.result(timeout=60)]

        here = op_context()  # the same step here, for reference
        _train_step(here, 0)
        for got, want in zip(exports, _export(here, 2)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        _op("load_weights", here, *exports, stages=1, **SPEC)
        local = _op("logprobs", here, rollouts, **SPEC)
        assert remote[0].values == pytest.approx(local[0].values, rel=0, abs=1e-12)

        path = weights.save_checkpoint(tmp_path / "actor.pt", exports)
        spec = {**SPEC, "model": "actor-restored",
                "model_config": {**GPT_CONFIG, "checkpoint": str(path)}}
        restored = ctl.submit("export_weights", config={**spec, "stage": 0, "stages": 1},
                              executor=ex[0]).result(timeout=60)
        _assert_same(restored, weights.merge(exports))


def test_a_checkpoint_loads_the_buffers_a_state_dict_has(tmp_path):
    class Scaled(torch.nn.Module):
        def __init__(self, scale: float = 1.0):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("scale", torch.tensor(scale))

    torch.manual_seed(5)
    saved = Scaled(scale=3.0)
    torch.save(saved.state_dict(), tmp_path / "s.pt")
    model = Scaled()
    weights.load_checkpoint(model, tmp_path / "s.pt")
    assert float(model.scale) == 3.0 and torch.equal(model.lin.weight, saved.lin.weight)
    torch.save({"lin.weight": saved.lin.weight, "lin.bias": saved.lin.bias}, tmp_path / "p.pt")
    weights.load_checkpoint(Scaled(), tmp_path / "p.pt")  # buffers may be left out


def test_a_checkpoint_of_another_model_names_its_weights_as_the_files_not_the_models(tmp_path):
    torch.save({"blocks.0.weight": torch.zeros(2, 2)}, tmp_path / "other.pt")
    with pytest.raises(StageError, match=r"the model \(loading checkpoint .*other.pt'\) has no "
                                         r"weights named 'blocks.0.weight' \(its names are like "
                                         r"'lin.bias', 'lin.weight'\)"):
        weights.load_checkpoint(torch.nn.ModuleDict({"lin": torch.nn.Linear(2, 2)}),
                                tmp_path / "other.pt")
