"""inspect-ai entry point (``[project.entry-points.inspect_ai]``): registers the ``tinker`` model API.

inspect-ai imports this module when it resolves a ``tinker/...`` model; the provider class and its
dependencies are imported only when such a model is created.
"""

from inspect_ai.model import modelapi


@modelapi(name="tinker")
def tinker():
    from prefect_tinker.inspect_provider.model_api import TinkerModelAPI

    return TinkerModelAPI
