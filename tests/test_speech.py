"""Speech recognition on ``tiny-audio``: spoken digits and words synthesised here with espeak-ng,
SFT on (audio, transcript) pairs with WER evaluated, then RL on the ``speech`` env (reward
``max(-WER, -1)``) from the SFT checkpoint; plus the WER and DMel building blocks."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
import tinker

from prefect_tinker.cli.main import main as cli_main
from prefect_tinker.recipes.audio_features import DEFAULT_DMEL, dmel_features, tensor_container
from prefect_tinker.recipes.grading_text import word_error_rate
from tests.test_vlm_classifier import one_thread_server

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "yes", "no",
         "stop", "go", "up", "down"]


def speak_clips(folder, words=WORDS, variants=((160, 50), (200, 35))):
    """One WAV per (word, speed/pitch variant) by espeak-ng, and a JSONL of {audio, text} next to
    them (relative paths). Skips the test when espeak-ng is not installed."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (scripts/setup.sh installs it with apt as root)")
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for word in words:
        for k, (speed, pitch) in enumerate(variants):
            wav = folder / f"{word}-{k}.wav"
            subprocess.run(["espeak-ng", "-s", str(speed), "-p", str(pitch), "-w", str(wav), word], check=True,
                           capture_output=True, timeout=30)
            rows.append({"audio": wav.name, "text": word})
    jsonl = folder / "speech.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return jsonl


def test_word_error_rate():
    assert word_error_rate("seven", "Seven.") == 0.0
    assert word_error_rate("the cat sat", "the cat sat down") == 0.25  # one deletion
    assert word_error_rate("a b c d", "a x c") == pytest.approx(2 / 3)  # one substitution, one insertion
    assert word_error_rate("", "two words") == 1.0 and word_error_rate("", "") == 0.0
    assert word_error_rate("one two three four", "five") == 4.0  # insertions: not bounded by 1
    jiwer = pytest.importorskip("jiwer", reason="jiwer (optional cross-check) is not installed")
    rng = np.random.default_rng(0)
    for _ in range(50):
        ref = " ".join(rng.choice(WORDS, rng.integers(1, 6)))
        hyp = " ".join(rng.choice(WORDS, rng.integers(0, 6)))
        assert word_error_rate(hyp, ref) == pytest.approx(jiwer.wer(ref, hyp) if hyp else 1.0)


def test_dmel_features_and_container(tmp_path):
    from tinker_local.media import decode_tensor_container

    jsonl = speak_clips(tmp_path / "clips", words=["seven"], variants=((160, 50),))
    from prefect_tinker.recipes.media_inputs import load_wav

    x, rate, _ = load_wav(str(jsonl.parent / "seven-0.wav"), 16000)
    assert rate == 16000 and x.dtype == np.float32 and 0.05 < np.abs(x).max() <= 1.0
    feats = dmel_features(x)
    assert feats.shape == (1 + (x.size - 1) // DEFAULT_DMEL["hop_length"], 80) and feats.dtype == np.uint8
    assert feats.max() == 15 and feats.min() == 0  # the loudest cell is level 15, silence level 0
    blob = tensor_container(feats)
    np.testing.assert_array_equal(decode_tensor_container(blob, "test"), feats)  # what the server reads
    assert tinker.DmelChunk(dmel=blob).length == feats.shape[0]  # what the SDK counts


def _sql(capsys, store, query):
    capsys.readouterr()
    assert cli_main(["sql", "--store", str(store), "--json", query]) in (0, None)
    return json.loads(capsys.readouterr().out)


def test_speech_recognition_sft_then_rl(prefect_api, local_credentials, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PREFECT_TINKER_MEDIA", str(tmp_path / "media"))
    jsonl = speak_clips(tmp_path / "clips")
    store = tmp_path / "store"
    one_thread_server(local_credentials)
    common = [
        "model=tiny-audio",
        f"dataset={jsonl}",
        f"store={store}",
        f"backend.local_root={local_credentials.local_root}",
    ]
    capsys.readouterr()
    rc = cli_main(["run", "sft", *common, "format=audio_transcript", "max_steps=8", "batch_size=8",
                   "learning_rate=3e-3", "lora_rank=16", "test_size=4", "eval_every=0", "save_every=0",
                   "num_eval_samples=0", "run_name=asr-sft"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    sft = json.loads(out[out.index("{"):])
    assert sft["steps"] == 8 and sft["last_loss"] < sft["first_loss"]
    wer = _sql(
        capsys, store, "SELECT step, value FROM metrics WHERE run_id='asr-sft' AND name='test/wer' ORDER BY step"
    )
    assert [r["step"] for r in wer] == [0, 8] and all(r["value"] >= 0 for r in wer)
    (state,) = _sql(capsys, store, "SELECT path FROM checkpoints WHERE run_id='asr-sft' AND kind='state'")

    rc = cli_main(["run", "rl", *common, "env=speech", "max_steps=2", "group_size=4", "groups_per_batch=2",
                   "max_tokens=6", "learning_rate=1e-3", "lora_rank=16", "save_every=0",
                   f"load_checkpoint_path={state['path']}", "run_name=asr-rl"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    rl = json.loads(out[out.index("{"):])
    assert rl["steps"] == 2 and all(-1.0 <= r <= 0.0 for r in rl["rewards"])
    rows = _sql(capsys, store, "SELECT step, name, value FROM metrics WHERE run_id='asr-rl' AND name IN "
                               "('env/wer', 'env/reward_mean') ORDER BY step, name")
    by = {(r["step"], r["name"]): r["value"] for r in rows}
    for step in (0, 1):  # reward = max(-WER, -1) >= -WER per rollout, so on average too
        assert by[(step, "env/wer")] >= 0 and -1.0 <= by[(step, "env/reward_mean")] <= 0.0
        assert by[(step, "env/reward_mean")] >= -by[(step, "env/wer")] - 1e-9
    traj = _sql(capsys, store, "SELECT prompt, metrics_json FROM trajectories WHERE run_id='asr-rl' LIMIT 2")
    assert traj and "<|audio_pad|>" in traj[0]["prompt"] and "wer" in json.loads(traj[0]["metrics_json"])
