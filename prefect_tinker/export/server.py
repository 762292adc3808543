"""The server side of an export, through the SDK's own calls only.

1. ``checkpoint`` is a state path (``tinker://<run>/weights/<name>``) or a sampler path
   (``tinker://<run>/sampler_weights/<name>``). External weights are saved by a training client,
   and a training client is made from a state, so a sampler path is paired with the state
   checkpoint of the same run and name (our runs save both under one name per step; found with
   ``RestClient.list_checkpoints``); the verification then compares with the *sampler* path
   itself, so a pair whose weights differed would fail the export, not pass silently.
2. ``ServiceClient.create_training_client_from_state(state)``, then
   ``TrainingClient.save_weights_external(name)`` -> ``tinker://<run>/external_weights/<name>``.
3. The reference for the verification: the sampler path, or for a state path sampler weights
   saved by the same client (``save_weights_for_sampler``).
4. ``RestClient.get_external_weights_urls(path)``: one signed URL per file.

The external and reference checkpoints get a time to live (``ttl_s``): they only carry the
weights out.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = ["ServerExport", "Wait", "export_on_server", "parse_checkpoint", "paired_state", "rest_client"]

#: ``wait(future, what) -> result``: the caller's wait for an SDK future (deadline, dead-server
#: check; ``what`` names the request in errors), e.g. ``functools.partial(tasks.clients.result, credentials)``
Wait = Callable[[Any, str], Any]

_PATH = re.compile(r"^tinker://(?P<run>[^/\s]+)/(?P<kind>weights|sampler_weights)/(?P<name>[^/\s]+)$")


@dataclass
class ServerExport:
    """What the server produced for one export.

    Attributes:
        checkpoint: the path asked for. state_path: the state the training client was made from.
        reference: the sampler path whose ``compute_logprobs`` the export must match.
        external_path: ``tinker://<run>/external_weights/<name>``.
        base_model: the training run's base model name. lora_rank: its LoRA rank.
        urls: ``{relative path: signed URL}`` (credentials while they last: never logged).
        expires: when the URLs expire (ISO 8601).
    """

    checkpoint: str
    state_path: str
    reference: str
    external_path: str
    base_model: str
    lora_rank: int
    urls: dict[str, str]
    expires: str


def parse_checkpoint(path: str) -> tuple[str, str, str]:
    """``(run, kind, name)`` of a ``tinker://<run>/weights|sampler_weights/<name>`` path.

    Raises:
        ValueError: any other form (the message names the value and the accepted forms).
    """
    m = _PATH.match(str(path).strip())
    if m is None:
        raise ValueError(
            f"checkpoint {path!r}: give a state path tinker://<run>/weights/<name> or a sampler path "
            "tinker://<run>/sampler_weights/<name>"
        )
    return m["run"], m["kind"], m["name"]


def rest_client(credentials: TinkerCredentials) -> Any:
    """A ``tinker.RestClient`` on the block's server (the ``ServiceClient``'s own, same key)."""
    with warnings.catch_warnings():  # the alias is deprecated in favour of RestClient(base_url, api_key)
        warnings.simplefilter("ignore", FutureWarning)
        return credentials.get_client().create_rest_client()


def paired_state(credentials: TinkerCredentials, run: str, name: str, *, wait: Wait) -> str:
    """The state path ``tinker://<run>/weights/<name>`` when the server lists it.

    Raises:
        ValueError: the run has no state checkpoint of that name (the message says what to do).
    """
    want = f"tinker://{run}/weights/{name}"
    listed = wait(rest_client(credentials).list_checkpoints(run), f"the checkpoints of {run}")
    if any(c.tinker_path == want for c in listed.checkpoints):
        return want
    raise ValueError(
        f"sampler checkpoint tinker://{run}/sampler_weights/{name} has no state checkpoint {want}: "
        "external weights are saved from a training client, which is made from a state checkpoint; "
        "export a tinker://.../weights/... path of the same weights"
    )


def _name(prefix: str, name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{prefix}-{name}")[:100]


def export_on_server(
    credentials: TinkerCredentials, checkpoint: str, *, wait: Wait, ttl_s: int | None = None
) -> ServerExport:
    """Steps 1-4 of the module docstring; every SDK future is awaited with ``wait``.

    Raises:
        ValueError: a malformed path or a sampler path without its state. SDK errors: an unknown
            checkpoint (user errors, not retried) or server trouble (retried by the task).
    """
    run, kind, name = parse_checkpoint(checkpoint)
    state = checkpoint if kind == "weights" else paired_state(credentials, run, name, wait=wait)
    service = credentials.get_client()
    tc = wait(service.create_training_client_from_state(state), f"a training client from {state}")
    external = wait(
        tc.save_weights_external(_name("export", name), ttl_seconds=ttl_s), f"external weights of {state}"
    ).path
    if kind == "sampler_weights":
        reference = checkpoint
    else:
        reference = wait(
            tc.save_weights_for_sampler(_name("export-ref", name), ttl_seconds=ttl_s),
            f"reference sampler weights of {state}",
        ).path
    info = tc.get_info()
    listing = wait(rest_client(credentials).get_external_weights_urls(external), f"the download URLs of {external}")
    return ServerExport(
        checkpoint=checkpoint,
        state_path=state,
        reference=reference,
        external_path=external,
        base_model=str(info.model_data.model_name),
        lora_rank=int(info.lora_rank or 0),
        urls=dict(listing.urls),
        expires=listing.expires.isoformat(),
    )
