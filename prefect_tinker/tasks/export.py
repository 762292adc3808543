"""The export tasks: ``check-export-output`` (the destination can be written, before any work) and
``export-checkpoint`` (weights out of the trainer as a verified Hugging Face model or PEFT adapter,
a Prefect asset with the checkpoint as its upstream), over the export engine
:mod:`prefect_tinker.export`; the ``export`` recipe's flow is :mod:`prefect_tinker.flows.export`.

One call (:func:`run_export`): the server saves external weights
(:mod:`~prefect_tinker.export.server`); their files are downloaded from the signed URLs
into a private temporary folder (:mod:`~prefect_tinker.export.download`); the export is
built next to its destination (``merged``: :func:`~prefect_tinker.export.merge.merge_into_folder`;
``peft``: the adapter), loaded back with plain ``transformers`` / ``peft`` and compared with the
server's ``compute_logprobs`` of the same checkpoint (:mod:`~prefect_tinker.export.verify`):
in float32 at 1e-4 first, then, for another dtype, cast and compared again at that dtype's
tolerance; only an export that passed is published
(:mod:`~prefect_tinker.export.output`), with ``export_metadata.json`` (source paths,
LoRA settings, tied-embedding handling, every file's size and SHA-256, the verification numbers).

The base model: the server's ``base_model/`` files when it sends them (``tinker_local``), else
``base_model`` (a local folder or a hub id, default the run's base model name) fetched with
``huggingface_hub.snapshot_download`` (the hosted service sends no base).

Caching: :func:`export_checkpoint` is keyed by (checkpoint, format, dtype, out, base model, shard
size) and the task's source; a destination that already holds the same export (same
``export_key``, every file's size) is returned as it is, without server work.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger, task
from prefect.assets import add_asset_metadata, materialize
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE

from prefect_tinker.export.download import check_tree, download_listing
from prefect_tinker.export.output import METADATA_FILE, ExportOutput
from prefect_tinker.tasks import clients
from prefect_tinker.tasks.policies import RETRY_OPTIONS, file_sha256, run_name_from_parameters

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = ["FORMATS", "check_export_output", "export_checkpoint", "export_key", "run_export"]

FORMATS = ("merged", "peft")
_BASE_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "LICENSE*"]


def export_key(checkpoint: str, fmt: str, dtype: str, base_model: str | None, max_shard_bytes: int) -> str:
    """Hex SHA-256 of what determines an export's files (recorded as ``export_key``)."""
    spec = {
        "checkpoint": checkpoint,
        "format": fmt,
        "dtype": dtype,
        "base_model": base_model,
        "max_shard_bytes": int(max_shard_bytes) if fmt == "merged" else None,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


@task(name="check-export-output", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def check_export_output(out: str, overwrite: bool, key: str) -> None:
    """Fail now when ``out`` cannot be written or holds other files (an identical export there
    is fine: it is returned as it is)."""
    output = ExportOutput(out)
    meta = output.read_metadata()
    if meta and meta.get("export_key") == key:
        return
    output.check(overwrite)


def _intact(output: ExportOutput, meta: dict[str, Any] | None, key: str) -> bool:
    if not meta or meta.get("export_key") != key or not meta.get("verification", {}).get("passed"):
        return False
    files = meta.get("files") or {}
    found = output.sizes()
    return all(found.get(n) == f["bytes"] for n, f in files.items())


def _base_dir(download: Path, base_model: str | None, fallback: str) -> tuple[Path, str]:
    served = download / "base_model"
    if served.is_dir() and base_model is None:
        return served, "the server's base_model/ files"
    name = base_model or fallback
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser(), f"local folder {name}"
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=_BASE_PATTERNS)), f"hub model {name}"
    except Exception as exc:  # offline, gated, unknown id
        raise FileNotFoundError(
            f"the server sent no base model and {name!r} could not be fetched ({type(exc).__name__}: "
            f"{str(exc)[:200]}); set base_model to a local Hugging Face folder of it"
        ) from exc


def _write_peft(download: Path, stage: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(download / "adapter_model.safetensors"))
    save_file(
        {k: (t.float() if t.is_floating_point() else t).contiguous() for k, t in tensors.items()},
        str(stage / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    shutil.copyfile(download / "adapter_config.json", stage / "adapter_config.json")


def _build_and_verify(
    credentials: TinkerCredentials,
    download: Path,
    base_dir: Path,
    adapter: Any,
    stage: Path,
    fmt: str,
    dtype: str,
    reference: str,
    max_shard_bytes: int,
    lap: Any,
) -> tuple[dict, dict]:
    """Build the export in float32 and check it at 1e-4, then (other dtypes) cast it and check
    again at the dtype's tolerance. Returns ``(verification, embeddings)``."""
    from prefect_tinker.export.merge import DTYPES, cast_weights, merge_into_folder
    from prefect_tinker.export.verify import Verifier
    from prefect_tinker.tasks.clients import sampling_client

    tied: dict[str, Any] = {}
    if fmt == "merged":  # shards sized for the final dtype: the float32 ones are cast later
        rep = merge_into_folder(
            base_dir, adapter, stage, dtype="float32", max_shard_bytes=max_shard_bytes * 4 // DTYPES[dtype].itemsize
        )
        tied = {"tied_in_base": rep.tied_in_base, "untied": rep.untied}
    else:
        _write_peft(download, stage)
    lap("build")
    verifier = Verifier(sampling_client(credentials, reference), reference, base_dir)
    result = verifier.check(stage, fmt, "float32")
    if dtype != "float32":
        cast_weights(stage, dtype)
        exact = {k: result[k] for k in ("max_abs_diff", "mean_abs_diff", "tolerance", "passed")}
        result = {**verifier.check(stage, fmt, dtype), "float32": exact}
    effect = verifier.adapter_effect()
    result.update(
        reference=reference,
        compute="float32",
        adapter_effect_max_abs=effect,
        discriminative=bool(effect > result["tolerance"]),
    )
    lap("verify")
    return result, tied


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("prefect-tinker", "tinker", "torch", "transformers", "peft", "safetensors"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def run_export(
    credentials: TinkerCredentials,
    checkpoint: str,
    format: str,
    dtype: str,
    out: str,
    *,
    base_model: str | None = None,
    max_shard_bytes: int = 5_000_000_000,
    server_ttl_s: int | None = 86_400,
    overwrite: bool = False,
    work_dir: str | None = None,
) -> dict[str, Any]:
    """Export ``checkpoint`` (see the module docstring); returns the export's metadata (what
    ``export_metadata.json`` holds). Safe to call again: an intact identical export at ``out`` is
    returned without work.

    Args:
        format: ``merged`` | ``peft``. dtype: ``float32`` | ``bfloat16`` | ``float16``.
        out: a local folder or ``s3://bucket/prefix``.
        base_model: the base model's local folder or hub id, when the server sends none.
        max_shard_bytes: largest merged shard. server_ttl_s: lifetime of the server's external
            and reference checkpoints (None: kept). work_dir: folder for the download.

    Raises:
        ValueError: a bad checkpoint path, format or dtype. FileExistsError: ``out`` holds other
            files and not ``overwrite``. UnsafeDownloadError: an unsafe listing.
        ExportVerificationError: the export's logprobs differ from the server's (nothing published).
        AdapterError: an adapter that cannot be merged exactly.
    """
    from prefect_tinker.export.adapter import read_adapter
    from prefect_tinker.export.merge import DTYPES
    from prefect_tinker.export.server import export_on_server

    if format not in FORMATS or dtype not in DTYPES:
        raise ValueError(
            f"format must be one of {FORMATS} and dtype one of {sorted(DTYPES)}; got {format!r}, {dtype!r}"
        )
    log = get_run_logger()
    output = ExportOutput(out)
    key = export_key(checkpoint, format, dtype, base_model, max_shard_bytes)
    existing = output.read_metadata()
    if existing is not None and _intact(output, existing, key):
        log.info("%s already holds this export (%s); nothing to do", output.uri, key[:12])
        return existing
    output.check(overwrite)
    clock, seconds = time.perf_counter(), {}

    def lap(what: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[what] = round(now - clock, 3)
        clock = now

    srv = export_on_server(
        credentials, checkpoint, wait=functools.partial(clients.result, credentials), ttl_s=server_ttl_s
    )
    lap("server")
    log.info("external weights %s: %d files", srv.external_path, len(srv.urls))
    if any(n.endswith(".age") for n in srv.urls):
        raise ValueError(f"{srv.external_path} is age-encrypted; an export needs the plain adapter files")
    with tempfile.TemporaryDirectory(prefix="export-download-", dir=work_dir) as tmp:
        download = Path(tmp) / "files"
        download_listing(srv.urls, download)
        base_dir, base_source = _base_dir(download, base_model, srv.base_model)
        lap("download")
        adapter = read_adapter(download)  # refuses what cannot be reproduced exactly, for both formats
        stage = output.staging_dir()
        try:
            verification, tied = _build_and_verify(
                credentials, download, base_dir, adapter, stage, format, dtype, srv.reference, max_shard_bytes, lap
            )
            files = {
                n: {"bytes": (stage / n).stat().st_size, "sha256": file_sha256(stage / n)} for n in check_tree(stage)
            }
            lora = {
                "rank": adapter.rank,
                "alpha": adapter.alpha,
                "targets": len(adapter.deltas),
                "use_rslora": bool(adapter.config.get("use_rslora")),
            }
            meta = {
                "export_key": key,
                "export_id": uuid.uuid4().hex,
                "format": format,
                "dtype": dtype,
                "out": output.uri,
                "checkpoint": checkpoint,
                "state_path": srv.state_path,
                "external_weights": srv.external_path,
                "base_model": srv.base_model,
                "base_model_source": base_source,
                "lora": lora,
                "embeddings": tied,
                "files": files,
                "verification": verification,
                "seconds": dict(seconds),
                "created": datetime.now(UTC).isoformat(timespec="seconds"),
                "versions": _versions(),
            }
            (stage / METADATA_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            output.publish(stage, overwrite)
            lap("publish")
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    log.info(
        "exported %s as %s (%s) to %s: max |logprob diff| %.2e (tolerance %g); seconds %s",
        checkpoint,
        format,
        dtype,
        output.uri,
        verification["max_abs_diff"],
        verification["tolerance"],
        seconds,
    )
    return meta


def _run_name(parameters: dict[str, Any]) -> str:
    name = str(parameters.get("checkpoint") or "").rstrip("/").rsplit("/", 1)[-1] or "checkpoint"
    return f"export-{parameters.get('format')}-{parameters.get('dtype')}-{name}"


def export_checkpoint(
    credentials: TinkerCredentials, checkpoint: str, format: str, dtype: str, out: str, **options: Any
) -> dict[str, Any]:
    """Run :func:`run_export` as the ``export-checkpoint`` task, a Prefect asset materialization:
    the asset is the export (``file://...`` or ``s3://...``), its upstream the checkpoint; the
    verification numbers are added to the asset's metadata.

    Cached by inputs (not the credentials, ``overwrite``, ``server_ttl_s`` or ``work_dir``) and
    the task's source; ``options`` are :func:`run_export`'s keyword arguments, and
    ``refresh_cache=True`` among them runs it again.
    """
    refresh = bool(options.pop("refresh_cache", False))
    uri = ExportOutput(out).uri

    def export(
        credentials: TinkerCredentials,
        checkpoint: str,
        format: str,
        dtype: str,
        out: str,
        base_model: str | None = None,
        max_shard_bytes: int = 5_000_000_000,
        server_ttl_s: int | None = 86_400,
        overwrite: bool = False,
        work_dir: str | None = None,
    ) -> dict[str, Any]:
        meta = run_export(
            credentials,
            checkpoint,
            format,
            dtype,
            out,
            base_model=base_model,
            max_shard_bytes=max_shard_bytes,
            server_ttl_s=server_ttl_s,
            overwrite=overwrite,
            work_dir=work_dir,
        )
        v = meta["verification"]
        add_asset_metadata(
            uri,
            {
                "format": format,
                "dtype": dtype,
                "checkpoint": checkpoint,
                "max_abs_logprob_diff": v["max_abs_diff"],
                "tolerance": v["tolerance"],
            },
        )
        return meta

    task = materialize(
        uri,
        asset_deps=[checkpoint],
        name="export-checkpoint",
        task_run_name=run_name_from_parameters(_run_name),
        cache_policy=(INPUTS - "credentials" - "overwrite" - "server_ttl_s" - "work_dir") + TASK_SOURCE,
        persist_result=True,
        refresh_cache=refresh,
        **RETRY_OPTIONS,
    )(export)
    return task(credentials, checkpoint, format, dtype, out, **options)
