"""`kthena bench pd --tp-pairs`: TP PD workers against a colocated engine of the decode size.

One small real run: the figures come from the run (streamed requests, the decode worker's
counters), and the KV bytes each request moved are exactly its prompt blocks' bytes."""

from __future__ import annotations

import argparse
import math

from kthena_serve.bench.pd import bench_tp
from kthena_serve.engine.config import EngineConfig
from kthena_serve.model import ModelConfig, resolve_checkpoint

PROMPT, OUTPUT, REQUESTS = 40, 4, 2


def test_a_tp_pair_is_measured_against_colocated() -> None:
    opts = argparse.Namespace(tp_pairs="2:2", tp_requests=REQUESTS, tp_prompt_tokens=PROMPT,
                              tp_output_tokens=OUTPUT)
    [row] = bench_tp(opts)
    assert (row["prefill_tp"], row["decode_tp"]) == (2, 2)
    for side in ("colocated", "pd"):
        assert row[side]["num_requests"] == REQUESTS
        assert row[side]["ttft_p50"] > 0 and row[side]["tpot_p50"] > 0
    assert row["pd"]["num_disaggregated"] == REQUESTS
    config = EngineConfig()
    model = ModelConfig.from_pretrained(resolve_checkpoint(config.model))
    shape = model.shape
    per_token = shape.num_layers * shape.num_kv_heads * model.kv_head_dim * 2 * 2  # K, V; bf16
    blocks = math.ceil(PROMPT / config.block_size)
    # every head of every prompt block, once: split over the decode ranks, nothing twice
    assert row["pd"]["kv_bytes_per_request"] == blocks * config.block_size * per_token
    assert set(row["pd_vs_colocated"]) == {"ttft_p50", "tpot_p50"}
