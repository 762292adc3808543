"""The RL flow end to end: Prefect flow runs -> rollout tasks -> tinker SDK -> local server ->
training store -> SQL. Kept small (tiny model, a few steps of a few groups)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from pydantic import BaseModel

from prefect_tinker.cli.main import main as cli_main
from prefect_tinker.flows.rl import RLConfig, rl_flow
from prefect_tinker.flows.callbacks import RunCallbacks, run_callbacks
from prefect_tinker.flows.rl_config import SCHEDULES
from prefect_tinker.flows.rl_schedules import Sync
from prefect_tinker.recipes.rl.envs import Environment, register_env
from prefect_tinker.recipes.rl.types import Env, EnvGroupBuilder, RLDataset, StepResult
from tests.task_runs import cached_task_runs

REQUIRED = {
    "env/reward_mean", "env/correct_rate", "env/format_rate", "env/tokens_per_turn", "rollout/errors",
    "train/kl_sample_train_v1", "train/kl_sample_train_v2", "train/entropy", "train/loss_sum",
    "train/learning_rate", "time/step_seconds", "time/rollout_seconds", "time/train_seconds",
}


def _config(local_credentials, store, run_name, **kw) -> RLConfig:
    base = dict(
        model="tiny", group_size=2, groups_per_batch=2, max_tokens=6, max_steps=2, lora_rank=8,
        learning_rate=5e-3, save_every=2, run_name=run_name, store=str(store), log_trajectories=3,
        backend={"local_root": local_credentials.local_root},
    )
    base.update(kw)
    return RLConfig(**base)


def _sql(capsys, store, query) -> list[dict]:
    capsys.readouterr()
    assert cli_main(["sql", "--store", str(store), "--json", query]) in (0, None)
    return json.loads(capsys.readouterr().out)


def test_rl_flow_on_arithmetic(prefect_api, local_credentials, tmp_path, capsys):
    store = tmp_path / "store"
    summary = rl_flow(_config(local_credentials, store, "arith"))
    assert summary["steps"] == 2 and len(summary["rewards"]) == 2
    rows = _sql(capsys, store, "SELECT step, name, count(*) AS n FROM metrics WHERE run_id='arith' GROUP BY ALL")
    assert rows and all(r["n"] == 1 for r in rows)
    assert REQUIRED <= {r["name"] for r in rows}
    assert sorted({r["step"] for r in rows}) == [0, 1]
    traj = _sql(
        capsys,
        store,
        "SELECT step, prompt, response, reward, metrics_json FROM trajectories WHERE run_id='arith' ORDER BY step",
    )
    assert len(traj) == 6 and "What is" in traj[0]["prompt"]
    assert {"correct", "format", "reference"} <= set(json.loads(traj[0]["metrics_json"]))
    ckpts = _sql(capsys, store, "SELECT step, kind FROM checkpoints WHERE run_id='arith' ORDER BY step, kind")
    assert [(c["step"], c["kind"]) for c in ckpts] == [(0, "sampler"), (2, "sampler"), (2, "state")]
    assert _sql(capsys, store, "SELECT status FROM runs WHERE run_id='arith'") == [{"status": "completed"}]


def test_rl_flow_on_math_jsonl_with_own_field_names(prefect_api, local_credentials, tmp_path, capsys):
    rows = [{"problem": f"Sam has {a} pens and gets {b} more. How many pens?", "meta": {"final": f"{a + b} pens"}}
            for a, b in [(3, 4), (10, 5), (7, 7), (2, 9)]]
    data = tmp_path / "word_problems.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp_path / "store"
    summary = rl_flow(_config(local_credentials, store, "math-run", env="math", dataset=str(data), max_steps=1,
                              env_options={"question_field": "problem", "answer_field": "meta.final"}, save_every=0))
    assert summary["steps"] == 1
    traj = _sql(capsys, store, "SELECT prompt, metrics_json FROM trajectories WHERE run_id='math-run'")
    assert traj and "\\boxed{}" in traj[0]["prompt"]
    assert json.loads(traj[0]["metrics_json"])["reference"] in {"7 pens", "15 pens", "14 pens", "11 pens"}


# ----- a dense-reward env, so every step trains on non-zero advantages --------------------------
class ParityEnv(Env):
    """Reward = fraction of even token ids in the reply; member ``fail`` raises (a broken grader)."""

    def __init__(self, prompt: list[int], fail: bool):
        self.prompt, self.fail = prompt, fail

    def initial_observation(self):
        return list(self.prompt), []

    def step(self, action):
        if self.fail:
            raise RuntimeError("broken grader")
        r = sum(1 for t in action if t % 2 == 0) / max(len(action), 1)
        return StepResult(reward=r, episode_done=True, metrics={"correct": float(r > 0.5), "format": 1.0})


@dataclass(frozen=True)
class ParityBuilder(EnvGroupBuilder):
    prompt: tuple[int, ...]
    group_size: int
    fail_member: int = -1

    def make_envs(self):
        return [ParityEnv(list(self.prompt), i == self.fail_member) for i in range(self.group_size)]


class ParityDataset(RLDataset):
    def __init__(self, group_size: int, groups_per_batch: int, fail: bool):
        self.group_size, self.groups_per_batch, self.fail = group_size, groups_per_batch, fail

    def get_batch(self, index):
        return [ParityBuilder((1, 100 + index, 200 + g, 300), self.group_size, 0 if self.fail and g == 0 else -1)
                for g in range(self.groups_per_batch)]


class _ParityOptions(BaseModel):
    fail: bool = False


@register_env
class _Parity(Environment):
    """The test's dense-reward env, registered like any other (``env=parity``)."""

    name = "parity"
    description = "test: reward = fraction of even token ids"
    Options = _ParityOptions

    @classmethod
    def build(cls, spec, ctx):
        return ParityDataset(ctx.group_size, ctx.groups_per_batch, cls.options(spec).fail)


def _parity(fail=False) -> dict:
    return {"env": "parity", "env_options": {"fail": fail}}


class _Interrupt(RuntimeError):
    pass


class _CrashAfter(RunCallbacks):
    def __init__(self, step: int):
        self.step = step

    def after_step(self, run_id, step):
        if step == self.step:
            raise _Interrupt(f"simulated crash after step {step}")


def test_interrupted_run_resumes_after_last_checkpoint(prefect_api, local_credentials, tmp_path, capsys):
    store = tmp_path / "store"
    # Adam's eps at 1e-8 (the default 1e-12 turns fp32 noise in near-zero gradients into full-size steps,
    # enough to flip a sampled token of the next step and so its reward: seen once in CI)
    kw = dict(max_steps=4, save_every=2, group_size=3, adam={"eps": 1e-8}, **_parity())
    straight = rl_flow(_config(local_credentials, store, "straight", **kw))

    with run_callbacks(_CrashAfter(3)), pytest.raises(_Interrupt):
        rl_flow(_config(local_credentials, store, "resumed", **kw))
    resumed = rl_flow(_config(local_credentials, store, "resumed", **kw))
    assert resumed["steps"] == 4 and resumed["steps_this_invocation"] == 2  # steps 2 and 3 again

    dup = _sql(capsys, store, "SELECT run_id, step, name, count(*) n FROM metrics GROUP BY ALL HAVING n > 1")
    assert dup == []
    vals = _sql(capsys, store, "SELECT run_id, step, name, value FROM metrics WHERE name IN "
                "('env/reward_mean', 'train/loss_sum', 'train/entropy') ORDER BY run_id, name, step")
    by = {(r["run_id"], r["name"], r["step"]): r["value"] for r in vals}
    keys = [(n, s) for n in ("env/reward_mean", "train/loss_sum", "train/entropy") for s in range(4)]
    assert all(("resumed", n, s) in by for n, s in keys)
    # Same sampled tokens, so the same rewards; the loss and entropy agree to fp32 noise only:
    # concurrent sample requests are batched as they arrive (logprobs differ ~1e-6 with the batch's
    # padding), and Adam turns such noise in near-zero gradients into steps (kept small by eps above).
    for name, tol in (("env/reward_mean", 1e-6), ("train/entropy", 2e-3), ("train/loss_sum", 2e-3)):
        assert [by[("resumed", name, s)] for s in range(4)] == pytest.approx(
            [by[("straight", name, s)] for s in range(4)], abs=tol), name
    assert straight["rewards"] == pytest.approx(_rewards(by, "straight"))
    n_traj = _sql(capsys, store, "SELECT count(*) n FROM trajectories WHERE run_id='resumed'")[0]["n"]
    assert n_traj == 4 * 3  # log_trajectories rows per step, no duplicates
    # the resumed step's rollouts came from the cache
    assert cached_task_runs("rollout-b2-g", like=True, at_least=2) >= 2


def _rewards(by, run):
    return [by[(run, "env/reward_mean", s)] for s in range(4)]


@pytest.mark.parametrize("schedule, extra", [
    ("streaming", dict(loss_fn="ppo", num_minibatches=2, groups_per_batch=4, kl_penalty_coef=0.1)),
    ("async", dict(loss_fn="cispo", max_steps_off_policy=1, groups_per_batch=2, num_substeps=2)),
    ("async", dict(loss_fn="ppo", max_steps_off_policy=1, groups_per_batch=4, num_minibatches=2)),
])
def test_streaming_and_async_schedules_with_failing_rollouts(prefect_api, local_credentials, tmp_path, capsys,
                                                             schedule, extra):
    store = tmp_path / "store"
    cfg = _config(
        local_credentials, store, f"sched-{schedule}", schedule=schedule, group_size=3, **_parity(True), **extra
    )
    summary = rl_flow(cfg)
    assert summary["optimizer_steps"] == 2 * cfg.num_substeps
    rows = _sql(capsys, store, f"SELECT step, name, value FROM metrics WHERE run_id='sched-{schedule}'")
    if cfg.num_minibatches:  # each step: the whole batch, over the minibatches' passes
        by = {(r["name"], r["step"]): r["value"] for r in rows}
        for st in (0, 1):
            assert by[("env/groups", st)] == cfg.groups_per_batch
            n, datums = by[("env/trajectories", st)], by[("train/datums", st)]
            assert 0 < datums <= n and (datums == n or by[("rollout/groups_constant", st)] > 0)
    names = {r["name"] for r in rows}
    assert REQUIRED <= names
    errors = [r["value"] for r in rows if r["name"] == "rollout/errors"]
    assert len(errors) == 2 and sum(errors) >= 2  # member 0 of group 0 fails in every batch
    if schedule == "streaming":
        assert all(e >= 1 for e in errors)  # (async may collect both batches' groups in its first step)
    if schedule == "async":
        steps = [0, cfg.num_substeps]
        assert "rollout/staleness_mean" in names and sorted({r["step"] for r in rows}) == steps
    else:
        assert "train/kl_policy_ref" in names


class _RecordingSchedule(Sync):
    """A plugin's schedule: the sync schedule, recording how many groups each update trains on."""

    seen: list[int] = []

    def train(self, groups):
        self.seen.append(len(groups))
        return super().train(groups)

    @classmethod
    def check_config(cls, config):
        if config.group_size < 3:
            raise ValueError(f"recording needs group_size >= 3, got {config.group_size}")


def test_a_registered_schedule_runs_the_rl_flow(prefect_api, local_credentials, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(SCHEDULES, "recording", _RecordingSchedule)
    monkeypatch.setattr(_RecordingSchedule, "seen", [])
    with pytest.raises(ValueError, match="recording needs group_size >= 3"):  # its own check, before anything runs
        RLConfig(schedule="recording", group_size=2)
    with pytest.raises(ValueError, match="needs an off-policy schedule"):
        RLConfig(schedule="recording", group_size=3, sampler_kind="inflight")
    with pytest.raises(ValueError, match=r"unknown RL schedule 'nope'; registered: .*async.*recording.*sync"):
        RLConfig(schedule="nope")
    store = tmp_path / "store"
    cfg = _config(local_credentials, store, "plugin-sched", schedule="recording", group_size=3, **_parity())
    summary = rl_flow(cfg)
    assert summary["steps"] == 2
    assert _RecordingSchedule.seen == [2, 2]  # groups_per_batch groups trained per step
    rows = _sql(capsys, store, "SELECT DISTINCT step, name FROM metrics WHERE run_id='plugin-sched'")
    assert REQUIRED <= {r["name"] for r in rows} and sorted({r["step"] for r in rows}) == [0, 1]


def test_config_validation_and_cli_registration():
    with pytest.raises(ValueError, match="clip_low_threshold"):
        RLConfig(clip_low_threshold=1.3)
    with pytest.raises(ValueError, match="streaming needs"):
        RLConfig(schedule="streaming", groups_per_batch=2, num_minibatches=4)
    with pytest.raises(ValueError, match="needs dataset"):
        RLConfig(env="math")
    with pytest.raises(ValueError, match="min_group_size"):
        RLConfig(group_size=2, rollout={"min_group_size": 3})
    cfg = RLConfig(loss_fn="ppo", clip_low_threshold=0.7)
    assert cfg.loss_fn_config() == {"clip_low_threshold": 0.7, "clip_high_threshold": 1.2}
    assert RLConfig().loss_fn_config() is None and RLConfig().run_name.startswith("rl-arithmetic-tiny-")
    from prefect_tinker.flows.registry import RECIPES

    assert RECIPES["rl"].load_flow() is rl_flow and RECIPES["rl"].entrypoint == "prefect_tinker.flows.rl.rl_flow"


class _ConstantDataset(ParityDataset):
    """Every reply gets reward 0: no group carries a learning signal."""

    def get_batch(self, index):
        return [_ConstantBuilder(b.prompt, b.group_size) for b in super().get_batch(index)]


class _ConstantEnv(ParityEnv):
    def step(self, action):
        return StepResult(reward=0.0, episode_done=True, metrics={"correct": 0.0, "format": 0.0})


@dataclass(frozen=True)
class _ConstantBuilder(ParityBuilder):
    def make_envs(self):
        return [_ConstantEnv(list(self.prompt), False) for _ in range(self.group_size)]


@register_env
class _Constant(Environment):
    name = "constant"
    description = "test: every reply gets reward 0"

    @classmethod
    def build(cls, spec, ctx):
        return _ConstantDataset(ctx.group_size, ctx.groups_per_batch, False)


def test_constant_rewards_are_counted_and_warned(prefect_api, local_credentials, tmp_path, capsys, caplog):
    store = tmp_path / "store"
    with caplog.at_level("WARNING"):
        rl_flow(_config(local_credentials, store, "flat", env="constant", max_steps=1, group_size=3,
                        groups_per_batch=2, save_every=0))
    rows = _sql(capsys, store, "SELECT name, value FROM metrics WHERE run_id='flat' AND name IN "
                "('rollout/groups_constant', 'train/grad_norm', 'env/reward_mean')")
    got = {r["name"]: r["value"] for r in rows}
    assert got["rollout/groups_constant"] == 2 and got["env/reward_mean"] == 0.0
    assert got["train/grad_norm"] == pytest.approx(0.0, abs=1e-12)  # zero advantages: no gradient
    assert "no learning signal: all 2 groups got constant rewards" in caplog.text
