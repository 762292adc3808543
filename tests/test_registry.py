"""The one registry mechanism (prefect_tinker.recipes.registry): built-ins, entry points, overrides,
errors; and the registered RL losses and advantage estimators against independent computations."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from prefect_tinker.recipes.registry import PluginLoadError, Registry, UnknownComponentError


def _distribution(site, group: str, entries: dict[str, str], modules: dict[str, str]) -> None:
    """A minimal installed distribution in ``site``: modules and a dist-info with entry points."""
    for name, source in modules.items():
        (site / f"{name}.py").write_text(source)
    dist = site / "reg_test_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: reg-test-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))


def test_entry_points_builtins_and_overrides(tmp_path, monkeypatch):
    group = "prefect_tinker.test_registry_kind"
    reg: Registry[int] = Registry("widget", group, builtins=["reg_builtin_mod"])
    _distribution(tmp_path, group, {"seven": "reg_plugin_mod:SEVEN", "self_registering": "reg_self_mod"}, {
        "reg_builtin_mod": ("import reg_holder\nreg_holder.REG.register('one', 1)\n"
                            "reg_holder.REG.register('seven', 0)\n"),
        "reg_plugin_mod": "SEVEN = 7\n",
        "reg_self_mod": "import reg_holder\nreg_holder.REG.register('eight', 8)\n",
        "reg_holder": "",
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    import reg_holder

    reg_holder.REG = reg
    try:
        # built-ins first, then entry points (a plugin overrides a built-in), a bare module registers itself
        assert dict(reg) == {"one": 1, "seven": 7, "eight": 8} and reg.names() == ["eight", "one", "seven"]
        reg.register("one", 11)  # a later registration replaces
        assert reg.get_or_raise("one") == 11 and "eight" in reg and len(reg) == 3
        with pytest.raises(UnknownComponentError, match=r"unknown widget 'nine'; registered: eight, one, seven"):
            reg.get_or_raise("nine")
        with pytest.raises(ValueError, match="non-empty name"):
            reg.register("", 0)
    finally:
        for mod in ("reg_holder", "reg_builtin_mod", "reg_plugin_mod", "reg_self_mod"):
            sys.modules.pop(mod, None)


def test_broken_entry_point_fails_every_read_and_the_others_load(tmp_path, monkeypatch):
    """A plugin whose module does not import, listed before two good ones (one ``module:attr``,
    one self-registering module) in a real dist-info: the good ones load and resolve by name;
    every read the broken one may concern raises the same one line naming its entry point."""
    group = "prefect_tinker.test_registry_broken"
    reg: Registry[int] = Registry("widget", group)
    _distribution(tmp_path, group, {"bad": "reg_broken_mod:X", "good": "reg_good_mod:GOOD", "also": "reg_also_mod"}, {
        "reg_broken_mod": "import reg_no_such_dependency\nX = 1\n",
        "reg_good_mod": "GOOD = 5\n",
        "reg_also_mod": "import reg_holder2\nreg_holder2.REG.register('also', 6)\n",
        "reg_holder2": "",
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    import reg_holder2

    reg_holder2.REG = reg
    try:
        line = ("entry point bad = 'reg_broken_mod:X' of group " + group
                + " does not import: ModuleNotFoundError: No module named 'reg_no_such_dependency'")
        reads = [reg.names, lambda: list(reg), lambda: len(reg), lambda: reg.get_or_raise("bad"),
                 lambda: reg["bad"], lambda: "nine" in reg, lambda: reg.get_or_raise("nine")]
        for read in reads + reads:  # every read, not only the first
            with pytest.raises(PluginLoadError) as info:
                read()
            assert str(info.value) == line
            assert isinstance(info.value.__cause__, ModuleNotFoundError)
        # the entry points after the broken one loaded: their names resolve
        assert reg.get_or_raise("good") == 5 and reg["also"] == 6 and "good" in reg
        assert "broken=['bad']" in repr(reg)
    finally:
        for mod in ("reg_holder2", "reg_good_mod", "reg_also_mod", "reg_broken_mod"):
            sys.modules.pop(mod, None)


def test_every_kind_is_registered():
    from prefect_tinker.flows.registry import RECIPES
    from prefect_tinker.recipes.data_sources import CONVERTERS
    from prefect_tinker.recipes.evals.graders import GRADERS
    from prefect_tinker.recipes.renderers import RENDERERS
    from prefect_tinker.recipes.rl.advantages import ADVANTAGE_ESTIMATORS
    from prefect_tinker.recipes.rl.envs import ENVS
    from prefect_tinker.recipes.rl.losses import LOSSES

    assert {"sft", "rl", "dpo"} <= set(RECIPES) and {"arithmetic", "math", "tictactoe"} <= set(ENVS)
    assert {"messages", "preference", "calculator_solution", "prompt", "image_folder"} <= set(CONVERTERS)
    assert {"chatml", "qwen3", "llama3"} <= set(RENDERERS)
    assert set(GRADERS) == {"number", "math", "choice", "exact_match", "code"}
    assert set(LOSSES) == {"importance_sampling", "ppo", "cispo", "gspo", "dro", "stable_reinforce"}
    assert set(ADVANTAGE_ESTIMATORS) == {"group_mean", "leave_one_out"}


def test_losses_build_the_server_config():
    from prefect_tinker.flows.rl_config import RLConfig

    assert RLConfig(loss_fn="cispo", clip_low_threshold=0.5, clip_high_threshold=2.0).loss_fn_config() == {
        "clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    assert RLConfig().loss().loss_fn == "importance_sampling" and RLConfig().loss_fn_config() is None
    with pytest.raises(
        ValueError,
        match="unknown RL loss 'grpo'; registered: cispo, dro, gspo, importance_sampling, ppo, stable_reinforce",
    ):
        RLConfig(loss_fn="grpo")
    with pytest.raises(ValueError, match="loss 'ppo': loss_options.epsilon: Extra inputs are not permitted"):
        RLConfig(loss_fn="ppo", loss_options={"epsilon": 0.1})
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'"):
        RLConfig(advantage_estimator="gae")
    assert RLConfig(loss_fn="dro", loss_options={"beta": 0.1}).loss_fn_config() == {"beta": 0.1}
    assert RLConfig(loss_fn="gspo").loss_fn_config() == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    sr = RLConfig(loss_fn="stable_reinforce", loss_options={"kl_coeff": 0.01})
    assert sr.provenance and sr.loss_fn_config() == {"kl_coeff": 0.01} and not RLConfig().provenance


def test_leave_one_out_baseline_against_the_definition():
    from prefect_tinker.recipes.rl.advantages import LeaveOneOutBaseline, groups_to_datums
    from prefect_tinker.recipes.rl.types import Trajectory, TrajectoryGroup, Transition

    rewards = [1.0, 0.0, 0.5, 0.25]
    expected = [r - np.mean([x for j, x in enumerate(rewards) if j != i]) for i, r in enumerate(rewards)]
    assert LeaveOneOutBaseline()(rewards) == pytest.approx(expected, abs=1e-12)
    assert LeaveOneOutBaseline()([3.0]).tolist() == [0.0]
    traj = [Trajectory([Transition([1, 2], [3], [-0.5], r, True)]) for r in rewards]
    group = TrajectoryGroup(traj, [0.0] * 4, [{}] * 4)
    datums, (adv,) = groups_to_datums([group], estimator=LeaveOneOutBaseline())
    assert adv == pytest.approx(expected) and [float(d.advantages[-1]) for d in datums] == pytest.approx(expected)


def test_a_registry_pickles_by_reference_so_a_flow_function_reaches_ray_workers():
    # cloudpickle takes a flow function by value with the globals it reads (the RL flow reads SCHEDULES): each
    # registry goes as a reference to the one of its group, which the receiving process gets from its module
    import pickle
    import subprocess
    import sys

    import cloudpickle  # a Prefect dependency; Ray ships the same one

    from prefect_tinker.flows.rl import rl_flow
    from prefect_tinker.flows.rl_config import SCHEDULES

    assert pickle.loads(pickle.dumps(SCHEDULES)) is SCHEDULES
    cloudpickle.dumps(rl_flow.fn)  # raised "cannot pickle '_thread.RLock' object" before
    reader = "import pickle, sys; r = pickle.loads(sys.stdin.buffer.read()); print(r.group, sorted(r))"
    out = subprocess.run([sys.executable, "-c", reader], input=pickle.dumps(SCHEDULES), capture_output=True,
                         timeout=120, check=True)
    assert out.stdout.decode().split() == ["prefect_tinker.schedules", "['async',", "'streaming',", "'sync']"]
