"""RL with verifiable rewards in one function: the ``rl`` recipe's algorithm, read top to bottom.

``main(Config(...))`` does what ``prefect-tinker run rl`` (the ``sync`` schedule) does, with the
tinker SDK and the same components, and nothing else. Each step:

1. save the current weights for sampling (the step's policy);
2. take the step's batch of group builders from the registered environment
   (:func:`~prefect_tinker.recipes.rl.envs.build_rl_dataset`: ``groups_per_batch`` problems,
   ``group_size`` envs each); for each group sample ``group_size`` replies to its prompt in one
   request, and let each env grade its reply (the reward);
3. group advantages: each reward minus its group's mean (GRPO without the division by the
   standard deviation, :func:`~prefect_tinker.recipes.rl.advantages.groups_to_datums`; groups whose
   rewards are all equal teach nothing and are dropped when ``remove_constant_reward_groups``);
4. datums: prompt + reply tokens, with the sampler's logprobs and the advantage on the reply
   tokens; with ``kl_penalty_coef`` the base model's logprobs of the same tokens fold a KL penalty
   into the advantages (:func:`~prefect_tinker.recipes.rl.advantages.apply_kl_penalty`);
5. ``forward_backward`` with the registered loss (``importance_sampling``: the policy gradient
   corrected by the ratio of trainer to sampler probabilities) and ``optim_step`` at the schedule's
   rate.

A state checkpoint follows every ``save_every`` steps and the last one. This loop takes single-turn
environments (a prompt, one reply, a reward: ``arithmetic``, ``gsm8k``, ``math``); the flow's
rollout task also steps multi-turn, tool-using and self-play environments, applies a failed-rollout
policy, and caches rollouts.

What the flow adds around the same requests (:mod:`prefect_tinker.flows.rl`): Prefect tasks with
retries and caching, a run session that resumes after the last checkpoint, the streaming and async
schedules, substeps, metrics and trajectory rows in the store, evaluators, Ctrl-C handling and a
client rebuilt when the server loses it. ``tests/test_reference_loops.py`` checks that this loop and
the flow send the same requests (samples, KL reference logprobs, training) and end with the same
weights.

Run: ``python -m prefect_tinker.recipes.loops.rl_loop --base-url http://127.0.0.1:8000 --model tiny``
(the options are :class:`Config`'s fields; ``env_options`` as JSON).
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any, cast

import numpy as np
import tinker
from pydantic import Field
from tinker.types import LossFnType

from prefect_tinker.recipes.media import model_input_from_tokens
from prefect_tinker.recipes.renderers import resolve_renderer_name
from prefect_tinker.recipes.rl.advantages import (
    apply_kl_penalty,
    groups_to_datums,
    remove_constant_reward_groups,
    rollout_metrics,
)
from prefect_tinker.recipes.rl.envs import EnvSpec, RunSettings, build_rl_dataset
from prefect_tinker.recipes.rl.losses import LOSSES, ClipThresholds
from prefect_tinker.recipes.rl.types import EnvGroupBuilder, Trajectory, TrajectoryGroup, Transition
from prefect_tinker.recipes.schedule import LRScheduleFields
from prefect_tinker.recipes.tokenizers import resolve_tokenizer

__all__ = ["Config", "main", "train"]

log = logging.getLogger(__name__)


class Config(EnvSpec, LRScheduleFields):
    """A run of the loop: the environment fields of :class:`~prefect_tinker.recipes.rl.envs.EnvSpec`
    (``env``, ``env_options``, ``dataset``, ``few_shot``, ...), the shared schedule's fields, and
    the defaults of :class:`~prefect_tinker.flows.rl.RLConfig` where it has the same field."""

    base_url: str | None = Field(default=None, description="Tinker-compatible server; None: the hosted service.")
    model: str = "tiny"
    tokenizer: str | None = Field(default=None, description="Tokenizer directory or id; None: the server's.")
    lora_rank: int = Field(default=32, ge=1)
    seed: int = 0
    renderer: str = Field(default="auto", description="A registered renderer, or auto (from the chat template).")
    group_size: int = Field(default=4, ge=2, description="Replies sampled per problem.")
    groups_per_batch: int = Field(default=8, ge=1, description="Problems per step.")
    max_tokens: int = Field(default=16, ge=1, description="Most sampled tokens per reply.")
    temperature: float = Field(default=1.0, gt=0)
    max_steps: int = Field(default=20, ge=1)
    loss_fn: str = Field(default="importance_sampling", description="A registered RL loss (ppo, cispo, ...).")
    clip_low_threshold: float | None = 0.8
    clip_high_threshold: float | None = 1.2
    kl_penalty_coef: float = Field(default=0.0, ge=0, description="KL penalty against the base model (0: off).")
    remove_constant_reward_groups: bool = True
    save_every: int = Field(default=5, ge=0, description="State checkpoint every n steps (0: at the end only).")
    name: str = Field(default="rl-loop", description="Checkpoint names start with it.")

    def run_settings(self) -> RunSettings:
        """What the environment's config check may need: the group size and the policy's model."""
        return RunSettings(group_size=self.group_size, model=self.model)


def sample_group(sampler: Any, builder: EnvGroupBuilder, config: Config, seed: int, index: int) -> TrajectoryGroup:
    """The rollouts of one group: ``group_size`` replies to the group's prompt (one request),
    each graded by its env (single-turn: the episode ends with the reply).

    Raises:
        ValueError: the group's envs have different prompts, or an episode does not end after
            one reply (a multi-turn environment: run it with the flow).
    """
    envs = builder.make_envs()
    prompts = [env.initial_observation() for env in envs]
    prompt, stop = prompts[0]
    if any(p != prompts[0] for p in prompts):
        raise ValueError(f"group {index}: its envs have different prompts; the reference loop needs one")
    params = tinker.SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, seed=seed, stop=stop)
    replies = sampler.sample(model_input_from_tokens(prompt), len(envs), params).result().sequences
    trajectories = []
    for env, reply in zip(envs, replies, strict=True):
        result = env.step(list(reply.tokens))
        if not result.episode_done:
            raise ValueError(f"group {index}: the episode goes on after the first reply (a multi-turn environment)")
        transition = Transition(
            observation=list(prompt),
            action_tokens=list(reply.tokens),
            action_logprobs=[float(x) for x in reply.logprobs or []],
            reward=float(result.reward),
            episode_done=True,
            stop_reason=str(reply.stop_reason),
            metrics=dict(result.metrics),
        )
        trajectories.append(Trajectory([transition], []))
    group_rewards = builder.compute_group_rewards(trajectories)  # e.g. pairwise judgements; 0 for problems
    return TrajectoryGroup(
        trajectories_G=trajectories,
        final_rewards_G=[float(r) for r, _ in group_rewards],
        metrics_G=[dict(m) for _, m in group_rewards],
        group_index=index,
    )


def main(config: Config) -> dict[str, Any]:
    """:func:`train` with a service client of ``config.base_url``, closed at the end."""
    with tinker.ServiceClient(base_url=config.base_url) as service:
        return train(service, config)


def train(service: tinker.ServiceClient, config: Config) -> dict[str, Any]:
    """Train as the module docstring says; returns ``rewards`` (mean reward per step),
    ``kl_policy_ref`` (per step, with the KL penalty on), ``checkpoints`` (``tinker://`` state
    paths) and ``steps``.

    Raises:
        ValueError: an unknown environment or loss (the message lists the registered ones), bad
            problem data (naming file, line and field), a multi-turn environment, no tokenizer (the
            server names none and ``tokenizer`` is unset).
    """
    # the clients: a LoRA training client, the tokenizer the server names, the KL reference (the base model)
    training = service.create_lora_training_client(
        base_model=config.model, rank=config.lora_rank, seed=config.seed
    ).result()
    tokenizer_id = config.tokenizer or training.get_info().model_data.tokenizer_id
    if tokenizer_id is None:
        raise ValueError(f"the server names no tokenizer for model {config.model!r}: give tokenizer=<directory or id>")
    renderer = resolve_renderer_name(config.renderer, resolve_tokenizer(tokenizer_id))
    reference = service.create_sampling_client(base_model=config.model).result() if config.kl_penalty_coef else None
    loss = LOSSES.get_or_raise(config.loss_fn).from_options({})
    loss_fn_config = loss.loss_fn_config(ClipThresholds(config.clip_low_threshold, config.clip_high_threshold))

    # the environment's problems, batch after batch
    dataset = build_rl_dataset(
        config,
        renderer_name=renderer,
        tokenizer_id=tokenizer_id,
        group_size=config.group_size,
        groups_per_batch=config.groups_per_batch,
        seed=config.seed,
    )

    rewards, kls, checkpoints = [], [], []
    for step in range(config.max_steps):
        # 1. the policy of this step, as sampler weights
        path = training.save_weights_for_sampler(f"{config.name}-step-{step:06d}").result().path
        sampler = service.create_sampling_client(model_path=path).result()

        # 2. rollouts and rewards, group by group
        builders = dataset.get_batch(step)
        groups = [sample_group(sampler, b, config, config.seed + 1000 * step + g, g) for g, b in enumerate(builders)]
        rewards.append(rollout_metrics(groups)["reward_mean"])
        if config.remove_constant_reward_groups:
            groups, _ = remove_constant_reward_groups(groups)

        # 3-4. group advantages on the reply tokens; the KL penalty folded in
        datums, _ = groups_to_datums(groups)
        if reference is not None and datums:
            futures = [reference.compute_logprobs(model_input_from_tokens(d.tokens)) for d in datums]
            ref = [np.asarray([0.0 if x is None else x for x in f.result()[1:]]) for f in futures]  # token 0: none
            kls.append(apply_kl_penalty(datums, ref, config.kl_penalty_coef)["kl_policy_ref"])

        # 5. the update
        if datums:
            sdk_datums = [d.to_datum() for d in datums]
            training.forward_backward(sdk_datums, cast(LossFnType, loss.loss_fn), loss_fn_config).result()
        training.optim_step(tinker.AdamParams(learning_rate=config.lr_at(step, config.max_steps))).result()
        log.info("step %d/%d: reward %.3f, %d datums", step + 1, config.max_steps, rewards[-1], len(datums))

        if step + 1 == config.max_steps or (config.save_every and (step + 1) % config.save_every == 0):
            checkpoints.append(training.save_state(f"{config.name}-state-{step + 1:06d}").result().path)
    return {"steps": config.max_steps, "rewards": rewards, "kl_policy_ref": kls, "checkpoints": checkpoints}


def _args() -> Config:
    """``Config`` from ``--field value`` options (``--base-url``, ``--env``, ``--env-options '{...}'``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, field in Config.model_fields.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, help=field.description)
    given = {k: v for k, v in vars(parser.parse_args()).items() if v is not None}
    if "env_options" in given:
        given["env_options"] = json.loads(given["env_options"])
    return Config.model_validate(given)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(main(_args()))
