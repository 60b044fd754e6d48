"""Multi-turn trajectories in the rollout engine [Note: multi-turn rollouts in
flowkit/ops/environments.py]: what the engine (executors/torch/rollout/engine.py, whose base this
is) does when a trajectory's turn ends, its environment answers, or its environment fails.

A sequence's turn ends at its stop token or its turn budget; its environment then steps in a
thread (turns.EnvCalls) while the engine decodes the others, the sequence holding its cache row
(keep_cache) or giving it up. The answer is appended as context (mask 0) and the next turn
starts, or the trajectory ends: done, out of turns, out of room, or its environment failed.

[Note: parked trajectories] An abort (partial rollouts cutting a step's leftover calls) hands a
trajectory back as an interrupted Rollout, as any sample; its episode (the environment, its
state, a step still running) stays parked on this engine under (prompt_id, sample). A later
request given that Rollout takes the episode back and goes on where it stopped, its sampled
tokens and the environment's state both kept, so it ends as it would have without the abort.
A Rollout whose episode is not here (another executor's, one evicted, or a resumed run's) goes
on from its `env_state` when it has one: an environment that saves its state
(Environment.state, plain data) and was cut between its steps is saved in its interrupted
Rollout with where the trajectory stood (turns, reward, the turn's start), so a checkpoint holds
it and any engine restores the episode (Environment.restore, no reset) and continues exactly.
Otherwise (no state, a step under way at the abort, an agent program, a state that is not what
`_saved` writes or that restore refuses) it starts again from its prompt, a fresh episode; no
sample is lost or trained twice either way. At most _PARKED episodes wait, the oldest closed
first.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from typing import Any

import attrs

from executors.torch.errors import StageError
from executors.torch.rollout.turns import ByteTurns, Episode, open_episode, step_episode
from flowkit.ops import Conversation
from flowkit.ops.records import Prompt, Rollout

__all__ = ["Trajectories"]

log = logging.getLogger("flowkit.executor")

_PARKED = 4096  # aborted trajectories' episodes kept for a continuation at most


class Trajectories:
    """The engine's trajectory steps, and what both engines do alike with a request's
    prompts and finished rollouts; the engine provides slots, waiting, env_calls, parked,
    passing, max_len, context, tokenizer, _finish, _version_now and _sequence."""

    @staticmethod
    def _prompt_of(rollout: Rollout) -> Prompt:
        return Prompt(prompt_id=rollout.prompt_id, tokens=list(rollout.prompt_tokens),
                      answer=rollout.answer, text=rollout.prompt_text,
                      messages=rollout.prompt_messages)

    def _pass_through(self) -> None:
        """Hand back the finished Rollouts requests were given (bound by now: the op that
        made the request has returned)."""
        requests, self.passing = self.passing, []
        for request in requests:
            items, request.passing = request.passing, []
            for rollout in items:
                self._deliver(request, rollout)

    def _open(self, seq: Any) -> None:
        """A new trajectory: it waits for its environment to be built and reset."""
        agent = seq.request.agent
        seq.episode = Episode()
        args = (agent.make, seq.prompt, seq.sample, self._prompt_text(seq.prompt))
        if agent.asynchronous:  # an agent program's (the endpoint loads with the first one)
            from executors.torch.rollout.endpoint import open_program

            self._begin(seq, open_program, *args)
        else:
            self.env_calls.start(seq, open_episode, *args, timeout_s=agent.timeout_s)

    def _begin(self, seq: Any, call: Any, *args: Any) -> None:
        """An asynchronous environment's call, made here; its Future pending. One that raises
        at once is a call that failed: its trajectory ends, alone."""
        try:
            future = call(*args)
        except Exception as error:
            future = Future()
            future.set_exception(error)
        self.env_calls.begin(seq, future, timeout_s=seq.request.agent.timeout_s)

    def _park(self, seq: Any) -> dict | None:
        """An aborted trajectory's episode, kept for a request that continues it; where it
        stands as plain data, when its environment saves its state, for one elsewhere."""
        key = (seq.prompt.prompt_id, seq.sample)
        self.parked.pop(key, None)
        self.parked[key] = (seq.episode, len(seq.tokens), seq.call, seq.on_hold)
        while len(self.parked) > _PARKED:
            oldest = next(iter(self.parked))
            self.parked.pop(oldest)[0].close()
        return _saved(seq)

    def _resume(self, request: Any, rollout: Any) -> None:
        """Continue an interrupted trajectory with its parked episode, or start it again."""
        prompt = self._prompt_of(rollout)
        seed = request.sampling.seed_of(rollout.prompt_id, rollout.sample)
        parked = self.parked.pop((rollout.prompt_id, rollout.sample), None)
        room = len(rollout.prompt_tokens) + len(rollout.response_tokens) < self.max_len
        if parked is None or parked[1] != len(rollout.response_tokens) or (
                parked[2] is None and not room):  # a model turn next, and no room for one
            if parked is not None:
                parked[0].close()
            episode = _restored(request.agent, prompt, rollout) if room else None
            if episode is None:
                self._open(self._sequence(request, prompt, rollout.sample, seed))
                return
            parked = (episode, len(rollout.response_tokens), None, False)
        episode, length, call, _ = parked
        seq = self._sequence(request, prompt, rollout.sample, seed,
                       tokens=list(rollout.response_tokens), logprobs=list(rollout.logprobs),
                       versions=list(rollout.versions), carried=length, episode=episode,
                       mask=list(rollout.response_mask))
        if call is not None:  # its environment was stepping: the answer is still to come
            self.env_calls.restore(seq, call)
        else:
            self.waiting.append(seq)

    def _texts(self, prompt: Any, response: list[int]) -> dict[str, str | None]:
        """A rollout's prompt_text and response_text [Note: rollout text in engine.py]."""
        if self.tokenizer is None:
            return {"prompt_text": getattr(prompt, "text", None), "response_text": None}
        return {"prompt_text": self._prompt_text(prompt),
                "response_text": self.tokenizer.decode(response, skip_special_tokens=True)}

    def _deliver(self, request: Any, rollout: Any) -> None:
        """A finished rollout to its request: streamed, and the request done with its last."""
        request.done.append(rollout)
        request.left -= 1
        if request.deferred.cancelled or request.deferred.finished:
            return
        request.deferred.emit(rollout)
        if request.left == 0:
            request.deferred.done(request.done)

    def _prompt_text(self, prompt: Any) -> str:
        """The prompt as the model sees it: its text, or its tokens decoded (bytes for a model
        without a tokenizer)."""
        text = getattr(prompt, "text", None)
        if text is not None:
            return text
        if self.tokenizer is None:
            return ByteTurns().text(list(prompt.tokens))
        return self.tokenizer.decode(list(prompt.tokens), skip_special_tokens=False)

    def _after_agent_token(self, seq: Any, eos: bool, full: bool) -> None:
        """A trajectory's turn ends at its stop token or its turn budget: its environment
        steps on it. The context, or the total budget reached within a turn, ends it."""
        agent, ep = seq.request.agent, seq.episode
        turn = len(seq.tokens) - ep.turn_start
        if full:
            self._close(seq, finished=False, clipped=True)
        elif eos or turn >= seq.request.sampling.max_new_tokens:
            action = agent.turns.text(seq.tokens[ep.turn_start:len(seq.tokens) - int(eos)])
            if not eos:
                self._append_context(seq, agent.turns.closing())
            if agent.keep_cache:
                seq.on_hold = True
            else:
                self.slots[seq.slot], seq.slot = None, None
            if agent.asynchronous:
                self._begin(seq, ep.env.step_async, action)
            else:
                self.env_calls.start(seq, step_episode, ep.env, action,
                                     timeout_s=agent.timeout_s)
        elif agent.max_total_tokens is not None and len(seq.tokens) >= agent.max_total_tokens:
            self._close(seq, finished=False)

    def _environments_answered(self) -> None:
        for seq, result, error, seconds in self.env_calls.ended():
            ep, agent = seq.episode, seq.request.agent
            ep.seconds += seconds
            if error is not None:
                ep.error = error
                self._close(seq, finished=False)
                continue
            try:
                if ep.env is None:  # it opened: its first turn may start
                    ep.env, observation = result
                    if isinstance(observation, Conversation):
                        if not self._reprompt(seq, *agent.turns.prompt(observation)):
                            continue
                    elif observation:
                        self._append_context(seq, agent.turns.opening(observation))
                    self._next_turn(seq)
                else:
                    self._stepped(seq, result)
            except StageError as problem:  # the flow's, not one sample's: its request fails
                self._fail_request(seq.request, problem)
            except Exception as problem:  # this trajectory's messages (a template refusing
                # them, an agent program's odd tools): it ends, the others go on
                ep.error = (f"the environment's turn could not be rendered: "
                            f"{type(problem).__name__}: {str(problem)[:200]}")
                self._close(seq, finished=False)

    def _reprompt(self, seq: Any, tokens: list[int], text: str) -> bool:
        """A Conversation opens the trajectory: its rendering is the prompt (whether it fits
        the model's context, with room for a turn, told)."""
        if len(tokens) + 1 >= self.max_len:
            seq.episode.error = (f"the conversation that opens the trajectory has {len(tokens)} "
                                 f"tokens, more than the model's context ({self.max_len}) holds")
            self._close(seq, finished=False, clipped=True)
            return False
        if list(seq.prompt.tokens) != tokens:
            seq.prompt = attrs.evolve(seq.prompt, tokens=tokens, text=text)
        return True

    def _fail_request(self, request: Any, error: Exception) -> None:
        mine = lambda s: s is not None and s.request is request  # noqa: E731
        gone = [s for s in [*self.slots, *self.waiting] if mine(s)]
        self.slots = [None if mine(s) else s for s in self.slots]
        self.waiting = deque(s for s in self.waiting if not mine(s))
        for seq in gone + self.env_calls.drop(lambda s: not mine(s)):
            seq.episode.close()
        if not (request.deferred.finished or request.deferred.cancelled):
            request.deferred.fail(error)

    def _stepped(self, seq: Any, step: Any) -> None:
        ep, agent = seq.episode, seq.request.agent
        ep.reward += float(step.reward)
        ep.info = {str(k): float(v) for k, v in dict(step.info or {}).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if step.done or ep.turns >= agent.max_turns:
            self._close(seq, finished=bool(step.done))
            return
        observation = agent.turns.observation(
            step.observation if isinstance(step.observation, list) else str(step.observation))
        after = len(seq.tokens) + len(observation)  # and no room left for a model token:
        if after >= self.max_len - len(seq.prompt.tokens):  # the model's context
            self._close(seq, finished=False, clipped=True)
            return
        if agent.max_total_tokens is not None and after >= agent.max_total_tokens:
            self._close(seq, finished=False)
            return
        self._append_context(seq, observation)
        self._next_turn(seq)

    def _next_turn(self, seq: Any) -> None:
        seq.episode.turns += 1
        seq.episode.turn_start = len(seq.tokens)
        if seq.on_hold:  # its row still holds its keys: the observation is prefilled next
            seq.on_hold = False
        else:
            self.waiting.appendleft(seq)

    def _append_context(self, seq: Any, tokens: list[int]) -> None:
        seq.tokens.extend(tokens)
        seq.logprobs.extend([0.0] * len(tokens))
        seq.versions.extend([self._version_now()] * len(tokens))
        seq.mask.extend([0] * len(tokens))

    def _close(self, seq: Any, *, finished: bool, clipped: bool = False) -> None:
        if seq.slot is not None and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None
        seq.on_hold = False
        self._finish(seq, finished=finished, interrupted=False, clipped=clipped)


def _saved(seq: Any) -> dict | None:
    """An aborted trajectory's episode as plain data (Rollout.env_state): its environment's
    `state()` and where the trajectory stood; None while a call of its environment is under
    way, or when the environment saves nothing."""
    ep = seq.episode
    if seq.call is not None or ep.env is None or ep.error is not None:
        return None
    try:
        state = getattr(ep.env, "state", lambda: None)()
    except Exception:  # its trajectory starts again elsewhere, as one without state
        log.warning("%s.state() raised", type(ep.env).__name__, exc_info=True)
        return None
    if state is None:
        return None
    if not _plain(state):
        log.warning("%s.state() returned more than plain data (dicts with string keys, "
                    "lists, strings, numbers, None): not saved", type(ep.env).__name__)
        return None
    return {"env": state, "reward": ep.reward, "seconds": ep.seconds, "info": dict(ep.info),
            "turns": ep.turns, "turn_start": ep.turn_start}


def _restored(agent: Any, prompt: Any, rollout: Any) -> Episode | None:
    """An interrupted trajectory's episode from its Rollout's env_state, its environment built
    and restored here; None (the trajectory starts again from its prompt) without one, or
    when the state is not what `_saved` writes or `restore` refuses it."""
    saved = rollout.env_state
    if saved is None or agent.asynchronous:
        return None
    fields = {"reward": (int, float), "seconds": (int, float), "info": dict, "turns": int,
              "turn_start": int}
    if not (isinstance(saved, dict) and "env" in saved
            and all(isinstance(saved.get(k), t) and not isinstance(saved.get(k), bool)
                    for k, t in fields.items())
            and 0 <= saved["turn_start"] <= len(rollout.response_tokens)
            and 0 <= saved["turns"] <= agent.max_turns):
        log.warning("a trajectory's env_state is not an episode's (prompt %s, sample %s): it "
                    "starts again", rollout.prompt_id, rollout.sample)
        return None
    try:
        env = agent.make(prompt, rollout.sample)
        env.restore(saved["env"])
    except Exception:
        log.warning("restoring an episode failed (prompt %s, sample %s): it starts again",
                    rollout.prompt_id, rollout.sample, exc_info=True)
        return None
    return Episode(env=env, reward=float(saved["reward"]), seconds=float(saved["seconds"]),
                   info={str(k): float(v) for k, v in saved["info"].items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)},
                   turns=saved["turns"], turn_start=saved["turn_start"])


def _plain(value: Any, depth: int = 0) -> bool:
    if depth > 32:
        return False
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False
