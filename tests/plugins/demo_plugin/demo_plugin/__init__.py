"""A prefect-tinker plugin: everything here is registered through the entry points of its
``pyproject.toml``; nothing of prefect-tinker's own repository is edited."""
