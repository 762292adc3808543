"""The recipe registry: recipe name -> config model, flow, curves, example configs, deployments.

Read by ``prefect-tinker run NAME`` / ``ls`` / ``show-config``, by the run session (curves of the
report) and by the generator of ``prefect.yaml`` (:func:`deployments_yaml`). A new recipe is one
:class:`Recipe` registered in :data:`RECIPES` (a :class:`~prefect_tinker.recipes.registry.Registry`;
a plugin package declares it as an entry point of group ``prefect_tinker.recipes``,
``name = "pkg.module:RECIPE"``) plus its flow module and its example configs (in
``configs/<name>/*.yaml`` here, or the folder named by ``Recipe.configs``). Flows and configs are
named by ``module:attribute`` strings, imported only when used (listing recipes imports no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from prefect_tinker.recipes.registry import Registry

__all__ = ["RECIPES", "Recipe", "deployments_yaml", "example_configs", "get_recipe", "load_example", "recipes"]


@dataclass(frozen=True)
class Recipe:
    """One recipe.

    Attributes:
        name: the registry name (``prefect-tinker run <name>``; run-name and artifact prefix).
        flow: ``module:attr`` of the Prefect flow taking ``config``.
        description: one line for ``prefect-tinker ls``.
        curves: metric names drawn in the run's curves picture.
        deployments: example config names deployed by ``prefect.yaml`` (as ``<name>-<example>``).
        configs: ``package:folder`` of the recipe's example configs (``*.yaml``) inside an
            installed package (a plugin's own); default ``configs/<name>/`` of this package.
        tags: extra tags of deployments, by example name (e.g. the opt-in tag an automation of
            :mod:`prefect_tinker.flows.ops` reacts to).
        schedules: schedules of deployments, by example name (``prefect.yaml`` schedule entries,
            e.g. ``{"cron": "0 3 * * *"}``).
    """

    name: str
    flow: str
    description: str = ""
    curves: tuple[str, ...] = ()
    deployments: tuple[str, ...] = field(default=())
    configs: str | None = None
    tags: dict[str, tuple[str, ...]] = field(default_factory=dict)
    schedules: dict[str, tuple[dict[str, Any], ...]] = field(default_factory=dict)

    @property
    def entrypoint(self) -> str:
        """The module-path entrypoint of the flow for ``prefect.yaml`` (``pkg.module.attr``)."""
        return self.flow.replace(":", ".")


#: The recipes by name; plugins add theirs through the ``prefect_tinker.recipes`` entry-point group.
RECIPES: Registry[Recipe] = Registry("recipe", "prefect_tinker.recipes")
for _recipe in (
    Recipe(
        "sft",
        "prefect_tinker.flows.sft:sft_flow",
        "supervised fine-tuning on chat data (LoRA)",
        ("train/loss", "test/nll", "train/learning_rate"),
        ("tiny",),
    ),
    Recipe(
        "rl",
        "prefect_tinker.flows.rl:rl_flow",
        "RL with verifiable rewards (GRPO-style group advantages)",
        ("env/reward_mean", "env/correct_rate", "train/entropy", "train/kl_sample_train_v1"),
        ("arithmetic",),
    ),
    Recipe(
        "dpo",
        "prefect_tinker.flows.dpo:dpo_flow",
        "preference learning: DPO / IPO / hinge on comparisons",
        ("train/dpo_loss", "train/accuracy", "train/margin", "test/accuracy"),
        ("tiny",),
    ),
    Recipe(
        "distill",
        "prefect_tinker.flows.distill:distill_flow",
        "distillation: on-policy (teacher KL), off-policy (teacher samples / top-K), SDFT, prompt distillation",
        ("train/teacher_kl", "sdft/kl", "train/soft_ce", "train/loss", "eval/teacher_agreement"),
    ),
    Recipe(
        "eval",
        "prefect_tinker.flows.eval:eval_flow",
        "benchmarks and inspect-ai tasks on base models, sampler paths or every checkpoint of a run (cached)",
        (),
        ("checkpoint",),
        tags={"checkpoint": ("consider-promotion",)},  # its evaluations may start a promotion (flows/ops.py)
    ),
    Recipe(
        "export",
        "prefect_tinker.flows.export:export_flow",
        "a checkpoint as a merged Hugging Face model or a PEFT adapter, verified by logprobs",
    ),
    Recipe(
        "reward_model",
        "prefect_tinker.flows.reward_model:reward_model_flow",
        "pairwise reward model: which of two completions is better, scored by label probabilities",
        ("train/loss", "eval/rm_accuracy", "eval/rm_brier"),
    ),
    Recipe(
        "rlhf",
        "prefect_tinker.flows.rlhf:rlhf_flow",
        "RLHF: SFT -> reward model -> RL from the reward model, one subflow (and run) per stage",
        (),
    ),
    Recipe(
        "decisions",
        "prefect_tinker.flows.decisions:decisions_flow",
        "a distribution over named choices from label-token probabilities; cross-entropy / KL, calibration",
        ("train/ce", "test/accuracy", "test/brier", "test/ece"),
    ),
    Recipe(
        "promote",
        "prefect_tinker.flows.promote:promote_flow",
        "eval-gated promotion: candidate vs champion on the same items (paired bootstrap), alias moved if better",
        (),
        ("candidate",),
    ),
    Recipe(
        "flywheel",
        "prefect_tinker.flows.flywheel:flywheel_flow",
        "captures -> dataset snapshot -> training from the champion -> gate -> promotion, on a schedule",
        (),
        ("tiny",),
        schedules={"tiny": ({"cron": "0 3 * * *", "timezone": "UTC"},)},  # each night: the last day's captures
    ),
):
    RECIPES.register(_recipe.name, _recipe)


def recipes() -> dict[str, Recipe]:
    """Every registered recipe (built-in and plugins'), by name."""
    return dict(RECIPES)


def get_recipe(name: str) -> Recipe:
    """The recipe ``name``; a recipe without a registration (a flow run by ``module:attr``) gets
    an empty one with no curves."""
    return RECIPES.get(name) or Recipe(name, "", "")


def _configs_folder(name: str) -> Path:
    recipe = RECIPES.get(name)
    if recipe is not None and recipe.configs:
        package, _, folder = recipe.configs.partition(":")
        return Path(str(resources.files(package))) / folder
    return Path(str(resources.files("prefect_tinker.configs"))) / name


def example_configs(name: str) -> dict[str, Path]:
    """Example config files of recipe ``name``: ``{example name: path}`` from ``configs/<name>/``
    (or the recipe's own ``configs`` folder)."""
    folder = _configs_folder(name)
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))} if folder.is_dir() else {}


def load_example(name: str, example: str) -> dict[str, Any]:
    """The example config ``example`` of recipe ``name`` as a dict.

    Raises:
        ValueError: no such example (the message lists the recipe's examples).
    """
    import yaml

    files = example_configs(name)
    if example not in files:
        raise ValueError(f"recipe {name!r} has no example config {example!r}; examples: {', '.join(files) or '(none)'}")
    return yaml.safe_load(files[example].read_text()) or {}


def deployments_yaml() -> str:
    """The ``deployments:`` section of ``prefect.yaml``: one deployment per (recipe, example in
    ``Recipe.deployments``), parameters from the example config, run by the ``tinker-process``
    work pool (the rest of ``prefect.yaml`` is written by hand)."""
    import yaml

    items = []
    for r in RECIPES.values():
        for ex in r.deployments:
            items.append(
                {
                    "name": f"{r.name}-{ex}",
                    "description": f"{r.description} (example config configs/{r.name}/{ex}.yaml)",
                    "entrypoint": r.entrypoint,
                    "tags": ["prefect-tinker", r.name, *r.tags.get(ex, ())],
                    "parameters": {"config": load_example(r.name, ex)},
                    **({"schedules": [dict(s) for s in r.schedules[ex]]} if ex in r.schedules else {}),
                    "work_pool": "*tinker_process",
                }
            )
    text = yaml.safe_dump({"deployments": items}, sort_keys=False, width=100)
    return text.replace("work_pool: '*tinker_process'", "work_pool: *tinker_process")
