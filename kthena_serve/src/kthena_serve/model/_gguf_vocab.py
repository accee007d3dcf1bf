"""GGUF tokenizer metadata -> ``tokenizer.json`` and ``tokenizer_config.json`` (private).

Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) are supported: the tokens
are already spelled in the GPT-2 byte alphabet and the merges are given, so the `tokenizers` BPE
model is built from them directly. The pre-tokenizer follows ``tokenizer.ggml.pre`` the way
llama.cpp does (SmolLM splits every digit, then applies the GPT-2 regex). Tokens of GGUF type
CONTROL (3) become special added tokens; USER_DEFINED (4) become plain added tokens.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from kthena_serve.model.errors import UnsupportedModelError

_CONTROL, _USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


_PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()]),
    "gpt2": _byte_level,
    "default": _byte_level,
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
}


def _contents(fields: dict[str, Any], key: str, default: Any = None) -> Any:
    return fields[key].contents() if key in fields else default


def build_tokenizer(fields: dict[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the GGUF file's vocabulary.

    Raises:
        UnsupportedModelError: the vocabulary is not byte-level BPE, or its pre-tokenizer is unknown.
    """
    kind = _contents(fields, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(f"GGUF tokenizer model {kind!r} is not supported; allowed: gpt2 (byte-level BPE)")
    pre = _contents(fields, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise UnsupportedModelError(f"GGUF pre-tokenizer {pre!r} is not supported; allowed: {', '.join(_PRE_TOKENIZERS)}")
    tokens = _contents(fields, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _contents(fields, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = _contents(fields, "tokenizer.ggml.token_type", [1] * len(tokens))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, k in zip(tokens, types, strict=True) if k == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED])
    return tokenizer


def tokenizer_config(fields: dict[str, Any]) -> dict[str, Any]:
    """The ``tokenizer_config.json`` dict: special tokens by name, BOS/EOS flags, chat template."""
    tokens = _contents(fields, "tokenizer.ggml.tokens")
    names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
             "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
    config: dict[str, Any] = {
        name: tokens[int(_contents(fields, f"tokenizer.ggml.{key}"))]
        for name, key in names.items() if f"tokenizer.ggml.{key}" in fields
    }
    types = _contents(fields, "tokenizer.ggml.token_type", [])
    config["additional_special_tokens"] = [t for t, k in zip(tokens, types, strict=True) if k == _CONTROL]
    config["add_bos_token"] = bool(_contents(fields, "tokenizer.ggml.add_bos_token", False))
    config["add_eos_token"] = bool(_contents(fields, "tokenizer.ggml.add_eos_token", False))
    config["clean_up_tokenization_spaces"] = False
    config["model_max_length"] = int(_contents(fields, "llama.context_length", 2048))
    config["tokenizer_class"] = "GPT2Tokenizer"
    template = _contents(fields, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config
