"""Services by key: a plugin registers a new service and an environment uses it through a real RL run.

The plugin here is the test module itself, as a third-party package would be: it defines a key
(``lookup``: answers from a table), registers a provider that loads the table from a JSON file, and
an environment whose rewards are the looked-up answers. The run stores its trajectories; their
rewards must be the table's values, which only the provider read.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from prefect_tinker.cli.main import main as cli_main
from prefect_tinker.flows.rl import rl_flow
from prefect_tinker.plugin import (
    JUDGE,
    SERVICES,
    Env,
    Environment,
    EnvGroupBuilder,
    MissingServiceError,
    RLDataset,
    RolloutContext,
    ServiceKey,
    ServiceResources,
    StepResult,
    register_env,
    register_service,
)
from tests.test_rl_flow import _config


class LookupTable:
    """The toy service: answers by question id, loaded from a JSON file by its provider."""

    def __init__(self, answers: dict[str, float]):
        self.answers = answers

    def questions(self) -> list[str]:
        return sorted(self.answers)

    def answer(self, question: str) -> float:
        return self.answers[question]


LOOKUP: ServiceKey[LookupTable] = ServiceKey("lookup", LookupTable, "answers from a table")


class _Provider:
    """``provider(resources) -> LookupTable``; counts how often it was asked to make one."""

    def __init__(self, path: Path):
        self.path, self.calls, self.lock = path, 0, threading.Lock()

    def __call__(self, resources: ServiceResources) -> LookupTable:
        with self.lock:
            self.calls += 1
        assert resources.credentials is None or resources.credentials.local_root  # the task's backend
        return LookupTable(json.loads(self.path.read_text()))


class LookupEnv(Env):
    def __init__(self, prompt: list[int], question: str, table: LookupTable):
        self.prompt, self.question, self.table = prompt, question, table

    def initial_observation(self):
        return self.prompt, []

    def step(self, action):
        return StepResult(reward=self.table.answer(self.question), episode_done=True,
                          logs={"question": self.question})


@dataclass(frozen=True)
class LookupBuilder(EnvGroupBuilder):
    prompt: tuple[int, ...]
    question: str
    group_size: int

    def make_envs(self):
        raise RuntimeError("lookup envs need the lookup service: make them with make_envs_in(ctx)")

    def make_envs_in(self, ctx: RolloutContext):
        table = ctx.service(LOOKUP)
        return [LookupEnv(list(self.prompt), self.question, table) for _ in range(self.group_size)]


class LookupDataset(RLDataset):
    def __init__(self, questions: list[str], group_size: int, groups_per_batch: int):
        self.questions, self.group_size, self.groups_per_batch = questions, group_size, groups_per_batch

    def get_batch(self, index):
        n = len(self.questions)
        return [LookupBuilder((1, 100 + index, 200 + g), self.questions[(index * self.groups_per_batch + g) % n],
                              self.group_size) for g in range(self.groups_per_batch)]


@register_env
class _Lookup(Environment):
    name = "lookup_test"
    description = "test: rewards are answers of the lookup service"

    @classmethod
    def build(cls, spec, ctx):
        # a build-time service: the questions come from the same table
        return LookupDataset(ctx.service(LOOKUP).questions(), ctx.group_size, ctx.groups_per_batch)


@pytest.fixture
def lookup_service(tmp_path):
    answers = {"q-a": 0.25, "q-b": -0.5, "q-c": 0.75}
    path = tmp_path / "answers.json"
    path.write_text(json.dumps(answers))
    provider = register_service(LOOKUP, _Provider(path))
    try:
        yield answers, provider
    finally:
        del SERVICES[LOOKUP.name]


def test_a_plugin_service_rewards_a_real_rl_run(prefect_api, local_credentials, tmp_path, capsys, lookup_service):
    answers, provider = lookup_service
    store = tmp_path / "store"
    rl_flow(_config(local_credentials, store, "lookup", env="lookup_test", max_steps=2, groups_per_batch=2,
                    log_trajectories=8, save_every=0))
    capsys.readouterr()
    assert cli_main(["sql", "--store", str(store), "--json",
                     "SELECT step, batch_index, group_index, reward FROM trajectories WHERE run_id='lookup' "
                     "ORDER BY step, group_index, member"]) in (0, None)
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 * 2 * 2  # steps x groups x members
    questions = sorted(answers)
    for r in rows:  # the question of (batch, group) as LookupDataset picks it, its answer as the service gave it
        q = questions[(r["batch_index"] * 2 + r["group_index"]) % len(questions)]
        assert r["reward"] == pytest.approx(answers[q])
    assert {r["reward"] for r in rows} == {0.25, -0.5, 0.75}
    # made lazily, once per process and resources: at build time (no credentials) and in the rollout tasks
    assert provider.calls == 2


def test_a_missing_service_names_the_key_and_the_registered_ones():
    ctx = RolloutContext(sample=lambda *a: ([], [], "stop"))
    with pytest.raises(MissingServiceError) as err:
        ctx.service(ServiceKey("nope", object, "a service nobody provides"))
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("no provider for service 'nope' (a service nobody provides); registered services: ")
    assert JUDGE.name in line and "prefect_tinker.services entry point group" in line


def test_a_built_in_service_outside_a_task_says_it_needs_credentials():
    ctx = RolloutContext(sample=lambda *a: ([], [], "stop"))
    with pytest.raises(RuntimeError, match="service 'judge' needs the backend credentials of a rollout task"):
        ctx.service(JUDGE)
