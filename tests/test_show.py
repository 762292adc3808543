"""``prefect-tinker show-example``: rendered examples with the trained tokens highlighted."""

from __future__ import annotations

import json

from prefect_tinker.cli.show import format_example
from tests.data_files import smollm2_tokenizer_dir
from tests.renderer_tokenizers import needs_smollm2


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_format_example_brackets_and_colour():
    tokens = [ord(c) for c in "Q: hi A: yo!"]
    weights = [0.0] * 9 + [1.0] * 3
    assert format_example(CharTokenizer(), tokens, weights, color=False) == "Q: hi A: [[yo!]]"
    assert format_example(CharTokenizer(), tokens, weights, color=True) == "Q: hi A: \x1b[1;32myo!\x1b[0m"


@needs_smollm2
def test_show_example_command(tmp_path, capsys):
    from prefect_tinker.cli.main import main

    data = tmp_path / "d.jsonl"
    rows = [{"instruction": f"Say {w}", "output": w} for w in ("one", "two", "three")]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["show-example", str(data), "--format", "alpaca", "--tokenizer", str(smollm2_tokenizer_dir()),
            "--renderer", "smollm2"]
    assert main([*args, "--index", "1", "--count", "2"]) == 0
    out = capsys.readouterr().out
    assert f"== {data}:2 (field 'instruction+output') | renderer smollm2 | all_assistant_messages" in out
    assert "<|im_start|>user\nSay two<|im_end|>\n<|im_start|>assistant\n[[two<|im_end|>]]\n" in out
    assert "[[three<|im_end|>]]" in out and "[[one" not in out
    assert "\x1b[" not in out  # not a terminal: brackets, no colour
    assert main([*args, "--color", "always", "--max-length", "30", "--train-on-what", "all_tokens"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[1;32m" in out and "-- 30 tokens, 30 trained (100.0%), cut from" in out
    assert main([*args, "--field", "output=answer"]) == 2
    assert f"{data}:1: field 'answer' is missing (record has: instruction, output)" in capsys.readouterr().err


@needs_smollm2
def test_show_example_content_is_text_unless_told(tmp_path, capsys):
    import re

    from prefect_tinker.cli.main import main

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "Say <|im_end|> now", "output": "ok"}) + "\n")
    args = [
        "show-example",
        str(data),
        "--format",
        "alpaca",
        "--tokenizer",
        str(smollm2_tokenizer_dir()),
        "--renderer",
        "smollm2",
        "--ids",
    ]
    im_end = re.compile(r"^\s*\d+\s+2\s", re.M)  # id listing rows of token 2 (<|im_end|>)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Say <|im_end|> now<|im_end|>" in out and len(im_end.findall(out)) == 3  # system, user, assistant ends
    assert main([*args, "--special-tokens-in-content"]) == 0
    assert len(im_end.findall(capsys.readouterr().out)) == 4  # the text in the message became the control token
