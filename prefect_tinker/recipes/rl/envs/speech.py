"""``speech``: speech recognition from a JSONL (or dataset) of ``{"audio": "clip.wav", "text": ...}``
records; the prompt is the audio and "Transcribe the audio."; the reward is ``max(-WER, -1)``
(0 for a perfect transcript, -1 for one with as many errors as reference words or more), with
the word error rate of :func:`prefect_tinker.recipes.grading_text.word_error_rate`.

Options (``env_options``): ``audio_field`` (default ``audio``), ``text_field`` (default ``text``),
``prompt``.  Relative audio paths are taken next to the JSONL file.  The audio goes into the
observation as DMel features by reference (a media run of the renderer: ``tiny-audio`` locally,
``tml_v0`` for the hosted Inkling models).  Metrics: ``wer``, ``correct`` (WER 0), ``format``
(the reply ended at the stop sequence).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from prefect_tinker.recipes.grading_text import word_error_rate
from prefect_tinker.recipes.media_sources import TRANSCRIBE_PROMPT
from prefect_tinker.recipes.rl.envs import EnvContext, Environment, EnvSpec, register_env
from prefect_tinker.recipes.rl.envs.problems import problem_builder
from prefect_tinker.recipes.rl.problem_env import Problem, ProblemDataset, ProblemEnv
from prefect_tinker.recipes.rl.types import RLDataset, StepResult, StopCondition

__all__ = ["Speech", "SpeechEnv", "SpeechOptions", "load_speech_problems"]


class SpeechOptions(BaseModel):
    """``env_options`` of ``speech``."""

    model_config = ConfigDict(extra="forbid")

    audio_field: str = "audio"
    text_field: str = "text"
    prompt: str = TRANSCRIBE_PROMPT


class SpeechEnv(ProblemEnv):
    """One transcription: ``problem.question`` is the audio file, ``problem.answer`` the transcript.
    Reward ``max(-WER, -1)``; ``question_suffix`` carries the prompt text."""

    def messages(self) -> list[dict]:
        audio = self.problem.question.split("#sha256:")[0]
        text = self.question_suffix or TRANSCRIBE_PROMPT
        return self.convo_prefix + [
            {"role": "user", "content": [{"type": "audio", "audio": audio}, {"type": "text", "text": text}]}
        ]

    def initial_observation(self) -> tuple[list[int], StopCondition]:
        return self.renderer.build_generation_sequence(self.messages()), self.renderer.get_stop_sequences()

    def step(self, action: list[int]) -> StepResult:
        parsed = self.renderer.parse_response(action)
        text = parsed.message.get("content") or ""
        wer = word_error_rate(text, self.problem.answer)
        return StepResult(
            reward=max(-wer, -1.0),
            episode_done=True,
            metrics={"wer": wer, "correct": float(wer == 0.0), "format": float(parsed.ok)},
            logs={"response": text, "reference": self.problem.answer, "problem_id": self.problem.id},
        )


def load_speech_problems(
    source: str,
    *,
    audio_field: str = "audio",
    text_field: str = "text",
    split: str = "train",
    max_problems: int | None = None,
) -> list[Problem]:
    """Problems (question = absolute audio path + ``#sha256:<digest>`` so that the rollout cache
    follows the file's content, answer = transcript) from a JSONL file or dataset.

    Raises:
        ValueError: a malformed line, a missing field, an audio file that does not exist
            (naming ``file:line``); FileNotFoundError: a missing source.
    """
    from prefect_tinker.recipes.builtin_datasets import resolve_source_path
    from prefect_tinker.recipes.data_reading import SourceSpec, iter_records
    from prefect_tinker.recipes.data_sources import RecordError, get_field

    local = Path(resolve_source_path(source)).expanduser()
    base = local.parent.resolve() if local.is_file() else Path.cwd()
    problems = []
    for raw in iter_records(SourceSpec(path=source, split=split, max_records=max_problems)):
        if raw.error:
            raise ValueError(f"{raw.where}: {raw.error}")
        try:
            audio, text = get_field(raw.record, audio_field), get_field(raw.record, text_field)
        except RecordError as exc:
            raise ValueError(f"{raw.where}: {exc}") from None
        if isinstance(audio, dict):
            audio = audio.get("path")
        if not isinstance(audio, str) or not isinstance(text, str) or not text.strip():
            raise ValueError(
                f"{raw.where}: fields {audio_field!r} (a WAV path) and {text_field!r} (the transcript) "
                "must be non-empty strings"
            )
        path = (base / audio).resolve() if not Path(audio).expanduser().is_absolute() else Path(audio).expanduser()
        if not path.is_file():
            raise ValueError(f"{raw.where}: field {audio_field!r}: audio file {str(path)!r} does not exist")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        problems.append(Problem(question=f"{path}#sha256:{digest}", answer=text.strip(), id=raw.where))
    if not problems:
        raise ValueError(f"no speech records in {source!r}")
    return problems


@register_env
class Speech(Environment):
    name = "speech"
    description = "Speech recognition on a JSONL of {audio: WAV path, text: transcript}; reward max(-WER, -1)."
    Options = SpeechOptions

    @classmethod
    def check(cls, spec: EnvSpec) -> None:
        if not spec.dataset:
            raise ValueError("env 'speech' needs dataset=<JSONL of {audio, text}>")
        if spec.few_shot:
            raise ValueError("env 'speech' has no few-shot example (few_shot must be false)")

    @classmethod
    def build(cls, spec: EnvSpec, ctx: EnvContext) -> RLDataset:
        opts = cls.options(spec)
        problems = load_speech_problems(
            spec.required_dataset(),
            audio_field=opts.audio_field,
            text_field=opts.text_field,
            split=spec.split,
            max_problems=spec.max_problems,
        )
        make = problem_builder(SpeechEnv, spec, ctx, (), opts.prompt, cls.name)
        return ProblemDataset(problems, ctx.groups_per_batch, make, seed=ctx.seed)
