"""The ``memorize`` recipe: one folder (config + flow + example configs) and one registration,
:data:`RECIPE`, named by the ``prefect_tinker.recipes`` entry point of the plugin."""

from prefect_tinker.plugin import Recipe

RECIPE = Recipe("memorize", "demo_plugin.memorize.flow:memorize_flow",
                "memorize one sentence (a plugin's recipe: next-token cross-entropy on one text)",
                curves=("train/loss",), configs="demo_plugin.memorize:configs")
