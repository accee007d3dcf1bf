"""A reference greedy loop over `LlamaForCausalLM`, for parity tests and examples (not the engine).

`GreedyRunner` owns a KV cache and hands out blocks from a bump allocator that never frees. It
can prefill in chunks (so later chunks read earlier ones from the cache) and reuse full blocks of
earlier prompts (so a shared prefix is read, not recomputed): both must leave the generated tokens
unchanged. The serving engine (kthena_serve's scheduler) is the real thing.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from kthena_serve.model import ModelConfig, load_weights
from kthena_serve.model.llama import LlamaForCausalLM
from mooncake_kv.paged import paged_batch


class GreedyRunner:
    """Greedy generation over a private paged KV cache (see the module docstring)."""

    def __init__(self, model: LlamaForCausalLM, *, block_size: int = 16, num_blocks: int = 128,
                 dtype: torch.dtype | None = None) -> None:
        self.model, self.block_size, self.num_blocks = model, block_size, num_blocks
        dtype = dtype or model.embed_weight.dtype
        shape = (num_blocks, block_size, model.num_kv_heads_per_rank, model.head_dim)
        self.kv_caches = [tuple(torch.zeros(shape, dtype=dtype) for _ in range(model.kv_parts))
                          for _ in range(model.config.shape.num_layers)]
        self._next_block = 0
        self._prefix_blocks: dict[tuple[int, ...], int] = {}  # full-block token prefix -> block id
        self.num_computed_prompt_tokens = 0

    def _allocate(self, count: int) -> list[int]:
        if self._next_block + count > self.num_blocks:
            raise RuntimeError(f"GreedyRunner ran out of KV blocks ({self.num_blocks}); give it more")
        self._next_block += count
        return list(range(self._next_block - count, self._next_block))

    def _table_for(self, prompt: Sequence[int], total_len: int, reuse: bool) -> tuple[list[int], int]:
        """Block ids for a sequence of `total_len` tokens, and how many prompt tokens are cached."""
        bs, table = self.block_size, []
        while reuse and (len(table) + 1) * bs < len(prompt):  # keep >= 1 prompt token to compute
            block = self._prefix_blocks.get(tuple(prompt[:(len(table) + 1) * bs]))
            if block is None:
                break
            table.append(block)
        cached = len(table) * bs
        table += self._allocate(-(-total_len // bs) - len(table))
        for i in range(len(prompt) // bs):
            self._prefix_blocks.setdefault(tuple(prompt[:(i + 1) * bs]), table[i])
        return table, cached

    @torch.inference_mode()
    def step(self, seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]]) -> torch.Tensor:
        """One forward over ``(new_tokens, num_cached, block_table)`` per sequence -> logits."""
        batch = paged_batch([(table, cached, len(new)) for new, cached, table in seqs],
                            block_size=self.block_size)
        ids = torch.tensor([token for new, _, _ in seqs for token in new])
        return self.model(ids, batch.positions, batch, self.kv_caches)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 prefill_chunk: int | None = None, reuse_prefix: bool = False,
                 eos_token_ids: Sequence[int] = ()) -> list[list[int]]:
        """Greedy-decode every prompt together; each stops at an EOS id or `max_new_tokens`."""
        tables, cached = zip(*(self._table_for(p, len(p) + max_new_tokens, reuse_prefix) for p in prompts), strict=True)
        self.num_computed_prompt_tokens += sum(len(p) - c for p, c in zip(prompts, cached, strict=True))
        last = self._prefill(prompts, list(cached), tables, prefill_chunk)
        outputs: list[list[int]] = [[] for _ in prompts]
        live = list(range(len(prompts)))
        while live:
            for i, token in zip(live, last.argmax(-1).tolist(), strict=True):
                outputs[i].append(token)
            live = [i for i in live if outputs[i][-1] not in eos_token_ids and len(outputs[i]) < max_new_tokens]
            if live:
                last = self.step([([outputs[i][-1]], len(prompts[i]) + len(outputs[i]) - 1, tables[i]) for i in live])
        return outputs

    def _prefill(self, prompts: Sequence[Sequence[int]], done: list[int], tables: Sequence[list[int]],
                 chunk: int | None) -> torch.Tensor:
        """Feed the uncached prompt tokens, `chunk` per sequence per step; each prompt's last logits."""
        last: dict[int, torch.Tensor] = {}
        while len(last) < len(prompts):
            todo = [i for i, p in enumerate(prompts) if done[i] < len(p)]
            ends = [min(len(prompts[i]), done[i] + (chunk or len(prompts[i]))) for i in todo]
            logits = self.step([(prompts[i][done[i]:end], done[i], tables[i]) for i, end in zip(todo, ends, strict=True)])
            for row, (i, end) in enumerate(zip(todo, ends, strict=True)):
                done[i] = end
                if end == len(prompts[i]):
                    last[i] = logits[row]
        return torch.stack([last[i] for i in range(len(prompts))])


def load_ours(folder, tp=None, *, expert_parallel: bool = False) -> LlamaForCausalLM:  # noqa: ANN001
    """Our model from a checkpoint folder in its dtype, kernels as the process has them (not
    ``load_model``, which applies a kernel choice process-wide); ``tp``: one rank's
    ``TensorParallel``; ``expert_parallel``: its experts split whole over the ranks."""
    config = ModelConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp, expert_parallel=expert_parallel)
    model = model.to_empty(device="cpu")
    if config.tie_word_embeddings:
        model.lm_head_weight = model.embed_weight
    load_weights(model, folder)
    model.reset_rope_cache()
    return model.eval()


def assert_greedy_on_every_path(model: LlamaForCausalLM, prompts: Sequence[Sequence[int]],
                                expected: list[list[int]], new_tokens: int,
                                computed_after_first: int) -> None:
    """``model``'s greedy tokens equal ``expected`` one prompt at a time, batched, with chunked
    prefill (chunks of 3) and with prefix hits: with the first prompt served before, the
    batch computes ``computed_after_first`` prompt tokens (the full blocks of 4 it shares with
    the first are read, not recomputed)."""
    assert [GreedyRunner(model, block_size=4).generate([p], new_tokens)[0]
            for p in prompts] == expected
    assert GreedyRunner(model, block_size=4).generate(prompts, new_tokens) == expected
    assert GreedyRunner(model, block_size=4).generate(prompts, new_tokens,
                                                      prefill_chunk=3) == expected
    runner = GreedyRunner(model, block_size=4)
    runner.generate(prompts[:1], new_tokens)
    before = runner.num_computed_prompt_tokens
    assert runner.generate(prompts, new_tokens, reuse_prefix=True) == expected
    assert runner.num_computed_prompt_tokens - before == computed_after_first


def hf_last_logits(hf, prompts: Sequence[Sequence[int]], dtype: torch.dtype) -> torch.Tensor:  # noqa: ANN001
    """A transformers model's logits at each prompt's last position, computed in ``dtype``
    (float64 out)."""
    model = copy.deepcopy(hf).to(dtype)
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p])).logits[0, -1].double() for p in prompts])


def prefill_logits(model: LlamaForCausalLM, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Our logits at each prompt's last position, the prompts prefilled together in one step
    (8 blocks of 4 each)."""
    runner = GreedyRunner(model, block_size=4, num_blocks=8 * len(prompts))
    return runner.step([(p, 0, list(range(i * 8, i * 8 + 8))) for i, p in enumerate(prompts)])


def assert_bf16_within_transformers_rounding(hf, folder, prompts: Sequence[Sequence[int]],  # noqa: ANN001
                                             room: float) -> None:
    """Our bf16 logits are within ``room`` x transformers' own bf16 distance from its float64
    logits (the yardstick, measured here on the same weights and prompts)."""
    exact = hf_last_logits(hf, prompts, torch.float64)
    yardstick = float((hf_last_logits(hf, prompts, torch.bfloat16) - exact).abs().max())
    model = load_ours(folder).to(torch.bfloat16)
    model.reset_rope_cache()  # .to() cast the float32 RoPE table too
    error = float((prefill_logits(model, prompts).double() - exact).abs().max())
    print(f"\nbf16 logits vs float64: ours {error:.3g}, transformers {yardstick:.3g}")
    assert error <= room * yardstick
