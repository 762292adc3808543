"""The ``prefect-tinker`` command line (installed as :mod:`prefect_tinker.cli`), the top layer.

- :mod:`prefect_tinker.cli.main`: the parser and ``main`` (the console script), run, flows, deploy,
  local (``python -m tinker_local``'s status/stop), ops;
- :mod:`prefect_tinker.cli.config`: CLI errors and exit codes, YAML values, ``key=value`` overrides;
- :mod:`prefect_tinker.cli.flows`: the flow registry as seen from the command line, config building;
- :mod:`prefect_tinker.cli.store`: ``sql``, ``runs``, ``checkpoints``, ``store check|repair``;
- :mod:`prefect_tinker.cli.show`: ``show-example``;
- :mod:`prefect_tinker.cli.sandbox`: ``sandbox``;
- :mod:`prefect_tinker.cli.capture`: ``capture serve`` (the capture proxy);
- :mod:`prefect_tinker.cli.ui`: ``ui``, ``ui status``, ``ui stop`` (the local Prefect server and its UI).

Nothing below the command line imports it.
"""
