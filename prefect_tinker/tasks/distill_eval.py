"""Agreement of the student with its teacher on held-out prompts (prompt distillation).

:class:`TeacherAgreementEvaluator` is a sampling-client evaluator: at each evaluation step the
student's sampler weights answer the held-out prompts greedily (the cached
``sample-completions`` task), each reply is parsed by the student's renderer, and it agrees when
its normalised text equals the teacher's label for that prompt (the teacher's greedy reply to its
own view of the prompt). Normalisation: surrounding whitespace removed, runs of whitespace made
one space, trailing punctuation dropped, case folded; with ``first_line`` only the first
non-empty line counts (a label followed by an explanation still agrees).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from prefect_tinker.tasks.evaluators import SamplingClientEvaluator
from prefect_tinker.tasks.sampling import sample_completions

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = ["TeacherAgreementEvaluator", "normalise_label"]


def normalise_label(text: str, first_line: bool = False) -> str:
    """``text`` as compared by :class:`TeacherAgreementEvaluator` (see the module docstring)."""
    if first_line:
        text = next((ln for ln in text.splitlines() if ln.strip()), "")
    return re.sub(r"\s+", " ", text.strip()).rstrip(".,;:!?").strip().casefold()


class TeacherAgreementEvaluator(SamplingClientEvaluator):
    """``eval/teacher_agreement``: fraction (0..1) of held-out prompts whose greedy student reply
    equals the teacher's label; also ``eval/teacher_agreement_prompts`` (how many).

    Args:
        prompts: the student's prompt tokens, one list per held-out prompt (P).
        labels: the teacher's reply text for each (P).
        renderer: the student's renderer (stop sequences, reply parsing).
        max_tokens: most tokens of a student reply.
        first_line: compare only the first non-empty line.

    Raises:
        ValueError: ``prompts`` and ``labels`` differ in length.
    """

    name = "teacher_agreement"

    def __init__(
        self,
        prompts: list[list[int]],
        labels: list[str],
        renderer: Any,
        *,
        max_tokens: int = 32,
        first_line: bool = False,
        prefix: str = "eval",
    ):
        if len(prompts) != len(labels):
            raise ValueError(f"{len(prompts)} prompts but {len(labels)} teacher labels")
        self.prompts, self.labels, self.renderer = [list(p) for p in prompts], list(labels), renderer
        self.max_tokens, self.first_line, self.prefix = max_tokens, first_line, prefix
        self.last_replies: list[str] = []

    def evaluate(self, credentials: TinkerCredentials, sampler_path: str, step: int) -> dict[str, float]:
        if not self.prompts:
            return {}
        outs = sample_completions.with_options(task_run_name=f"agreement-step-{step}")(
            credentials,
            sampler_path,
            self.prompts,
            max_tokens=self.max_tokens,
            temperature=0.0,
            seed=0,
            stop=self.renderer.get_stop_sequences(),
        )
        replies = [self.renderer.parse_response(o[0]["tokens"]).message.get("content") or "" for o in outs]
        self.last_replies = replies
        agree = [
            normalise_label(r, self.first_line) == normalise_label(t, self.first_line)
            for r, t in zip(replies, self.labels, strict=True)
        ]
        return {
            f"{self.prefix}/teacher_agreement": sum(agree) / len(agree),
            f"{self.prefix}/teacher_agreement_prompts": float(len(agree)),
        }
