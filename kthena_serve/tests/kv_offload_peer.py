"""One engine process with ``--kv-offload``: serves one prompt, then stays up until told.

Usage: python kv_offload_peer.py KV_OFFLOAD PROMPT_IDS_JSON [MODEL TP]
  (MODEL: a checkpoint folder, served with tp TP; default: the default model at tp 1)
  -> one JSON line on stdout (output tokens, cached and computed prompt tokens, tier stats),
     then waits for a line on stdin before closing (its Mooncake Store client lends the
     store memory that the blocks it put live in).
Not a test module; test_kv_offload.py runs two of these against one mooncake_master, and
test_kv_offload_tp.py a TP2 and a TP1 one.
"""

import json
import sys

import attrs
import torch

from kthena_serve.engine import LLMEngine
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.model import load_model


def main() -> None:
    kv_offload, prompt = sys.argv[1], json.loads(sys.argv[2])
    if len(sys.argv) > 3:  # a checkpoint folder and a TP size (the ranks load it themselves)
        config = EngineConfig(model=sys.argv[3], tp=int(sys.argv[4]), num_kv_blocks=8,
                              dtype="float32", num_threads=1, kernels="native",
                              kv_offload=kv_offload)
        engine = LLMEngine.from_config(config)
    else:
        model, tokenizer = load_model("default", dtype=torch.float32)
        config = EngineConfig(num_kv_blocks=8, dtype="float32", num_threads=1,
                              kv_offload=kv_offload)
        engine = LLMEngine.from_config(config, model=model, tokenizer=tokenizer)
    try:
        engine.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=8))
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final = out
        engine.offloader.drain(30.0)
        stats = engine.stats()
        print(json.dumps({"tokens": list(final.token_ids),
                          "num_cached_tokens": final.num_cached_tokens,
                          "num_computed": stats.num_computed_prompt_tokens,
                          "tiers": [attrs.asdict(t) for t in stats.kv_tiers]}), flush=True)
        sys.stdin.readline()
    finally:
        engine.close()


if __name__ == "__main__":
    main()
