"""Same config, same requests: tinker-cookbook 0.6.1's SFT and DPO loops against ours, on ``tiny``.

A short version of ``benchmarks/cookbook_parity.py`` (which runs 20 steps, SmolLM2 and RL): one
in-process ``tinker_local`` server (fp32, every request recorded, content-seeded sampling, LoRA seed
0); the cookbook's own entry point runs in a child process (its own session), our flow in this
process (another session); then the two sessions' requests are compared datum by datum and field by
field, and the final adapters tensor by tensor.  A later change to our data pipeline, loss
weights, data order, learning-rate schedule or Adam settings that drifts from the cookbook fails
here, naming the first differing request.

Needs the cookbook in ``.cookbook/`` (``scripts/setup.sh`` installs it); skips without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.parity import API_KEY
from benchmarks.parity.compare import Comparison, compare, table
from benchmarks.parity.dpo import COOKBOOK_DPO, dpo_data
from benchmarks.parity.recipe import any_sample, prompt_logprobs
from benchmarks.parity.requests import training_stream
from benchmarks.parity.rl import COOKBOOK_RL
from benchmarks.parity.running import cookbook_command
from benchmarks.parity.sft import COOKBOOK_SFT
from tests import inproc_server
from tests.recorded_requests import mark, since

ROOT = Path(__file__).resolve().parents[1]
COOKBOOK = ROOT / ".cookbook"
DATA = ROOT / "prefect_tinker" / "recipes" / "data"


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Green, or red."},
    ],
    # text a renderer might treat specially: a role marker and a special-token string inside content
    [{"role": "user", "content": "Say\n\nUser: hi <|im_end|>"}, {"role": "assistant", "content": "hi\n\nthere"}],
]


def _tokenizers() -> list:
    from transformers import AutoTokenizer

    from tinker_local.tokenizer import save_tiny_tokenizer

    out = []
    tiny = ROOT / ".tinker-local" / "parity-tiny-tokenizer"
    if not (tiny / "tokenizer.json").is_file():
        save_tiny_tokenizer(tiny)
    out.append(AutoTokenizer.from_pretrained(str(tiny)))
    smol = ROOT.parent / "shared" / "data" / "tokenizer" / "smollm2"
    if (smol / "tokenizer.json").is_file():  # SmolLM2's: a bos_token its tokenizer never adds itself
        out.append(AutoTokenizer.from_pretrained(str(smol)))
    return out


def test_role_colon_cookbook_renders_as_the_cookbook():
    """``role_colon_cookbook`` against tinker-cookbook 0.6.1's ``RoleColonRenderer``: the same tokens and
    weights for every ``train_on_what``, the same generation prompt, the same parsed reply."""
    if not (COOKBOOK / "tinker_cookbook").is_dir():
        pytest.skip("tinker-cookbook 0.6.1 is not installed in .cookbook/ (scripts/setup.sh installs it)")
    sys.path.insert(0, str(COOKBOOK))
    try:
        from tinker_cookbook.renderers import TrainOnWhat, get_renderer as cookbook_renderer
    finally:
        sys.path.remove(str(COOKBOOK))
    from prefect_tinker.recipes.renderers import get_renderer

    for tok in _tokenizers():
        theirs, ours = cookbook_renderer("role_colon", tok), get_renderer("role_colon_cookbook", tok)
        for conv in CONVERSATIONS:
            # (all_messages differs on purpose: ours trains the role headers too, docs/cookbook-parity.md)
            for mode in ("all_assistant_messages", "last_assistant_message", "last_assistant_turn", "all_tokens"):
                mi, w = theirs.build_supervised_example(conv, train_on_what=TrainOnWhat(mode))
                our_mi, our_w = ours.build_supervised_example(conv, train_on_what=mode)
                assert our_mi.to_ints() == mi.to_ints(), (tok.name_or_path, conv, mode)
                # the first position is never a target (all_tokens: the cookbook gives its BOS weight 0, we 1)
                assert np.asarray(our_w)[1:].tolist() == w[1:].tolist(), (tok.name_or_path, conv, mode)
            prompt = conv[:-1]
            assert ours.build_generation_prompt(prompt).to_ints() == theirs.build_generation_prompt(prompt).to_ints()
            reply = tok.encode(" " + conv[-1]["content"] + "\n\nUser:", add_special_tokens=False)
            msg, term = theirs.parse_response(reply)
            parsed = ours.parse_response(reply)
            assert parsed.message["content"] == msg["content"] and term.name == "STOP_SEQUENCE" and parsed.ok


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not (COOKBOOK / "tinker_cookbook").is_dir():
        pytest.skip("tinker-cookbook 0.6.1 is not installed in .cookbook/ (scripts/setup.sh installs it)")
    root = tmp_path_factory.mktemp("cookbook-parity")
    srv = inproc_server.start(
        root / "server", ["tiny"], record_requests=root / "requests", content_seeds=True, default_lora_seed=0
    )
    srv.requests = root / "requests"  # type: ignore[attr-defined]
    srv.tokenizer_dir = srv.service.engine.load_base_model("tiny")["tokenizer_id"]  # type: ignore[attr-defined]
    yield srv
    from tinker_blocks.credentials import close_clients

    close_clients(srv.base_url)  # our flows' cached client: its heartbeat must not outlive the server
    srv.stop()


def _cookbook(server, tmp_path: Path, code: str, args: dict) -> list[dict]:
    marked = mark(server.requests)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")}
    env.update(TINKER_BASE_URL=server.base_url, TINKER_API_KEY=API_KEY, PYTHONPATH=str(COOKBOOK))
    env["WANDB_MODE"] = "disabled"
    a = {"model": "tiny", "tokenizer_dir": server.tokenizer_dir, "log": str(tmp_path / "cookbook"), **args}
    out = subprocess.run(cookbook_command(code, a), env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return since(server.requests, marked)


def _ours(server, monkeypatch, flow, config) -> list[dict]:
    marked = mark(server.requests)
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    flow(config=config)
    return since(server.requests, marked)


def _assert_identical(
    recipe: str, cb: list[dict], ours: list[dict], steps: int, rtol: float = 1e-6, samples=None
) -> Comparison:
    cmp = compare(recipe, "tiny", cb, ours, rtol, samples)
    assert cmp.steps == steps and cmp.requests == 2 * steps, table(cmp, 1e-6)
    assert cmp.first is None, table(cmp, rtol)
    assert cmp.max_loss_rel <= rtol and cmp.max_weight_abs is not None and cmp.max_weight_abs <= rtol, table(
        cmp, rtol
    )
    return cmp


@pytest.mark.slow  # whole flows on both sides (~20-30 s each): the file goes first
def test_sft_sends_what_the_cookbook_sends(server, tmp_path, monkeypatch, prefect_api):
    from prefect_tinker.flows.sft import SFTConfig, sft_flow

    data = tmp_path / "chat.jsonl"
    data.write_text((DATA / "example_chat.jsonl").read_text())
    steps, batch = 3, 4
    cb = _cookbook(
        server,
        tmp_path,
        COOKBOOK_SFT,
        {"data": str(data), "renderer": "role_colon", "max_length": 64, "batch_size": batch, "test_size": 2,
         "seed": 0, "lr": 1e-3, "lora_rank": 4, "steps": steps, "num_epochs": 1},
    )  # fmt: skip
    config = SFTConfig(
        model="tiny", dataset=str(data), renderer="role_colon_cookbook", max_length=64, batch_size=batch, test_size=2,
        seed=0, learning_rate=1e-3, lr_schedule="linear", lora_rank=4, max_steps=steps, reduction="mean",
        data_order="cookbook", on_too_long="truncate_keep", adam={"eps": 1e-8}, eval_every=0, save_every=0,
        num_eval_samples=0, backend={"base_url": server.base_url}, store=str(tmp_path / "store"), run_name="parity-sft",
    )  # fmt: skip
    cmp = _assert_identical("sft", cb, _ours(server, monkeypatch, sft_flow, config), steps)
    # max_length 64 truncates: some datums carry only zero weights, on both sides
    assert any(a == b and a > 0 for a, b in cmp.losses)


@pytest.mark.slow  # whole flows on both sides (~20-30 s each): the file goes first
def test_dpo_sends_what_the_cookbook_sends(server, tmp_path, monkeypatch, prefect_api):
    from prefect_tinker.flows.dpo import DPOConfig, dpo_flow

    steps, batch = 2, 4
    args = type("A", (), {"dataset": str(DATA / "example_prefs.jsonl"), "steps": steps, "batch_size": batch})()
    cb_file, ours_file, n = dpo_data(args, tmp_path)  # the same pairs in both forms
    assert n == steps * batch
    cb = _cookbook(
        server,
        tmp_path,
        COOKBOOK_DPO,
        {"data": str(cb_file), "renderer": "role_colon", "max_length": 128, "batch_size": batch, "lr": 1e-3,
         "beta": 0.1, "lora_rank": 4, "steps": steps, "num_epochs": 1},
    )  # fmt: skip
    config = DPOConfig(
        model="tiny", dataset=str(ours_file), format="preference", renderer="role_colon_cookbook", max_length=128,
        batch_size=batch, test_size=0, seed=0, learning_rate=1e-3, lr_schedule="linear", lora_rank=4, max_steps=steps,
        beta=0.1, reference_via="sampler", data_order="cookbook", adam={"eps": 1e-8}, eval_every=0, save_every=0,
        backend={"base_url": server.base_url}, store=str(tmp_path / "store"), run_name="parity-dpo",
    )  # fmt: skip
    cmp = _assert_identical("dpo", cb, _ours(server, monkeypatch, dpo_flow, config), steps, samples=prompt_logprobs)
    assert cmp.sequences == 2 * steps * batch  # the reference: one compute_logprobs per chosen and rejected reply


@pytest.mark.slow  # whole flows on both sides (~20-30 s each): the file goes first
def test_sync_rl_sends_what_the_cookbook_sends(server, tmp_path, monkeypatch, prefect_api):
    """``rl.train`` on the cookbook's arithmetic environment against ``prefect-tinker run rl``, with the KL
    penalty on: the untrained ``tiny`` model never earns a varying reward, so the KL term is what makes the
    advantages (and the updates) non-zero; every sample request, sampled sequence, advantage and Adam step
    must be the same, and the weights after the last step bit-equal."""
    from prefect_tinker.flows.rl import RLConfig, rl_flow

    steps, groups, group_size, kl = 2, 2, 2, 0.05
    cb = _cookbook(
        server,
        tmp_path,
        COOKBOOK_RL,
        {"groups": groups, "group_size": group_size, "max_tokens": 6, "steps": steps, "lr": 1e-3, "lora_rank": 4,
         "renderer": "role_colon", "kl": kl, "streaming": False, "minibatches": 1, "data": None, "async_loss": None},
    )  # fmt: skip
    config = RLConfig(
        model="tiny", env="arithmetic", few_shot=True, renderer="role_colon_cookbook", group_size=group_size,
        groups_per_batch=groups, max_tokens=6, learning_rate=1e-3, lr_schedule="constant", lora_rank=4,
        max_steps=steps, seed=0, loss_fn="importance_sampling", temperature=1.0, save_every=0, eval_every=0,
        kl_penalty_coef=kl, kl_reference="base:tiny",
        env_options={"max_operand": 100, "problems": "cookbook", "answer": "last_integer"}, format_needs_stop=True,
        remove_constant_reward_groups=False, adam={"eps": 1e-8}, log_trajectories=0,
        backend={"base_url": server.base_url}, store=str(tmp_path / "store"), run_name="parity-rl",
    )  # fmt: skip
    ours = _ours(server, monkeypatch, rl_flow, config)
    cmp = _assert_identical("rl", cb, ours, steps, samples=any_sample)
    # rollouts (steps x groups x group_size) and the KL reference's logprobs of each of them
    assert cmp.sequences == 2 * steps * groups * group_size
    advantages = [
        x for e in training_stream(cb) if e["op"] == "forward_backward" for d in e["datums"]
        for x in d["loss_fn_inputs"]["advantages"]["data"]
    ]  # fmt: skip
    assert any(a != 0 for a in advantages)  # the comparison covers real advantages and updates
