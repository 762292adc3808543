"""The ``forecasting`` environment: parsing, the Brier reward against a direct computation, bad
records named by file and line, and the example config run through ``prefect-tinker run`` on the
tiny model with its per-step Brier score in the store."""

from __future__ import annotations

import json

import pytest

from prefect_tinker.cli.main import main as cli_main
from prefect_tinker.recipes.rl.envs.forecasting import (
    forecast_reward, load_forecasts, parse_probability, parse_resolution,
)


def test_parse_probability_takes_the_last_statement_and_percentages():
    assert parse_probability("I think so.\nProbability: 0.8") == pytest.approx(0.8)
    assert parse_probability("probability = 35%") == pytest.approx(0.35)
    assert parse_probability("Probability: 0.2, no wait, Probability: .9") == pytest.approx(0.9)
    assert parse_probability("Probability: 1.5") == pytest.approx(1.5)  # kept as stated, clipped by the reward
    assert parse_probability("likely yes") is None
    # fractions, as SmolLM2 writes them ("Probability: 1/4" was read as 1 before)
    assert parse_probability("not greater than 20.\nProbability: 1/4<|im_end|>") == pytest.approx(0.25)
    assert parse_probability("Probability: 1 / 1.5 (") == pytest.approx(2 / 3)
    assert parse_probability("Probability: 3/0") is None


@pytest.mark.parametrize("prob, outcome, ended, reward, fmt", [
    (0.8, 1, True, -(0.2 ** 2), 1.0),
    (0.8, 0, True, -(0.8 ** 2), 1.0),
    (0.0, 0, True, 0.0, 1.0),
    (1.5, 1, True, -0.1, 0.0),       # clipped to 1 (Brier 0), pays the format penalty
    (-0.2, 1, True, -1.0 - 0.1, 0.0),  # clipped to 0 (Brier 1), pays the penalty
    (0.3, 0, False, -(0.3 ** 2) - 0.1, 0.0),  # cut off before the stop sequence
    (None, 1, True, -1.1, 0.0),      # no probability: the worst forecast and the penalty
])
def test_reward_is_negative_brier_with_clipped_format_penalty(prob, outcome, ended, reward, fmt):
    got, metrics = forecast_reward(prob, outcome, ended, 0.1)
    assert got == pytest.approx(reward)
    assert metrics["format"] == fmt
    assert -1.1 <= got <= 0.0


def test_resolutions_and_bad_records(tmp_path):
    assert [parse_resolution(v) for v in (True, "yes", 1, "0", "No", False)] == [1, 1, 1, 0, 0, 0]
    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "Will it rain?", "resolution": "yes"}\n'
                    '{"question": "Will it snow?", "resolution": "maybe"}\n')
    with pytest.raises(ValueError, match=r"q\.jsonl:2: field 'resolution'.*'maybe'"):
        load_forecasts(str(data))
    data.write_text('{"question": "Will it rain?", "outcome": false}\n')
    assert load_forecasts(str(data), resolution_field="outcome")[0].answer == "0"
    with pytest.raises(ValueError, match=r"q\.jsonl:1.*resolution.*missing"):
        load_forecasts(str(data))
    shipped = load_forecasts("builtin:forecasting_questions")
    assert len(shipped) == 40 and sum(int(p.answer) for p in shipped) == 20


def test_example_config_runs_on_tiny_and_sql_shows_brier(prefect_api, local_credentials, tmp_path, capsys):
    store = tmp_path / "store"
    rc = cli_main(["run", "rl", "--example", "forecasting", "max_steps=2", "group_size=2", "groups_per_batch=2",
                   "max_tokens=12", "save_every=0", "run_name=fc", f"store={store}", "lora_rank=8",
                   f"backend.local_root={local_credentials.local_root}"])
    assert rc in (0, None)
    capsys.readouterr()
    assert cli_main(
        [
            "sql",
            "--store",
            str(store),
            "--json",
            "SELECT step, name, value FROM metrics WHERE run_id='fc' AND name LIKE 'env/%' ORDER BY step",
        ]
    ) in (0, None)
    rows = json.loads(capsys.readouterr().out)
    by = {(r["step"], r["name"]): r["value"] for r in rows}
    for step in (0, 1):
        assert 0.0 <= by[(step, "env/brier")] <= 1.0
        assert -1.1 <= by[(step, "env/reward_mean")] <= 0.0
        assert (step, "env/format_rate") in by and (step, "env/correct_rate") in by
    capsys.readouterr()
    assert cli_main(["sql", "--store", str(store), "--json",
                     "SELECT response, reward, metrics_json FROM trajectories WHERE run_id='fc'"]) in (0, None)
    for t in json.loads(capsys.readouterr().out):  # each logged reward recomputed from its reply
        info = json.loads(t["metrics_json"])
        expected, _ = forecast_reward(parse_probability(t["response"]) if info["format"] else None,
                                      int(info["reference"]), True, 0.1)
        if info["format"]:
            assert t["reward"] == pytest.approx(expected)
        else:
            assert t["reward"] < 0.0
