"""Small environments written with the ``verifiers`` library (its public API only, as any third-party
environment package is), for the example configs of ``env=verifiers`` (``configs/rl/verifiers_*.yaml``):
``env_options.name`` takes their module path, which ``vf.load_environment`` imports."""
