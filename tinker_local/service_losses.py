"""Server-side custom losses (an endpoint group of ``LocalService``): ``create_custom_loss`` stores an
uploaded graph (``tinker_local.custom_loss``) under a session-scoped ``loss_id``, and a
``forward_backward`` / ``forward`` with ``loss_fn="custom"`` and ``loss_fn_config={"loss_id": ...}``
runs it on the trainer's logprobs.

The client config flag ``custom_loss_server_side`` (``ServiceState.custom_loss_server_side``,
default on) tells the SDK to upload losses; with it off the SDK runs them client-side (a
forward, then a cross_entropy forward_backward with weights = -dloss/dlogprobs).
"""

from __future__ import annotations

from typing import Any

from .custom_loss import BoundLoss, CompiledLoss, compile_graph
from .errors import HttpError, int_field, required_field
from .loss_limits import CustomLossError
from .outcomes import UserError
from .service_base import ServiceState
from .trace import session_of


class CustomLosses:
    """The custom-loss endpoint and the lookup of a stored loss (see the module docstring), on
    the server's ``state``."""

    def __init__(self, state: ServiceState):
        self.state = state
        self.compiled: dict[str, CompiledLoss] = {}  # loss_id -> the stored loss

    def create_custom_loss(self, body: dict[str, Any]) -> dict[str, Any]:
        """Validate and store an uploaded loss; answers a request id whose result is
        ``{"loss_id", "type": "create_custom_loss"}``.  A graph tinker_local will not run is
        refused at once (HTTP 400 naming the node and the op)."""
        ep = "create_custom_loss"
        if not self.state.custom_loss_server_side:
            raise HttpError(
                400,
                f"{ep}: server-side custom losses are switched off on this server "
                "(client config custom_loss_server_side is false)",
            )
        session_id = str(required_field(body, "session_id", ep))
        seq = int_field(body, "custom_loss_seq_id", ep)
        if seq is None:
            raise HttpError(422, f"{ep}: field 'custom_loss_seq_id' is required")
        try:
            compiled = compile_graph(
                body.get("name") or "loss", body.get("inputs"), body.get("graph"), self.state.graph_limits
            )
        except CustomLossError as e:
            raise HttpError(400, f"{ep}: {e}") from e
        loss_id = f"{session_id}:loss:{seq}"

        def work() -> dict[str, Any]:
            self.compiled[loss_id] = compiled
            return {"type": ep, "loss_id": loss_id}

        key = (f"loss:{session_id}", seq)
        if self.state.store.lookup_seq(*key) is None:  # a retried upload is traced once
            work, span = self.state.tracer.wrap(session_id, ep, "session", work, loss_id=loss_id, name=compiled.name)
        else:
            span = None
        rid = self.state.store.submit(ep, work, dedupe_key=key)
        self.state.tracer.bind(span, rid)
        return {"request_id": rid}

    def bound_custom_loss(self, model_id: str, cfg: dict[str, Any] | None, n_datums: int) -> BoundLoss:
        """The stored loss a ``loss_fn="custom"`` request names, bound to its datums; UserError
        when the id is missing, unknown or of another session."""
        loss_id = (cfg or {}).get("loss_id")
        if not isinstance(loss_id, str):
            raise UserError(
                "loss_fn 'custom' needs loss_fn_config {'loss_id': <id from ServiceClient.create_custom_loss>}"
            )
        loss: CompiledLoss | None = self.compiled.get(loss_id)
        if loss is None:
            raise UserError(
                f"unknown custom loss {loss_id!r}: create it with "
                "ServiceClient.create_custom_loss in this session (losses do not "
                "survive a server restart)"
            )
        if session_of(loss_id) != session_of(model_id):
            raise UserError(f"custom loss {loss_id!r} belongs to another session than model {model_id!r}")
        return loss.bind(n_datums)
