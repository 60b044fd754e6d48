"""@op functions of the group-quota tests, run on executors by import path as flows' are."""

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
