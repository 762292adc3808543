"""The ``memorize`` flow: each step trains next-token cross-entropy on one sentence, on the
recipe skeleton (run session, step loop, training task)."""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, ClassVar

import numpy as np
import tinker
from prefect.utilities.annotations import quote
from pydantic import Field

from prefect_tinker.plugin import RESUME, RecipeConfig, RunSession, StepLoop, recipe_flow, tokenizer, train_step


class MemorizeConfig(RecipeConfig):
    """Parameters of a ``memorize`` run."""

    recipe: ClassVar[str] = "memorize"

    text: Annotated[str, RESUME] = Field(  # a resumed run must keep it
        default="The quick brown fox jumps over the lazy dog.", description="The sentence.")
    max_steps: int = Field(default=5, ge=1, description="Optimizer steps.")
    learning_rate: float = Field(default=1e-3, gt=0, description="Adam learning rate.")

    def data_fingerprint(self, renderer: str) -> str:  # the recipe protocol: the data's identity
        return "sha256:" + hashlib.sha256(self.text.encode()).hexdigest()


def sentence_datum(tokens: list[int]) -> tinker.Datum:
    """Next-token prediction on ``tokens`` (L,): input ``tokens[:-1]``, targets ``tokens[1:]``, weight 1."""
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tinker.TensorData.from_numpy(np.asarray(tokens[1:], dtype=np.int64)),
        "weights": tinker.TensorData.from_numpy(np.ones(len(tokens) - 1, dtype=np.float32))})


@recipe_flow("memorize", "memorize-{config.run_name}")  # a Prefect flow; Ctrl-C ends it Cancelled, checkpoint saved
def memorize_flow(config: MemorizeConfig) -> dict[str, Any]:
    """Train on ``config.text`` for ``max_steps`` steps; returns the first and last loss."""
    with RunSession(config) as session:
        datum = sentence_datum(tokenizer(session.tokenizer_id).encode(config.text))

        def one_step(step: int) -> dict[str, float]:
            session.run, m = train_step(session.credentials, session.run, step, quote([datum]),
                                        config.lr_at(step, config.max_steps), config.adam.model_dump())
            return {f"train/{k}": v for k, v in m.items()}

        StepLoop(session, config.max_steps).run(one_step)
        first, last = session.metric_ends("train/loss")
        return session.finish({"first_loss": first, "last_loss": last})
