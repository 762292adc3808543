"""Names vulture reports as unused (scripts/lint.sh) that an interface requires; each is used by its caller.

Read by vulture only (``vulture PACKAGES scripts/vulture_allowlist.py``); never imported.
"""

_ = None
# RunSession.__exit__(exc_type, exc, tb): the context manager protocol's arguments (prefect_tinker/flows/session.py)
_.exc_type
_.tb
# the sandbox reaper's signal handler stop(signum, frame): signal.signal's callback signature
# (prefect_tinker/recipes/sandbox/reaper.py)
_.signum
_.frame
# retry_condition(task, task_run, state): Prefect's retry_condition_fn signature (prefect_tinker/tasks/policies.py)
_.task_run
