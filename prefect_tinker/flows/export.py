"""Export a checkpoint: a merged Hugging Face model or a PEFT adapter, verified by logprobs.

Not a training run, so of the recipe skeleton it uses the backend's credentials
(:func:`~prefect_tinker.flows.config.resolve_credentials`), the check of the destination before
any work (like the run session's ``check-store``: wrong S3 credentials or an occupied folder
fail first: the ``check-export-output`` task) and a summary artifact. The work is the
``export-checkpoint`` task (:func:`prefect_tinker.tasks.export.export_checkpoint`): cached, an
asset with the checkpoint upstream; both tasks are in :mod:`prefect_tinker.tasks.export`, the
engine they run in :mod:`prefect_tinker.export`. A cached result whose files are gone (or
replaced) from ``out`` is exported again.

``prefect-tinker run export checkpoint=tinker://...|run:NAME format=merged|peft out=DIR|s3://... [dtype=...]``
(``run:NAME`` / ``alias:LINE@ALIAS``: the weights they name in ``store``, by the one resolver of
every ``model=``, ``teacher=`` and ``checkpoint=`` setting,
:func:`~prefect_tinker.flows.config.weights_ref`; its state checkpoint where one is recorded)
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field, field_validator

from prefect_tinker.export.output import ExportOutput
from prefect_tinker.export.server import parse_checkpoint
from prefect_tinker.flows.config import (
    BackendConfig,
    PreflightChecks,
    default_store_root,
    resolve_credentials,
    weights_ref,
)
from prefect_tinker.flows.interrupts import recipe_flow
from prefect_tinker.tasks.export import check_export_output, export_checkpoint, export_key
from prefect_tinker.tasks.reporting import artifact_key
from tinker_blocks.model_registry import WeightsRefError, is_weights_ref

__all__ = ["ExportConfig", "export_flow"]


class ExportConfig(PreflightChecks, BaseModel):
    """Parameters of an export (the flow's single parameter)."""

    recipe: ClassVar[str] = "export"

    checkpoint: str = Field(
        description=(
            "State (tinker://<run>/weights/<name>) or sampler (tinker://<run>/sampler_weights/<name>) checkpoint to "
            "export, or run:RUN / alias:LINE@ALIAS (the checkpoint it names in the training store)."
        )
    )
    format: Literal["merged", "peft"] = Field(
        default="merged",
        description=(
            "merged: a Hugging Face model folder (LoRA merged into the weights); peft: the adapter for peft.PeftModel."
        ),
    )
    out: str = Field(
        description="Destination: a local folder or s3://bucket/prefix (S3 credentials from the AWS_* environment)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="Dtype of the saved tensors (the merge itself is float32)."
    )
    base_model: str | None = Field(
        default=None,
        description=(
            "The base model's local Hugging Face folder or hub id, when the server sends none (the hosted service); "
            "default: the run's base model name."
        ),
    )
    max_shard_mb: int = Field(default=5000, ge=1, description="Largest safetensors shard of a merged model (MB).")
    overwrite: bool = Field(default=False, description="Replace what out already holds.")
    server_ttl_s: int | None = Field(
        default=86_400,
        ge=3600,
        description="Lifetime of the server-side external and reference checkpoints (seconds; null keeps them).",
    )
    work_dir: str | None = Field(
        default=None, description="Folder for the downloaded files (default: the system's temp folder)."
    )
    store: str = Field(
        default_factory=default_store_root,
        description="Training store root (where run: and alias: references are looked up).",
    )
    backend: BackendConfig = Field(default_factory=BackendConfig)

    @field_validator("checkpoint")
    @classmethod
    def _path(cls, v: str) -> str:
        if is_weights_ref(v.strip()):
            return v.strip()
        parse_checkpoint(v)
        return v

    def preflight(self) -> None:
        """A ``run:`` or ``alias:`` reference names a checkpoint in the store (checked before
        anything starts)."""
        self.checkpoint_path()

    def checkpoint_path(self) -> str:
        """``checkpoint`` as a ``tinker://`` path (a reference resolved through the store now: the
        state checkpoint of the weights it names where one is recorded, else their sampler
        weights; a sampler row an evaluation of a run wrote has no state of its own).

        Raises:
            WeightsRefError: the reference names nothing, or a base model (nothing to export).
        """
        if not is_weights_ref(self.checkpoint):
            return self.checkpoint
        weights = weights_ref(self.store, self.checkpoint, "checkpoint")
        if weights.is_base:
            raise WeightsRefError(
                f"checkpoint={self.checkpoint} names the base model {weights.checkpoint}: no checkpoint"
            )
        return weights.state_path or weights.checkpoint

    @field_validator("out")
    @classmethod
    def _out(cls, v: str) -> str:
        ExportOutput(v)  # another scheme, or an S3 URL without a prefix, fails here
        return v


def _summary(config: ExportConfig, checkpoint: str, meta: dict[str, Any]) -> None:
    v, name = meta["verification"], parse_checkpoint(checkpoint)[2]
    rows = {
        "checkpoint": f"`{meta['checkpoint']}`",
        "state": f"`{meta['state_path']}`",
        "external weights": f"`{meta['external_weights']}`",
        "format": meta["format"],
        "dtype": meta["dtype"],
        "out": f"`{meta['out']}`",
        "base model": f"`{meta['base_model']}` ({meta['base_model_source']})",
        "LoRA": f"rank {meta['lora']['rank']}, alpha {meta['lora']['alpha']:g}, {meta['lora']['targets']} targets",
        "tied embeddings": ", ".join(f"{k}={v}" for k, v in meta["embeddings"].items()) or "-",
        "verified against": f"`{v['reference']}` compute_logprobs",
        "max / mean abs logprob diff": f"{v['max_abs_diff']:.2e} / {v['mean_abs_diff']:.2e} "
        f"(tolerance {v['tolerance']:g}"
        + (f" / {v['mean_tolerance']:g})" if v.get("mean_tolerance") is not None else ")"),
        **(
            {
                "float32 stage (before the cast)": f"{v['float32']['max_abs_diff']:.2e} / "
                f"{v['float32']['mean_abs_diff']:.2e} "
                f"(tolerance {v['float32']['tolerance']:g})"
            }
            if "float32" in v
            else {}
        ),
        "tokens compared": f"{v['tokens']} in {v['sequences']} sequences",
        "adapter effect (max abs)": f"{v['adapter_effect_max_abs']:.3g}",
    }
    lines = [
        f"# Export of `{name}` ({meta['format']}, {meta['dtype']})",
        "",
        "| field | value |",
        "|---|---|",
        *[f"| {k} | {val} |" for k, val in rows.items()],
        "",
        "## Files",
        "",
        "| file | bytes | sha256 |",
        "|---|---|---|",
        *[f"| `{n}` | {f['bytes']} | `{f['sha256'][:16]}` |" for n, f in meta["files"].items()],
    ]
    create_markdown_artifact(
        "\n".join(lines),
        key=artifact_key("export", f"{name}-{meta['format']}-{meta['dtype']}"),
        description="export summary",
    )


@recipe_flow("export", "export-{config.format}-{config.dtype}")
def export_flow(config: ExportConfig) -> dict[str, Any]:
    """Export ``config.checkpoint`` to ``config.out``; returns the export's metadata
    (``export_metadata.json``: files, verification, sources)."""
    log = get_run_logger()
    credentials = resolve_credentials(config.backend)
    config = config.model_copy(update={"checkpoint": config.checkpoint_path()})
    checkpoint = config.checkpoint
    max_shard = config.max_shard_mb * 1_000_000
    key = export_key(checkpoint, config.format, config.dtype, config.base_model, max_shard)
    check_export_output(config.out, config.overwrite, key)
    options = dict(
        base_model=config.base_model,
        max_shard_bytes=max_shard,
        server_ttl_s=config.server_ttl_s,
        overwrite=config.overwrite,
        work_dir=config.work_dir,
    )
    meta = export_checkpoint(credentials, checkpoint, config.format, config.dtype, config.out, **options)
    there = ExportOutput(config.out).read_metadata()
    if (
        not there
        or there.get("export_id") != meta.get("export_id")
        or there.get("export_key") != meta.get("export_key")
    ):
        log.info("the cached export is no longer at %s; exporting again", config.out)
        meta = export_checkpoint(
            credentials, checkpoint, config.format, config.dtype, config.out, refresh_cache=True, **options
        )
    _summary(config, checkpoint, meta)
    return meta
