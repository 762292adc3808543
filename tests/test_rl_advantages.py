"""Advantages, datums, KL penalty and rollout failure policies, checked against independent
computations (no server: a fake sampler stands in for the SDK's SamplingClient)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from prefect_tinker.recipes.rl.advantages import (
    apply_kl_penalty,
    compute_advantages,
    groups_to_datums,
    remove_constant_reward_groups,
    rollout_metrics,
    sample_train_kl,
    trajectory_to_datums,
)
from prefect_tinker.recipes.rl.types import Env, EnvGroupBuilder, StepResult, Trajectory, TrajectoryGroup, Transition
from prefect_tinker.tasks.rollouts import RolloutError, RolloutPolicy, group_seed, run_group_rollout
from tests.scripted_policy import completed


def _traj(ob, ac, lp, reward=0.0):
    return Trajectory([Transition(list(ob), list(ac), list(lp), reward, True)])


def test_group_centred_advantages_match_a_direct_computation():
    rng = np.random.default_rng(0)
    for _ in range(20):
        r = rng.normal(size=rng.integers(2, 9))
        expected = [x - sum(r) / len(r) for x in r]
        # centred in float32, as tinker-cookbook computes them: within float32 rounding of the rewards (|r| < 5)
        assert compute_advantages(r) == pytest.approx(expected, abs=2e-6)
        std = (sum((x - sum(r) / len(r)) ** 2 for x in r) / len(r)) ** 0.5
        assert compute_advantages(r, normalize_std=True) == pytest.approx(
            [e / (std + 1e-6) for e in expected], abs=2e-6 / std
        )
    assert compute_advantages([1.0, 1.0, 1.0]).tolist() == [0.0, 0.0, 0.0]


def test_single_turn_datum_layout():
    d = trajectory_to_datums(_traj([1, 2, 3], [4, 5], [-0.5, -0.7]), advantage=0.3)[0]
    datum = d.to_datum()
    assert datum.model_input.to_ints() == [1, 2, 3, 4]
    inputs = {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()}
    assert inputs["target_tokens"].tolist() == [2, 3, 4, 5]
    assert inputs["logprobs"] == pytest.approx([0, 0, -0.5, -0.7])
    assert inputs["advantages"] == pytest.approx([0, 0, 0.3, 0.3])
    assert d.mask.tolist() == [0, 0, 1, 1]


def test_multi_turn_merges_extending_observations_and_splits_others():
    t1 = Transition([1, 2], [3, 4], [-1.0, -2.0], 0.0, False)
    t2 = Transition([1, 2, 3, 4, 9], [5], [-3.0], 1.0, True)  # extends turn 1 -> one datum
    (d,) = trajectory_to_datums(Trajectory([t1, t2]), 2.0)
    assert d.tokens == [1, 2, 3, 4, 9, 5]
    assert d.mask.tolist() == [0, 1, 1, 0, 1] and d.sampler_logprobs.tolist() == [0, -1, -2, 0, -3]
    t3 = Transition([7, 8], [6], [-4.0], 1.0, True)  # does not extend -> a second datum
    ds = trajectory_to_datums(Trajectory([t1, t3]), 1.0)
    assert [x.tokens for x in ds] == [[1, 2, 3, 4], [7, 8, 6]]
    with pytest.raises(ValueError, match="logprobs"):
        trajectory_to_datums(_traj([1], [2, 3], [-1.0]), 1.0)


def _random_group(rng, gi, G=4):
    trajs = []
    for _ in range(G):
        ob = list(rng.integers(0, 50, size=rng.integers(2, 6)))
        ac = list(rng.integers(0, 50, size=rng.integers(1, 5)))
        trajs.append(_traj(ob, ac, list(-rng.random(len(ac))), float(rng.integers(0, 2))))
    return TrajectoryGroup(trajs, [0.0] * G, [{}] * G, group_index=gi)


def test_datums_of_groups_against_an_independent_loop():
    rng = np.random.default_rng(1)
    groups = [_random_group(rng, i) for i in range(5)]
    datums, advs = groups_to_datums(groups)
    assert len(datums) == 20
    k = 0
    for g, adv in zip(groups, advs, strict=True):
        rewards = [t.transitions[0].reward for t in g.trajectories_G]
        for t, r in zip(g.trajectories_G, rewards, strict=True):
            a = r - np.mean(rewards)
            tr = t.transitions[0]
            seq = tr.observation + tr.action_tokens
            P = len(tr.observation)
            want_adv = [a if i >= P else 0.0 for i in range(1, len(seq))]
            want_lp = [tr.action_logprobs[i - P] if i >= P else 0.0 for i in range(1, len(seq))]
            assert datums[k].tokens == seq
            assert datums[k].advantages == pytest.approx(want_adv, abs=1e-6)
            assert datums[k].sampler_logprobs == pytest.approx(want_lp, abs=1e-6)
            k += 1


def test_kl_penalty_and_sample_train_kl():
    rng = np.random.default_rng(2)
    datums, _ = groups_to_datums([_random_group(rng, 0), _random_group(rng, 1)])
    before = [d.advantages.copy() for d in datums]
    refs = [np.where(d.mask > 0, d.sampler_logprobs - rng.random(d.mask.shape), 0.0) for d in datums]
    diffs = np.concatenate([(d.sampler_logprobs - r)[d.mask > 0] for d, r in zip(datums, refs, strict=True)])
    out = apply_kl_penalty(datums, refs, coef=0.5)
    assert out["kl_policy_ref"] == pytest.approx(diffs.mean())
    for d, b, r in zip(datums, before, refs, strict=True):
        want = b + 0.5 * d.mask * (diffs.mean() - (d.sampler_logprobs - r))
        assert d.advantages == pytest.approx(want, abs=1e-5)
    trainer = [d.sampler_logprobs - 0.1 * d.mask for d in datums]
    kl = sample_train_kl(datums, trainer)
    assert kl["kl_sample_train_v1"] == pytest.approx(0.1, abs=1e-6)
    assert kl["kl_sample_train_v2"] == pytest.approx(0.005, abs=1e-6)
    ent = -np.concatenate([d.sampler_logprobs[d.mask > 0] for d in datums]).mean()
    assert kl["entropy"] == pytest.approx(ent, abs=1e-6)


def test_constant_groups_removed_and_metrics():
    rng = np.random.default_rng(3)
    varied = _random_group(rng, 0)
    for t, r in zip(varied.trajectories_G, [0.0, 1.0, 0.0, 1.0], strict=True):
        t.transitions[0].reward = r
    const = TrajectoryGroup([_traj([1], [2], [-1.0], 1.0)] * 3, [0.0] * 3, [{}] * 3)
    kept, removed = remove_constant_reward_groups([varied, const])
    assert kept == [varied] and removed == 1
    assert remove_constant_reward_groups([const]) == ([const], 0)
    m = rollout_metrics([varied, const])
    assert m["reward_mean"] == pytest.approx(5 / 7) and m["groups"] == 2 and m["trajectories"] == 7


# ----- rollouts with a fake sampler ---------------------------------------------------------------
class FakeSampler:
    """Stands in for tinker.SamplingClient: action = [seed % 7 + i] per sample, logprob -1 each."""

    def __init__(self):
        self.calls = []

    def sample(self, prompt, num_samples, sampling_params):
        self.calls.append((prompt.to_ints(), num_samples, sampling_params.seed))
        seqs = [SimpleNamespace(tokens=[sampling_params.seed % 7 + i, 99], logprobs=[-1.0, -1.0], stop_reason="stop",
                                sequence_id="") for i in range(num_samples)]
        return completed(SimpleNamespace(sequences=seqs, prompt_cache_hit_tokens=0))


class FlakyEnv(Env):
    def __init__(self, fail: bool):
        self.fail = fail

    def initial_observation(self):
        return [1, 2, 3], [99]

    def step(self, action):
        if self.fail:
            raise ValueError("grader crashed")
        return StepResult(reward=float(action[0] % 2), episode_done=True, metrics={"correct": float(action[0] % 2)})


@dataclass(frozen=True)
class FlakyBuilder(EnvGroupBuilder):
    fail_members: tuple[int, ...] = ()
    fail_times: int = 99  # how many times each failing member fails before succeeding
    G: int = 4

    def make_envs(self):
        count = _FAILS.setdefault(self, [0])
        count[0] += 1
        return [FlakyEnv(i in self.fail_members and count[0] <= self.fail_times) for i in range(self.G)]


_FAILS: dict = {}


def test_rollout_samples_a_group_in_one_request_and_is_deterministic():
    s = FakeSampler()
    g = run_group_rollout(s, FlakyBuilder(), seed=group_seed(0, 1, 2), max_tokens=4, batch_index=1, group_index=2)
    assert len(s.calls) == 1 and s.calls[0][1] == 4
    assert len(g.trajectories_G) == 4 and g.errors == 0 and (g.batch_index, g.group_index) == (1, 2)
    g2 = run_group_rollout(FakeSampler(), FlakyBuilder(), seed=group_seed(0, 1, 2), max_tokens=4)
    assert [t.transitions[0].action_tokens for t in g.trajectories_G] == [
        t.transitions[0].action_tokens for t in g2.trajectories_G
    ]
    assert group_seed(0, 1, 2) != group_seed(0, 2, 1)
    assert pickle.loads(pickle.dumps(g)).total_rewards() == g.total_rewards()


def test_failure_policies():
    _FAILS.clear()
    with pytest.raises(RolloutError, match="member 1 failed"):
        run_group_rollout(
            FakeSampler(), FlakyBuilder((1,)), seed=5, max_tokens=4, policy=RolloutPolicy(mode="fail_fast")
        )
    # retry: member 2 fails once, then its fresh env succeeds
    g = run_group_rollout(FakeSampler(), FlakyBuilder((2,), fail_times=1), seed=5, max_tokens=4,
                          policy=RolloutPolicy(mode="retry", retries=2))
    assert len(g.trajectories_G) == 4 and g.errors == 1
    with pytest.raises(RolloutError):
        run_group_rollout(FakeSampler(), FlakyBuilder((2,), fail_times=99), seed=5, max_tokens=4,
                          policy=RolloutPolicy(mode="retry", retries=2))
    g = run_group_rollout(FakeSampler(), FlakyBuilder((0, 3)), seed=5, max_tokens=4,
                          policy=RolloutPolicy(mode="min_viable", min_group_size=2))
    assert len(g.trajectories_G) == 2 and g.errors == 2 and "grader crashed" in g.error_messages[0]
    g = run_group_rollout(FakeSampler(), FlakyBuilder((0, 1, 3)), seed=5, max_tokens=4,
                          policy=RolloutPolicy(mode="min_viable", min_group_size=2))
    assert g.trajectories_G == [] and g.errors == 3
