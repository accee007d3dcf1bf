"""Test helpers: a tiny random-weight Llama and engines built on it (fast, deterministic).

Used by kthena_serve's tests and handy for anyone testing a scheduler change without the real
checkpoint. The tokenizer is the default checkpoint's (converted once, then cached).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import torch

from kthena_serve.engine import LLMEngine

if TYPE_CHECKING:
    from kthena_serve.async_engine import AsyncLLM
from kthena_serve.engine.config import EngineConfig

if TYPE_CHECKING:
    from kthena_serve.engine.request import RequestOutput

__all__ = ["PD_ENGINE", "prompt_logprobs_of", "tiny_server", "default_tokenizer", "finish_all", "greedy_text", "tiny_checkpoint",
           "tiny_engine", "tiny_llama", "two_prompts"]

# The engine settings of the PD tests' workers and of the colocated engine their tokens are
# compared with. Token-for-token equality across processes needs the same kernels on both
# sides: with kernels="auto" each process times its candidates, and under the suite's load a
# choice is provisional and timed again at every start, so the reference and a worker can sum
# a bf16 matmul in different orders and flip a near-tie. "native" picks by the CPU's features.
PD_ENGINE = {"num_kv_blocks": 256, "max_num_seqs": 8, "kernels": "native"}

_TOKENIZER = None
_REFERENCE_IDS = itertools.count()


def default_tokenizer():  # noqa: ANN201
    """The default checkpoint's Tokenizer (cached for the process)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from kthena_serve.model import Tokenizer, resolve_checkpoint

        _TOKENIZER = Tokenizer.from_pretrained(resolve_checkpoint("default"))
    return _TOKENIZER


def finish_all(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step ``engine`` until no request is left unfinished; the final output of each request
    that finished meanwhile, by request id."""
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    return finals


def greedy_text(engine: LLMEngine, prompt_ids: list[int], max_tokens: int = 8) -> str:
    """Run one greedy request to completion on ``engine`` alone; its text (a reference to
    compare a served answer with)."""
    from kthena_serve.engine.sampling_params import SamplingParams

    request_id = f"ref-{next(_REFERENCE_IDS)}"
    engine.add_request(request_id, prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    return finish_all(engine)[request_id].text


def tiny_llama(vocab_size: int = 49152, *, num_layers: int = 2, hidden_size: int = 64,
               num_heads: int = 4, num_kv_heads: int = 2, max_len: int = 4096, seed: int = 0,
               dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):  # noqa: ANN201
    """A randomly initialised ``LlamaForCausalLM`` with well-separated logits (few argmax ties)."""
    from kthena_core.shape import ModelShape
    from kthena_serve.model import LlamaForCausalLM, ModelConfig

    config = ModelConfig(
        ModelShape(num_layers=num_layers, num_attention_heads=num_heads,
                   num_kv_heads=num_kv_heads, head_dim=hidden_size // num_heads,
                   hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                   vocab_size=vocab_size),
        max_position_embeddings=max_len, tie_word_embeddings=False, eos_token_id=2,
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device or torch.get_default_device())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                scale = 1.0 if "embed" in name or "lm_head" in name else param.shape[1] ** -0.5
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.reset_rope_cache()
    return model.to(dtype).eval()


def tiny_engine(**config) -> LLMEngine:
    """An engine over ``tiny_llama()`` in fp32 with the default tokenizer; ``config`` overrides."""
    options = {"dtype": "float32", "num_kv_blocks": 256, "block_size": 4,
               "max_num_batched_tokens": 64, "max_num_seqs": 8, "check_invariants": True,
               "num_threads": 1}
    options.update(config)
    engine_config = EngineConfig(**options)
    model = tiny_llama(device=engine_config.device)
    return LLMEngine.from_config(engine_config, model=model, tokenizer=default_tokenizer())


def tiny_checkpoint(folder, *, seed: int = 0, **config):  # noqa: ANN001, ANN003, ANN201
    """Write a Hugging Face checkpoint folder of a tiny random Llama (2 layers, hidden 64, tied
    embeddings, bf16-safe values) with the default checkpoint's tokenizer files into ``folder``;
    returns it as a ``Path``. What ``--model FOLDER`` loads in a second, not a real model.
    ``config`` overrides config.json keys (e.g. ``num_attention_heads=9, num_key_value_heads=3,
    head_dim=8`` for SmolLM2's uneven head split)."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    from kthena_serve.model import ModelConfig, resolve_checkpoint
    from kthena_serve.model.loader import expected_weight_names

    folder, default = Path(folder), resolve_checkpoint("default")
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(default / name, folder / name)
    hf = json.loads((default / "config.json").read_text())
    hf.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
              tie_word_embeddings=True, torch_dtype="float32")
    hf.update(config)
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    config = ModelConfig.from_dict(hf)
    shape = config.shape
    q, kv, h, inter = (shape.num_attention_heads * shape.head_dim,
                       shape.num_kv_heads * shape.head_dim, shape.hidden_size,
                       shape.intermediate_size)
    shapes = {"embed_tokens": (shape.vocab_size, h), "q_proj": (q, h), "k_proj": (kv, h),
              "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (inter, h),
              "up_proj": (inter, h), "down_proj": (h, inter)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(expected_weight_names(config)):
        kind = name.split(".")[-2]
        if kind not in shapes:  # a norm
            tensors[name] = torch.ones(h)
        else:
            shape = shapes[kind]
            scale = 1.0 if kind == "embed_tokens" else shape[1] ** -0.5
            tensors[name] = torch.randn(shape, generator=generator) * scale
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def prompt_logprobs_of(prompt: list[int], k: int, **engine_config: object) -> list:
    """The prompt logprobs (top ``k``) of ``prompt`` from a fresh tiny engine built with
    ``engine_config``: what a served answer's prompt logprobs are compared with."""
    from kthena_serve.engine.sampling_params import SamplingParams

    core = tiny_engine(**engine_config)
    try:
        core.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1,
                                                     prompt_logprobs=k))
        outputs = []
        while core.has_unfinished_requests():
            outputs += core.step()
        return outputs[-1].prompt_logprobs
    finally:
        core.close()


@contextlib.contextmanager
def tiny_server(model_name: str, timeout_s: float = 60, **engine_config: object,
                ) -> Iterator[tuple[AsyncLLM, httpx.Client]]:
    """A tiny engine on its thread behind the OpenAI app on a free port: (engine, client);
    everything is stopped on exit."""
    from kthena_serve.async_engine import AsyncLLM
    from kthena_serve.server import BackgroundServer, build_app

    engine = AsyncLLM(tiny_engine(**engine_config)).start()
    try:
        with BackgroundServer(build_app(engine, model_name=model_name)) as server, \
                httpx.Client(base_url=server.url, timeout=timeout_s) as client:
            yield engine, client
    finally:
        engine.shutdown()


def two_prompts(tokenizer) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """Two unrelated prompts of the default tokenizer: 61 tokens, then one that 8 blocks of 16
    hold with its output and nothing else (the offload tests' eviction setups)."""
    first = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    second = tokenizer.encode("Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 5)
    return first, second
