"""Export endpoints of the local Tinker server (a part of ``LocalService``: its ``export``):
``save_weights_external`` (``TrainingClient.save_weights_external``), the signed download URLs
of ``get_external_weights_urls`` and the downloads themselves.

Layout of an external weights checkpoint ``tinker://<run>/external_weights/<name>`` (keys of
``ExternalWeightsUrlsResponse.urls``, paths relative to the checkpoint root):

- ``adapter_model.safetensors``, ``adapter_config.json``: the LoRA adapter in PEFT format
  (fp32 tensors keyed ``base_model.model.<module>.lora_{A,B}.weight``; ``r``, ``lora_alpha``,
  ``target_modules``), loadable with ``peft.PeftModel.from_pretrained(base, folder)``;
  with ``age_encryption_recipients`` they are ``adapter_model.safetensors.age`` /
  ``adapter_config.json.age`` (age-encrypted to those recipients; needs ``pyrage``);
- ``base_model/<file>``: every file of the base model's local Hugging Face folder (config.json,
  generation_config.json, weights, tokenizer files) as the server loads it, so an exporter can
  merge ``W + (alpha / r) B A`` without a model hub.  These are served from the server's model
  cache (not copied, not encrypted).  tinker_local only: the hosted service's external weights
  hold no base model, which an exporter fetches by name (``base_model_name_or_path``).

URLs are signed and expire (``tinker_local.signing``; default one hour).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from . import protocol as P
from .errors import HttpError, int_field, required_field
from .registry import CheckpointRecord, iso
from .rest import check_ttl
from .service_base import ServiceState
from .signing import SignatureError
from .tinker_paths import TinkerPath, check_checkpoint_name, engine_id

logger = logging.getLogger("tinker_local.export")

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
BASE_PREFIX = "base_model/"
_SKIP_BASE = ("tinker_local_preset.json",)
MAX_RECIPIENTS = 10


def _recipients(values: Any):
    """``age_encryption_recipients`` -> pyrage recipients; HttpError 400 naming a bad one."""
    if not values:
        return None
    if not isinstance(values, list) or len(values) > MAX_RECIPIENTS:
        raise HttpError(
            400,
            f"save_weights_external: age_encryption_recipients must be a list of at most {MAX_RECIPIENTS} recipients",
        )
    try:
        import pyrage
    except ImportError:
        raise HttpError(
            400,
            "save_weights_external: age_encryption_recipients needs the optional "
            "'pyrage' package on the server (pip install pyrage)",
        ) from None
    out = []
    for r in values:
        try:
            out.append(
                pyrage.ssh.Recipient.from_str(r)
                if str(r).startswith("ssh-")
                else pyrage.x25519.Recipient.from_str(str(r))
            )
        except Exception as e:  # pyrage.RecipientError
            raise HttpError(
                400, f"save_weights_external: {str(r)[:40]!r} is not an age or SSH recipient ({e})"
            ) from None
    return out


def _encrypt_in_place(folder: Path, recipients) -> None:
    import pyrage

    for name in ADAPTER_FILES:
        src = folder / name
        tmp = folder / f".{name}.age.tmp"
        tmp.write_bytes(pyrage.encrypt(src.read_bytes(), recipients))
        os.replace(tmp, folder / f"{name}.age")
        src.unlink()


class ExportEndpoints:
    """The export endpoints (see the module docstring), on the server's ``state``."""

    def __init__(self, state: ServiceState):
        self.state = state

    def save_weights_external(self, body: dict[str, Any]) -> dict[str, Any]:
        ep = "save_weights_external"
        model_id = str(required_field(body, "model_id", ep))
        seq = int_field(body, "seq_id", ep)
        name = required_field(body, "path", ep)
        try:
            check_checkpoint_name(name)
        except P.ProtocolError as e:
            raise HttpError(422, f"{ep}: {e}") from e
        ttl = check_ttl(body.get("ttl_seconds"), ep)
        recipients = _recipients(body.get("age_encryption_recipients"))

        def work() -> dict[str, Any]:
            self.state.run_record(model_id)
            folder = Path(self.state.engine.save_external_weights(engine_id(model_id), name))
            if recipients:
                _encrypt_in_place(folder, recipients)
            files = self._own_files(folder)
            ck = CheckpointRecord(
                uri=TinkerPath(model_id, "external", name).uri,
                model_id=model_id,
                kind="external",
                name=name,
                path=str(folder),
                size_bytes=sum(p.stat().st_size for p in files.values()),
                expires_at=None if ttl is None else self.state.registry.clock() + ttl,
            )
            self.state.registry.add_checkpoint(ck)
            return {"type": ep, "path": ck.uri, "size_bytes": ck.size_bytes}

        return {"request_id": self.state.submit_ordered(ep, work, model_id, seq), "model_id": model_id}

    @staticmethod
    def _own_files(folder: Path) -> dict[str, Path]:
        out = {}
        for name in ADAPTER_FILES:
            for candidate in (name, f"{name}.age"):
                if (folder / candidate).is_file():
                    out[candidate] = folder / candidate
        return out

    def external_files(self, ck: CheckpointRecord) -> dict[str, Path]:
        """Relative path -> file of an external weights checkpoint (see the module docstring)."""
        files = self._own_files(Path(ck.path))
        run = self.state.registry.runs.get(ck.model_id)
        base = None
        if run is not None:
            try:
                base = self.state.engine.base_model_dir(run.base_model)
            except Exception as e:  # the base model is gone: the adapter is still served
                logger.warning("%s: base model %r not found: %s", ck.uri, run.base_model, e)
        if base is not None and base.is_dir():
            for dirpath, dirs, names in os.walk(base):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for n in sorted(names):
                    p = Path(dirpath) / n
                    rel = p.relative_to(base).as_posix()
                    if n.startswith(".") or n in _SKIP_BASE or not p.is_file():
                        continue
                    files[BASE_PREFIX + rel] = p
        return files

    def external_weights_urls(self, model_id: str, checkpoint_id: str, base_url: str) -> dict[str, Any]:
        """``ExternalWeightsUrlsResponse``: one signed URL per file, and when they expire."""
        ck = self.state.checkpoint_record_of(model_id, checkpoint_id)
        if ck.kind != "external":
            raise HttpError(
                400,
                f"{ck.uri} is not an external weights checkpoint; save one with "
                "TrainingClient.save_weights_external(name)",
            )
        expires = self.state.signer.expiry(self.state.url_ttl_s)
        key = f"{ck.model_id}/{ck.name}"
        urls = {rel: self.state.signer.url(base_url, "external", key, rel, expires) for rel in self.external_files(ck)}
        return {"urls": urls, "expires": iso(expires)}

    def external_download(self, model_id: str, name: str, file: str, expires: str | None, sig: str | None) -> Path:
        """The file a signed external-weights URL names; HttpError 403 for a tampered or expired
        URL, 404 when the checkpoint or file is gone."""
        try:
            self.state.signer.check("external", f"{model_id}/{name}", file, expires, sig)
        except SignatureError as e:
            raise HttpError(403, str(e)) from e
        ck = self.state.checkpoint_record(TinkerPath(model_id, "external", name).uri)
        path = self.external_files(ck).get(file)
        if path is None:
            raise HttpError(404, f"{ck.uri} has no file {file!r}")
        return path
