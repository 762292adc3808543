"""The prepare-dataset task (supervised builder) counts the conversations it drops (no trained
token within max_length), so the flow can say how many were skipped."""

from __future__ import annotations

import json

from prefect import flow

from prefect_tinker.recipes.builders import SupervisedBuilder
from prefect_tinker.recipes.data_reading import SourceSpec
from prefect_tinker.tasks.data import prepare_dataset
from tests.data_files import smollm2_tokenizer_dir
from tests.renderer_tokenizers import needs_smollm2


@needs_smollm2
def test_skipped_conversations_are_counted(prefect_api, tmp_path):
    long_user = "word " * 300  # the assistant turn starts past max_length tokens
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"},
                          {"role": "assistant", "content": f"Answer {i}."}]} for i in range(8)]
    rows += [{"messages": [{"role": "user", "content": long_user},
                           {"role": "assistant", "content": "Too late."}]} for _ in range(3)]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    @flow
    def prep():
        builder = SupervisedBuilder(sources=[SourceSpec(path=str(path))], renderer="role_colon", max_length=64,
                                    test_size=0, seed=0)
        return prepare_dataset(builder, str(smollm2_tokenizer_dir()))

    data = prep()
    assert (data.skipped, len(data.train) + len(data.test)) == (3, 8)
