"""The default checkpoint: GGUF -> HF folder conversion, config, tokenizer and chat template.

The tokenizer is checked against transformers' own GGUF tokenizer for the same file, and the chat
template against transformers' ``apply_chat_template``.
"""

from __future__ import annotations

import json
import os

import pytest

from kthena_serve.model import (
    ChatTemplateError,
    IncrementalDetokenizer,
    ModelConfig,
    Tokenizer,
    ensure_default_checkpoint,
)
from kthena_serve.model.convert import CHECKPOINT_FILES

transformers = pytest.importorskip("transformers")
kthena_known = pytest.importorskip("kthena_core.known_models")

TEXTS = [
    "Hello, world! How are you today?",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "你好，世界！今天天气怎么样？我想去北京看看长城。",
    "混合 mixed text: 机器学习 (machine learning) 和 deep learning。",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
    "emoji 🚀🎉 and accents: café, naïve, Ångström",
    "<|im_start|>user\nspecial tokens stay whole<|im_end|>\n",
    "def f(x):\n    return x ** 2  # code",
]
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "你好"},
     {"role": "assistant", "content": "你好！"}, {"role": "user", "content": "Tell me a joke."}],
]


@pytest.fixture(scope="module")
def checkpoint():
    return ensure_default_checkpoint(progress=False)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return Tokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def hf_tokenizer():
    folder, name = os.path.split(kthena_known.default_gguf_path())
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_checkpoint_folder_and_config(checkpoint):
    assert all((checkpoint / name).is_file() for name in CHECKPOINT_FILES)
    config = ModelConfig.from_pretrained(checkpoint)
    shape = config.shape
    sizes = (shape.vocab_size, shape.hidden_size, shape.intermediate_size, shape.num_layers)
    assert sizes == (49152, 576, 1536, 30)
    assert (shape.num_attention_heads, shape.num_kv_heads, shape.head_dim) == (9, 3, 64)
    assert (config.rope_theta, config.rms_norm_eps, config.max_position_embeddings) == (100000.0, 1e-05, 8192)
    assert config.tie_word_embeddings and not config.attention_bias and config.rope_scaling is None
    assert (config.bos_token_id, config.eos_token_ids) == (1, {2})
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_second_conversion_is_identical_and_leaves_no_temp(checkpoint, tmp_path):
    target = ensure_default_checkpoint(tmp_path, progress=False)
    assert target == tmp_path / "SmolLM2-135M-Instruct"
    for name in CHECKPOINT_FILES:
        assert (target / name).read_bytes() == (checkpoint / name).read_bytes(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]
    assert ensure_default_checkpoint(tmp_path, progress=False) == target  # found, not converted


def test_publish_replaces_a_damaged_folder_and_keeps_a_complete_one(tmp_path):
    from kthena_serve.model.convert import _publish

    def folder(name: str, content: str, files=CHECKPOINT_FILES):
        path = tmp_path / name
        path.mkdir()
        for f in files:
            (path / f).write_text(content)
        return path

    target = folder("ckpt", "damaged", CHECKPOINT_FILES[:2])
    _publish(folder(".new1", "fresh"), target)
    assert all((target / f).read_text() == "fresh" for f in CHECKPOINT_FILES)
    _publish(folder(".new2", "late"), target)  # a concurrent winner is kept
    assert all((target / f).read_text() == "fresh" for f in CHECKPOINT_FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_tokens_match_transformers_gguf_tokenizer(tokenizer, hf_tokenizer):
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), text
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("2024") == [34, 32, 34, 36]  # SmolLM splits digits (llama.cpp 'smollm')
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.vocab_size) == (1, {2}, 49152)
    assert tokenizer.decode(tokenizer.encode(TEXTS[6])) == "user\nspecial tokens stay whole\n"


def test_chat_template_matches_transformers(tokenizer, hf_tokenizer):
    for messages in MESSAGES:
        for add in (True, False):
            expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert tokenizer.apply_chat_template(messages, add_generation_prompt=add) == expected
    rendered = tokenizer.apply_chat_template(MESSAGES[0])
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_errors(tokenizer, tmp_path, checkpoint):
    with pytest.raises(ChatTemplateError, match="'role' and 'content'"):
        tokenizer.apply_chat_template([{"content": "no role"}])
    (tmp_path / "tokenizer.json").write_bytes((checkpoint / "tokenizer.json").read_bytes())
    bare = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template(MESSAGES[0])
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('only one message') }}")
    with pytest.raises(ChatTemplateError, match="only one message"):
        Tokenizer.from_pretrained(tmp_path).apply_chat_template(MESSAGES[0])


@pytest.mark.parametrize("text", TEXTS[2:6])
def test_incremental_detokenizer_streams_valid_utf8(tokenizer, text):
    prompt = tokenizer.encode("Answer:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.step(i) for i in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == detok.text
    assert not any("\ufffd" in piece for piece in pieces)
    if any("\ufffd" in tokenizer.decode([i]) for i in ids):  # a character split across tokens
        assert "" in pieces  # ... was held back until complete
