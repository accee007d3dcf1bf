"""A paged-attention generation loop: mooncake_kv hands out blocks, mooncake_ops computes.

    python docs/examples/paged_decode_loop.py

One attention layer over a paged KV cache, driven step by step the way an engine drives it:

    step 0   prefill request A (40 tokens)
    step 1   decode A + prefill B, whose first 32 tokens are A's: B matches 2 cached blocks
             of A's prompt and computes only its last 13 tokens (a mixed, varlen batch)
    step 2+  decode A and B together (paged decode attention)

Each step: the manager's verbs (``match_prefix``, ``try_allocate`` / ``try_append``,
``commit``), ``paged_batch`` for the step's tensors, then ``rotary_embedding``, ``write_kv``
and paged attention from mooncake_ops on a ``KVPool``. Every output row is checked against
dense causal attention over the whole sequence recomputed from scratch
(``scaled_dot_product_attention``), so a wrong block table, slot or position shows up at once.
"""

import torch
import torch.nn.functional as F

import mooncake_ops as mo
from mooncake_kv import KVCacheManager, KVLayout, KVPool, KVShape, paged_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 64, 16, 32
VOCAB, DECODE_STEPS = 1000, 8
SCALE = HEAD_DIM ** -0.5

torch.manual_seed(0)
EMBED_Q = torch.randn(VOCAB, NUM_HEADS, HEAD_DIM)  # a stand-in for the model's projections
EMBED_K = torch.randn(VOCAB, NUM_KV_HEADS, HEAD_DIM)
EMBED_V = torch.randn(VOCAB, NUM_KV_HEADS, HEAD_DIM)
UNEMBED = torch.randn(NUM_HEADS * HEAD_DIM, VOCAB)
ROPE = mo.build_rope_cache(HEAD_DIM, 4096, 10000.0)


def qkv(token_ids: torch.Tensor, positions: torch.Tensor):
    """q, k, v of tokens at positions (RoPE applied), each [num_tokens, heads, head_dim]."""
    q, k = mo.rotary_embedding(positions, EMBED_Q[token_ids], EMBED_K[token_ids], ROPE)
    return q, k, EMBED_V[token_ids]


def dense_attention(tokens: list[int], num_new: int) -> torch.Tensor:
    """Reference: causal attention of the last num_new tokens over the whole sequence."""
    q, k, v = qkv(torch.tensor(tokens), torch.arange(len(tokens)))
    group = NUM_HEADS // NUM_KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, scale=SCALE)
    return out.transpose(0, 1)[-num_new:]


def step(pool: KVPool, seqs: dict[str, list[int]], blocks: dict,
         num_cached: dict[str, int]) -> dict[str, int]:
    """One forward over the scheduled sequences; returns each one's next token (greedy)."""
    batch = paged_batch([(blocks[r], num_cached[r], len(seqs[r]) - num_cached[r])
                         for r in seqs], block_size=BLOCK_SIZE)
    new_tokens = torch.tensor([t for r in seqs for t in seqs[r][num_cached[r]:]])
    q, k, v = qkv(new_tokens, batch.positions)
    k_cache, v_cache = pool.k_cache(0), pool.v_cache(0)
    mo.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    if batch.is_decode_only:
        out = mo.paged_decode_attention(q, k_cache, v_cache, batch.block_tables,
                                        batch.context_lens, SCALE)
    else:
        out = mo.paged_prefill_attention(q, k, v, k_cache, v_cache, batch.block_tables,
                                         batch.cached_lens, batch.query_lens, SCALE)
    rows = torch.split(out, batch.query_lens.tolist())
    for rid, got in zip(seqs, rows, strict=True):
        torch.testing.assert_close(got, dense_attention(seqs[rid], got.shape[0]),
                                   atol=1e-4, rtol=1e-4)
    logits = out[batch.logits_indices].flatten(1) @ UNEMBED
    return dict(zip(seqs, logits.argmax(dim=-1).tolist(), strict=True))


def admit(kv: KVCacheManager, rid: str, prompt: list[int], blocks: dict,
          num_cached: dict[str, int]) -> None:
    match = kv.match_prefix(rid, prompt)  # refs the cached leading blocks
    blocks[rid] = kv.try_allocate(rid, len(prompt) - match.num_cached_tokens)
    assert blocks[rid] is not None, "pool too small for the prompt"
    num_cached[rid] = match.num_cached_tokens
    print(f"{rid}: {len(prompt)} prompt tokens, {match.num_cached_tokens} from the cache")


def main() -> None:
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, check_invariants=True)
    shape = KVShape(num_layers=1, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                    block_size=BLOCK_SIZE, dtype="float32")
    prompt_a = torch.randint(0, VOCAB, (40,)).tolist()
    prompt_b = prompt_a[:32] + torch.randint(0, VOCAB, (13,)).tolist()
    with KVPool.create(KVLayout(shape, NUM_BLOCKS)) as pool:
        seqs, blocks, num_cached = {"A": list(prompt_a)}, {}, {}
        admit(kv, "A", prompt_a, blocks, num_cached)
        for i in range(DECODE_STEPS + 1):
            if i == 1:
                seqs["B"] = list(prompt_b)
                admit(kv, "B", prompt_b, blocks, num_cached)
            next_tokens = step(pool, seqs, blocks, num_cached)
            for rid, token in next_tokens.items():
                kv.commit(rid, seqs[rid])  # KV of every token so far is written: cacheable
                num_cached[rid] = len(seqs[rid])
                seqs[rid].append(token)
                blocks[rid] = kv.try_append(rid, 1)  # a slot for the token fed next step
                assert blocks[rid] is not None, "pool too small"
        for rid in seqs:
            kv.free(rid)
    stats = kv.stats()
    assert stats.num_used_blocks == 0, stats
    print(f"{DECODE_STEPS} decode steps match dense attention; prefix hit rate "
          f"{stats.hit_rate:.2f}, {stats.num_cached_blocks} blocks still cached, none in use")


if __name__ == "__main__":
    main()
