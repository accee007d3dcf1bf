"""Run inside network namespace A: PD workers behind the Kthena router's connector sequence,
the decode worker here, the prefill worker in namespace B, KV pulled over Mooncake (TCP).

Usage: python pd_connector_netns_helper.py NS_B ADDR_A ADDR_B PROMPTS_JSON -> one JSON line.
Not a test module; test_pd_connector.py runs it under ``ip netns exec``.
"""

import json
import sys

import httpx
from _kthena_proxy import decode_body, prefill_body, proxy
from test_pd_connector import held, metric, shm_files

from kthena_serve.engine.config import EngineConfig
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.launcher import PDLauncher


def main() -> None:
    ns_b, addr_a, addr_b, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    engine = {"num_kv_blocks": 256, "max_num_seqs": 8}
    pd = {"transport": "mooncake", "transfer_timeout_s": 60, "kv_pin_timeout_s": 30}
    hosts = {"decode-0": addr_a, "prefill-0": addr_b}
    prefix = {"prefill-0": ["ip", "netns", "exec", ns_b]}
    launcher = PDLauncher(EngineConfig(**engine), PDConfig(**pd), 1, 1, quiet=True, worker_hosts=hosts,
                          worker_prefix=prefix).start()
    pids = [launcher.pid(name) for name in launcher.workers]
    try:
        prefill_url, decode_url = launcher.url("prefill-0"), launcher.url("decode-0")
        texts, params = [], []
        with httpx.Client(timeout=120) as client:
            for ids in prompts:
                body = {"model": "default", "prompt": ids, "max_tokens": 8, "temperature": 0}
                exchange = proxy(client, "/v1/completions", body, prefill_url, decode_url)
                params.append(exchange.kv_transfer_params)
                reply = exchange.decode
                texts.append(reply.json()["choices"][0]["text"]
                             if reply is not None and reply.status_code == 200
                             else f"HTTP {(reply or exchange.prefill).status_code}: "
                                  f"{(reply or exchange.prefill).text}")
            pulled = metric(launcher, "decode-0", 'kthena_pd_requests_total{path="pulled"')
            body = {"model": "default", "prompt": prompts[0], "max_tokens": 2}
            answer = client.post(f"{prefill_url}/v1/completions", json=prefill_body(body))
            foreign = {**answer.json()["kv_transfer_params"], "remote_host": "10.99.0.1"}
            refused = client.post(f"{decode_url}/v1/completions",
                                  json=decode_body(body, foreign)).status_code
            client.post(f"{decode_url}/v1/completions",  # the genuine one frees the pin
                        json=decode_body(body, answer.json()["kv_transfer_params"]))
        pulled_bytes = metric(launcher, "decode-0",
                              'kthena_pd_transferred_bytes_total{role="decode"}')
        still_held = list(held(launcher))
    finally:
        launcher.stop()
    print(json.dumps({"texts": texts, "params": params, "pulled": pulled,
                      "pulled_bytes": pulled_bytes, "held": still_held,
                      "foreign_host": refused, "shm_left": shm_files(pids)}), flush=True)


if __name__ == "__main__":
    main()
