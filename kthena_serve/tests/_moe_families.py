"""The MoE and MLA families' tiny checkpoints, as each family's transformers class draws and saves
them, for the parity tests (test_moe_models, test_mla_pd): transformers is imported on use."""

from __future__ import annotations

import json

import torch

BASE = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6)
FAMILIES = {
    # Mixtral: every layer sparse, 4 experts of width intermediate_size, top-2 renormalised
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2)),
    # Qwen3-MoE: q/k norms, explicit head_dim, layer 1 dense (mlp_only_layers), top-3 of 6
    # renormalised (norm_topk_prob)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48,
                       norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                       head_dim=32)),
    # DeepSeek-V2: MLA without a query LoRA, interleaved RoPE; layer 0 dense
    # (first_k_dense_replace), a shared expert; group-limited greedy top-2 of 8 experts in 4
    # groups, 2 of them allowed; routed weights times 2
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
                         topk_method="group_limited_greedy", routed_scaling_factor=2.0,
                         first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None,
                         qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24)),
    # DeepSeek-V3: MLA with a query LoRA; sigmoid scores with the correction bias, groups ranked
    # by their two best, renormalised, times 2.5
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
                         first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
                         qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24)),
}
SPARSE_LAYERS = {"mixtral": [0, 1, 2], "qwen3_moe": [0, 2], "deepseek_v2": [1, 2],
                 "deepseek_v3": [1, 2]}
PROMPTS = [[5, 17, 33, 2, 9, 40, 41, 42, 11, 3, 60, 61, 62, 63, 1, 7, 8, 9, 22, 23],
           [70, 71, 72], [5, 17, 33, 2, 9, 40, 41, 42, 11, 3, 60, 61, 62, 63, 1, 7, 8, 9, 90,
                          91, 92, 93]]
NEW_TOKENS = 12


def write_tokenizer(folder) -> None:
    """A byte-level tokenizer with no merges (256 byte tokens, 3 specials): enough for the
    engine and the server to load the folder; the tests feed token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))


def save_family(folder, family: str, **overrides):
    """transformers' model of ``family`` with random weights, saved with a tokenizer; returns it."""
    import transformers

    config_cls, model_cls, options = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**BASE, **options, **overrides})
    config._experts_implementation = "eager"  # its grouped_mm takes no float64 (the yardstick)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight") and param.dim() == 2:  # a router
                param.normal_(0.0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's, zero by default
                buffer.normal_(0.0, 0.5)
    model.eval().save_pretrained(folder)
    write_tokenizer(folder)
    return model


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                      min_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


