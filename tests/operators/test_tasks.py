"""Built-in tasks: seeded endless streams, verifiable rewards with partial credit, and task references."""

from __future__ import annotations

import pytest

from flowrl.errors import ConfigError, GraphError
from flowrl.graph.refs import resolve
from flowrl.operators.tasks import (
    TASKS, AddTask, CopyTask, LongTailTask, Task, add_reward, brevity_reward, copy_reward, longtail_reward, make_task,
)
from flowrl.models.families.builtin.tokenizer import DEFAULT_TOKENIZER as TOK


@pytest.mark.parametrize("name", sorted(TASKS))
def test_streams_are_pure_functions_of_seed_and_index(name):
    a, b, c = make_task(name, 0), make_task(name, 0), make_task(name, 1)
    assert isinstance(a, Task) and a.name == name
    assert [a.prompt(i) for i in range(20)] == [b.prompt(i) for i in reversed(range(20))][::-1]
    assert [a.prompt(i) for i in range(20)] != [c.prompt(i) for i in range(20)]
    # varied; a longtail prompt is one digit and a heavy-tailed count (mostly 1 to 3), so it repeats more
    assert len({tuple(a.prompt(i)) for i in range(50)}) > (25 if name == "longtail" else 40)
    assert a.prompt(10**9)  # endless


@pytest.mark.parametrize(
    ("prompt", "completion", "reward"),
    [
        ("<s>4071=", "4071</s>", 1.0),
        ("<s>4071=", "4071", 0.8),  # no end token
        ("<s>4071=", "4079</s>", 0.8),
        ("<s>4071=", "40</s>", 0.4),  # stopped early
        ("<s>4071=", "40710", 0.8),
        ("<s>4071=", "", 0.0),
    ],
)
def test_copy_reward_is_positional(prompt, completion, reward):
    assert copy_reward(TOK.encode(prompt), TOK.encode(completion)) == pytest.approx(reward)


@pytest.mark.parametrize(
    ("prompt", "completion", "reward"),
    [
        ("<s>27+385=", "412</s>", 1.0),
        ("<s>27+385=", "402</s>", 0.75),
        ("<s>9+1=", "10</s>", 1.0),
        ("<s>9+1=", "1</s>", 1 / 3),
        ("<s>0+0=", "0</s>", 1.0),
    ],
)
def test_add_reward_gives_partial_credit(prompt, completion, reward):
    assert add_reward(TOK.encode(prompt), TOK.encode(completion)) == pytest.approx(reward)


def test_task_rewards_use_their_reward_function():
    for task in (CopyTask(3), AddTask(3)):
        p = task.prompt(7)
        question = TOK.decode(p)[3:-1]
        answer = question if task.name == "copy" else str(eval(question))  # noqa: S307 - digits and '+'
        assert task.reward(p, TOK.encode(answer + "</s>")) == 1.0
        assert task.reward(p, []) == 0.0


def test_add_is_harder_than_copy():
    copy, add = CopyTask(0), AddTask(0)
    lens = [len(add.prompt(i)) for i in range(200)]
    assert max(lens) == len(TOK.encode("<s>123+456=")) and min(lens) == len(TOK.encode("<s>1+2="))
    # Copying the question scores well on 'copy' and poorly on 'add'.
    echo = lambda t, i: t.reward(t.prompt(i), t.prompt(i)[1:-1] + [TOK.eos_id])  # noqa: E731
    assert sum(echo(copy, i) for i in range(100)) == 100
    assert sum(echo(add, i) for i in range(100)) < 30


def test_brevity_rewards_stopping_within_the_answer_length():
    prompt = TOK.encode("<s>4071=")
    assert brevity_reward(prompt, TOK.encode("1</s>")) == 1.0
    assert brevity_reward(prompt, TOK.encode("4071</s>")) == 1.0
    assert brevity_reward(prompt, TOK.encode("40710</s>")) == 0.0
    assert brevity_reward(prompt, TOK.encode("4071")) == 0.0


def test_reward_functions_of_the_examples_resolve():
    assert resolve("flowrl.operators.tasks:copy_reward") is copy_reward
    assert resolve("flowrl.operators.tasks:brevity_reward") is brevity_reward


def test_make_task_accepts_references():
    task = make_task("tests.operators.userfns:task_factory", 5)
    assert isinstance(task, CopyTask) and task.n_digits == 2 and task.seed == 5


@pytest.mark.parametrize(
    ("name", "error", "match"),
    [
        ("cpy", ConfigError, "unknown task 'cpy': built-in tasks are add, copy"),
        ("tests.operators.userfns:not_a_task", ConfigError, "returned int"),
        ("tests.operators.userfns:nope", GraphError, "no attribute 'nope'"),
    ],
    ids=["typo", "not-a-task", "missing"],
)
def test_bad_task_names_are_clear(name, error, match):
    with pytest.raises(error, match=match):
        make_task(name, 0)


def test_non_task_prompts_are_rejected_by_rewards():
    with pytest.raises(ValueError, match="not a built-in task prompt"):
        copy_reward([1, 4, 5], [4, 5, 2])
    with pytest.raises(ValueError, match="not a 'longtail' prompt"):
        longtail_reward(TOK.encode("<s>47-3="), TOK.encode("444</s>"))


@pytest.mark.parametrize(
    "prompt, completion, reward",
    [("<s>4-3=", "444</s>", 1.0), ("<s>4-3=", "44</s>", 0.5), ("<s>0-1=", "0</s>", 1.0), ("<s>4-3=", "4444", 0.75),
     ("<s>7-12=", "777777777777</s>", 1.0), ("<s>7-12=", "7</s>", 1 / 13)],
    ids=["exact", "stops-early", "one", "no-stop", "two-digit-count", "two-digit-count-stops-early"],
)
def test_longtail_reward_is_positional(prompt, completion, reward):
    assert longtail_reward(TOK.encode(prompt), TOK.encode(completion)) == pytest.approx(reward)


def test_longtail_lengths_are_heavy_tailed_as_documented():
    task = LongTailTask(seed=0)
    counts = [len(task.target(i)) for i in range(20000)]
    mean = sum(counts) / len(counts)
    assert 4.0 < mean < 4.6  # the docstring's 4.3
    assert 0.05 < sum(c >= 16 for c in counts) / len(counts) < 0.08  # its tail: 0.065
    assert max(counts) == 31 and min(counts) == 1
    for i in range(50):  # the prompt names the target and the reward accepts it
        assert task.reward(task.prompt(i), [*task.target(i), TOK.eos_id]) == 1.0
    digits = {TOK.decode(task.prompt(i))[3] for i in range(1000)}
    assert digits == set("0123456789")  # every digit is drawn


@pytest.mark.parametrize(
    "kwargs, match", [({"alpha": 1.0}, "alpha=1.0 must be > 1"), ({"max_count": 100}, r"max_count=100 must be in \[1, 99\]")],
    ids=["light-tail", "three-digits"],
)
def test_longtail_bad_settings_are_clear(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LongTailTask(0, **kwargs)
