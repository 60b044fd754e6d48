"""The vLLM engine's own logic (executors/torch/rollout/vllm_engine.py) against a stand-in for
vllm's LLMEngine, so that it runs where vllm is not installed: the settings given to vLLM one to
one, a sample per request streamed as it finishes, each token stamped with the weights version
of the step that sampled it, a weight change handed to vLLM before the next step (running
requests refilled), aborts, continuations, cancels, the context's room and a failing engine.
tests/torch/test_vllm_engine.py runs the real one."""

from __future__ import annotations

import attrs
import pytest
import torch

from executors.torch.errors import StageError
from executors.torch.rollout.engine import Sampling, run_until_done
from executors.torch.rollout.sampling import sequence_seed
from executors.torch.rollout.turns import agent_of
from executors.torch.rollout.vllm_engine import (
    VLLMEngine,
    engine_args,
    sampling_params,
    sleep_mode,
    weights_fingerprint,
)
from flowkit.ops import AgentConfig, Environment, EnvStep
from flowkit.ops.records import Prompt

STOP = 40


@attrs.define
class _Logprob:
    logprob: float


@attrs.define
class _Completion:
    token_ids: list
    logprobs: list
    finish_reason: str | None


@attrs.define
class _Output:
    request_id: str
    finished: bool
    outputs: list


class FakeLLM:
    """One token a step per request: the last one + 1 (mod 50), log-prob -(its count)/10; a
    request stops at its stop tokens or max_tokens, as vLLM's would."""

    def __init__(self) -> None:
        self.requests: dict[str, dict] = {}
        self.added, self.aborted, self.resets, self.reloads = [], [], [], []
        self.asleep: set[str] = set()  # what vLLM's sleep mode has discarded
        self.calls: list = []  # sleeps and wakes, in order

    def sleep(self, level=1):
        assert not self.requests, "vLLM sleeps with no request running"
        self.asleep = {"weights", "kv_cache"} if level >= 2 else {"kv_cache"}
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.asleep -= set(tags or ("weights", "kv_cache"))
        self.calls.append(("wake", tuple(tags or ())))

    def add_request(self, rid, prompt, params):
        self.requests[rid] = {"tokens": list(prompt["prompt_token_ids"]), "params": params,
                              "made": 0}
        self.added.append((rid, list(prompt["prompt_token_ids"]), params))

    def step(self):
        assert not self.asleep, f"a step with its {sorted(self.asleep)} asleep"
        out = []
        for rid, r in list(self.requests.items()):
            token = (r["tokens"][-1] + 1) % 50
            r["tokens"].append(token)
            r["made"] += 1
            stop = token in r["params"]["stop_token_ids"]
            done = stop or r["made"] >= r["params"]["max_tokens"]
            reason = "stop" if stop else ("length" if done else None)
            out.append(_Output(rid, done, [_Completion([token], [{token: _Logprob(
                -r["made"] / 10)}], reason)]))
            if done:
                del self.requests[rid]
        return out

    def abort_request(self, ids):
        for rid in ids:
            self.requests.pop(rid, None)
        self.aborted += ids

    def reset_prefix_cache(self, reset_running_requests=False):
        assert "kv_cache" not in self.asleep, "the prefix cache reset while the cache sleeps"
        self.resets.append(reset_running_requests)

    def collective_rpc(self, fn):
        fn(_Worker(self))


@attrs.define
class _Worker:
    llm: FakeLLM

    @property
    def model_runner(self):
        return self

    def reload_weights(self, weights_iterator):
        assert "weights" not in self.llm.asleep, "weights loaded into discarded memory"
        self.llm.reloads.append({name: t.clone() for name, t in weights_iterator})

    def get_model(self):
        return torch.nn.Module()  # no tied head to make again


class _Held:
    version = None


@pytest.fixture
def setup():
    model, held, llm = torch.nn.Linear(2, 2), _Held(), FakeLLM()
    engine = VLLMEngine(model, folder="unused", version=lambda: held.version, device="cpu",
                        dtype="float32", seed=0, max_batch=8, logprobs_mode="raw_logprobs",
                        context=32, llm=llm)
    return engine, model, held, llm


def _sampling(**given) -> Sampling:
    return Sampling(**{"max_new_tokens": 4, "temperature": 1.0, "eos": STOP, "seed": 5,
                       "step": 2, **given})


def _run(engine, items, n=1, on_item=None, **given):
    return run_until_done({"vllm": engine}, engine.submit(items, _sampling(**given), n),
                          on_item)


def test_the_settings_reach_vllm_one_to_one():
    st = Sampling(max_new_tokens=9, temperature=0.7, top_p=0.9, eos=(2, 7), seed=1)
    assert sampling_params(st, seed=11, max_tokens=6) == {
        "n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "seed": 11, "max_tokens": 6,
        "stop_token_ids": [2, 7], "ignore_eos": True, "logprobs": 0, "detokenize": False}
    cpu = engine_args(folder="m", dtype="float32", device="cpu", seed=3, max_batch=16,
                      logprobs_mode="raw_logprobs")
    assert cpu["enforce_eager"] and cpu["kv_cache_memory_bytes"] > 0
    assert (cpu["max_num_seqs"], cpu["seed"], cpu["dtype"]) == (16, 3, "float32")
    gpu = engine_args(folder="m", dtype="bfloat16", device="cuda:0", seed=3, max_batch=16,
                      logprobs_mode="processed_logprobs")
    assert not gpu["enforce_eager"] and 0 < gpu["gpu_memory_utilization"] < 1


def test_each_sample_is_a_request_with_its_own_seed_and_streams_as_it_finishes(setup):
    engine, _, _, llm = setup
    prompts = [Prompt(prompt_id=0, tokens=[37, 38]), Prompt(prompt_id=1, tokens=[10, 11])]
    streamed = []
    done = _run(engine, prompts, n=2, on_item=streamed.append)
    assert streamed == done
    assert [r.prompt_id for r in done] == [0, 0, 1, 1]  # 39, 40: prompt 0 stops first
    assert done[0].response_tokens == [39, 40] and done[0].finished
    assert done[2].response_tokens == [12, 13, 14, 15] and not done[2].finished
    assert not done[2].clipped  # max_new_tokens, not the context
    assert [params["seed"] for _, _, params in llm.added] == [
        sequence_seed(5, p, k, step=2) for p in (0, 1) for k in (0, 1)]
    assert done[2].logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])


def test_a_later_round_numbers_its_samples_on_with_their_seeds(setup):
    """first_sample [Note: second rounds in flowkit/runner/second_round.py]: samples 3 and 4,
    seeded as a request for 5 would seed them, whatever the prompt's own n."""
    engine, _, _, llm = setup
    done = _run(engine, [Prompt(prompt_id=1, tokens=[10], n=3)], n=2, first_sample=3)
    assert sorted(r.sample for r in done) == [3, 4]
    assert [params["seed"] for _, _, params in llm.added] == [
        sequence_seed(5, 1, k, step=2) for k in (3, 4)]


def test_a_weight_change_reaches_vllm_before_the_next_step_and_stamps_the_tokens(setup):
    engine, model, held, llm = setup
    deferred = engine.submit([Prompt(prompt_id=0, tokens=[1])], _sampling(eos=None), 1)
    box = {}
    deferred.bind(_Sink(box))
    engine.step()  # the first step loads the held weights: they may differ from the folder's
    assert len(llm.reloads) == 1 and llm.resets == [True]
    engine.step()
    held.version = 3  # a load_weights, or a colocated optimizer step
    with torch.no_grad():
        model.weight.add_(1.0)
    engine.step()
    assert len(llm.reloads) == 2 and llm.resets == [True, True]  # running requests refill
    assert torch.equal(llm.reloads[-1]["weight"], model.weight)
    engine.step()
    [rollout] = box["done"]
    assert rollout.versions == [-1, -1, 3, 3]
    assert weights_fingerprint(model, 3) == engine.loaded


def test_an_in_place_update_alone_is_a_change(setup):
    engine, model, _, llm = setup
    engine.sync_weights()
    assert not engine.sync_weights()
    with torch.no_grad():
        model.bias.mul_(2.0)  # an optimizer step on a colocated, unsplit model: no version
    assert engine.sync_weights() and len(llm.reloads) == 2


def test_an_abort_cuts_a_request_and_its_continuation_picks_up_its_tokens(setup):
    engine, _, _, llm = setup
    deferred = engine.submit([Prompt(prompt_id=4, tokens=[1, 2])], _sampling(eos=None,
                                                                             max_new_tokens=6),
                             1, key="r1")
    box = {}
    deferred.bind(_Sink(box))
    engine.step()
    engine.step()
    assert engine.abort_requests({"r1"}) == (1, 2)
    [cut] = box["done"]
    assert cut.interrupted and cut.response_tokens == [3, 4] and llm.aborted == ["1"]
    [whole] = _run(engine, [cut], eos=None, max_new_tokens=6)
    _, prompt, params = llm.added[-1]
    assert prompt == [1, 2, 3, 4] and params["max_tokens"] == 4  # the rest of its budget
    assert whole.response_tokens == [3, 4, 5, 6, 7, 8] and not whole.interrupted
    assert whole.logprobs[:2] == cut.logprobs and len(whole.versions) == 6
    late = engine.submit([Prompt(prompt_id=5, tokens=[1])], _sampling(), 2, key="r1")
    assert run_until_done({"vllm": engine}, late)[0].interrupted  # aborted before it came


def test_a_cancelled_request_is_aborted_in_vllm(setup):
    engine, _, _, llm = setup
    deferred = engine.submit([Prompt(prompt_id=0, tokens=[1])], _sampling(eos=None), 1)
    deferred.bind(_Sink({}))
    engine.step()
    deferred.cancel()
    engine.step()
    assert llm.aborted == ["1"] and not engine.busy()


def test_a_sample_stops_at_the_contexts_end_clipped(setup):
    engine, _, _, llm = setup
    [rollout] = _run(engine, [Prompt(prompt_id=0, tokens=[1] * 30)], eos=None,
                     max_new_tokens=8)
    assert llm.added[-1][2]["max_tokens"] == 2  # the context (32) has room for 2
    assert rollout.clipped and not rollout.finished and len(rollout.response_tokens) == 2


# -- tree rollouts [Note: vLLM trees] ----------------------------------------------------------
def test_a_tree_forks_at_its_depth_into_requests_over_the_shared_prefix(setup):
    engine, _, _, llm = setup
    prompt = Prompt(prompt_id=3, tokens=[1, 2])
    done = _run(engine, [prompt], n=2, eos=None, max_new_tokens=4, branch_at=(2,), branches=2)
    leaves = {r.sample: r for r in done}
    assert sorted(leaves) == [0, 1, 2, 3]  # root k is sample 2k, its branch 2k + 1
    for root in (0, 2):
        parent, branch = leaves[root], leaves[root + 1]
        assert parent.branch_of is None and parent.shared_tokens == 0
        assert (branch.branch_of, branch.shared_tokens) == (root, 2)
        assert branch.response_tokens[:2] == parent.response_tokens[:2] == [3, 4]
        assert branch.logprobs[:2] == parent.logprobs[:2]
        assert len(branch.logprobs) == len(branch.versions) == 4
    seed = {k: sequence_seed(5, 3, k, step=2) for k in range(4)}
    asked = [(tokens, params["max_tokens"], params["seed"]) for _, tokens, params in llm.added]
    assert asked[:2] == [([1, 2], 2, seed[0]), ([1, 2], 2, seed[2])]  # up to the depth
    # each parent goes on, then its branch, over prompt + the 2 shared tokens, from seed + 2
    assert sorted(asked[2:]) == sorted([([1, 2, 3, 4], 2, seed[k] + 2) for k in range(4)])


def test_a_tree_of_two_levels_numbers_its_leaves_as_the_own_engine(setup):
    engine, _, _, _ = setup
    done = _run(engine, [Prompt(prompt_id=0, tokens=[1])], n=1, eos=None, max_new_tokens=4,
                branch_at=(1, 3), branches=2)
    shape = sorted((r.sample, r.branch_of, r.shared_tokens) for r in done)
    # level 1 (depth 1) adds 2, level 2 (depth 3) adds 1: [Note: tree rollouts]
    assert shape == [(0, None, 0), (1, 0, 3), (2, 0, 1), (3, 2, 3)]
    assert all(len(r.response_tokens) == 4 for r in done)


def test_a_sample_ended_before_its_depth_does_not_fork(setup):
    engine, _, _, llm = setup
    stopped = _run(engine, [Prompt(prompt_id=0, tokens=[38])], n=1, max_new_tokens=4,
                   branch_at=(2,), branches=2)  # 39, then the stop token 40
    assert [(r.sample, r.response_tokens, r.finished) for r in stopped] == [(0, [39, 40], True)]
    [clipped] = _run(engine, [Prompt(prompt_id=1, tokens=[1] * 30)], n=1, eos=None,
                     max_new_tokens=4, branch_at=(2,), branches=2)  # the context holds 2
    assert clipped.clipped and clipped.branch_of is None and len(llm.added) == 2


def test_an_abort_counts_a_branchs_shared_tokens_once(setup):
    engine, _, _, _ = setup
    deferred = engine.submit([Prompt(prompt_id=0, tokens=[1])],
                             _sampling(eos=None, max_new_tokens=6, branch_at=(2,), branches=2),
                             1, key="t")
    box = {}
    deferred.bind(_Sink(box))
    for _ in range(3):  # two tokens, the fork, one more token each
        engine.step()
    # the parent's 3 tokens and the branch's own 1: the 2 shared ones count once
    assert engine.abort_requests({"t"}) == (2, 3 + 1)
    assert sorted(r.sample for r in box["done"]) == [0, 1]


def test_a_tree_cut_and_continued_grows_into_the_uninterrupted_tree(setup):
    engine, _, _, _ = setup
    tree = dict(eos=None, max_new_tokens=6, branch_at=(2, 4), branches=2)
    whole = _run(engine, [Prompt(prompt_id=0, tokens=[1])], n=1, **tree)
    deferred = engine.submit([Prompt(prompt_id=0, tokens=[1])], _sampling(**tree), 1, key="t")
    box = {}
    deferred.bind(_Sink(box))
    for _ in range(3):  # the root's first 2 tokens, its fork, a token each
        engine.step()
    engine.abort_requests({"t"})
    done = _run(engine, box["done"], **tree)  # the finished pass, the cut go on

    def shape(rollouts):
        return sorted((r.sample, r.branch_of, r.shared_tokens, tuple(r.response_tokens))
                      for r in rollouts)

    assert shape(done) == shape(whole) and len(whole) == 4


def test_a_failing_engine_fails_its_requests_and_refuses_more(setup):
    engine, _, _, llm = setup

    def broken():
        raise RuntimeError("engine core died")

    llm.step = broken
    with pytest.raises(StageError, match="the vLLM engine failed: engine core died"):
        _run(engine, [Prompt(prompt_id=0, tokens=[1])])
    with pytest.raises(StageError, match="failed earlier"):
        engine.submit([Prompt(prompt_id=0, tokens=[1])], _sampling(), 1)


# -- sleep mode [Note: vLLM sleeps beside a trainer in executors/torch/rollout/vllm_engine.py] ---
def test_an_idle_engine_asked_for_room_sleeps_and_wakes_with_the_held_weights(setup):
    engine, model, held, llm = setup
    engine.may_sleep = True  # vLLM on a GPU
    first = _run(engine, [Prompt(prompt_id=0, tokens=[1])], eos=None)
    assert llm.calls == [] and not engine.asleep  # idle, but no training op asked
    engine.make_room()  # a training F on this executor
    assert llm.calls == [("sleep", 2)] and engine.asleep and engine.stats["sleeps"] == 1
    engine.make_room()  # asleep already: nothing more
    held.version = 4  # the step's optimizer, while vLLM sleeps
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not engine.sync_weights()  # nothing is loaded into a sleeping engine
    second = _run(engine, [Prompt(prompt_id=0, tokens=[1])], eos=None)
    # weights woken, loaded from the held model, then the cache: vLLM's RLHF order
    assert llm.calls == [("sleep", 2), ("wake", ("weights",)), ("wake", ("kv_cache",))]
    assert torch.equal(llm.reloads[-1]["weight"], model.weight) and engine.stats["wakes"] == 1
    assert first[0].versions == [-1] * 4 and second[0].versions == [4] * 4
    assert second[0].response_tokens == first[0].response_tokens


def test_a_wake_first_hands_torchs_cached_blocks_back_to_the_device(setup, monkeypatch):
    from executors.torch.rollout import vllm_engine

    engine, _, _, llm = setup
    engine.may_sleep, order = True, []
    monkeypatch.setattr(vllm_engine, "free_device_memory",
                        lambda device: order.append(("freed", str(device))))
    real_wake = llm.wake_up
    llm.wake_up = lambda tags=None: (order.append(("wake", tuple(tags))), real_wake(tags))
    engine.make_room()
    _run(engine, [Prompt(prompt_id=0, tokens=[1])], eos=None)
    assert order == [("freed", "cpu"), ("wake", ("weights",)), ("wake", ("kv_cache",))]


def test_a_busy_engine_keeps_its_memory_and_an_aborted_one_gives_it(setup):
    engine, _, _, llm = setup
    engine.may_sleep = True
    deferred = engine.submit([Prompt(prompt_id=0, tokens=[1])], _sampling(eos=None,
                                                                          max_new_tokens=8),
                             1, key="r1")
    box = {}
    deferred.bind(_Sink(box))
    engine.step()
    engine.make_room()  # a sample in flight: training overlaps generation, vLLM stays
    assert llm.calls == [] and not engine.asleep
    engine.abort_requests({"r1"})  # a partial rollouts step ends its generation
    assert not engine.busy()
    engine.make_room()
    assert llm.calls == [("sleep", 2)]


def test_on_a_cpu_or_turned_off_an_engine_never_sleeps(setup):
    engine, _, _, llm = setup  # may_sleep is False: vLLM on a CPU, or FLOWKIT_VLLM_SLEEP=0
    _run(engine, [Prompt(prompt_id=0, tokens=[1])], eos=None)
    engine.make_room()
    _run(engine, [Prompt(prompt_id=1, tokens=[2])], eos=None)
    assert llm.calls == [] and not engine.asleep and len(llm.reloads) == 1


def test_a_failing_sleep_fails_the_engine_not_the_training_op(setup):
    engine, _, _, llm = setup
    engine.may_sleep = True

    def broken(level=1):
        raise RuntimeError("cuMemUnmap failed")

    llm.sleep = broken
    engine.make_room()  # no exception here
    with pytest.raises(StageError, match="failed earlier: cuMemUnmap failed"):
        engine.submit([Prompt(prompt_id=0, tokens=[1])], _sampling(), 1)


def test_sleep_mode_is_asked_of_vllm_on_a_gpu_unless_turned_off(monkeypatch):
    args = dict(folder="m", dtype="bfloat16", device="cuda:0", seed=3, max_batch=16,
                logprobs_mode="processed_logprobs")
    assert engine_args(**args)["enable_sleep_mode"]
    monkeypatch.setenv("FLOWKIT_VLLM_SLEEP", "0")
    assert not engine_args(**args)["enable_sleep_mode"]
    assert "enable_sleep_mode" not in engine_args(**{**args, "device": "cpu"})
    assert not sleep_mode("cuda:0") and not sleep_mode("cpu")
    monkeypatch.setenv("FLOWKIT_VLLM_SLEEP", "1")
    assert sleep_mode("cuda:0") and not sleep_mode("cpu")  # what an engine's may_sleep is


def test_a_sampler_another_log_prob_mode_serves_is_refused(setup):
    engine = setup[0]  # raw_logprobs: temperature 1 or greedy
    with pytest.raises(StageError, match="raw_logprobs"):
        engine.submit([Prompt(prompt_id=0, tokens=[1])], _sampling(temperature=0.7), 1)


class _Sink:
    def __init__(self, box: dict) -> None:
        self.box = box

    def emit(self, item) -> None:
        self.box.setdefault("items", []).append(item)

    def done(self, result) -> None:
        self.box["done"] = result

    def fail(self, error) -> None:
        self.box["error"] = error



class Twice(Environment):
    """Answers "ok" to the model's first turn, ends the episode at its second."""

    def __init__(self) -> None:
        self.turns = 0

    def step(self, action: str) -> EnvStep:
        self.turns += 1
        return EnvStep(observation="ok", reward=0.5, done=self.turns == 2)


def test_a_trajectory_is_a_vllm_request_a_turn_over_its_whole_prefix(setup):
    engine, _, _, llm = setup
    agent = agent_of(AgentConfig(environment=f"{__name__}:Twice", max_turns=3), None)
    deferred = engine.submit([Prompt(prompt_id=0, tokens=[1, 2])], _sampling(eos=None,
                                                                             max_new_tokens=3),
                             1, agent=agent)
    [rollout] = run_until_done({"vllm": engine}, deferred)
    first, second = llm.added  # one request a model turn
    assert first[1] == [1, 2] and second[1][:5] == [1, 2, 3, 4, 5]  # token in: the prefix
    context = second[1][5:]  # the turn's closing (byte 10: it ended at max_new_tokens), "ok"
    assert context[0] == 10 and len(context) > 1
    turn = [(context[-1] + k) % 50 for k in (1, 2, 3)]
    assert rollout.response_tokens == [3, 4, 5, *context, *turn, 10]
    assert rollout.response_mask == [1, 1, 1] + [0] * len(context) + [1, 1, 1, 0]
    assert rollout.turns == 2 and rollout.env_reward == 1.0 and rollout.finished
    assert len(rollout.logprobs) == len(rollout.versions) == len(rollout.response_tokens)
