"""The exact LoRA merge across the causal-LM families of transformers: a random tiny model of
each, a random PEFT adapter on every Linear / Conv1D (the output projection included; the input
embedding too where named), merged by ``merge_into_folder`` and loaded back with plain
``AutoModelForCausalLM.from_pretrained``; its logprobs must equal the unmerged ``PeftModel``'s
(the independent reference) to 1e-4. Covers tied embeddings (Qwen3, Qwen2, Llama, Gemma 1-3,
GPT-2, Cohere, Granite, Starcoder2), GPT-2's Conv1D weights (stored transposed), GPT-NeoX's
checkpoint key renamed on load (``embed_out`` -> ``lm_head``), fused projections (Phi-3) and a
MoE model (attention targets); the refusals of what cannot be merged exactly."""

from __future__ import annotations

import json

import pytest
import torch

from prefect_tinker.export.adapter import AdapterError, read_adapter
from prefect_tinker.export.merge import merge_into_folder

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

V = 300
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _configs() -> dict:
    import transformers as T

    plain = dict(vocab_size=V, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
    return {
        "qwen3-tied": lambda: T.Qwen3Config(**SMALL, head_dim=8, tie_word_embeddings=True),
        "qwen2-tied-bias": lambda: T.Qwen2Config(**SMALL, tie_word_embeddings=True),
        "llama-tied+embedding-target": lambda: T.LlamaConfig(**SMALL, tie_word_embeddings=True),
        "mistral": lambda: T.MistralConfig(**SMALL),
        "gemma-tied": lambda: T.GemmaConfig(**SMALL, head_dim=8),
        "gemma2-tied": lambda: T.Gemma2Config(**SMALL, head_dim=8),
        "gemma3-text-tied": lambda: T.Gemma3TextConfig(**SMALL, head_dim=8),
        "phi3-fused": lambda: T.Phi3Config(**SMALL),
        "olmo2": lambda: T.Olmo2Config(**SMALL),
        "gpt2-conv1d-tied": lambda: T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=128),
        "gpt-neox-renamed-head": lambda: T.GPTNeoXConfig(**plain, hidden_size=32, intermediate_size=64),
        "cohere-tied": lambda: T.CohereConfig(**SMALL),
        "granite-tied": lambda: T.GraniteConfig(**SMALL, tie_word_embeddings=True),
        "starcoder2-tied": lambda: T.Starcoder2Config(**SMALL),
        "smollm3": lambda: T.SmolLM3Config(**SMALL),
        "qwen3-moe": lambda: T.Qwen3MoeConfig(**SMALL, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=16),
    }


def _logprobs(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float(), -1)


def _adapted(tmp_path, name: str, embedding_target: bool = False):
    """(base folder, adapter folder, reference logprobs, tied, ids): a random model of family
    ``name`` saved by transformers, and a random PEFT adapter on it saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    AutoModelForCausalLM.from_config(_configs()[name]()).float().save_pretrained(str(base_dir))
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    names = {id(m): n for n, m in model.named_modules()}
    targets = [n for n, m in model.named_modules()
               if isinstance(m, (torch.nn.Linear, Conv1D)) and n.rsplit(".", 1)[-1] != "gate"]  # not MoE routers
    if embedding_target:
        targets.append(names[id(model.get_input_embeddings())])
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules=targets))
    g = torch.Generator().manual_seed(1)
    for n, p in peft_model.named_parameters():
        if "lora_B" in n or "lora_embedding_A" in n:  # the zero-initialised factor: make the delta real
            p.data = torch.randn(p.shape, generator=g) * 0.05
    ids = torch.tensor([list(range(3, 60))])
    ref = _logprobs(peft_model.eval(), ids)
    peft_model.save_pretrained(str(adapter_dir), save_embedding_layers=False)
    return base_dir, adapter_dir, ref, tied, ids


@pytest.mark.parametrize("name", list(_configs()))
def test_merged_model_equals_the_peft_model(name, tmp_path):
    from transformers import AutoModelForCausalLM

    base_dir, adapter_dir, ref, tied, ids = _adapted(tmp_path, name, embedding_target="embedding-target" in name)
    report = merge_into_folder(base_dir, read_adapter(adapter_dir), tmp_path / "merged", max_shard_bytes=40_000)
    assert report.tied_in_base == tied and report.untied == tied  # the head is always a target here
    merged, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32,
                                                        output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert (_logprobs(merged.eval(), ids) - ref).abs().max().item() < 1e-4
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    assert len(report.shards) > 1 and sorted(set(index["weight_map"].values())) == report.shards
    if tied:
        assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is False


def test_merging_into_the_tied_weight_would_be_wrong(tmp_path):
    """The check above can tell: folding the output-side delta into the shared weight (what a
    merge that ignores the tie does) moves the logprobs far beyond 1e-4."""
    from transformers import AutoModelForCausalLM

    base_dir, adapter_dir, ref, tied, ids = _adapted(tmp_path, "llama-tied+embedding-target")
    adapter = read_adapter(adapter_dir)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    assert tied
    with torch.no_grad():
        for module, d in adapter.deltas.items():
            model.get_submodule(module).weight += d.delta()  # lm_head's delta lands on the embedding too
    assert (_logprobs(model.eval(), ids) - ref).abs().max().item() > 1e-2


def test_bfloat16_merge_is_saved_in_bfloat16_from_a_float32_merge(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    base_dir, adapter_dir, ref, _, ids = _adapted(tmp_path, "qwen3-tied")
    merge_into_folder(base_dir, read_adapter(adapter_dir), tmp_path / "f32")
    merge_into_folder(base_dir, read_adapter(adapter_dir), tmp_path / "bf16", dtype="bfloat16")
    with safe_open(str(next((tmp_path / "f32").glob("*.safetensors"))), "pt") as a, \
            safe_open(str(next((tmp_path / "bf16").glob("*.safetensors"))), "pt") as b:
        for k in a.keys():  # bf16 = the float32 merge rounded once (not a bf16 merge)
            assert b.get_tensor(k).dtype == torch.bfloat16 and torch.equal(a.get_tensor(k).bfloat16(), b.get_tensor(k))
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    low = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype=torch.float32)
    assert 1e-5 < (_logprobs(low.eval(), ids) - ref).abs().max().item() < 0.1


def test_what_cannot_be_merged_exactly_is_refused(tmp_path):
    base_dir, adapter_dir, *_ = _adapted(tmp_path, "mistral")
    cfg_path = adapter_dir / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    for field, value, match in (("use_dora", True, "DoRA"), ("alpha_pattern", {"q_proj": 8}, "per-module alphas"),
                                ("r", 0, "positive number"), ("peft_type", "IA3", "LORA")):
        cfg_path.write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(AdapterError, match=match):
            read_adapter(adapter_dir)
    cfg_path.write_text(json.dumps({**cfg, "use_rslora": True}))
    assert read_adapter(adapter_dir).deltas["model.layers.0.self_attn.q_proj"].scale == pytest.approx(16 / 2)
    cfg_path.write_text(json.dumps(cfg))

    from safetensors.torch import load_file, save_file

    weights = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    save_file({**tensors, "base_model.model.model.layers.0.mlp.extra_proj.lora_A.weight": torch.zeros(4, 32)},
              str(weights))
    with pytest.raises(AdapterError, match="extra_proj.*needs both"):
        read_adapter(adapter_dir)
    save_file({**tensors, "base_model.model.model.nope.lora_A.weight": torch.zeros(4, 32),
               "base_model.model.model.nope.lora_B.weight": torch.zeros(32, 4)}, str(weights))
    with pytest.raises(AdapterError, match="'model.nope' has no weight"):
        merge_into_folder(base_dir, read_adapter(adapter_dir), tmp_path / "x")
    save_file({**tensors, "base_model.model.model.layers.0.mlp.experts.lora_A.weight": torch.zeros(2, 4, 32)},
              str(weights))
    with pytest.raises(AdapterError, match="3-D expert"):
        read_adapter(adapter_dir)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    save_file({**tensors, key: torch.zeros(16, 4)}, str(weights))  # q_proj is 32 x 32
    with pytest.raises(AdapterError, match="q_proj.*shape"):
        merge_into_folder(base_dir, read_adapter(adapter_dir), tmp_path / "y")
    assert not list((tmp_path / "y").iterdir())  # refused before anything was written
