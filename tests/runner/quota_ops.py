"""@op functions of the runner's tests (group quotas, sampling and second rounds, failing
steps), run on executors by import path as flows' are."""

from flowkit.dsl import Batch, Grouped, Metrics, Stream, op
from flowkit.ops.records import Prompt


@op
def keyed_prompts(*, groups: int = 4, size: int = 3) -> Stream[Prompt]:
    """`groups` x `size` prompts, prompt_id the group's number."""
    for i in range(groups * size):
        yield Prompt(prompt_id=i // size, tokens=[i])


@op
def keep_odd(group: Grouped[Prompt]) -> Stream[Prompt]:
    """A group's prompts if its id is odd; nothing (the group dropped) if it is even."""
    if group[0].prompt_id % 2:
        yield from group


@op
def kept(prompts: Batch[Prompt]) -> Metrics:
    return Metrics({"kept/items": len(prompts),
                    "kept/groups": len({p.prompt_id for p in prompts})})


@op
def numbered_prompts(*, prompts: int = 4) -> Stream[Prompt]:
    """One prompt per group, prompt_id its number."""
    for i in range(prompts):
        yield Prompt(prompt_id=i, tokens=[i])


@op
def three_of(prompt: Prompt) -> Stream[Prompt]:
    """The prompt three times: a group of three, as generation makes n samples of it."""
    for j in range(3):
        yield Prompt(prompt_id=prompt.prompt_id, tokens=[*prompt.tokens, j])


@op
def drawn(prompt: Prompt, *, n: int = 3, first_sample: int = 0) -> Stream[Prompt]:
    """Samples `first_sample`.. of a prompt, as generation draws them: its samples in a group,
    tokens [prompt_id, sample] [Note: second rounds in flowkit/runner/second_round.py]."""
    for j in range(first_sample, first_sample + n):
        yield Prompt(prompt_id=prompt.prompt_id, tokens=[prompt.prompt_id, j])


@op
def judged(sample: Prompt) -> Prompt:
    """A sample's pass ("1") or fail ("0"): sample 1 of a prompt whose id is a multiple of 3
    passes, and sample 3 of an odd one; so prompts 0 and 3 differ in their first three samples,
    1 and 5 only with a fourth, and 2 and 4 never."""
    prompt_id, j = sample.tokens
    passed = (j == 1 and prompt_id % 3 == 0) or (j == 3 and prompt_id % 2 == 1)
    return Prompt(prompt_id=prompt_id, tokens=list(sample.tokens), answer=str(int(passed)))


@op
def differing(group: Grouped[Prompt]) -> Stream[Prompt]:
    """The group if its samples' passes differ; nothing if they agree (GRPO's filter)."""
    if len({s.answer for s in group}) > 1:
        yield from group


@op
def kept_samples(samples: Batch[Prompt]) -> Metrics:
    """Each kept prompt's sample numbers, as "prompt_id:0,1,2" metrics."""
    by_prompt: dict[int, list[int]] = {}
    for s in samples:
        by_prompt.setdefault(s.prompt_id, []).append(s.tokens[1])
    return Metrics({f"kept/{p}": ",".join(map(str, sorted(js))) for p, js in by_prompt.items()})


@op
def breaks(prompt: Prompt) -> Prompt:
    raise ValueError(f"prompt {prompt.prompt_id} breaks")


@op
def sleepy(prompt: Prompt) -> Prompt:
    """The prompt, a second later."""
    import time

    time.sleep(1.0)
    return prompt


@op
def slow_prompts(*, prompts: int = 4, seconds: float = 0.05) -> Stream[Prompt]:
    """numbered_prompts, one every `seconds`: a source still streaming while the first groups
    are judged."""
    import time

    for i in range(prompts):
        yield Prompt(prompt_id=i, tokens=[i])
        time.sleep(seconds)


@op
def drawn_plain(prompt: Prompt, *, n: int = 3) -> Stream[Prompt]:
    """drawn without first_sample: it cannot draw a later round."""
    for j in range(n):
        yield Prompt(prompt_id=prompt.prompt_id, tokens=[prompt.prompt_id, j])
