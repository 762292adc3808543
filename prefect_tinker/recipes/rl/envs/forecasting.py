"""``forecasting``: binary questions with a known resolution; the reply states a probability.

Records (JSONL or a dataset; ``dataset`` defaults to ``builtin:forecasting_questions``) hold a
question (``question_field``, default ``question``) and its resolution
(``env_options.resolution_field``, default ``resolution``): ``true``/``false``, ``1``/``0`` or
``"yes"``/``"no"``. The question is asked with an instruction to end the reply with
``Probability: p`` (a number in [0, 1], a percentage such as ``70%`` or a fraction such as
``1/4``); the last such statement counts. The reward is the negative Brier score of the stated
probability ``p`` against the outcome ``y`` in {0, 1}, with a clipped format penalty:

    reward = -(p - y)^2                                  well-formed reply, 0 <= p <= 1
    reward = -(clip(p, 0, 1) - y)^2 - format_coef        p stated outside [0, 1], or the reply was cut off
    reward = -1 - format_coef                            no probability stated (scored as the worst forecast)

so every reward lies in ``[-1 - format_coef, 0]`` and a reply stating no probability scores below
every reply that states one. Metrics (``env/*`` per step): ``brier`` (of the
clipped probability, 1 when none was stated), ``format_rate``, ``correct_rate`` (the side of 0.5
the probability is on matches the outcome; 0.5 counts one half), ``prob`` (mean stated
probability) and ``outcome`` (mean outcome of the step's questions).

Source: Brier, "Verification of forecasts expressed in terms of probability", Monthly Weather
Review 78(1), 1950; the Tinker cookbook's ``forecasting`` recipe (0.6.x) for the setting.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

from prefect_tinker.recipes.rl.envs import EnvContext, Environment, EnvSpec, register_env
from prefect_tinker.recipes.rl.envs.problems import problem_builder
from prefect_tinker.recipes.rl.problem_env import Problem, ProblemDataset, ProblemEnv
from prefect_tinker.recipes.rl.types import RLDataset, StepResult

__all__ = [
    "FORECAST_SUFFIX",
    "Forecasting",
    "ForecastingOptions",
    "ForecastEnv",
    "forecast_reward",
    "load_forecasts",
    "parse_probability",
    "parse_resolution",
]

DEFAULT_DATASET = "builtin:forecasting_questions"

#: Instruction appended to every question.
FORECAST_SUFFIX = (
    "\nGive the probability that the answer is yes. End your reply with a line "
    "'Probability: p' where p is a number between 0 and 1."
)

_NUMBER = r"-?\d+(?:\.\d+)?|-?\.\d+"
_PROB = re.compile(rf"probability\s*[:=]\s*({_NUMBER})(?:\s*/\s*({_NUMBER}))?\s*(%?)", re.IGNORECASE)
_YES = {"true", "yes", "1", "1.0"}
_NO = {"false", "no", "0", "0.0"}


class ForecastingOptions(BaseModel):
    """``env_options`` of ``forecasting``."""

    model_config = ConfigDict(extra="forbid")

    question_field: str = Field(default="question", description="Record field holding the question text.")
    resolution_field: str = Field(
        default="resolution", description="Record field holding the outcome (true/false, 1/0, yes/no)."
    )


def parse_probability(text: str) -> float | None:
    """The probability stated last in ``text`` as ``Probability: p`` (``p`` a decimal, a
    percentage ``70%`` read as 0.7, or a fraction ``1/4`` read as 0.25); None when there is none
    or the fraction's denominator is 0. The value is returned as stated (it may lie outside
    [0, 1]; :func:`forecast_reward` clips it)."""
    found = _PROB.findall(text)
    if not found:
        return None
    number, denominator, percent = found[-1]
    value = float(number)
    if denominator:
        if float(denominator) == 0.0:
            return None
        value /= float(denominator)
    return value / (100.0 if percent else 1.0)


def parse_resolution(value: object) -> int:
    """The outcome (1 yes, 0 no) of a record's resolution field.

    Raises:
        ValueError: anything but true/false, 1/0, yes/no (case-insensitive).
    """
    text = str(value).strip().lower()
    if text in _YES:
        return 1
    if text in _NO:
        return 0
    raise ValueError(f"resolution must be true/false, 1/0 or yes/no, got {value!r:.40}")


def forecast_reward(prob: float | None, outcome: int, well_ended: bool, format_coef: float) -> tuple[float, dict]:
    """Reward and metrics of one forecast (module docstring): ``prob`` as stated (None: none),
    ``outcome`` 0 or 1, ``well_ended`` whether the reply ended on a stop sequence."""
    if prob is None:
        return -1.0 - format_coef, {"brier": 1.0, "format": 0.0, "correct": 0.0, "outcome": float(outcome)}
    clipped = min(max(prob, 0.0), 1.0)
    format_ok = well_ended and clipped == prob
    brier = (clipped - outcome) ** 2
    correct = 0.5 if clipped == 0.5 else float((clipped > 0.5) == bool(outcome))
    metrics = {
        "brier": brier,
        "format": float(format_ok),
        "correct": correct,
        "prob": clipped,
        "outcome": float(outcome),
    }
    return -brier - (0.0 if format_ok else format_coef), metrics


def load_forecasts(
    source: str,
    *,
    question_field: str = "question",
    resolution_field: str = "resolution",
    split: str = "train",
    config_name: str | None = None,
    max_problems: int | None = None,
) -> list[Problem]:
    """Questions with their outcome (``Problem.answer`` ``"1"`` or ``"0"``), in file order.

    Raises:
        FileNotFoundError: a missing local file.
        ValueError: a malformed record, a missing or empty question, a resolution that is not
            yes/no; the message names ``file:line``, the field and the value. No record at all.
    """
    from prefect_tinker.recipes.data_reading import SourceSpec, iter_records
    from prefect_tinker.recipes.data_sources import RecordError, get_field

    out = []
    for raw in iter_records(SourceSpec(path=source, split=split, config_name=config_name, max_records=max_problems)):
        if raw.error:
            raise ValueError(f"{raw.where}: {raw.error}")
        try:
            question, resolution = get_field(raw.record, question_field), get_field(raw.record, resolution_field)
        except RecordError as exc:
            raise ValueError(f"{raw.where}: {exc}") from None
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{raw.where}: field {question_field!r} must be a non-empty string, got {question!r:.60}")
        try:
            outcome = parse_resolution(resolution)
        except ValueError as exc:
            raise ValueError(f"{raw.where}: field {resolution_field!r}: {exc}") from None
        out.append(Problem(question=question.strip(), answer=str(outcome), id=raw.where))
    if not out:
        raise ValueError(f"no questions in {source!r}")
    return out


class ForecastEnv(ProblemEnv):
    """One forecast of one question, rewarded by :func:`forecast_reward`."""

    def step(self, action: list[int]) -> StepResult:
        parsed = self.renderer.parse_response(action)
        text = parsed.message.get("content") or ""
        outcome = int(self.problem.answer)
        reward, metrics = forecast_reward(parse_probability(text), outcome, bool(parsed.ok), self.format_coef)
        return StepResult(
            reward=reward,
            episode_done=True,
            metrics=metrics,
            logs={"response": text, "reference": self.problem.answer, "problem_id": self.problem.id},
        )


def _shot() -> tuple[dict, dict]:
    return (
        {"role": "user", "content": "Will 7 + 8 be larger than 20?" + FORECAST_SUFFIX},
        {"role": "assistant", "content": "7 + 8 = 15, which is not larger than 20.\nProbability: 0.02"},
    )


@register_env
class Forecasting(Environment):
    name = "forecasting"
    description = "Binary questions with a resolution; the reply states a probability; reward = -Brier score."
    Options = ForecastingOptions

    @classmethod
    def _load(cls, spec) -> list[Problem]:
        opts = cls.options(spec)
        return load_forecasts(
            spec.dataset or DEFAULT_DATASET,
            question_field=opts.question_field,
            resolution_field=opts.resolution_field,
            split=spec.split,
            config_name=spec.dataset_config,
            max_problems=spec.max_problems,
        )

    @classmethod
    def preflight(cls, spec: EnvSpec) -> None:
        from prefect_tinker.recipes.data_reading import looks_local

        if looks_local(spec.dataset or DEFAULT_DATASET):
            cls._load(spec)

    @classmethod
    def build(cls, spec: EnvSpec, ctx: EnvContext) -> RLDataset:
        make = problem_builder(ForecastEnv, spec, ctx, _shot(), FORECAST_SUFFIX, cls.name)
        return ProblemDataset(cls._load(spec), ctx.groups_per_batch, make, ctx.seed)
