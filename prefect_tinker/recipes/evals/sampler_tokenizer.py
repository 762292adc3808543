"""The tokenizer of a ``tinker.SamplingClient``, also for base models named by a server preset.

``SamplingClient.get_tokenizer()`` loads ``AutoTokenizer.from_pretrained(<base model name>)``.
For a client created with ``base_model="tiny"`` (a ``tinker_local`` preset, or any name that is
not a Hugging Face id or a local directory) that name does not load; the server's record of
the sampler (``GET /api/v1/samplers/{id}``, SDK ``RestClient.get_sampler``) names a loadable
base model (``tinker_local`` answers the preset's tokenizer directory), which is then used.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["sampler_tokenizer"]


def sampler_tokenizer(service_client: Any, sampling_client: Any) -> Any:
    """A Hugging Face tokenizer for ``sampling_client``.

    Raises:
        OSError: neither the client's base model name nor the server's name for it loads.
    """
    try:
        return sampling_client.get_tokenizer()
    except (OSError, ValueError) as first:
        session_id = getattr(sampling_client, "_sampling_session_id", None)  # SDK 0.38 keeps it here
        if session_id is None:
            raise
        from transformers import AutoTokenizer

        with warnings.catch_warnings():  # deprecated in 0.38, but the one call sharing this client's backend and key
            warnings.simplefilter("ignore", FutureWarning)
            rest = service_client.create_rest_client()
        info = rest.get_sampler(session_id).result()
        name = str(info.base_model).split(":")[0]
        try:
            return AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as exc:
            raise OSError(
                f"no tokenizer for base model {sampling_client.get_base_model()!r} "
                f"(server name {info.base_model!r}): {exc}"
            ) from first
