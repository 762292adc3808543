"""The ``tinker`` inspect-ai model provider: the real ``inspect eval`` command line in a subprocess and
``run_inspect_task`` in process, against the local server with the tiny model; outputs compared with
greedy completions sampled directly through the SDK and our renderer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("inspect_ai", reason="inspect-ai is not installed (extra 'inspect')")

from inspect_ai.log import list_eval_logs, read_eval_log  # noqa: E402

import tinker  # noqa: E402

from prefect_tinker.recipes.evals.sampler_tokenizer import sampler_tokenizer  # noqa: E402
from prefect_tinker.recipes.renderers import get_renderer  # noqa: E402

QUESTIONS = ["What is 2 + 2?", "Say hello to the world.", "Name a colour.", "Count to three."]
MISS = "zq-not-in-any-output-qz"


def _greedy(local_credentials, **model) -> list[str]:
    service = local_credentials.get_client()
    client = service.create_sampling_client(**model).result()
    renderer = get_renderer("chatml", sampler_tokenizer(service, client))
    out = []
    for q in QUESTIONS:
        prompt = renderer.build_generation_prompt([{"role": "user", "content": q}])
        params = tinker.SamplingParams(max_tokens=8, temperature=0.0, stop=renderer.get_stop_sequences())
        seq = client.sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences[0]
        out.append(renderer.parse_response(list(seq.tokens)).message["content"])
    return out


def _write_task(directory: Path, targets: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    samples = ", ".join(
        f"Sample(input={q!r}, target={t!r}, id={i})" for i, (q, t) in enumerate(zip(QUESTIONS, targets, strict=False))
    )
    path = directory / "tiny_task.py"
    path.write_text(
        "from inspect_ai import Task, task\n"
        "from inspect_ai.dataset import Sample\n"
        "from inspect_ai.scorer import includes\n"
        "from inspect_ai.solver import generate\n\n\n"
        "@task\n"
        "def tiny_includes():\n"
        f"    return Task(dataset=[{samples}], solver=[generate()], scorer=includes())\n")
    return path


def _targets(completions: list[str]) -> tuple[list[str], list[bool]]:
    targets = [completions[0][:5], completions[1][-4:], MISS, MISS]
    expected = [t.lower() in c.lower() for t, c in zip(targets, completions, strict=True)]  # includes() ignores case
    return targets, expected


def _check_log(log, completions: list[str], expected: list[bool]) -> None:
    assert log.status == "success", log.error
    samples = sorted(log.samples, key=lambda s: s.id)
    assert len(samples) == len(QUESTIONS) and log.results.completed_samples == len(QUESTIONS)
    assert [s.output.completion for s in samples] == completions
    values = [{"C": 1.0, "I": 0.0}[s.scores["includes"].value] for s in samples]
    assert values == [float(e) for e in expected]
    (score,) = log.results.scores
    assert score.metrics["accuracy"].value == pytest.approx(sum(values) / len(values))


def test_inspect_eval_command_line_against_the_local_server(local_credentials, tmp_path):
    completions = _greedy(local_credentials, base_model="tiny")
    targets, expected = _targets(completions)
    outside = tmp_path / "user-project"  # a task file outside this repository
    _write_task(outside, targets)
    logs = tmp_path / "logs"
    default_home = tmp_path / "default-home"  # where a provider built without -M args would start a server
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TINKER_TELEMETRY": "0",
           "INSPECT_LOG_DIR": str(logs), "PREFECT_TINKER_HOME": str(default_home)}
    cmd = [str(Path(sys.executable).parent / "inspect"), "eval", "tiny_task.py", "--model", "tinker/tiny",
           "-M", f"local_root={local_credentials.local_root}", "-M", "renderer=chatml", "--temperature", "0",
           "--max-tokens", "8", "--max-connections", "1", "--log-format", "json", "--display", "none"]
    proc = subprocess.run(cmd, cwd=outside, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # inspect also builds providers just to look up model info: those must not start servers
    assert not (default_home / "server.json").exists()
    (info,) = list_eval_logs(str(logs))
    log = read_eval_log(info)
    assert log.eval.model == "tinker/tiny"
    _check_log(log, completions, expected)
    assert {s.output.stop_reason for s in log.samples} <= {"stop", "max_tokens"}
    assert all(s.output.usage.output_tokens <= 8 for s in log.samples)


def test_run_inspect_task_on_a_sampler_checkpoint_of_a_server_by_url(local_credentials, tmp_path, monkeypatch):
    """A ``tinker://`` sampler path on a server named by ``base_url`` (the self-hosted path; the key
    from ``TINKER_API_KEY``), through ``run_inspect_task`` in this process."""
    from prefect_tinker.inspect_provider import run_inspect_task

    service = local_credentials.get_client()
    trainer = service.create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
    path = trainer.save_weights_for_sampler("inspect-probe").result().path
    assert path.startswith("tinker://")
    completions = _greedy(local_credentials, model_path=path)
    targets, expected = _targets(completions)
    task = _write_task(tmp_path / "elsewhere", targets)
    logs = tmp_path / "logs"
    monkeypatch.setenv("TINKER_API_KEY", "tml-inspect-test")
    base_url = local_credentials.base_url_for_sdk()
    scores = run_inspect_task(task, path, model_args={"base_url": base_url, "renderer": "chatml"},
                              log_dir=logs, temperature=0.0, max_tokens=8, max_connections=1, num_choices=2,
                              log_format="json")
    (info,) = list_eval_logs(str(logs))
    log = read_eval_log(info)
    _check_log(log, completions, expected)
    assert "tml-inspect-test" not in "".join(p.read_text() for p in logs.rglob("*.json"))  # no key in the log
    assert all(len(s.output.choices) == 2 for s in log.samples)  # num_choices -> num_samples
    assert scores["samples"] == len(QUESTIONS)
    assert scores["includes/accuracy"] == pytest.approx(sum(expected) / len(expected))
    assert json.loads(json.dumps(scores)) == scores  # plain floats, ready for eval_results rows


def test_stop_seqs_cut_the_reply_on_a_stop_token_renderer(local_credentials):
    import asyncio

    from inspect_ai.model import GenerateConfig, get_model

    (full,) = _greedy(local_credentials, base_model="tiny")[:1]
    assert len(full) >= 4
    stop = full[2:4]
    model = get_model("tinker/tiny", local_root=local_credentials.local_root, renderer="chatml")
    out = asyncio.run(
        model.generate(QUESTIONS[0], config=GenerateConfig(temperature=0.0, max_tokens=8, stop_seqs=[stop]))
    )
    assert out.completion == full[: full.find(stop)] and out.stop_reason == "stop"
