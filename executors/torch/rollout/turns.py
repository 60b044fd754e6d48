"""Multi-turn rollouts on the rollout engine [Note: multi-turn rollouts in
flowkit/ops/environments.py]: a request's environment settings (`Agent`), each sample's episode
(`Episode`), the environment calls the engine runs in threads (`EnvCalls`), and how an
environment's turn becomes tokens (`ChatTurns`, `ByteTurns`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs

from executors.torch.errors import StageError
from executors.torch.models.built import imported
from flowkit.ops import AgentConfig, Conversation, Environment, EnvStep

__all__ = ["Agent", "ByteTurns", "ChatTurns", "EnvCalls", "Episode", "agent_of", "open_episode",
           "step_episode"]

TIMED_OUT = "the environment took longer than env_timeout_s"

log = logging.getLogger("flowkit.executor")

# the engine's environment calls at once: a trajectory waiting for its environment gives its turn
# to the others, so a few threads keep slow steps (a tool, a sandboxed program) overlapping
_ENV_THREADS = 8


@attrs.frozen(kw_only=True)
class Agent:
    """A request's environment settings, resolved on the executor."""

    make: Callable[[Any, int], Environment]  # (the Prompt, the sample) -> its environment
    turns: Any  # ByteTurns or ChatTurns: a turn's text, an observation's tokens
    max_turns: int
    max_total_tokens: int | None
    timeout_s: float
    keep_cache: bool
    # its environments answer with Futures (reset_async, step_async), called on the engine's
    # thread, so none of the call threads waits on them (an agent program's)
    asynchronous: bool = False


@attrs.define(eq=False)
class Episode:
    """One sample's environment and where its trajectory stands."""

    env: Environment | None = None
    reward: float = 0.0
    seconds: float = 0.0  # in its environment's calls
    info: dict[str, float] = attrs.field(factory=dict)  # the numbers of its last step's info
    turns: int = 0  # model turns begun
    turn_start: int = 0  # where in the response the model's current turn began
    error: str | None = None

    def close(self) -> None:
        """Its environment's close(), once; a failure there is the environment's to log, and
        ends nothing else."""
        env, self.env = self.env, None
        close = getattr(env, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception:  # the trajectory has ended already: nothing to fail
            log.warning("the environment %s raised in close()", type(env).__name__,
                        exc_info=True)


def agent_of(config: AgentConfig, tokenizer: Any) -> Agent | None:
    """The request's Agent, or None for single responses. The environment's class (or the
    agent program's function) is imported here, by the name the flow gave, as a model's build
    is (executors/torch/models/built.py)."""
    if config.environment is None and config.program is None:
        return None
    if config.max_turns < 1:
        raise StageError(f"max_turns must be at least 1, got {config.max_turns}")
    turns = ByteTurns() if tokenizer is None else ChatTurns(tokenizer)
    return Agent(make=_program_maker(config, turns) if config.program is not None
                 else _environment_maker(config), asynchronous=config.program is not None,
                 turns=turns, max_turns=int(config.max_turns),
                 max_total_tokens=None if config.max_total_tokens is None
                 else int(config.max_total_tokens),
                 timeout_s=float(config.env_timeout_s), keep_cache=bool(config.keep_cache))


def _environment_maker(config: AgentConfig) -> Callable[[Any, int], Environment]:
    cls = imported(str(config.environment), "environment", "Class")
    if not (isinstance(cls, type) and callable(getattr(cls, "step", None))):
        raise StageError(f"environment {config.environment!r} is not a class with "
                         "step(action) (subclass flowkit.ops.Environment)")
    settings = dict(config.env_config or {})
    return lambda prompt, sample: cls(**settings)


def _program_maker(config: AgentConfig, turns: Any) -> Callable[[Any, int], Environment]:
    """[Note: agent programs] in executors/torch/rollout/endpoint.py."""
    from executors.torch.rollout.endpoint import ProgramEnvironment, shared_endpoint

    if config.environment is not None:
        raise StageError(f"give an environment or an agent program, not both (environment="
                         f"{config.environment!r}, program={config.program!r})")
    program = imported(str(config.program), "agent program", "function")
    if not callable(program):
        raise StageError(f"agent program {config.program!r} is not a function")
    if not isinstance(turns, ChatTurns) or turns.tokenizer.chat_template is None:
        raise StageError("an agent program speaks chat messages: its model needs a tokenizer "
                         "with a chat template (a Hugging Face model's folder), not bytes")
    endpoint, timeout_s = shared_endpoint(), float(config.env_timeout_s)
    return lambda prompt, sample: ProgramEnvironment(program, endpoint, timeout_s=timeout_s,
                                                     prompt=prompt, sample=sample)


class EnvCalls:
    """Environment calls (an episode's start, its steps) in threads, each with a deadline; the
    engine takes the ended ones between its model steps."""

    def __init__(self, threads: int = _ENV_THREADS) -> None:
        self.threads = max(1, int(threads))
        self._pool: ThreadPoolExecutor | None = None
        # id(seq) -> (seq, call, when it started, its deadline)
        self.pending: dict[int, tuple[Any, Future, float, float]] = {}

    def start(self, seq: Any, fn: Callable[..., Any], *args: Any, timeout_s: float) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="flowkit-env")
        now = time.monotonic()
        self.pending[id(seq)] = (seq, self._pool.submit(fn, *args), now, now + timeout_s)

    def ended(self) -> list[tuple[Any, Any, str | None, float]]:
        """(sequence, result, None, seconds) for each call that returned, (sequence, None, why,
        seconds) for each that raised or ran past its deadline (its thread is left to end on
        its own)."""
        now, out = time.monotonic(), []
        for key, (seq, call, started, by) in list(self.pending.items()):
            if call.done():
                error = call.exception()
                out.append((seq, None, _why(error), now - started) if error
                           else (seq, call.result(), None, now - started))
            elif now > by:
                out.append((seq, None, TIMED_OUT, now - started))
            else:
                continue
            del self.pending[key]
        return out

    def begin(self, seq: Any, call: Future, *, timeout_s: float) -> None:
        """A call already under way elsewhere (an asynchronous environment's Future)."""
        now = time.monotonic()
        self.pending[id(seq)] = (seq, call, now, now + timeout_s)

    def wait(self, timeout_s: float) -> None:
        """Until a call ends or `timeout_s` passes (a deadline passing is seen by `ended`)."""
        futures.wait([call for _, call, _, _ in self.pending.values()], timeout=timeout_s,
                     return_when=futures.FIRST_COMPLETED)

    def drop(self, keep: Callable[[Any], bool]) -> list[Any]:
        """Forget the calls of sequences `keep` refuses; those sequences, each with its call
        as `seq.call` (a parked trajectory takes it back: `restore`)."""
        gone = [entry for entry in self.pending.values() if not keep(entry[0])]
        for seq, *call in gone:
            del self.pending[id(seq)]
            seq.call = tuple(call)
        return [entry[0] for entry in gone]

    def restore(self, seq: Any, call: tuple) -> None:
        """A call `drop` took, again pending for `seq` (still running, or already ended)."""
        self.pending[id(seq)] = (seq, *call)

    def __bool__(self) -> bool:
        return bool(self.pending)


def _why(error: BaseException) -> str:
    return f"the environment raised {type(error).__name__}: {str(error)[:200]}"


def open_episode(make: Callable[[Any, int], Environment], prompt: Any, sample: int,
                 text: str) -> tuple[Environment, Any]:
    """An episode's first call: its environment built, and reset on the prompt's text and its
    answer (what reset returns, if anything, opens the response or replaces the prompt)."""
    env = make(prompt, sample)
    return env, env.reset(text, getattr(prompt, "answer", None))


def step_episode(env: Environment, action: str) -> EnvStep:
    result = env.step(action)
    if not isinstance(result, EnvStep):
        raise TypeError(f"{type(env).__name__}.step returned a {type(result).__name__}, not "
                        "an EnvStep")
    return result


class ByteTurns:
    """A model on bytes (the built-in GPT): a turn's text is its bytes; an environment's turn is
    its text's UTF-8 bytes and a newline (the byte that ends the model's turns)."""

    def text(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if 0 <= t < 256).decode(errors="replace")

    def observation(self, text: Any) -> list[int]:
        if not isinstance(text, str):
            raise StageError("an environment's observation is a text for a model without a chat "
                             "template (the built-in GPT on bytes), not a list of messages")
        return list(text.encode()) + [10]

    def closing(self) -> list[int]:
        """What ends a model turn cut by its token budget, as its stop token would."""
        return [10]

    def opening(self, text: str) -> list[int]:
        """reset's observation, before the model's first turn."""
        return self.observation(text)

    def prompt(self, conversation: Conversation) -> tuple[list[int], str]:
        raise StageError("a Conversation (an agent program's messages) needs a model whose "
                         "tokenizer has a chat template: the built-in GPT reads bytes")


class ChatTurns:
    """A model with a tokenizer and its chat template: a turn's text is decoded without special
    tokens; an environment's turn is what the template renders after the model's turn ends
    (Qwen2's "\\n" after <|im_end|>): the observation as a user message (or its list of
    messages) and the next assistant header, tokenized alone: the history is never tokenized
    again. The rendering is the template's own, taken as the text it adds to a conversation
    that ends with an assistant's turn (verl's and TRL's way)."""

    _BASE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
             {"role": "assistant", "content": "a"}]

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._after_turn: str | None = None
        self._base: str | None = None  # _BASE rendered: the same every observation

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def observation(self, observation: str | list[dict]) -> list[int]:
        messages = ([{"role": "user", "content": observation}] if isinstance(observation, str)
                    else list(observation))
        if getattr(self.tokenizer, "chat_template", None) is None:
            if not isinstance(observation, str):
                raise StageError("an observation given as messages needs a tokenizer with a "
                                 "chat template")
            return self.tokenizer.encode(observation + "\n", add_special_tokens=False)
        render = self.tokenizer.apply_chat_template
        if self._base is None:
            self._base = render(self._BASE, tokenize=False)
        base = self._base
        full = render([*self._BASE, *messages], tokenize=False, add_generation_prompt=True)
        if not full.startswith(base):
            raise StageError("the chat template renders a conversation's beginning differently "
                             "once a message follows, so an environment's turn cannot be "
                             "appended without tokenizing the history again")
        return self.tokenizer.encode(self.after_turn() + full[len(base):],
                                     add_special_tokens=False)

    def prompt(self, conversation: Conversation) -> tuple[list[int], str]:
        """The tokens and text of a conversation that opens a trajectory, as a prompt source
        renders a prompt (dataflows/datasets.py: the template's text, its ids without the
        tokenizer's own special tokens)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise StageError("a Conversation needs a tokenizer with a chat template")
        text = self.tokenizer.apply_chat_template(list(conversation.messages),
                                                  tools=conversation.tools, tokenize=False,
                                                  add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False)), text

    def closing(self) -> list[int]:
        """What ends a model turn cut by its token budget: the end-of-turn token the template
        writes after every assistant message."""
        eos = self.tokenizer.eos_token_id
        return [] if eos is None else [int(eos)]

    def opening(self, text: str) -> list[int]:
        raise StageError("with a chat template, what reset would show goes in the prompt (the "
                         "prompt source's messages): reset must return None")

    def after_turn(self) -> str:
        """What the template writes between the model's end-of-turn token and the next message
        (Qwen2: a newline)."""
        if self._after_turn is None:
            render = self.tokenizer.apply_chat_template
            eos = self.tokenizer.eos_token or ""
            marker = "\u2063turn\u2063"
            whole = render([*self._BASE[:2], {"role": "assistant", "content": marker}],
                           tokenize=False)
            tail = whole[whole.index(marker) + len(marker):]
            self._after_turn = tail[len(eos):] if eos and tail.startswith(eos) else ""
        return self._after_turn
