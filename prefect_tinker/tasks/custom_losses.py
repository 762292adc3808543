"""Per-datum custom losses on the server where it accepts them, on the client otherwise.

:func:`custom_loss` turns a per-datum torch loss ``fn(logprobs, *inputs) -> (loss, metrics)`` (the
shape ``ServiceClient.create_custom_loss`` takes; ``metrics`` keyed ``custom/<name>:sum|mean``) into
what ``TrainingClient.forward_backward_custom`` runs, choosing in one place:

- **server-side**: the SDK traces ``fn`` and, where the server's client config says
  ``custom_loss_server_side`` (``tinker_local`` does; so may the hosted service), uploads it; the
  returned ``LossHandle`` carries a ``loss_id`` and each pass is one ``forward_backward`` request
  computed on the server;
- **client-side fallback** (:class:`ClientSideLoss`): the server does not run custom losses (no
  ``loss_id``) or refused this one (a 4xx answer to the upload, e.g. an op outside its allow-list).
  ``forward_backward_custom`` then asks the server for the logprobs (a forward), computes the loss
  and its gradient with respect to the logprobs here in torch, and sends a cross-entropy backward
  with weights ``-dloss/dlogprobs`` (the same gradient in the weights).

Both give the same ``loss:sum`` (the summed per-datum losses), the same ``custom/*`` metrics
(``:sum`` summed over datums, ``:mean`` averaged) and the same gradients.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import tinker

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = ["ClientSideLoss", "custom_loss", "input_names"]

#: Status codes of an upload the server refused for this loss or does not serve (anything else re-raises).
_REFUSED = (400, 404, 405, 422, 501)

_resolved: dict[tuple[int, str], tuple[Any, Any]] = {}
_lock = threading.Lock()


def input_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The ``loss_fn_inputs`` keys ``fn`` reads: its parameters after ``logprobs``, in order."""
    return tuple(list(inspect.signature(fn).parameters)[1:])


class ClientSideLoss:
    """A per-datum loss as the callable ``forward_backward_custom`` runs on the client:
    ``(data_D, logprobs_D) -> (summed loss, metrics)``, each datum's ``fn(logprobs_T, *inputs)``
    with its ``loss_fn_inputs`` named by ``fn``'s parameters as tensors; metrics ``:sum`` summed over
    datums, ``:mean`` averaged (as the server reduces them).

    Args:
        fn: the per-datum loss; name: its name in messages (default ``fn.__name__``).
    """

    def __init__(self, fn: Callable[..., Any], name: str | None = None):
        self.fn, self.names = fn, input_names(fn)
        self.name = name or getattr(fn, "__name__", "loss")

    def __call__(self, data: Sequence[tinker.Datum], logprobs_D: Sequence[Any]) -> tuple[Any, dict[str, float]]:
        total: Any = None
        sums: dict[str, float] = {}
        for datum, logprobs in zip(data, logprobs_D, strict=True):
            loss, metrics = self.fn(logprobs, *[datum.loss_fn_inputs[n].to_torch() for n in self.names])
            if loss.ndim != 0:
                raise ValueError(f"loss {self.name!r} must return a scalar loss, got shape {tuple(loss.shape)}")
            total = loss if total is None else total + loss
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value.detach())
        n = max(len(data), 1)
        return total, {k: v / n if k.endswith(":mean") else v for k, v in sums.items()}


def _key(fn: Callable[..., Any], input_ranks: Mapping[str, int]) -> str:
    """The traced graph's code and the ranks (what the SDK keys a session's losses by), hashed."""
    import torch.fx

    code = torch.fx.symbolic_trace(fn).code
    return hashlib.sha256((code + repr(sorted(input_ranks.items()))).encode()).hexdigest()


def custom_loss(credentials: TinkerCredentials, fn: Callable[..., Any], input_ranks: Mapping[str, int]) -> Any:
    """What ``forward_backward_custom`` runs for the per-datum loss ``fn`` on the credentials'
    service client (module docstring): its ``LossHandle`` when the server runs it, else a
    :class:`ClientSideLoss`. Resolved once per service client and traced loss (the SDK refuses a
    second upload of one loss in a session) and reused.

    Args:
        fn: ``fn(logprobs, *inputs) -> (scalar loss, {"custom/<name>:sum|mean": scalar})``, traceable by
            ``torch.fx`` (torch and math only, no branching on tensor values).
        input_ranks: the rank of each of ``fn``'s parameters (``logprobs`` included): 0, 1 (T,) or 2 (T, K).

    Raises:
        ValueError: ``fn`` cannot be a custom loss (the SDK's message). tinker errors: the upload
            failed otherwise than by a refusal.
    """
    service = credentials.get_client()
    try:
        key = _key(fn, input_ranks)
    except Exception:  # not traceable: the SDK says why
        service.create_custom_loss(fn, input_ranks).result()
        raise
    with _lock:
        known = _resolved.get((id(service), key))
        if known is not None and known[0] is service:
            return known[1]
        from prefect.logging import get_logger

        try:
            handle = service.create_custom_loss(fn, input_ranks).result()
            chosen = handle if handle.loss_id is not None else ClientSideLoss(fn, handle.name)
            get_logger(__name__).info(
                "custom loss %r: %s",
                handle.name,
                f"computed on the server (loss_id {handle.loss_id})"
                if handle.loss_id is not None
                else "the server does not run custom losses; computing it client-side "
                "(a forward and a backward request per pass)",
            )
        except tinker.APIStatusError as e:
            if e.status_code not in _REFUSED:
                raise
            get_logger(__name__).warning(
                "custom loss %r: the server refused the upload (HTTP %d: %s); computing it client-side "
                "(a forward and a backward request per pass)",
                getattr(fn, "__name__", "loss"),
                e.status_code,
                str(e)[:300],
            )
            chosen = ClientSideLoss(fn)
        _resolved[(id(service), key)] = (service, chosen)
        return chosen
