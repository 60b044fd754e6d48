"""Agent programs [Note: agent programs in executors/torch/rollout/endpoint.py]: an agent written
with the `openai` package against the rollout engine's chat-completions endpoint rolls out the same
trajectory as an in-process environment saying the same things; tool calls come back as
`tool_calls`; the endpoint refuses what is not the API's shape, or not its trajectory's, and
serves on; a program that fails, or is cut by a budget, ends its trajectory alone."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from tests.harness import requires

requires("transformers", "hf")
requires("openai", "agents")  # imported where used

from dataflows.tools import calculator  # noqa: E402
from executors.optable import Deferred  # noqa: E402
from executors.torch.rollout import generate as gen  # noqa: E402
from executors.torch.rollout.endpoint import Endpoint, ProgramEnvironment  # noqa: E402
from executors.torch.rollout.engine import run_until_done  # noqa: E402
from executors.torch.rollout.turns import ChatTurns  # noqa: E402
from flowkit.ops import Conversation, EnvStep  # noqa: E402
from flowkit.ops.records import Prompt  # noqa: E402
from flowkit.ops.tokenizers import load_tokenizer  # noqa: E402
from tests.harness import generating, op_context  # noqa: E402
from tests.hf_folders import save_tiny_qwen2, save_tokenizer  # noqa: E402
from tests.torch.test_multiturn_hf import Feedback  # noqa: E402  (environment=...:Feedback here)

QUESTION = [{"role": "user", "content": "What is 2+3?"}]


def feedback_program(task) -> float:
    """Feedback, as an agent program: the same conversation through the openai client."""
    client, env, reward = task.client(), Feedback(), 0.0
    messages = list(task.messages)
    while True:
        reply = client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content or ""
        step = env.step(text)
        reward += step.reward
        if step.done:
            return reward
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": step.observation}]


def failing_program(task) -> float:
    if task.sample == 1:
        raise KeyError("no such tool")
    return feedback_program(task)


def silent_program(task) -> float:
    return 1.0


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2"))


def _prompt(tokenizer) -> Prompt:
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    return Prompt(prompt_id=0, tokens=tokenizer.encode(text, add_special_tokens=False), text=text,
                  messages=QUESTION)


def _rollouts(qwen2, **agent) -> list:
    ctx = op_context()
    result = gen._generate(ctx, [_prompt(load_tokenizer(str(qwen2)))], model="policy",
                           build="executors.torch.models.hf:HFCausalLM",
                           model_config={"path": str(qwen2)}, dtype="float64", seed=0, n=4,
                           max_new_tokens=5, temperature=1.0, sample_seed=1, **agent)
    assert isinstance(result, Deferred)
    return sorted(run_until_done(ctx.background, result), key=lambda r: r.sample)


def test_a_program_through_the_endpoint_rolls_out_the_in_process_trajectories(qwen2):
    direct = _rollouts(qwen2, environment=f"{__name__}:Feedback", max_turns=4)
    served = _rollouts(qwen2, program=f"{__name__}:feedback_program", max_turns=4)
    for a, b in zip(direct, served, strict=True):
        assert b.finished and b.turns == 3 and b.env_reward == 3.0 and b.env_error is None
        assert (a.prompt_tokens, a.response_tokens, a.response_mask) == \
            (b.prompt_tokens, b.response_tokens, b.response_mask)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-10)
        assert (a.finished, a.turns, a.env_reward) == (b.finished, b.turns, b.env_reward)


def test_a_failing_program_ends_its_own_trajectory_and_no_other(qwen2):
    rollouts = _rollouts(qwen2, program=f"{__name__}:failing_program", max_turns=4)
    failed = [r for r in rollouts if r.env_error]
    assert [r.sample for r in failed] == [1]
    assert "agent program raised KeyError" in failed[0].env_error and not failed[0].finished
    assert all(r.finished and r.turns == 3 for r in rollouts if r.sample != 1)


def test_a_program_must_ask_the_model_at_least_once(qwen2):
    rollouts = _rollouts(qwen2, program=f"{__name__}:silent_program")
    assert all("returned before its first request" in r.env_error for r in rollouts)


CUT_SEEN: list = []  # what cut_program's requests were answered with, when refused


def cut_program(task) -> float:
    from openai import APIStatusError

    try:
        return feedback_program(task)
    except APIStatusError as error:
        CUT_SEEN.append((error.status_code, error.body.get("code")))
        raise


def test_a_budget_cut_answers_the_waiting_request_with_trajectory_ended(qwen2):
    CUT_SEEN.clear()
    rollouts = _rollouts(qwen2, program=f"{__name__}:cut_program", max_turns=2)
    assert all(not r.finished and r.turns == 2 and r.env_error is None for r in rollouts)
    deadline = time.monotonic() + 10  # the programs hear of it over HTTP, in their threads
    while len(CUT_SEEN) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert CUT_SEEN == [(409, "trajectory_ended")] * 4


def test_a_program_needs_a_chat_template(tmp_path):
    folder = save_tiny_qwen2(tmp_path, chat_template=False)
    with pytest.raises(Exception, match="needs a tokenizer with a chat template"):
        gen._generate(op_context(), [Prompt(prompt_id=0, tokens=[5, 6, 7])], model="policy",
                      build="executors.torch.models.hf:HFCausalLM",
                      model_config={"path": str(folder)}, dtype="float32", seed=0,
                      max_new_tokens=3, program=f"{__name__}:feedback_program")


# -- tool calls, through the Environment interface the engine drives ----------------------------
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function.name') "
    "| join(', ') }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n"
    "{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
    "{% else %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


def calculator_program(task) -> float:
    client = task.client()
    messages = list(task.messages)
    while True:
        reply = client.chat.completions.create(model="policy", messages=messages,
                                               tools=[CALCULATOR])
        message = reply.choices[0].message
        if not message.tool_calls:
            return float(message.content.strip() == task.answer)
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments)["expression"]
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculator(expression)})


def _environment(program, endpoint, **prompt) -> ProgramEnvironment:
    record = Prompt(prompt_id=7, tokens=[1], messages=QUESTION, **prompt)
    return ProgramEnvironment(program, endpoint, timeout_s=10, prompt=record, sample=0)


def test_tool_calls_come_back_as_tool_calls_and_results_render_as_the_template_does(tmp_path):
    tokenizer = save_tokenizer(tmp_path)
    tokenizer.chat_template = TOOL_TEMPLATE
    endpoint = Endpoint()
    try:
        env = _environment(calculator_program, endpoint, answer="36")
        opening = env.reset("(the prompt's text)", "36")
        assert opening == Conversation(messages=QUESTION, tools=[CALCULATOR])
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*3"}}</tool_call>'
        step = env.step("Let me compute. " + call)
        assert not step.done and step.observation == [
            {"role": "tool", "content": "36", "tool_call_id": "call_1_0"}]
        # the result's tokens are the template's rendering of the tool message, after the turn
        turns = ChatTurns(tokenizer)
        whole = tokenizer.apply_chat_template(env.history, tools=[CALCULATOR], tokenize=False,
                                              add_generation_prompt=True)
        before = tokenizer.apply_chat_template(env.history[:-1], tools=[CALCULATOR],
                                               tokenize=False)
        assert tokenizer.decode(turns.observation(step.observation)) == \
            "\n" + whole[len(before):]
        assert env.step("36") == EnvStep(reward=1.0, done=True)
        env.close()
    finally:
        endpoint.shutdown()


# -- what the endpoint refuses ------------------------------------------------------------------
def _post(endpoint, body, *, key=None, path="/v1/chat/completions", raw=None, headers=None):
    host, port = endpoint.server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={
        "Content-Type": "application/json",
        **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})})
    response = conn.getresponse()
    reply = json.loads(response.read() or b"{}")
    conn.close()
    return response.status, reply.get("error", {}).get("code")


def _waiting_program(started: threading.Event, finish: threading.Event):
    def program(task) -> None:
        client = task.client()
        client.chat.completions.create(model="m", messages=QUESTION)
        started.set()
        finish.wait(10)
        messages = [*QUESTION, {"role": "assistant", "content": "four"},
                    {"role": "user", "content": "sure?"}]
        client.chat.completions.create(model="m", messages=messages)
    return program


def test_the_endpoint_refuses_bad_requests_and_serves_on():
    endpoint = Endpoint()
    try:
        env = _environment(feedback_program, endpoint)
        env.reset("text", None)
        key = env.session.key
        ok = {"model": "m", "messages": QUESTION}
        assert _post(endpoint, ok) == (401, "invalid_api_key")
        assert _post(endpoint, ok, key="not-a-trajectory") == (401, "invalid_api_key")
        assert _post(endpoint, ok, key=key, path="/v1/completions") == (404, "not_found")
        assert _post(endpoint, None, key=key, raw=b"{not json") == (400, "invalid_json")
        assert _post(endpoint, None, key=key, raw=b"[1, 2]") == (400, "invalid_request")
        assert _post(endpoint, {**ok, "stream": True}, key=key) == (400, "unsupported")
        assert _post(endpoint, {**ok, "n": 2}, key=key) == (400, "unsupported")
        assert _post(endpoint, {"messages": "hi"}, key=key) == (400, "invalid_messages")
        assert _post(endpoint, {"messages": [{"role": "wizard", "content": "x"}]},
                     key=key) == (400, "invalid_messages")
        assert _post(endpoint, {"messages": [{"role": "user", "content": 5}]},
                     key=key) == (400, "invalid_messages")
        assert _post(endpoint, {**ok, "tools": "all"}, key=key) == (400, "invalid_tools")
        assert _post(endpoint, {"messages": [{"role": "assistant", "content": "x",
                                              "tool_calls": 5}]}, key=key) == \
            (400, "invalid_messages")
        deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        assert _post(endpoint, None, key=key, raw=deep) == (400, "invalid_json")
        assert _post(endpoint, None, key=key, raw=b"{}",
                     headers={"Content-Length": str(1 << 30)}) == (413, "request_too_large")
        # its program's first request waits for the model's turn: a second is refused
        assert _post(endpoint, ok, key=key) == (409, "request_in_flight")
        # and the trajectory goes on: the program's conversation continues
        step = env.step("Five.")
        assert step.observation == [{"role": "user",
                                     "content": "That was 5 characters. Again?"}]
        env.close()
        assert _post(endpoint, ok, key=key) == (401, "invalid_api_key")
    finally:
        endpoint.shutdown()


def test_a_request_that_rewrites_the_history_ends_its_trajectory():
    endpoint = Endpoint()
    started, finish = threading.Event(), threading.Event()
    try:
        env = _environment(_waiting_program(started, finish), endpoint)
        env.reset("text", None)
        finish.set()  # the program answers "four" where the model said something else
        with pytest.raises(ValueError, match="messages\\[1\\] differs from the conversation"):
            env.step("Five.")
        env.close()
    finally:
        endpoint.shutdown()


# -- trajectories cut by an abort (partial rollouts) ---------------------------------------------
def _settings(qwen2) -> dict:
    return {"model": "policy", "build": "executors.torch.models.hf:HFCausalLM",
            "model_config": {"path": str(qwen2)}, "dtype": "float64", "seed": 0, "n": 4,
            "max_new_tokens": 5, "temperature": 1.0, "sample_seed": 1, "max_turns": 4,
            "program": f"{__name__}:feedback_program"}


def test_an_aborted_programs_trajectory_goes_on_here_or_starts_again_elsewhere(qwen2):
    """[Note: parked trajectories in executors/torch/rollout/trajectories.py]: on the engine that
    cut it, a program's trajectory continues (its program still waiting for its answer) and ends
    as the uninterrupted one; on another, it starts again from its prompt, its program given
    the prompt's messages again."""
    whole = {(r.prompt_id, r.sample): r for r in _rollouts(qwen2, **{
        k: v for k, v in _settings(qwen2).items() if k in ("program", "max_turns")})}
    prompts = [_prompt(load_tokenizer(str(qwen2)))]
    ctx, engine, first = generating(prompts, **_settings(qwen2))
    deadline = time.monotonic() + 20
    while not any(s is not None and s.episode.turns >= 2 for s in engine.slots) \
            and time.monotonic() < deadline:  # some trajectories into their second turn
        engine.step()
    engine.abort()
    cut = [r for r in first if r.interrupted]
    assert cut and all(r.prompt_messages == QUESTION for r in cut)
    here = run_until_done(ctx.background, gen._generate(ctx, cut, **_settings(qwen2)))
    for r in here:
        want = whole[(r.prompt_id, r.sample)]
        assert (r.response_tokens, r.response_mask, r.turns) == \
            (want.response_tokens, want.response_mask, want.turns)
    elsewhere = op_context("exec1")
    again = run_until_done(elsewhere.background, gen._generate(elsewhere, cut,
                                                               **_settings(qwen2)))
    assert all(r.finished and r.turns == 3 and r.env_error is None for r in again)
    assert {(r.prompt_id, r.sample) for r in again} == {(r.prompt_id, r.sample) for r in cut}


def test_idle_connections_hold_at_most_the_cap_of_threads_and_time_out():
    """[Note: bounded endpoint]: 600 connections that never send a byte hold at most
    `max_connections` threads, the rest are closed at once; the held ones close after the idle
    timeout, and the endpoint serves on."""
    import socket

    endpoint = Endpoint(max_connections=16, idle_timeout_s=1.0)
    host, port = endpoint.server.server_address[:2]
    before = threading.active_count()
    idle = [socket.create_connection((host, port)) for _ in range(600)]
    try:
        deadline = time.monotonic() + 30
        while endpoint.server.refused < 600 - 16 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert endpoint.server.refused == 600 - 16
        assert threading.active_count() - before <= 16
        time.sleep(1.5)  # past the idle timeout: the held connections are closed
        assert threading.active_count() - before <= 1
        client = http.client.HTTPConnection(host, port, timeout=5)
        client.request("GET", "/v1/models")
        assert client.getresponse().status == 401  # served (no key: refused, as ever)
    finally:
        for sock in idle:
            sock.close()
        endpoint.shutdown()
