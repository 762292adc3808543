"""A deterministic LLM judge behind a real Tinker-compatible server, for rubric-reward tests.

:class:`ScriptedJudgeEngine` is the real ``tinker_local`` engine (the policy trains and samples on
it as usual) in which one more base model, :data:`JUDGE_MODEL`, answers by a script: it reads the
reply quoted under ``## Reply`` in the judge's prompt (the prompt as the judge task rendered and
sent it, decoded with the policy's tokenizer) and answers ``1: <s1>\\n2: <s2>`` with the scores of
:func:`scores_of`, or a sentence with no score for an empty reply. Served by
``tests.inproc_server.start(..., engine_cls=ScriptedJudgeEngine)``, the judge is reached like any
other sampler weights: ``base:scripted-judge`` through the SDK and the HTTP protocol.

The scores depend on the reply's words only (not on how its lines were split when quoted), so a
test can recompute them from the reply the environment logged, independently of the prompt.
"""

from __future__ import annotations

from typing import Any

from tinker_local.datatypes import SampleResult
from tinker_local.engine import Engine

JUDGE_MODEL = "scripted-judge"
UNGRADABLE = "I cannot grade this reply."


def scores_of(reply: str) -> tuple[int, int]:
    """The two criteria's scores (0..10) of ``reply``: its number of words and its number of
    non-space characters, each modulo 11."""
    words = reply.split()
    return len(words) % 11, sum(len(w) for w in words) % 11


def answer_for(reply: str) -> str:
    """The judge's answer to ``reply``: one ``k: score`` line per criterion, or, for a reply with
    no word, a sentence without scores (every criterion then unparsed)."""
    if not reply.split():
        return UNGRADABLE
    s1, s2 = scores_of(reply)
    return f"1: {s1}\n2: {s2}"


def quoted_reply(prompt_text: str) -> str:
    """The reply quoted in a judge prompt (``recipes.rl.judge.judge_messages``): the ``> ``-prefixed
    lines between ``## Reply`` and ``## Task``, unquoted (``> (empty)`` is the empty reply)."""
    section = prompt_text.split("## Reply\n", 1)[1].split("\n\n## Task", 1)[0]
    lines = [line[2:] if line.startswith("> ") else line for line in section.split("\n")]
    return "" if lines == ["(empty)"] else "\n".join(lines)


class ScriptedJudgeEngine(Engine):
    """The real engine; requests for base model :data:`JUDGE_MODEL` get :func:`answer_for` the
    quoted reply, ended by ``<|im_end|>`` (the chatml stop), with logprobs 0; every other request
    is sampled as usual."""

    judge_tokenizer_model = "tiny"  # the policy's base model: the judge reads with its tokenizer

    def sample_many(self, requests: list[dict]) -> list[SampleResult | Exception]:
        out: list[Any] = [None] * len(requests)
        others = [i for i, r in enumerate(requests) if r["base_model"] != JUDGE_MODEL]
        for i, r in enumerate(requests):
            if r["base_model"] == JUDGE_MODEL:
                out[i] = self._judge(r)
        if others:
            for i, res in zip(others, super().sample_many([requests[i] for i in others]), strict=True):
                out[i] = res
        return out

    def _judge(self, request: dict) -> SampleResult:
        tok = self._base(self.judge_tokenizer_model).tokenizer
        text = tok.decode(list(request["prompt_tokens"]), skip_special_tokens=False)
        ids = tok.encode(answer_for(quoted_reply(text)), add_special_tokens=False)
        ids = (ids + [tok.convert_tokens_to_ids("<|im_end|>")])[: int(request["max_tokens"])]
        seq = {"tokens": ids, "logprobs": [0.0] * len(ids), "stop_reason": "stop"}
        return SampleResult([dict(seq) for _ in range(int(request.get("num_samples", 1)))])
