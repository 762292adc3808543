"""``arithmetic`` with ``env_options.reward=partial``: the partial credit of a wrong reply recomputed
by hand, a right reply still scoring exactly 1, and the option choosing the environment class."""

from __future__ import annotations

import pytest

from prefect_tinker.recipes.rl.envs import EnvContext, EnvSpec
from prefect_tinker.recipes.rl.envs.arithmetic import (
    Arithmetic,
    ArithmeticEnv,
    ArithmeticPartialCreditEnv,
    arithmetic_partial_credit,
)
from prefect_tinker.recipes.rl.problem_env import Problem, load_renderer
from tests.scripted_policy import tokenizer_dirs  # noqa: F401


@pytest.mark.parametrize(
    "reply,answer,expected",
    [
        ("12", 10, 0.1 * 1 + 0.2 * 1 + 0.2 / 3),  # as long as the answer, all digits, 2 away
        ("abc", 3, 0.1 / 3),  # 3 characters for a 1-character answer, no digit
        ("x 7 yz", 9, 0.1 / 4 + 0.2 / 4 + 0.2 / 3),  # 4 non-space characters, 1 digit, 7 is 2 away from 9
        ("", 3, 0.0),
        ("  ", 3, 0.0),
    ],
)
def test_partial_credit_by_hand(reply, answer, expected):
    assert arithmetic_partial_credit(reply, answer) == pytest.approx(expected, abs=1e-12)
    assert 0.0 <= arithmetic_partial_credit(reply, answer) < 0.5


def test_env_reward_right_and_wrong(tokenizer_dirs):  # noqa: F811
    renderer = load_renderer("chatml", tokenizer_dirs["tiny"])
    tok = renderer.tokenizer
    end = tok.encode("<|im_end|>", add_special_tokens=False)
    env = ArithmeticPartialCreditEnv(Problem(question="What is 4 + 6?", answer="10"), renderer, format_coef=0.1)
    right = env.step(tok.encode("10", add_special_tokens=False) + end)
    assert right.reward == 1.0 and right.metrics["partial"] == 0.0 and right.metrics["format"] == 1.0
    wrong = env.step(tok.encode("12", add_special_tokens=False) + end)  # well-formed, wrong
    assert wrong.reward == pytest.approx(0.1 + 0.2 + 0.2 / 3)
    cut = env.step(tok.encode("12 apples", add_special_tokens=False))  # no end: malformed, minus format_coef
    assert cut.reward == pytest.approx(0.1 * 2 / 8 + 0.2 * 2 / 8 + 0.2 / 3 - 0.1)
    plain = ArithmeticEnv(Problem(question="What is 4 + 6?", answer="10"), renderer, format_coef=0.1)
    assert plain.step(tok.encode("12", add_special_tokens=False) + end).reward == 0.0


@pytest.mark.parametrize("reward,env_cls", [("exact", ArithmeticEnv), ("partial", ArithmeticPartialCreditEnv)])
def test_option_picks_the_env(tokenizer_dirs, reward, env_cls):  # noqa: F811
    spec = EnvSpec(env="arithmetic", env_options={"reward": reward, "max_operand": 3})
    ctx = EnvContext(renderer_name="chatml", tokenizer_id=tokenizer_dirs["tiny"], group_size=2, groups_per_batch=3)
    builders = Arithmetic.build(spec, ctx).get_batch(0)
    assert len(builders) == 3
    assert all(type(env) is env_cls for b in builders for env in b.make_envs())
    with pytest.raises(ValueError, match="reward"):
        EnvSpec(env="arithmetic", env_options={"reward": "dense"})


def test_env_options_are_the_options_model_of_the_env_named():
    """``env_options`` validates into the ``Options`` of the environment ``env`` names (the tag of
    the union); a dump holds the options as given, and validates back to the same model."""
    from prefect_tinker.recipes.rl.envs.arithmetic import ArithmeticOptions
    from prefect_tinker.recipes.rl.envs.math import MathOptions

    spec = EnvSpec(env="arithmetic", env_options={"max_operand": 7})
    assert type(spec.env_options) is ArithmeticOptions and spec.env_options.max_operand == 7
    assert Arithmetic.options(spec) is spec.env_options and spec.env_options.reward == "exact"
    assert spec.model_dump(mode="json")["env_options"] == {"max_operand": 7}
    assert EnvSpec.model_validate(spec.model_dump()).env_options == spec.env_options
    math = EnvSpec(env="math", dataset="org/problems", env_options={"answer_style": "boxed"})
    assert type(math.env_options) is MathOptions
    with pytest.raises(ValueError, match=r"env 'math': env_options\.max_operand: Extra inputs"):
        EnvSpec(env="math", dataset="org/problems", env_options={"max_operand": 7})  # arithmetic's option, not math's
