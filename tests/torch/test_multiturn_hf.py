"""Multi-turn rollouts of a Hugging Face model with a chat template [Note: multi-turn rollouts in
flowkit/ops/environments.py]: every token the engine appends is the template's own rendering of
the conversation (ChatML: the assistant's <|im_end|>, a newline, the environment's message as a
user turn, the next assistant header), so the whole trajectory reads as the template renders the
whole conversation, and the environment's pieces are the tokenizer's ids of that text."""

from __future__ import annotations

import itertools

import pytest

from tests.harness import requires

requires("transformers", "hf")

from executors.optable import Deferred  # noqa: E402
from executors.torch.rollout import generate as gen  # noqa: E402
from executors.torch.rollout.engine import run_until_done  # noqa: E402
from flowkit.ops import Environment, EnvStep  # noqa: E402
from flowkit.ops.records import Prompt  # noqa: E402
from flowkit.ops.tokenizers import load_tokenizer  # noqa: E402
from tests.harness import op_context  # noqa: E402
from tests.hf_folders import save_tiny_qwen2  # noqa: E402
from tests.torch.rl_ops import Feedback  # noqa: E402


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2"))


def test_the_trajectory_is_the_templates_rendering_of_the_conversation(qwen2):
    tokenizer = load_tokenizer(str(qwen2))
    question = [{"role": "user", "content": "What is 2+3?"}]
    text = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    prompt = Prompt(prompt_id=0, tokens=tokenizer.encode(text, add_special_tokens=False),
                    text=text)
    ctx = op_context()
    result = gen._generate(ctx, [prompt], model="policy",
                           build="executors.torch.models.hf:HFCausalLM",
                           model_config={"path": str(qwen2)}, dtype="float32", seed=0, n=4,
                           max_new_tokens=5, temperature=1.0, sample_seed=1,
                           environment=f"{Feedback.__module__}:Feedback", max_turns=4)
    assert isinstance(result, Deferred)
    rollouts = run_until_done(ctx.background, result)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for r in rollouts:
        assert r.finished and r.turns == 3 and r.env_reward == 3.0
        # the model's turns, as the mask marks them, without the <|im_end|> that ends each
        turns, current = [], []
        for token, bit in zip(r.response_tokens, r.response_mask):
            if bit:
                current.append(token)
            elif current:
                turns.append(current)
                current = []
        turns.append(current) if current else None
        assert len(turns) == 3
        conversation = list(question)
        for k, turn in enumerate(turns):
            content = tokenizer.decode([t for t in turn if t != end], skip_special_tokens=False)
            conversation.append({"role": "assistant", "content": content})
            if k < 2:
                conversation.append({"role": "user",
                                     "content": f"That was {len(content)} characters. Again?"})
        whole = tokenizer.apply_chat_template(conversation, tokenize=False)
        ids = r.prompt_tokens + r.response_tokens
        # up to the last <|im_end|>: the trajectory ends where the model's last turn does
        assert whole.endswith("<|im_end|>\n")
        assert tokenizer.decode(ids, skip_special_tokens=False) == whole.removesuffix("\n")
        # each environment piece is the tokenizer's ids of its text, tokenized alone
        start = len(r.prompt_tokens)
        pieces, piece = [], []
        for k, bit in enumerate(r.response_mask):
            if not bit:
                piece.append(r.response_tokens[k])
            elif piece:
                pieces.append(piece)
                piece = []
        pieces.append(piece) if piece else None
        for piece in pieces:
            body = [t for t in piece if t != end] if piece[0] == end else piece
            assert body == tokenizer.encode(tokenizer.decode(body, skip_special_tokens=False),
                                            add_special_tokens=False)
        assert start == len(prompt.tokens)


def test_reset_with_a_chat_template_must_leave_the_opening_to_the_prompt(qwen2):
    ctx = op_context()
    result = gen._generate(ctx, [Prompt(prompt_id=0, tokens=[5, 6, 7])], model="policy",
                           build="executors.torch.models.hf:HFCausalLM",
                           model_config={"path": str(qwen2)}, dtype="float32", seed=0,
                           max_new_tokens=3, environment=f"{__name__}:Opens")
    with pytest.raises(Exception, match="reset must return None"):
        run_until_done(ctx.background, result)


class Opens(Feedback):
    def reset(self, prompt: str, answer: str | None = None) -> str:
        return "Here is a board."


class Boom(Environment):
    """The first of its instances answers with a message its model's template refuses; the
    others as Feedback does."""

    made = itertools.count()

    def __init__(self) -> None:
        self.boom, self.feedback = next(Boom.made) == 0, Feedback()

    def step(self, action: str) -> EnvStep:
        if self.boom:
            return EnvStep(observation=[{"role": "user", "content": "boom"}])
        return self.feedback.step(action)


def test_a_turn_the_template_refuses_ends_its_own_trajectory_only(tmp_path):
    """A chat template may raise on messages it refuses (raise_exception, as templates that
    require alternating roles do): that trajectory ends with env_error saying so; the others
    of the request finish."""
    from examples.qwen2_build import CHAT_TEMPLATE

    folder = save_tiny_qwen2(tmp_path)
    tokenizer = load_tokenizer(str(folder))
    tokenizer.chat_template = ("{% for m in messages %}{% if m['content'] == 'boom' %}"
                               "{{ raise_exception('no boom here') }}{% endif %}{% endfor %}"
                               + CHAT_TEMPLATE)
    tokenizer.save_pretrained(str(folder))
    Boom.made = itertools.count()
    ctx = op_context()
    rollouts = run_until_done(ctx.background, gen._generate(
        ctx, [Prompt(prompt_id=0, tokens=[5, 6, 7])], model="policy",
        build="executors.torch.models.hf:HFCausalLM", model_config={"path": str(folder)},
        dtype="float32", seed=0, n=4, max_new_tokens=3, environment=f"{__name__}:Boom",
        max_turns=4))
    failed = [r for r in rollouts if r.env_error]
    assert len(rollouts) == 4 and len(failed) == 1
    assert "could not be rendered" in failed[0].env_error and "no boom here" in \
        failed[0].env_error and not failed[0].finished
    assert all(r.finished and r.turns == 3 for r in rollouts if not r.env_error)
