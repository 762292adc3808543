"""From traffic to a better model: the post-training loop as one flow (the ``flywheel`` deployment).

Each run, usually on a schedule:

1. **captures** of the last period (``period_hours``, or ``since`` / ``until``) from the capture
   store, selected by an SQL filter over their columns, the clients' ``rating`` and the
   ``judge_score`` (``select-captures``, :func:`~prefect_tinker.recipes.capture_data.read_captured_conversations`);
2. a **dataset snapshot**: the selection as a JSONL file named by its content hash under
   ``<store>/datasets/<line>/`` -- a Prefect asset with the capture table upstream
   (``snapshot-dataset``); the same captures give the same file, so a re-run trains nothing new;
3. **training from the champion** (``model=alias:<line>@champion``): SFT on the selected replies, or
   DPO when ``method`` asks for it (``auto``: when the rated captures hold at least ``min_examples``
   comparisons -- the same conversation answered once well, once badly); the run is named after the
   snapshot's hash, its checkpoints assets with the snapshot upstream;
4. the **gate and the promotion**: the ``promote`` flow (:mod:`prefect_tinker.flows.promote`)
   evaluates the run's last checkpoint against the champion on ``benchmarks`` and moves the
   ``champion`` alias only when the gate holds;
5. **serving**: a capture endpoint started with ``--model alias:<line>@champion`` picks the new
   champion up by itself (:mod:`prefect_tinker.capture.follow`), requests in flight finishing on the
   old weights.

The lineage captures -> dataset -> checkpoint -> evaluation -> promotion is in Prefect's events:
the asset materializations (snapshot, checkpoints, ``model://<line>/champion``) and
``prefect-tinker.checkpoint.saved`` / ``eval.completed`` / ``model.promoted``; the run's artifact
``flywheel-<line>`` sums it up.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar, Literal, cast

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.assets import Asset, AssetProperties, add_asset_metadata, materialize
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field, field_validator, model_validator

from prefect_tinker.flows.config import BackendConfig, default_store_root
from prefect_tinker.flows.dpo import DPOConfig, dpo_flow
from prefect_tinker.flows.interrupts import recipe_flow
from prefect_tinker.flows.promote import PromoteConfig, promote_flow
from prefect_tinker.flows.sft import SFTConfig, sft_flow
from prefect_tinker.recipes.evals.specs import EvalSpec
from prefect_tinker.recipes.gate import GateConfig
from prefect_tinker.tasks.policies import RETRY_OPTIONS
from prefect_tinker.tasks.reporting import artifact_key
from tinker_blocks.model_registry import ModelRegistry, Weights, check_name

__all__ = ["FlywheelConfig", "flywheel_flow"]


class FlywheelConfig(BaseModel):
    """Parameters of one turn of the loop (the flow's single parameter)."""

    recipe: ClassVar[str] = "flywheel"

    line: str = Field(description="The model line: trained from its champion, promoted into it.")
    base_model: str | None = Field(
        default=None, description="A line without a champion yet starts from this base model (e.g. tiny)."
    )
    captures: str | None = Field(default=None, description="Capture store root; default the store root.")
    where: str = Field(
        default="rating > 0",
        description="SQL filter of the captures trained on (SFT): columns of captures, rating (the client's), "
        "judge_score, e.g. \"rating > 0 AND client = 'agent-a'\".",
    )
    include_truncated: bool = Field(
        default=False,
        description="Keep captures whose reply was cut by max_tokens (finish_reason length); off: a cut reply is a "
        "poor training target.",
    )
    pair_where: str = Field(
        default="rating IS NOT NULL", description="SQL filter of the rated captures that comparisons come from (DPO)."
    )
    period_hours: float | None = Field(
        default=24.0, gt=0, description="Captures of the last N hours (None: all); since/until override it."
    )
    since: datetime | None = Field(default=None, description="Captures at or after this time (UTC).")
    until: datetime | None = Field(default=None, description="Captures before this time (UTC).")
    method: Literal["auto", "sft", "dpo"] = Field(
        default="auto", description="sft, dpo, or auto: dpo when there are min_examples comparisons, else sft."
    )
    min_examples: int = Field(default=4, ge=1, description="Fewer selected examples: nothing is trained this turn.")
    max_examples: int | None = Field(default=None, ge=1, description="At most this many (the newest).")
    training: dict[str, Any] = Field(
        default_factory=dict,
        description="Fields of the training run's config (sft or dpo): max_steps, learning_rate, batch_size, "
        "lora_rank, test_size, ...",
    )
    benchmarks: list[EvalSpec] = Field(min_length=1, description="The suite of the gate.")
    limit: int | None = Field(default=None, ge=1, description="Override: first N examples of every benchmark.")
    gate: GateConfig = Field(default_factory=GateConfig)
    store: str = Field(default_factory=default_store_root, description="Training store root (runs, models).")
    eval_store: str | None = Field(default=None, description="Eval store root; default: the store root.")
    backend: BackendConfig = Field(default_factory=BackendConfig)

    @field_validator("line")
    @classmethod
    def _line(cls, v: str) -> str:
        return check_name(v, "model line")

    @model_validator(mode="after")
    def _check(self) -> FlywheelConfig:
        reserved = {"model", "dataset", "format", "run_name", "store", "backend", "load_checkpoint_path"}
        taken = sorted(reserved & set(self.training))
        if taken:
            raise ValueError(f"training: {taken} are set by the flywheel itself")
        unknown = sorted(set(self.training) - set(SFTConfig.model_fields) - set(DPOConfig.model_fields))
        if unknown:
            raise ValueError(f"training: {unknown} are fields of neither the sft nor the dpo config")
        self.promote_config("run:probe")  # bad benchmark or gate settings fail now
        return self

    def capture_root(self) -> str:
        return self.captures or self.store

    def window(self, now: datetime) -> tuple[datetime | None, datetime | None]:
        """``(since, until)`` of this turn's captures."""
        since = self.since or (now - timedelta(hours=self.period_hours) if self.period_hours else None)
        return since, self.until

    def promote_config(self, candidate: str) -> PromoteConfig:
        return PromoteConfig(
            line=self.line,
            candidate=candidate,
            benchmarks=self.benchmarks,
            limit=self.limit,
            gate=self.gate,
            store=self.store,
            eval_store=self.eval_store,
            backend=self.backend,
        )


def _store_uri(root: str, *parts: str) -> str:
    """A URI under the store root: ``s3://...`` as is, a folder as ``file://<absolute path>``."""
    path = "/".join([root.rstrip("/"), *parts])
    return path if "://" in root else "file://" + str(Path(path).expanduser().resolve())


@task(name="select-captures", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def select_captures(config: FlywheelConfig, since: datetime | None, until: datetime | None) -> dict[str, Any]:
    """The training records of this turn: ``{"method": "sft"|"dpo", "records": [...], "counts":
    {"sft": n, "dpo": n}}`` (SFT: ``{"messages"}``; DPO: ``{"prompt", "chosen", "rejected"}``)."""
    from prefect_tinker.recipes.capture_data import read_captured_conversations, read_captured_preferences

    root = config.capture_root()
    sft = [
        {"messages": c.messages, "source": c.source}
        for c in read_captured_conversations(
            root, config.where, since=since, until=until, include_truncated=config.include_truncated
        )
    ]
    dpo = read_captured_preferences(root, config.pair_where, since=since, until=until) if config.method != "sft" else []
    if config.max_examples:
        sft, dpo = sft[-config.max_examples :], dpo[-config.max_examples :]
    method = config.method
    if method == "auto":
        method = "dpo" if len(dpo) >= config.min_examples else "sft"
    return {"method": method, "records": dpo if method == "dpo" else sft, "counts": {"sft": len(sft), "dpo": len(dpo)}}


def snapshot_dataset(config: FlywheelConfig, selection: dict[str, Any]) -> dict[str, Any]:
    """Write the selection as ``<store>/datasets/<line>/<method>-<sha256[:16]>.jsonl`` (content-
    addressed: written once) inside the ``snapshot-dataset`` asset materialization, the capture
    table upstream. Returns ``{"path", "uri", "sha256", "examples", "method"}``."""
    lines = [json.dumps(r, sort_keys=True, ensure_ascii=False) for r in selection["records"]]
    body = ("\n".join(lines) + "\n").encode()
    digest = hashlib.sha256(body).hexdigest()
    name = f"{selection['method']}-{digest[:16]}.jsonl"
    path = "/".join([config.store.rstrip("/"), "datasets", config.line, name])
    uri = _store_uri(config.store, "datasets", config.line, name)
    upstream = _store_uri(config.capture_root(), "capture", "captures")

    def write() -> None:
        import fsspec

        from tinker_blocks.atomic import atomic_write_bytes

        fs, inner = fsspec.core.url_to_fs(path)
        if not fs.exists(inner):
            atomic_write_bytes(fs, inner, body)
        add_asset_metadata(uri, {"sha256": digest, "examples": len(lines), "method": selection["method"]})

    asset = Asset(
        key=uri,
        properties=AssetProperties(
            name=f"{config.line} {selection['method']} snapshot {digest[:12]}",
            description=f"{len(lines)} examples selected from the captures ({config.where})",
        ),
    )
    materialize(
        asset,
        asset_deps=[upstream],
        name="snapshot-dataset",
        task_run_name=f"snapshot-{digest[:12]}",
        cache_policy=NO_CACHE,
        **RETRY_OPTIONS,
    )(write)()
    return {"path": path, "uri": uri, "sha256": digest, "examples": len(lines), "method": selection["method"]}


def _start(config: FlywheelConfig) -> None:
    """A line without a champion starts from ``base_model`` (the first gate then makes its first
    champion); without one either, one line saying how to make it."""
    from tinker_blocks.stores import TrainingStore

    registry = ModelRegistry(TrainingStore(root=config.store))
    if registry.current(config.line) is not None:
        return
    if not config.base_model:
        raise ValueError(
            f"model line {config.line!r} has no champion: set base_model=..., or "
            f"prefect-tinker models promote {config.line} BASE_MODEL --store {config.store}"
        )
    from prefect_tinker.tasks.models import alias_row, set_alias

    weights = Weights(checkpoint=config.base_model, base_model=config.base_model)
    set_alias(
        config.store,
        alias_row(registry.store, config.line, "champion", "promote", weights, {"reason": "the line starts"}),
    )


def _train(config: FlywheelConfig, snap: dict[str, Any]) -> dict[str, Any]:
    """The training subflow: SFT or DPO from the champion on the snapshot."""
    common = {
        **config.training,
        "model": f"alias:{config.line}@champion",
        "dataset": snap["path"],
        "run_name": f"{config.line}-{snap['method']}-{snap['sha256'][:12]}",
        "store": config.store,
        "backend": config.backend,
    }
    if snap["method"] == "dpo":
        return cast(dict[str, Any], dpo_flow(DPOConfig(**{"format": "preference", **common})))
    return cast(dict[str, Any], sft_flow(SFTConfig(**common)))


@recipe_flow("flywheel", "flywheel-{config.line}")
def flywheel_flow(config: FlywheelConfig) -> dict[str, Any]:
    """One turn of the loop (module docstring); returns ``trained``, ``promoted``, the counts, the
    snapshot, the training summary and the promotion's."""
    log = get_run_logger()
    since, until = config.window(datetime.now(UTC))
    _start(config)
    selection = select_captures(config, since, until)
    n = len(selection["records"])
    log.info(
        "%s: %d captures selected for %s (%s); window %s .. %s",
        config.line,
        n,
        selection["method"],
        selection["counts"],
        since,
        until or "now",
    )
    out: dict[str, Any] = {"line": config.line, "window": [since, until], "counts": selection["counts"]}
    if n < config.min_examples:
        reason = f"{n} examples selected, fewer than min_examples={config.min_examples}: nothing to train"
        _report(config, {**out, "trained": False, "promoted": False, "reason": reason})
        return {**out, "trained": False, "promoted": False, "reason": reason}
    snap = snapshot_dataset(config, selection)
    trained = _train(config, snap)
    promotion = cast(dict[str, Any], promote_flow(config.promote_config(f"run:{trained['run_name']}")))
    result = {
        **out,
        "trained": True,
        "snapshot": snap,
        "run": trained["run_name"],
        "training": {k: v for k, v in trained.items() if isinstance(v, (int, float, str)) or v is None},
        "promoted": promotion["promoted"],
        "reason": promotion["reason"],
        "promotion": promotion,
    }
    _report(config, result)
    return result


def _report(config: FlywheelConfig, result: dict[str, Any]) -> None:
    snap = result.get("snapshot") or {}
    promotion = result.get("promotion") or {}
    decision = promotion.get("decision") or {}
    rows = [
        (
            "captures",
            f"{result['counts']} selected by `{config.where}`, window {result['window'][0]} .. "
            f"{result['window'][1] or 'now'}",
        ),
        ("dataset", f"`{snap.get('uri', '-')}` ({snap.get('examples', 0)} {snap.get('method', '')} examples)"),
        ("training run", f"`{result.get('run', '-')}`"),
        ("candidate", f"`{promotion.get('candidate', '-')}`"),
        ("champion before", f"`{promotion.get('champion', '-')}`"),
        (
            "gate",
            f"difference {decision['difference']:+.4f} [{decision['low']:+.4f}, {decision['high']:+.4f}]"
            if decision
            else "-",
        ),
        ("promoted", f"{result['promoted']} ({result.get('reason', '')})"),
    ]
    create_markdown_artifact(
        "\n".join(
            [f"# Flywheel `{config.line}`", "", "| step | what |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]
        ),
        key=artifact_key("flywheel", config.line),
        description="flywheel turn: captures -> dataset -> checkpoint -> gate -> promotion",
    )
