"""kernelize on real transformers v5 models built from small configs."""

import pytest
import torch
import transformers

import kernelhub
from kernelhub.matching import match_layer

TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=64)


def tiny_model(kind: str) -> torch.nn.Module:
    if kind == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=48, **TINY)
        return transformers.LlamaForCausalLM(cfg)
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                          num_experts_per_tok=2, **TINY)
        return transformers.Qwen3MoeForCausalLM(cfg)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **TINY)
        return transformers.MixtralForCausalLM(cfg)
    if kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24,
                                          shared_expert_intermediate_size=40, num_experts=4,
                                          num_experts_per_tok=2, **TINY)
        return transformers.Qwen2MoeForCausalLM(cfg)
    if kind == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **TINY)
        return transformers.DeepseekV3ForCausalLM(cfg)
    if kind == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=24, num_experts=4, num_experts_per_tok=2, **TINY)
        return transformers.OlmoeForCausalLM(cfg)
    raise ValueError(kind)


# (model, number of *Experts modules, number of SiLU-gated MLPs incl. shared experts)
EXPECTED = {
    "llama": (0, 2),
    "qwen3_moe": (2, 0),
    "mixtral": (2, 0),
    "qwen2_moe": (2, 2),
    "deepseek_v3": (1, 2),
    "olmoe": (2, 0),
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_transformers_modules_are_matched_by_class(kind):
    model = tiny_model(kind)
    found = {"MoEExperts": 0, "SwiGLUMLP": 0}
    for module in model.modules():
        m = match_layer(module)
        if m is not None:
            assert m.unsupported_reason is None, (type(module).__name__, m.unsupported_reason)
            found[m.layer_name] += 1
    assert (found["MoEExperts"], found["SwiGLUMLP"]) == EXPECTED[kind]


def test_experts_implementation_kernelhub_is_registered():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert "kernelhub" in ALL_EXPERTS_FUNCTIONS
    cfg = transformers.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                      num_experts_per_tok=2, **TINY)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    model.set_experts_implementation("kernelhub")
    assert model.config._experts_implementation == "kernelhub"
    assert kernelhub.__name__ == "kernelhub"
