"""Reward-model scoring as a cached Prefect task, and the evaluators built on it.

``label_logprobs(credentials, reward_model, comparisons)`` returns, per rendered comparison, the
reward model's log-probabilities of its two labels (``log p("A" | prompt)``, ``log p("B" |
prompt)``; each the sum over the label's tokens, nats) on the sampler weights ``reward_model``:
one prompt-logprobs request per comparison when both labels are single tokens (the second read
from the top-k alternatives at the label position), else one ``compute_logprobs`` per label
(only the label scored: ``prompt_logprobs_last_n``). Every request of the call is submitted
before any is awaited (the server batches them) and identical ones are made once. The task is
cached across flow runs under (reward-model weights, the comparisons' tokens, the task's
source), so a repeated group, evaluation or resumed step never asks the reward model twice.

Evaluators (:mod:`prefect_tinker.tasks.evaluators` interface, on sampler weights):

- :class:`RewardModelEvaluator`: held-out comparisons, both orders:
  ``eval/rm_accuracy`` (P(chosen better) > 0.5; ties one half), ``eval/rm_accuracy_stderr``
  (binomial), ``eval/rm_brier`` (``mean((1 - P(chosen better))^2)``: calibration, 0.25 = chance),
  ``eval/rm_prob_a`` (mean probability of the label "A" over both orders: 0.5 = no position
  bias), ``eval/rm_pairs``;
- :class:`WinRateEvaluator`: the policy's replies to held-out prompts against a reference
  policy's (e.g. the SFT model), judged by the reward model in both orders: ``eval/win_rate``
  (mean P(policy better); exactly 0.5 when the policy is the reference), its standard error, the
  fraction of the policy's replies that ended on a stop sequence.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tinker
from prefect import task

from prefect_tinker.recipes.renderers.base import Termination
from prefect_tinker.recipes.reward_model import (
    ComparisonFormat,
    RenderedComparison,
    RMComparison,
    brier,
    debiased_prob,
    label_token_ids,
    prob_second,
    render_comparison,
)
from prefect_tinker.tasks.clients import sampling_client
from prefect_tinker.tasks.evaluators import SamplingClientEvaluator
from prefect_tinker.tasks.policies import cached_options, quote, run_name_from_parameters

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = ["RewardModelEvaluator", "WinRateEvaluator", "label_logprobs", "pair_preferences"]


def _key(context: Any, params: dict[str, Any]) -> str:
    h = hashlib.sha256(str(params["reward_model"]).encode())
    for c in params["comparisons"]:
        h.update(np.asarray(c.prompt, dtype=np.int64).tobytes() + b"|")
        for lab in c.labels:
            h.update(np.asarray(lab, dtype=np.int64).tobytes() + b",")
        h.update(b"#")
    return h.hexdigest()


def _run_name(parameters: dict[str, Any]) -> str:
    path = str(parameters.get("reward_model") or "")
    return f"rm-score-{path.rstrip('/').rsplit('/', 1)[-1] or 'weights'}-x{len(parameters.get('comparisons') or ())}"


#: Top-k alternatives read at the label position when both labels are single tokens.
TOPK = 20


def _ask_single(client: Any, prompt: list[int], label_a: int) -> Any:
    """One request for both single-token labels: ``prompt + [label_a]`` with its last prompt
    logprob (``label_a``) and the top-:data:`TOPK` alternatives at that position (``label_b``
    when it is among them)."""
    return client.sample(
        prompt=tinker.ModelInput.from_ints(prompt + [label_a]),
        num_samples=1,
        sampling_params=tinker.SamplingParams(max_tokens=1, seed=0),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=TOPK,
        prompt_logprobs_last_n=1,
    )


def _ask_sequence(client: Any, prompt: list[int], label: list[int]) -> Any:
    """``compute_logprobs`` of ``prompt + label``, only the label scored."""
    return client.compute_logprobs(tinker.ModelInput.from_ints(prompt + label), prompt_logprobs_last_n=len(label))


@task(
    name="reward-label-logprobs",
    task_run_name=run_name_from_parameters(_run_name),
    **cached_options(_key),
)
def label_logprobs(
    credentials: TinkerCredentials, reward_model: str, comparisons: list[RenderedComparison]
) -> list[tuple[float, float]]:
    """Per comparison (C), ``(log p(labels[0] | prompt), log p(labels[1] | prompt))`` under the
    reward model's sampler weights ``reward_model`` (``tinker://.../sampler_weights/...`` or
    ``base:<model>``), nats.

    Single-token labels take one request per comparison (the first label's prompt logprob and
    the top-k alternatives at its position; a second request only when the other label is not
    among the top :data:`TOPK`); longer labels one ``compute_logprobs`` each. Every request is
    submitted before any is awaited; identical ones are made once.

    Raises:
        ValueError: a comparison with an empty label.
    """
    client = sampling_client(credentials, reward_model)
    single: dict[tuple, Any] = {}
    sequences: dict[tuple, Any] = {}
    for c in comparisons:
        if not all(c.labels):
            raise ValueError("a comparison has an empty label")
        prompt = tuple(c.prompt)
        if len(c.labels[0]) == len(c.labels[1]) == 1:
            key = (prompt, c.labels[0][0], c.labels[1][0])
            if key not in single:
                single[key] = _ask_single(client, list(prompt), key[1])
        else:
            for lab in c.labels:
                if (prompt, tuple(lab)) not in sequences:
                    sequences[(prompt, tuple(lab))] = _ask_sequence(client, list(prompt), list(lab))
    pairs: dict[tuple, tuple[float, float]] = {}
    firsts: dict[tuple, float] = {}
    missing: dict[tuple, Any] = {}
    for key, fut in single.items():
        resp = fut.result()
        top = dict((resp.topk_prompt_logprobs or [None])[-1] or [])
        first, second = float(resp.prompt_logprobs[-1]), top.get(key[2])
        if second is None:  # the second label is not among the top-k: ask for it
            firsts[key], missing[key] = first, _ask_sequence(client, list(key[0]), [key[2]])
        else:
            pairs[key] = (first, float(second))
    for key, fut in missing.items():
        pairs[key] = (firsts[key], float(list(fut.result())[-1]))
    # entry i of the prompt logprobs is log p(token i | tokens before it); the labels end the prompt
    scored = {key: float(sum(float(x) for x in list(fut.result())[-len(key[1]) :])) for key, fut in sequences.items()}
    out = []
    for c in comparisons:
        prompt = tuple(c.prompt)
        if len(c.labels[0]) == len(c.labels[1]) == 1:
            a, b = pairs[(prompt, c.labels[0][0], c.labels[1][0])]
        else:
            a, b = (scored[(prompt, tuple(lab))] for lab in c.labels)
        out.append((float(a), float(b)))
    return out


def pair_preferences(
    credentials: TinkerCredentials,
    reward_model: str,
    pairs: Sequence[tuple[RenderedComparison, RenderedComparison]],
    *,
    task_run_name: str | None = None,
) -> list[float]:
    """P(y better than x) per pair (:func:`~prefect_tinker.recipes.reward_model.debiased_prob`),
    where each pair is ``(x as A and y as B, y as A and x as B)``; one ``label-logprobs`` call."""
    if not pairs:
        return []
    flat = [c for pair in pairs for c in pair]
    fn = label_logprobs.with_options(task_run_name=task_run_name) if task_run_name else label_logprobs
    lps = fn(credentials, reward_model, quote(flat))  # quote: no walk of the token lists
    return [debiased_prob(lps[2 * k], lps[2 * k + 1]) for k in range(len(pairs))]


class RewardModelEvaluator(SamplingClientEvaluator):
    """Held-out pairwise accuracy and calibration of reward-model sampler weights (see the module
    docstring for the metrics).

    Args:
        comparisons: held-out :class:`~prefect_tinker.recipes.reward_model.RMComparison` s.
        prefix: metric prefix (default ``eval``).
    """

    name = "reward_model"

    def __init__(self, comparisons: Sequence[RMComparison], prefix: str = "eval"):
        self.comparisons, self.prefix = list(comparisons), prefix

    def probabilities(
        self, credentials: TinkerCredentials, sampler_path: str, step: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(P(chosen better) (C,), mean P(label A) over both orders (C,))``."""
        flat = [c for cmp in self.comparisons for c in (cmp.chosen_b, cmp.chosen_a)]
        lps = label_logprobs.with_options(task_run_name=f"rm-eval-step-{step}")(credentials, sampler_path, quote(flat))
        fwd, bwd = lps[0::2], lps[1::2]  # chosen as B, chosen as A
        p = np.array([debiased_prob(f, b) for f, b in zip(fwd, bwd, strict=True)])
        prob_a = np.array(
            [0.5 * ((1 - prob_second(*f)) + (1 - prob_second(*b))) for f, b in zip(fwd, bwd, strict=True)]
        )
        return p, prob_a

    def evaluate(self, credentials: TinkerCredentials, sampler_path: str, step: int) -> dict[str, float]:
        if not self.comparisons:
            return {}
        p, prob_a = self.probabilities(credentials, sampler_path, step)
        acc = float(np.mean((p > 0.5) + 0.5 * (p == 0.5)))
        n, pre = len(p), self.prefix
        return {
            f"{pre}/rm_accuracy": acc,
            f"{pre}/rm_accuracy_stderr": float(np.sqrt(acc * (1 - acc) / n)),
            f"{pre}/rm_brier": brier(p),
            f"{pre}/rm_prob_a": float(np.mean(prob_a)),
            f"{pre}/rm_pairs": float(n),
        }


class WinRateEvaluator(SamplingClientEvaluator):
    """The policy's win rate against a reference policy on held-out prompts, judged by a reward
    model (see the module docstring). Both policies sample with the same seed, ``max_tokens`` and
    temperature (cached ``sample-completions``: the reference's replies are sampled once).

    Args:
        prompts: held-out prompts (message lists ending with a user turn).
        reference: sampler weights of the reference policy (``tinker://.../sampler_weights/...``).
        reward_model: the reward model's sampler weights; ``fmt``: the format it was trained with.
        renderer_name, tokenizer_id: the policy's; reward_renderer, reward_tokenizer: the reward
            model's (default the policy's).
    """

    name = "win_rate"

    def __init__(
        self,
        prompts: Sequence[Sequence[dict]],
        reference: str,
        reward_model: str,
        *,
        renderer_name: str,
        tokenizer_id: str,
        fmt: ComparisonFormat | None = None,
        reward_renderer: str | None = None,
        reward_tokenizer: str | None = None,
        max_tokens: int = 64,
        temperature: float = 1.0,
        seed: int = 0,
        prefix: str = "eval",
    ):
        self.prompts = [[dict(m) for m in p] for p in prompts]
        self.reference, self.reward_model, self.fmt = reference, reward_model, fmt or ComparisonFormat()
        self.renderer_name, self.tokenizer_id = renderer_name, tokenizer_id
        self.reward_renderer, self.reward_tokenizer = reward_renderer or renderer_name, reward_tokenizer or tokenizer_id
        self.max_tokens, self.temperature, self.seed, self.prefix = max_tokens, temperature, seed, prefix

    def replies(self, credentials: TinkerCredentials, sampler_path: str) -> list[tuple[str, bool]]:
        """``(text, ended on a stop sequence)`` of the sampler's reply to every prompt."""
        from prefect_tinker.recipes.rl.problem_env import load_renderer
        from prefect_tinker.tasks.sampling import sample_completions

        rend = load_renderer(self.renderer_name, self.tokenizer_id)
        tokens = [rend.build_generation_prompt(p).to_ints() for p in self.prompts]
        outs = sample_completions(
            credentials,
            sampler_path,
            tokens,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=self.seed,
            stop=rend.get_stop_sequences(),
        )
        parsed = [rend.parse_response(o[0]["tokens"]) for o in outs]
        return [(p.message.get("content") or "", p.termination == Termination.STOP_SEQUENCE) for p in parsed]

    def evaluate(self, credentials: TinkerCredentials, sampler_path: str, step: int) -> dict[str, float]:
        from prefect_tinker.recipes.rl.problem_env import load_renderer

        if not self.prompts:
            return {}
        ours, theirs = self.replies(credentials, sampler_path), self.replies(credentials, self.reference)
        rend = load_renderer(self.reward_renderer, self.reward_tokenizer)
        labels = label_token_ids(rend, self.fmt.labels)
        pairs = [
            (
                render_comparison(rend, p, ref, pol, self.fmt, labels),
                render_comparison(rend, p, pol, ref, self.fmt, labels),
            )
            for p, (pol, _), (ref, _) in zip(self.prompts, ours, theirs, strict=True)
        ]
        wins = np.array(pair_preferences(credentials, self.reward_model, pairs, task_run_name=f"win-rate-step-{step}"))
        n, pre = len(wins), self.prefix
        return {
            f"{pre}/win_rate": float(wins.mean()),
            f"{pre}/win_rate_stderr": float(wins.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0,
            f"{pre}/win_rate_format": float(np.mean([ok for _, ok in ours])),
            f"{pre}/win_rate_prompts": float(n),
        }
