"""Example configs of the recipes, one folder per recipe (``configs/<recipe>/<name>.yaml``),
listed by ``prefect-tinker ls`` and run with ``prefect-tinker run <recipe> --example <name>``."""
