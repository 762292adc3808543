"""Reference log-probabilities of whole replies, as a cached Prefect task (DPO, reward models).

``reference_sequence_logprobs(credentials, reference, datums)`` returns, per datum, the weighted
sum of its target logprobs (the reply's log-probability, nats) under fixed reference weights. It
is cached across flow runs under (reference weights, how they are computed, the datums' tokens and
weights, the task's source), so a resumed or repeated run never asks the reference twice.

``via="trainer"`` (default) computes them with a frozen training client of the reference weights
(:func:`prefect_tinker.tasks.clients.reference_client`): the same engine, precision and LoRA path
as the policy, so a policy equal to its reference has log-ratios of exactly 0 (the DPO loss is
``ln 2`` for every pair at step 0). ``via="sampler"`` uses a sampling client's
``compute_logprobs`` (cheaper on the hosted service; a sampler that computes in another precision
than the trainer biases the log-ratios by that difference).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import tinker
from prefect import task

from prefect_tinker.recipes.preference import sequence_logprob
from prefect_tinker.tasks.clients import reference_client, result, sampling_client
from prefect_tinker.tasks.policies import cached_options

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = ["reference_input_tokens", "reference_sequence_logprobs"]


def _key(context: Any, params: dict[str, Any]) -> str:
    h = hashlib.sha256(f"{params['reference']}|{params.get('via', 'trainer')}".encode())
    for d in params["datums"]:
        h.update(np.asarray(d.model_input.to_ints(), dtype=np.int64).tobytes() + b"|")
        h.update(d.loss_fn_inputs["target_tokens"].to_numpy().astype(np.int64).tobytes() + b"|")
        h.update(d.loss_fn_inputs["weights"].to_numpy().astype(np.float32).tobytes() + b"#")
    return h.hexdigest()


def _weighted(logprobs: np.ndarray, datum: tinker.Datum) -> float:
    # the float32 dot product the policy side computes too (recipes.preference.sequence_logprob), as
    # tinker-cookbook's DPO sums its reference: the same logprobs give the same bits on both sides
    return float(sequence_logprob(np.asarray(logprobs, dtype=np.float32).ravel(), datum))


@task(
    name="reference-sequence-logprobs",
    **cached_options(_key),
)
def reference_sequence_logprobs(
    credentials: TinkerCredentials,
    reference: str,
    datums: list[tinker.Datum],
    via: Literal["trainer", "sampler"] = "trainer",
    seed: int | None = None,
) -> list[float]:
    """Per datum (D), ``sum(logprob(target) * weight)`` under ``reference`` (``base:<model>``, a
    ``tinker://.../weights/...`` state, or with ``via="sampler"`` a ``.../sampler_weights/...``
    path), nats.

    Raises:
        ValueError: a reference the chosen ``via`` cannot load.
    """
    if via == "trainer":
        fut = reference_client(credentials, reference, seed=seed).forward(datums, "cross_entropy")
        out = result(credentials, fut, f"reference logprobs of {reference}")
        return [_weighted(o["logprobs"].to_numpy(), d) for o, d in zip(out.loss_fn_outputs, datums, strict=True)]
    if via != "sampler":
        raise ValueError(f"via must be 'trainer' or 'sampler', got {via!r}")
    client = sampling_client(credentials, reference)
    seqs = [d.model_input.to_ints() + [int(d.loss_fn_inputs["target_tokens"].to_numpy().ravel()[-1])] for d in datums]
    futures = [client.compute_logprobs(tinker.ModelInput.from_ints(s)) for s in seqs]
    out = []
    for fut, d in zip(futures, datums, strict=True):
        lp = [x if x is not None else 0.0 for x in list(fut.result())[1:]]  # position i predicts token i+1
        out.append(_weighted(np.asarray(lp), d))
    return out


def reference_input_tokens(datums: list[tinker.Datum], via: Literal["trainer", "sampler"] = "trainer") -> float:
    """Tokens the reference requests of :func:`reference_sequence_logprobs` process for ``datums``
    (prefill, see :mod:`prefect_tinker.recipes.pricing`): every datum's model input with
    ``via="trainer"`` (one ``forward``), plus its last target token with ``via="sampler"``
    (``compute_logprobs`` of the whole sequence)."""
    inputs = float(sum(d.model_input.length for d in datums))
    return inputs + (float(len(datums)) if via == "sampler" else 0.0)
