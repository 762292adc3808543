"""A capture server that serves what an alias of a model line holds now.

``capture serve --model alias:assistant@champion`` resolves the reference through the model
registry (:mod:`tinker_blocks.model_registry`) when it starts and again every ``refresh_s``
seconds. When the alias moved (a promotion, a rollback), the new weights are opened -- sampling
client, tokenizer, renderer -- and only then swapped in: each request takes the model current when
it arrives and keeps it to its end, so requests in flight finish on the weights they started on
and none is dropped or refused while the alias moves.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from prefect_tinker.capture.model import ServedModel

__all__ = ["ModelFollower"]

logger = logging.getLogger("prefect_tinker.capture")


class ModelFollower:
    """The served model behind a weights reference (see the module docstring).

    Args:
        resolve: ``() -> checkpoint`` (a ``tinker://`` path or a base model name) the reference
            names now; raising keeps the current model (logged).
        open_model: ``checkpoint -> ServedModel``.
        refresh_s: seconds between two resolutions (> 0).

    Raises:
        Whatever ``resolve`` / ``open_model`` raise on the first resolution (the server does not
        start without a model).
    """

    def __init__(self, resolve: Callable[[], str], open_model: Callable[[str], ServedModel], refresh_s: float = 10.0):
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self._resolve, self._open, self.refresh_s = resolve, open_model, float(refresh_s)
        self._model = open_model(resolve())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current(self) -> ServedModel:
        """The model to answer the next request with."""
        return self._model

    def refresh(self) -> bool:
        """Resolve the reference now; open and swap in new weights when it moved. Returns whether
        the model changed."""
        try:
            checkpoint = self._resolve()
            if checkpoint == self._model.checkpoint:
                return False
            model = self._open(checkpoint)
        except Exception as exc:  # the store or backend hiccupped: keep serving what we have
            logger.warning("could not follow the served model's reference: %s: %s", type(exc).__name__, exc)
            return False
        logger.warning("serving %s (was %s)", model.checkpoint, self._model.checkpoint)
        self._model = model  # one reference assignment: a request sees the old or the new model, whole
        return True

    def start(self) -> None:
        """Refresh every ``refresh_s`` seconds in a daemon thread until :meth:`stop`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="capture-follow", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()
