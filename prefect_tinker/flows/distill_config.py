"""The distill flow's configuration (its single parameter) and the teacher's spec.

One config serves the four modes; the fields a mode does not read are ignored. It is composed of
the RL loop's parts (:class:`~prefect_tinker.flows.rl_config.RLTrainingConfig`: the step settings,
the environment, the task runner), not an RL config: on-policy distillation and SDFT are RL-shaped
(the student samples groups of replies on the ``prompts`` environment, trained by the RL loop and
its schedules), and the off-policy modes read their prompts from the same ``dataset`` /
``env_options`` fields.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from prefect_tinker.flows.config import BackendConfig, weights_ref
from prefect_tinker.flows.rl_config import RLTrainingConfig
from prefect_tinker.recipes.builders import DatasetBuilder
from prefect_tinker.recipes.builtin_datasets import EXAMPLE_CHAT_PATH
from prefect_tinker.recipes.data_reading import SourceSpec, source_fingerprint
from prefect_tinker.recipes.distill.prompts import DEMO_TEMPLATE, TeacherView
from prefect_tinker.recipes.resume_marker import RESUME
from prefect_tinker.recipes.rl.envs.prompts import PromptsOptions
from tinker_blocks.model_registry import is_weights_ref

__all__ = ["DistillConfig", "DistillMode", "TeacherSpec"]

DistillMode = Literal["on_policy", "off_policy", "sdft", "prompt"]


class TeacherSpec(BaseModel):
    """One teacher: its weights, how it renders, what it is shown, and (on-policy with several
    teachers) its own prompts. A plain string is read as ``weights``."""

    weights: str = Field(
        description=(
            "A base model ('smollm2', 'base:tiny'), a checkpoint tinker://.../sampler_weights/... (or "
            ".../weights/...), run:<run_id> (that run's last checkpoint in the store) or alias:LINE@ALIAS."
        )
    )
    renderer: str = Field(
        default="auto",
        description=(
            "The teacher's own renderer ('auto' resolves from its tokenizer); it renders its prompt and end-of-turn "
            "marker."
        ),
    )
    system_prompt: str | None = Field(
        default=None, description="A system message only the teacher sees (prompt distillation)."
    )
    prompt_template: str | None = Field(
        default=None,
        description=(
            "The teacher's user message: {prompt} = the student's, {answer} = the golden answer (sdft default: a "
            "demonstration)."
        ),
    )
    backend: BackendConfig | None = Field(
        default=None, description="Where the teacher runs; default the run's backend."
    )
    dataset: str | None = Field(
        default=None, description="on_policy with several teachers: this teacher's prompts (default the run's dataset)."
    )
    format: str | None = Field(
        default=None, description="Record format of this teacher's dataset (default env_options.format)."
    )
    fields: dict[str, str] = Field(default_factory=dict, description="Field mapping of this teacher's dataset.")
    weight: float = Field(
        default=1.0,
        gt=0,
        description="on_policy with several teachers: share of the prompts drawn from this teacher's dataset.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, v: Any) -> Any:
        return {"weights": v} if isinstance(v, str) else v

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: str) -> str:
        v = v.strip()
        if not v or v == "run:":
            raise ValueError(
                "teacher weights must name a base model, a tinker:// checkpoint, run:<run_id> or alias:LINE@ALIAS"
            )
        if is_weights_ref(v):  # resolved through the store (resolved_teachers)
            return v
        if v.startswith("tinker://"):
            if "/weights/" not in v and "/sampler_weights/" not in v:
                raise ValueError(
                    f"teacher checkpoint {v!r} must be tinker://<run>/sampler_weights/<name> or .../weights/<name>"
                )
            return v
        return v if v.startswith("base:") else f"base:{v}"

    def view(self) -> TeacherView:
        """The teacher's :class:`~prefect_tinker.recipes.distill.prompts.TeacherView`."""
        return TeacherView(system_prompt=self.system_prompt, prompt_template=self.prompt_template)


class DistillConfig(RLTrainingConfig):
    """Parameters of a distillation run.

    Modes:

    - ``on_policy``: the student samples on ``dataset``'s prompts (the ``prompts`` env); each
      teacher scores the completions in its own format; per-token advantage
      ``-kl_penalty_coef * (logp_student - logp_teacher)`` (discounted by ``kl_discount_factor``),
      loss ``loss_fn``; several ``teachers`` each with their dataset and weight.
    - ``off_policy``: the teacher's replies to the prompts become a chat dataset (``sequences=
      teacher``) or the dataset's own conversations are used (``sequences=dataset``); the student
      trains on them with SFT, or with ``soft_targets=true`` on the teacher's top-``topk``
      distribution at every reply token.
    - ``sdft``: self-distillation (Shenfeld et al. 2026): the teacher is the frozen initial model
      shown the question and the golden answer (``teacher.prompt_template``), the student answers
      the question alone on-policy; forward KL over the teacher's top-``topk`` (skipping
      ``skip_first_tokens``), or the reverse KL with ``reverse=true``.
    - ``prompt``: prompt distillation: the teacher answers with its ``system_prompt`` /
      ``prompt_template``, the student learns the answers without it; held-out agreement with the
      teacher is ``eval/teacher_agreement``.
    """

    recipe: ClassVar[str] = "distill"
    # the off-policy / prompt sequences once sampled (with_sequences): not a setting, not stored
    _sequences: tuple[list[SourceSpec], float | int] | None = PrivateAttr(default=None)

    mode: Annotated[DistillMode, RESUME] = Field(
        default="on_policy", description="on_policy, off_policy, sdft or prompt."
    )
    env: str = Field(
        default="prompts",
        description="The environment the student samples on (on_policy, sdft): 'prompts' serves the dataset's prompts.",
    )
    dataset: str | None = Field(
        default=EXAMPLE_CHAT_PATH,
        description="Prompts (and golden answers, sdft): a JSONL file or dataset; read as env_options.format.",
    )
    teacher: Annotated[TeacherSpec | None, RESUME] = Field(
        default=None, description="The teacher (a string = its weights); sdft default: the frozen initial weights."
    )
    teachers: Annotated[list[TeacherSpec], RESUME] = Field(
        default_factory=list,
        description="on_policy: several teachers, each with its dataset and weight, instead of `teacher`.",
    )
    kl_penalty_coef: float = Field(
        default=1.0,
        gt=0,
        description="on_policy: advantage = -coef x (logp_student - logp_teacher) per completion token.",
    )
    kl_discount_factor: Annotated[float, RESUME] = Field(
        default=0.0,
        ge=0,
        le=1,
        description="on_policy: advantages summed over later tokens with this discount (0 = per token).",
    )
    remove_constant_reward_groups: bool = Field(
        default=False, description="Unused by distillation (its signal is the teacher, not rewards)."
    )
    topk: Annotated[int, RESUME] = Field(
        default=20, ge=1, description="sdft / off_policy soft targets: teacher tokens per position (K)."
    )
    skip_first_tokens: Annotated[int, RESUME] = Field(
        default=3, ge=0, description="sdft: completion tokens at the start left out of the loss."
    )
    reverse: Annotated[bool, RESUME] = Field(
        default=False,
        description="sdft: reverse KL over the K slots (client-side custom loss) instead of the forward KL.",
    )
    soft_targets: Annotated[bool, RESUME] = Field(
        default=False,
        description="off_policy / prompt: train on the teacher's top-K distribution instead of its sampled tokens.",
    )
    sequences: Annotated[Literal["teacher", "dataset"], RESUME] = Field(
        default="teacher",
        description=(
            "off_policy: supervised sequences are the teacher's samples, or the dataset's own conversations "
            "(soft_targets only)."
        ),
    )
    teacher_max_tokens: Annotated[int, RESUME] = Field(
        default=128, ge=1, description="off_policy / prompt: most tokens of a teacher reply."
    )
    teacher_temperature: Annotated[float, RESUME] = Field(
        default=1.0,
        ge=0,
        description="off_policy / prompt: temperature of the teacher's training replies (held-out labels are greedy).",
    )
    samples_per_prompt: Annotated[int, RESUME] = Field(
        default=1, ge=1, description="off_policy / prompt: teacher replies per prompt."
    )
    keep_truncated: Annotated[bool, RESUME] = Field(
        default=False, description="off_policy / prompt: keep teacher replies that hit teacher_max_tokens."
    )
    batch_size: Annotated[int, RESUME] = Field(default=8, ge=1, description="off_policy / prompt: sequences per step.")
    test_size: Annotated[float, RESUME] = Field(
        default=0.1, ge=0, description="off_policy / prompt: held-out prompts (count >= 1 or fraction < 1)."
    )
    max_length: Annotated[int, RESUME] = Field(
        default=512, ge=8, description="off_policy / prompt: most tokens of a training sequence."
    )
    eval_max_tokens: int = Field(
        default=32, ge=1, description="prompt: most tokens of a student reply in the agreement evaluation."
    )
    agreement_first_line: bool = Field(
        default=False, description="prompt: agreement compares only the first non-empty line of the replies."
    )

    @model_validator(mode="after")
    def _check_distill(self) -> DistillConfig:
        if self.teacher is not None and self.teachers:
            raise ValueError("give either teacher=... or teachers=[...], not both")
        if len(self.teachers) > 1 and self.mode != "on_policy":
            raise ValueError(f"mode={self.mode}: one teacher only (several teachers are an on_policy feature)")
        if self.mode != "sdft" and self.teacher is None and not self.teachers:
            raise ValueError(
                f"mode={self.mode} needs a teacher: teacher=<base model, tinker:// checkpoint or run:<run_id>>"
            )
        if self.mode == "prompt" and self.resolved_teachers(runs=False)[0].view().is_identity:
            raise ValueError(
                "mode=prompt needs what the student will not see: teacher.system_prompt or teacher.prompt_template"
            )
        if self.mode == "sdft":
            if self.num_substeps != 1 or self.schedule != "sync":
                raise ValueError("mode=sdft trains one optimizer step per batch (num_substeps=1, schedule=sync)")
            if not self.resolved_teachers(runs=False)[0].view().needs_answer:
                raise ValueError("mode=sdft: the teacher's prompt_template must show the golden answer ({answer})")
        if self.mode == "off_policy" and self.sequences == "dataset" and not self.soft_targets:
            raise ValueError(
                "off_policy with sequences=dataset and soft_targets=false is plain SFT: use the sft recipe, "
                "or set soft_targets=true"
            )
        return self

    def run_name_prefix(self) -> str:
        return f"distill-{self.mode}-{self.rl_run_name_prefix()}"

    def with_sequences(self, sources: list[SourceSpec], test_size: float | int) -> DistillConfig:
        """This config with the supervised sequences of an off-policy or prompt run (the teacher's
        samples, or the dataset's conversations) and their held-out share ``test_size``: what
        :meth:`dataset_builder` renders for the run session."""
        out = self.model_copy()
        out._sequences = (list(sources), test_size)
        return out

    def dataset_builder(self, renderer: str) -> DatasetBuilder | None:
        """The off-policy / prompt run's sequences (:meth:`with_sequences`) for ``renderer``:
        :class:`~prefect_tinker.recipes.distill.soft_data.SoftTargetBuilder` with
        ``soft_targets``, else :class:`~prefect_tinker.recipes.builders.SupervisedBuilder`; None
        before the sequences are known (the on-policy modes, the checks before the run)."""
        if self._sequences is None:
            return None
        from prefect_tinker.recipes.builders import SupervisedBuilder
        from prefect_tinker.recipes.distill.soft_data import SoftTargetBuilder

        sources, test_size = self._sequences
        kw: dict[str, Any] = dict(
            sources=sources, renderer=renderer, seed=self.seed, max_length=self.max_length, test_size=test_size
        )
        return SoftTargetBuilder(**kw) if self.soft_targets else SupervisedBuilder(**kw)

    def test_count(self) -> float | int:
        """``test_size`` as the split functions take it: an int count when >= 1, else a fraction."""
        return int(self.test_size) if self.test_size >= 1 else float(self.test_size)

    def resolved_teachers(self, runs: bool = True) -> list[TeacherSpec]:
        """The teachers of the run: ``teachers``, else ``[teacher]``; for sdft without one, the
        frozen initial weights with SDFT's demonstration template. With ``runs``, ``run:<id>``
        weights become that run's last checkpoint in ``store``.

        Raises:
            ValueError: (``runs``) a ``run:<id>`` / ``alias:`` teacher that names nothing in the store.
        """
        resolve = self._from_run if runs else (lambda spec: spec)
        if self.teachers:
            return [resolve(t) for t in self.teachers]
        if self.teacher is not None:
            t = resolve(self.teacher)
            if self.mode == "sdft" and t.prompt_template is None:
                t = t.model_copy(update={"prompt_template": DEMO_TEMPLATE})
            return [t]
        start = self.load_checkpoint_path or (self.model if is_weights_ref(self.model) else f"base:{self.model}")
        return [resolve(TeacherSpec(weights=start, prompt_template=DEMO_TEMPLATE))]

    def _from_run(self, spec: TeacherSpec) -> TeacherSpec:
        """``spec`` with ``run:<id>`` / ``alias:LINE@ALIAS`` weights replaced by what they name in
        ``store`` now."""
        if not is_weights_ref(spec.weights):
            return spec
        return spec.model_copy(update={"weights": weights_ref(self.store, spec.weights, "teacher").sampler})

    def preflight(self) -> None:
        """The environment's problems (:meth:`RLTrainingConfig.preflight`) and every ``run:<id>`` teacher
        (a run with a checkpoint in the store), before the run starts.

        Raises:
            ValueError: a bad problem record, or a teacher run that is not in the store (one line).
        """
        super().preflight()
        self.resolved_teachers()

    def prompt_spec(self) -> DistillConfig:
        """This config as the spec of the ``prompts`` env its prompts come from: each teacher's
        dataset a weighted source (``env_options.sources``) when there are several teachers, else
        the config itself.

        Raises:
            ValueError: a teacher with no dataset where the config has none either.
        """
        teachers = self.resolved_teachers()
        if len(teachers) < 2:
            return self
        base = self.env_options.model_dump(exclude_unset=True)
        fmt = base.get("format", "messages")
        sources = [
            {
                "path": t.dataset or self.dataset,
                "format": t.format or fmt,
                "fields": t.fields or base.get("fields", {}),
                "options": base.get("options", {}),
                "weight": t.weight,
                "split": self.split,
                "config_name": self.dataset_config,
                "max_records": self.max_problems,
            }
            for t in teachers
        ]
        missing = [i for i, s in enumerate(sources) if not s["path"]]
        if missing:
            raise ValueError(f"teachers[{missing[0]}]: no dataset (and no run dataset)")
        return self.model_copy(update={"env_options": PromptsOptions.model_validate({"sources": sources})})

    def data_fingerprint(self, renderer: str) -> str:
        """The RL fingerprint plus the content of every teacher's dataset."""
        datasets = [source_fingerprint(t.dataset) if t.dataset else None for t in self.resolved_teachers()]
        body = {"rl": super().data_fingerprint(renderer), "teacher_datasets": datasets, "mode": self.mode}
        return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
