"""Run reports a person reads at a glance in the Prefect UI: the latest metrics as a table artifact
and the training curves as a PNG picture embedded in a markdown artifact.

Both are read back from the training store (so a resumed run's report covers every invocation)
and posted under stable artifact keys (``<kind>-<run>-metrics``, ``<kind>-<run>-curves``), each with
a description naming the run and the step: the first report of a flow run creates the artifact and
later ones (every checkpoint) update that one in place, so the flow run's Artifacts tab shows one
card of each, at its newest step; each flow run of the run (a resume) adds a version to the key's
history. The picture is embedded
as a ``data:image/png;base64`` URI (the self-hosted UI renders it; no file server needed) and also
written to ``<store root>/reports/<run_id>/curves.png`` (a local folder or ``s3://``).
"""

from __future__ import annotations

import base64
import io
import json
import math
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast
from uuid import UUID

from prefect import task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE

from prefect_tinker.tasks.policies import RETRY_OPTIONS

if TYPE_CHECKING:
    from tinker_blocks.stores import TrainingStore

__all__ = [
    "Progress",
    "artifact_key",
    "eval_curve_names",
    "latest_metrics",
    "metric_series",
    "plot_curves",
    "report_run",
    "write_png",
    "SFT_CURVES",
    "RL_CURVES",
]

#: Curves of an SFT run (one panel per name; names absent from the store are skipped).
SFT_CURVES: tuple[str, ...] = ("train/loss", "test/nll", "train/learning_rate")
#: Curves of an RL run.
RL_CURVES: tuple[str, ...] = ("env/reward_mean", "env/correct_rate", "train/entropy", "train/kl_sample_train_v1")


def artifact_key(kind: str, run_id: str, what: str = "") -> str:
    """A valid Prefect artifact key (lowercase letters, digits, dashes) for ``kind``/``run_id``/``what``
    (``<kind>-<run>`` when ``what`` is empty: the run's summary)."""

    def clean(text: str) -> str:
        return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")

    slug, kind = clean(run_id)[:60], clean(kind)  # e.g. recipe reward_model -> reward-model
    return f"{kind}-{slug}-{what}" if what else f"{kind}-{slug}"


#: (flow run id, artifact key) -> id of the artifact this flow run posted under that key (this process)
_posted: dict[tuple[str, str], UUID] = {}
_posted_lock = threading.Lock()


def _post_once_per_flow_run(key: str, description: str, data: Any, create: Any) -> None:
    """``create(data, key=key, description=description)`` the first time this flow run posts ``key``,
    then update that artifact's data and description in place (no second card in the run's
    Artifacts tab). Outside a flow run: always created."""
    from prefect.runtime import flow_run

    run = flow_run.get_id()
    slot = (str(run), key) if run else None
    with _posted_lock:
        posted = _posted.get(slot) if slot else None
    if posted is None:
        new = cast(UUID, create(data, key=key, description=description))
        if slot is not None:
            with _posted_lock:
                _posted[slot] = new
        return
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate

    formatted = data if isinstance(data, str) else json.dumps(data)  # as the table artifact stores its rows
    get_client(sync_client=True).update_artifact(posted, ArtifactUpdate(data=formatted, description=description))


class Progress:
    """A progress artifact (percent of ``total`` steps done) updated at most every ``every`` seconds
    and always at the end: each update is a blocking API call (10-60 ms), too much for every step
    of a fast run.

    Example: ``p = Progress(f"SFT {run}: steps done of {total}", total, run.step, key=...)``, then
    ``p.update(run.step)`` after each step.
    """

    def __init__(self, description: str, total: int, done: int = 0, every: float = 5.0, key: str | None = None):
        self.total, self.every = max(int(total), 1), every
        # called from sync code: Prefect's sync_compatible returns the id itself, not a coroutine
        self.id = cast(UUID, create_progress_artifact(progress=self._pct(done), key=key, description=description))
        self.last = time.monotonic()

    def _pct(self, done: int) -> float:
        return min(100.0, 100.0 * done / self.total)

    def update(self, done: int) -> None:
        """Record ``done`` steps when ``every`` seconds passed since the last update, or at the end."""
        now = time.monotonic()
        if done >= self.total or now - self.last >= self.every:
            update_progress_artifact(self.id, progress=self._pct(done))
            self.last = now


def _store(store: str | TrainingStore) -> TrainingStore:
    from tinker_blocks.stores import TrainingStore

    return store if isinstance(store, TrainingStore) else TrainingStore(root=str(store))


def latest_metrics(store: Any, run_id: str) -> list[dict[str, Any]]:
    """The newest value of every metric of ``run_id``: rows ``{"metric", "step", "value"}`` sorted by
    name (values rounded to 6 significant digits for display; NaN shown as None)."""
    rows = _store(store).query(
        "SELECT name, max(step) AS step, arg_max(value, step) AS value FROM metrics "
        "WHERE run_id = ? GROUP BY name ORDER BY name",
        [run_id],
    )
    out = []
    for r in rows:
        v = r["value"]
        v = None if v is None or (isinstance(v, float) and math.isnan(v)) else float(f"{v:.6g}")
        out.append({"metric": r["name"], "step": int(r["step"]), "value": v})
    return out


def metric_series(store: Any, run_id: str, names: Sequence[str]) -> dict[str, tuple[list[int], list[float]]]:
    """``name -> (steps, values)`` for each of ``names`` that ``run_id`` has, in step order."""
    if not names:
        return {}
    marks = ", ".join("?" for _ in names)
    rows = _store(store).query(
        f"SELECT name, step, value FROM metrics WHERE run_id = ? AND name IN ({marks}) ORDER BY name, step",
        [run_id, *names],
    )
    series: dict[str, tuple[list[int], list[float]]] = {}
    for r in rows:
        steps, values = series.setdefault(r["name"], ([], []))
        steps.append(int(r["step"]))
        values.append(float(r["value"]))
    return {n: series[n] for n in names if n in series}


def plot_curves(series: dict[str, tuple[list[int], list[float]]], title: str) -> bytes:
    """A PNG (bytes) with one panel per metric (x: step). Uses matplotlib's Agg backend (no display).

    Raises:
        ValueError: ``series`` is empty.
    """
    if not series:
        raise ValueError("no metric series to plot")
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure  # a bare Figure: no pyplot global state, thread-safe

    n = len(series)
    width = 3.2 * n  # inches; margins fixed in inches (matplotlib's constrained layout doubles the drawing time)
    fig = Figure(figsize=(width, 2.6), dpi=80)
    fig.subplots_adjust(left=0.7 / width, right=1 - 0.15 / width, bottom=0.17, top=0.78, wspace=0.45)
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, (name, (steps, values)) in zip(axes, series.items(), strict=True):
        ax.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=3, linewidth=1.5)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def eval_curve_names(store: Any, run_id: str) -> list[str]:
    """The ``eval/<benchmark>/accuracy`` metrics ``run_id`` has in the training store (recorded by
    the benchmark evaluators during training), sorted."""
    rows = _store(store).query(
        "SELECT DISTINCT name FROM metrics WHERE run_id = ? AND name LIKE 'eval/%/accuracy' ORDER BY name", [run_id]
    )
    return [r["name"] for r in rows]


def write_png(root: str, run_id: str, png: bytes, name: str = "curves.png") -> str:
    """Write ``png`` to ``<root>/reports/<run_id>/<name>`` whole or not at all (a local file
    goes through a temporary and a rename, S3 is one PUT; a dead writer's leftover temporaries
    there are removed first); returns that path or URL.

    Raises:
        WriteError: the write failed (e.g. a full disk); the message names the path.
    """
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    from tinker_blocks.atomic import atomic_write_bytes, sweep_stale_temps
    from tinker_blocks.store_config import resolve_storage_options

    url = f"{root.rstrip('/')}/reports/{run_id}/{name}"
    fs, path = fsspec.core.url_to_fs(url, **resolve_storage_options(root))
    local = isinstance(fs, LocalFileSystem)
    if local:
        sweep_stale_temps(path.rsplit("/", 1)[0])
    atomic_write_bytes(fs, path, png, local=local)
    return url


@task(name="report-run", task_run_name="report-{run_id}-step-{step}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def report_run(
    store: str | TrainingStore,
    run_id: str,
    step: int,
    kind: str = "sft",
    curves: Sequence[str] = SFT_CURVES,
    plot: bool = True,
) -> dict[str, Any]:
    """Post the run's report artifacts from the training store at ``store``.

    - table artifact ``<kind>-<run>-metrics``: the newest value of every metric;
    - markdown artifact ``<kind>-<run>-curves`` (``plot=True`` and at least one of ``curves``
      recorded): the PNG of those curves and of every ``eval/<benchmark>/accuracy`` of the run
      (:func:`eval_curve_names`), embedded, and its path in the store.

    Each is created at a flow run's first report and updated in place by its later ones.

    Returns ``{"metrics": n_rows, "png": path or None, "png_bytes": size}``.
    """
    rows = latest_metrics(store, run_id)
    if rows:
        _post_once_per_flow_run(
            artifact_key(kind, run_id, "metrics"),
            f"{kind.upper()} run `{run_id}`: latest value of every metric at step {step}",
            rows,
            create_table_artifact,
        )
    if not plot:
        return {"metrics": len(rows), "png": None, "png_bytes": 0}
    series = metric_series(store, run_id, [*curves, *(n for n in eval_curve_names(store, run_id) if n not in curves)])
    if not series:
        return {"metrics": len(rows), "png": None, "png_bytes": 0}
    png = plot_curves(series, f"{kind.upper()} {run_id} (step {step})")
    path = write_png(_store(store).root, run_id, png)
    data = base64.b64encode(png).decode("ascii")
    markdown = "\n".join(
        [
            f"# {kind.upper()} run `{run_id}`: curves at step {step}",
            "",
            f"![{kind} curves of {run_id}](data:image/png;base64,{data})",
            "",
            f"Picture also at `{path}`. Curves: " + ", ".join(f"`{n}`" for n in series) + ".",
        ]
    )
    _post_once_per_flow_run(
        artifact_key(kind, run_id, "curves"),
        f"{kind.upper()} run `{run_id}`: curves at step {step}",
        markdown,
        create_markdown_artifact,
    )
    return {"metrics": len(rows), "png": path, "png_bytes": len(png)}
