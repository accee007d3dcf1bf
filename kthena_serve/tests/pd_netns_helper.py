"""Run inside network namespace A: a PD deployment whose prefill worker lives in namespace B.

Usage: python pd_netns_helper.py NS_B ADDR_A ADDR_B PROMPTS_JSON  -> one JSON line on stdout.
Not a test module; test_pd_mooncake.py runs it under ``ip netns exec``.
"""

import json
import sys

from _support import metric_value
from _tiny import PD_ENGINE

from kthena_serve.engine.config import EngineConfig
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.embedded import PDCluster


def main() -> None:
    ns_b, addr_a, addr_b, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    pd = {"transport": "mooncake", "pd_threshold_tokens": 16, "transfer_timeout_s": 60}
    hosts = {"decode-0": addr_a, "prefill-0": addr_b}
    prefix = {"prefill-0": ["ip", "netns", "exec", ns_b]}
    with PDCluster(EngineConfig(**PD_ENGINE), PDConfig(**pd), worker_hosts=hosts,
                   worker_prefix=prefix) as cluster:
        texts = []
        for ids in prompts:
            reply = cluster.complete(ids, max_tokens=8)
            texts.append(reply.json()["choices"][0]["text"] if reply.status_code == 200
                         else f"HTTP {reply.status_code}: {reply.text}")
        metrics = cluster.worker_metrics("prefill-0")
    moved = metric_value(metrics, "kthena_pd_transferred_bytes_total")
    print(json.dumps({"texts": texts, "transferred_bytes": moved}), flush=True)


if __name__ == "__main__":
    main()
