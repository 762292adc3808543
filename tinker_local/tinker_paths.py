"""``tinker://`` checkpoint paths and the ids in them (no HTTP, no torch).

``parse_tinker_path`` reads ``tinker://<model_id>/<segment>/<name>`` into a ``TinkerPath``
(``KIND_SEGMENT`` / ``SEGMENT_KIND`` map its kind to the path segment), ``check_checkpoint_name``
validates a name the client chose, and ``engine_id`` maps a wire model id to the engine's
(folder-safe) id.  Malformed input raises ``tinker_local.protocol.ProtocolError``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .protocol import ProtocolError

_NAME_RE = re.compile(r"^[A-Za-z0-9._\-]+$")
KIND_SEGMENT = {"state": "weights", "sampler": "sampler_weights", "external": "external_weights"}
SEGMENT_KIND = {v: k for k, v in KIND_SEGMENT.items()}


@dataclass(frozen=True)
class TinkerPath:
    """``tinker://<model_id>/<segment>/<name>`` with segment ``weights``, ``sampler_weights`` or
    ``external_weights`` (PEFT export of ``save_weights_external``)."""

    model_id: str
    kind: str  # "state" | "sampler" | "external"
    name: str

    @property
    def uri(self) -> str:
        return f"tinker://{self.model_id}/{KIND_SEGMENT[self.kind]}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{KIND_SEGMENT[self.kind]}/{self.name}"


def parse_tinker_path(uri: str) -> TinkerPath:
    """Parse a checkpoint URI; raises ProtocolError with the accepted form on anything else."""
    if not isinstance(uri, str) or not uri.startswith("tinker://"):
        raise ProtocolError(f"checkpoint path must start with 'tinker://', got {uri!r}")
    parts = uri[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in SEGMENT_KIND or not parts[0] or not parts[2]:
        raise ProtocolError(
            f"checkpoint path {uri!r} is not of the form tinker://<model_id>/weights/<name>, "
            "tinker://<model_id>/sampler_weights/<name> or tinker://<model_id>/external_weights/<name>"
        )
    return TinkerPath(parts[0], SEGMENT_KIND[parts[1]], parts[2])


def check_checkpoint_name(name: Any) -> str:
    """Validate a checkpoint name (letters, digits, '.', '_', '-'; not '.' or '..')."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise ProtocolError(f"checkpoint name {name!r} is invalid: use letters, digits, '.', '_' and '-' only")
    return name


def engine_id(model_id: str) -> str:
    """The engine's id for a wire model id: ':' (from the SDK's ``<session>:train:<n>`` form)
    becomes '.', since engine ids name folders (root/checkpoints/<engine id>/...)."""
    return model_id.replace(":", ".")
