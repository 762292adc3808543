"""The backends' concurrency limits on a Prefect server (``prefect-tinker ops install-limits``).

:func:`install_limits` creates (or resizes) the global concurrency limits the flows take slots of
(:mod:`prefect_tinker.tasks.limits`): ``tinker-train:<backend>``, ``tinker-sample:<backend>`` and the
rate limit ``tinker-sample-rate:<backend>``. The command line: :mod:`prefect_tinker.cli.ops`.
"""

from __future__ import annotations

__all__ = ["install_limits"]


def install_limits(
    backend: str = "local", train: int | None = None, sample: int | None = None, sample_rate: float | None = None
) -> list[str]:
    """Create or resize the global concurrency limits of ``backend``: ``tinker-train:<backend>``
    (``train`` slots), ``tinker-sample:<backend>`` (``sample`` slots) and the rate limit
    ``tinker-sample-rate:<backend>`` (``sample_rate`` requests per second: the limit is
    ``max(1, ceil(rate))`` slots decaying at ``rate`` per second). None leaves a limit as it is.
    Returns one line per limit written.

    Raises:
        ValueError: a size below 1 or a rate not above 0.
    """
    import math

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectNotFound

    wanted: list[tuple[str, int, float]] = []
    for kind, size in (("train", train), ("sample", sample)):
        if size is not None:
            if size < 1:
                raise ValueError(f"--{kind} must be at least 1, got {size}")
            wanted.append((f"tinker-{kind}:{backend}", int(size), 0.0))
    if sample_rate is not None:
        if not sample_rate > 0:
            raise ValueError(f"--sample-rate must be above 0, got {sample_rate}")
        wanted.append((f"tinker-sample-rate:{backend}", max(1, math.ceil(sample_rate)), float(sample_rate)))
    out = []
    with get_client(sync_client=True) as client:
        for name, limit, decay in wanted:
            try:
                client.read_global_concurrency_limit_by_name(name)
                client.update_global_concurrency_limit(
                    name, GlobalConcurrencyLimitUpdate(limit=limit, slot_decay_per_second=decay, active=True)
                )
                out.append(f"updated {name}: {limit} slot(s)" + (f", {decay:g}/s" if decay else ""))
            except ObjectNotFound:
                client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=limit, slot_decay_per_second=decay, active=True)
                )
                out.append(f"created {name}: {limit} slot(s)" + (f", {decay:g}/s" if decay else ""))
    return out
