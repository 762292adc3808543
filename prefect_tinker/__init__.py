"""prefect-tinker: LLM post-training as Prefect flows over the Tinker API.

Everything of the plugin but the blocks and the server lives in this one namespace, so that no generic
top-level name (``flows``, ``tasks``, ``recipes``) is taken from the user's own project:

- :mod:`prefect_tinker.flows`: one flow per recipe, the run session and the step loop shared by every
  recipe, the recipe registry;
- :mod:`prefect_tinker.tasks`: the Prefect tasks (training primitives, checkpoints, rollouts,
  evaluation, store writes) with the one retry policy;
- :mod:`prefect_tinker.recipes`: renderers, dataset builders, RL environments, losses and evaluators
  (no Prefect);
- :mod:`prefect_tinker.configs`: example configs per recipe (YAML);
- :mod:`prefect_tinker.cli`: the ``prefect-tinker`` command line;
- :mod:`prefect_tinker.capture` (the OpenAI-compatible capture proxy), :mod:`prefect_tinker.export`
  (the export engine) and :mod:`prefect_tinker.inspect_provider` (the inspect-ai model provider).

A module's import name is its path in the checkout (docs/layers.md).

The Prefect blocks (:mod:`tinker_blocks`) and the local Tinker-compatible server
(:mod:`tinker_local`) keep their own, specific top-level names: the blocks are the package's
``prefect.collections`` entry point and the server could ship on its own.
"""

__version__ = "0.2.0"
