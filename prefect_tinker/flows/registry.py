"""The recipe registry: recipe name -> config model, flow, curves, example configs, deployments.

Read by ``prefect-tinker run NAME`` / ``ls`` / ``show-config``, by the run session (curves of the
report) and by the generator of ``prefect.yaml`` (:func:`deployments_yaml`). A new recipe is one
:class:`Recipe` registered in :data:`RECIPES` (a :class:`~prefect_tinker.recipes.registry.Registry`;
the built-in ones in :mod:`prefect_tinker.flows.builtin_recipes`; a plugin package declares it as an
entry point of group ``prefect_tinker.recipes``, ``name = "pkg.module:RECIPE"``) plus its flow
module and its example configs (in ``configs/<name>/*.yaml`` here, or the folder named by
``Recipe.configs``). A flow is given by a function that imports and returns it (the built-in
recipes: an editor follows the import into the flow's module) or by a ``module:attribute`` string
(a plugin's); either way it is imported only when used, so listing recipes imports no flow.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
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
        flow: the Prefect flow taking ``config``: a function of no arguments that imports and
            returns it, or its ``module:attr``.
        description: one line for ``prefect-tinker ls``.
        curves: metric names drawn in the run's curves picture.
        deployments: example config names deployed by ``prefect.yaml`` (as ``<name>-<example>``).
        configs: ``package:folder`` of the recipe's example configs (``*.yaml``) inside an
            installed package (a plugin's own); default ``configs/<name>/`` of this package.
        tags: extra tags of deployments, by example name (e.g. the opt-in tag an automation of
            :mod:`prefect_tinker.cli.automations` reacts to).
        schedules: schedules of deployments, by example name (``prefect.yaml`` schedule entries,
            e.g. ``{"cron": "0 3 * * *"}``).
    """

    name: str
    flow: str | Callable[[], Any]
    description: str = ""
    curves: tuple[str, ...] = ()
    deployments: tuple[str, ...] = field(default=())
    configs: str | None = None
    tags: dict[str, tuple[str, ...]] = field(default_factory=dict)
    schedules: dict[str, tuple[dict[str, Any], ...]] = field(default_factory=dict)

    def load_flow(self) -> Any:
        """The flow object (imports its module).

        Raises:
            ImportError / AttributeError: a ``module:attr`` that does not name an importable object.
        """
        if callable(self.flow):
            return self.flow()
        module, _, attr = self.flow.partition(":")
        return getattr(importlib.import_module(module), attr)

    @property
    def entrypoint(self) -> str:
        """The module-path entrypoint of the flow for ``prefect.yaml`` (``pkg.module.attr``)."""
        if isinstance(self.flow, str):
            return self.flow.replace(":", ".")
        fn = self.load_flow().fn  # a Prefect Flow: the decorated function
        return f"{fn.__module__}.{fn.__name__}"


#: The recipes by name; plugins add theirs through the ``prefect_tinker.recipes`` entry-point group.
RECIPES: Registry[Recipe] = Registry(
    "recipe", "prefect_tinker.recipes", builtins=("prefect_tinker.flows.builtin_recipes",)
)


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
