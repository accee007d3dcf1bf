"""PD where the prefill and decode instances are TP engines (same host, shm): each prefill
rank's KV heads reach the decode ranks that own them, re-sharded between TP sizes.

A tiny fp32 checkpoint with SmolLM2's uneven head split (3 KV heads: 2 + 1 over two ranks)
serves each pair of role sizes; transformers gives the reference tokens and a colocated
one-rank engine of the same checkpoint the reference logprobs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _support import metric_value
from _tiny import PD_ENGINE, default_tokenizer, tiny_checkpoint

from kthena_serve.engine import LLMEngine
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.embedded import PDCluster, shm_pools

HEADS = {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16, "hidden_size": 96}
# 256-token steps: the long prompt is prefilled in three chunks on the TP prefill worker
ENGINE = {**PD_ENGINE, "dtype": "float32", "max_num_batched_tokens": 256}
TEXT = ("Paged attention stores the key and value cache in fixed-size blocks, so that a "
        "scheduler can share prefixes between requests and evict whole blocks when memory "
        "runs short. Prefill is bound by compute and decode by memory bandwidth. ")
NEW_TOKENS = 8
# fp32 logprobs of one model summed in another order (TP all-reduce, another head split,
# another chunking) differ by rounding only: ~1e-6 at this depth (2 layers, hidden 96). A head
# copied into the wrong slot changes them by 1e-1 or more (the copy's unit test: pd_reshard).
LOGPROB_TOLERANCE = 1e-3
# The greedy token's own logprob is ~0 (this model's logits are well separated), whatever the
# context: the runners-up's logprobs are what a wrong K/V shows in.
TOP = 5


def _prompt(num_tokens: int, salt: str) -> list[int]:
    ids = default_tokenizer().encode(salt + TEXT * (num_tokens // 30 + 2))
    return ids[:num_tokens]


# a batch of mixed lengths sent at once (short, two blocks, three prefill chunks), then a prompt
# sharing the long one's first 512 tokens: a prefix hit on the decode side
BATCH = {"short": _prompt(20, "one: "), "mid": _prompt(150, "two: "),
         "long": _prompt(700, "three: ")}
PREFIX_HIT = BATCH["long"][:512] + _prompt(60, "a new tail: ")
PROMPTS = {**BATCH, "prefix": PREFIX_HIT}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:  # noqa: ANN001
    return tiny_checkpoint(tmp_path_factory.mktemp("tp-pd") / "model", **HEADS)


def greedy_transformers(checkpoint: Path, prompts: dict[str, list[int]],
                        num_tokens: int = NEW_TOKENS) -> dict[str, list[int]]:
    """Each prompt's ``num_tokens`` greedy tokens from transformers (fp32), by name."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        for name, ids in prompts.items():
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=num_tokens, do_sample=False,
                              min_new_tokens=num_tokens, pad_token_id=0, eos_token_id=None)
            out[name] = gen[0, len(ids):].tolist()
    return out


@pytest.fixture(scope="module")
def transformers_tokens(checkpoint: Path) -> dict[str, list[int]]:
    """Each prompt's greedy tokens from transformers (fp32), the independent reference."""
    return greedy_transformers(checkpoint, PROMPTS)


def colocated_logprobs(checkpoint: Path, prompts: dict[str, list[int]],
                       num_tokens: int = NEW_TOKENS) -> dict[str, list[tuple[float, ...]]]:
    """Each prompt's top ``TOP`` logprobs at every generated position, from a colocated
    one-rank engine of the same settings."""
    engine = LLMEngine.from_config(EngineConfig(model=str(checkpoint), **ENGINE, num_threads=1))
    try:
        out = {}
        for name, ids in prompts.items():
            engine.add_request(name, ids, SamplingParams(temperature=0, max_tokens=num_tokens,
                                                         logprobs=TOP))
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        out[o.request_id] = [e.top_logprobs for e in o.logprobs]
        return out
    finally:
        engine.close()


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> dict[str, list[tuple[float, ...]]]:
    """``colocated_logprobs`` of this module's prompts."""
    return colocated_logprobs(checkpoint, PROMPTS)


def _descendants(pid: int) -> set[int]:
    """``pid`` and every process under it (a TP worker's spawned ranks)."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return found


def _check(reply, name: str, transformers_tokens, reference,  # noqa: ANN001
           num_tokens: int = NEW_TOKENS) -> int:
    """Assert one served reply against both references; its cached prompt tokens."""
    assert reply.status_code == 200, reply.text
    body = reply.json()
    choice = body["choices"][0]
    assert choice["text"] == default_tokenizer().decode(transformers_tokens[name]), name
    got = choice["logprobs"]["top_logprobs"]  # {token text: logprob} per position
    assert len(got) == num_tokens
    for served, want in zip(got, reference[name], strict=True):
        for value in served.values():  # texts may collide: each is one of the top
            assert min(abs(value - w) for w in want) < LOGPROB_TOLERANCE, (name, served, want)
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "kv_push"),
                         [(2, 2, "layerwise"), (1, 2, "layerwise"), (2, 1, "layerwise"),
                          (2, 1, "batched")])
def test_tp_instances_match_transformers(checkpoint: Path, transformers_tokens,  # noqa: ANN001
                                         reference, prefill_tp: int, decode_tp: int,
                                         kv_push: str) -> None:
    """``--prefill-tp A --decode-tp B``: greedy tokens equal transformers' (fp32) and the top
    logprobs a colocated engine's, for a batch of mixed lengths and a prefix hit, every one
    disaggregated; no rank's pool is left in /dev/shm. Layer-wise (the default: each prefill
    rank copies its heads in its forward, a tp=1 prefill in the model's hook; the 700-token
    prompt's three chunks each copy the blocks they complete) and batched."""
    from concurrent.futures import ThreadPoolExecutor

    pd = PDConfig(pd_threshold_tokens=8, transfer_timeout_s=60, health_interval_s=0.2,
                  prefill_tp=prefill_tp, decode_tp=decode_tp, kv_push=kv_push)
    cluster = PDCluster(EngineConfig(model=str(checkpoint), **ENGINE), pd).start()
    pids: set[int] = set()
    try:
        for name in cluster.launcher.workers:
            pids |= _descendants(cluster.launcher.pid(name))
        state = cluster.worker_state("decode-0")
        assert state["pool"]["tp"] == decode_tp
        assert len(state["pool"]["rank_shm_names"]) == (decode_tp if decode_tp > 1 else 0)
        with ThreadPoolExecutor(len(BATCH)) as pool:  # one prefill batch of mixed lengths
            replies = dict(zip(BATCH, pool.map(
                lambda ids: cluster.complete(ids, max_tokens=NEW_TOKENS, logprobs=TOP),
                BATCH.values()), strict=True))
        for name, reply in replies.items():
            _check(reply, name, transformers_tokens, reference)
        reply = cluster.complete(PREFIX_HIT, max_tokens=NEW_TOKENS, logprobs=TOP)
        assert _check(reply, "prefix", transformers_tokens, reference) >= 496  # 31 of 32 blocks
        metrics = cluster.worker_metrics("decode-0")
        assert metric_value(metrics, "kthena_pd_requests_total", path="disaggregated") == 4
        assert metric_value(metrics, "kthena_pd_requests_total", path="recomputed") in (0, None)
    finally:
        cluster.stop()
    left = [p for p in shm_pools() for pid in pids if f".{pid}." in os.path.basename(p)]
    assert not left  # every rank's pool unlinked


def test_a_role_size_the_heads_cannot_take_is_refused_before_any_worker(checkpoint: Path,
                                                                      capsys) -> None:  # noqa: ANN001
    from kthena_serve.pd.serve import role_layouts, run_pd
    from kthena_serve.spec import ServeSpec

    ok = ServeSpec.resolve({"mode": "pd", "model": str(checkpoint), "prefill_tp": 3,
                            "decode_tp": 2})
    assert role_layouts(ok) == {"prefill": 3, "decode": 2}
    bad = ServeSpec.resolve({"mode": "pd", "model": str(checkpoint), "decode_tp": 4})
    with pytest.raises(ValueError, match="--decode-tp 4: the decode workers cannot split"):
        role_layouts(bad)
    assert run_pd(bad) == 2  # one line, and no worker started
    err = capsys.readouterr().err
    assert "--decode-tp 4: the decode workers cannot split" in err
    assert "starting" not in err


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_rank_that_dies_stops_its_worker_which_is_started_again(
        checkpoint: Path, transformers_tokens, role: str) -> None:  # noqa: ANN001
    """SIGKILL one spawned rank of a TP worker: a request then either fails naming the hand-off
    (policy fail) or is served another way, never hangs; the worker stops itself, the launcher
    starts it again, requests are disaggregated again, and the dead rank's pool is unlinked."""
    import signal

    from _support import eventually

    pd = PDConfig(pd_threshold_tokens=8, transfer_timeout_s=30, health_interval_s=0.2,
                  prefill_tp=2, decode_tp=2, policy="fail")
    cluster = PDCluster(EngineConfig(model=str(checkpoint), **ENGINE), pd).start()
    try:
        worker = cluster.launcher.pid(f"{role}-0")
        ranks = [p for p in _descendants(worker) - {worker}
                 if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(ranks) == 1  # rank 1 (rank 0 is the worker's own process)
        os.kill(ranks[0], signal.SIGKILL)
        reply = cluster.complete(BATCH["mid"], max_tokens=NEW_TOKENS)
        assert reply.status_code in (200, 503), reply.text
        if reply.status_code == 503:  # the failed hand-off, step, or worker, each says retry
            assert "retry" in reply.json()["error"]["message"]
        restarted = cluster.launcher.workers[f"{role}-0"]
        # generous: a TP worker's start (ranks meeting, the model loading) on a loaded machine
        assert eventually(lambda: restarted.num_restarts == 1 and restarted.proc is not None
                          and cluster.router.up("prefill") and cluster.router.up("decode"),
                          300, interval_s=0.2)  # started again, and polled by the router
        before = metric_value(cluster.worker_metrics("decode-0"), "kthena_pd_requests_total",
                              path="disaggregated") or 0
        reply = cluster.complete(BATCH["short"], max_tokens=NEW_TOKENS)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == default_tokenizer().decode(
            transformers_tokens["short"])
        after = metric_value(cluster.worker_metrics("decode-0"), "kthena_pd_requests_total",
                             path="disaggregated")
        assert after == before + 1
    finally:
        cluster.stop()
    assert not [p for p in shm_pools() if f".{ranks[0]}." in os.path.basename(p)]


def _rank_of(cluster: PDCluster, worker: str) -> int:
    """The pid of ``worker``'s spawned rank 1 (rank 0 is the worker's own process)."""
    pid = cluster.launcher.pid(worker)
    ranks = [p for p in _descendants(pid) - {pid}
             if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(ranks) == 1
    return ranks[0]


def _is_gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie its parent has not reaped yet counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except (OSError, IndexError):
        return True


@pytest.mark.parametrize(("role", "policy"), [("prefill", "fail"), ("decode", "fail"),
                                              ("prefill", "recompute")])
def test_a_rank_killed_mid_handoff_fails_its_request_naming_the_handoff(
        checkpoint: Path, transformers_tokens, role: str, policy: str) -> None:  # noqa: ANN001
    """SIGKILL a rank of the prefill (or the decode) TP worker while a request's KV is being
    handed off: the client gets a 503 naming the hand-off and the dead rank (policy fail; a
    prefill rank under recompute: the right tokens); after the cluster stops, no process it
    started and no rank's /dev/shm pool is left.

    The window is held open without mocks: prefill rank 1 is stopped (SIGSTOP), so the
    prompt's first forward waits for it, until the prefill worker reports the request running.
    """
    import signal
    import threading

    from _support import eventually

    pd = PDConfig(pd_threshold_tokens=8, transfer_timeout_s=30, health_interval_s=0.2,
                  prefill_tp=2, decode_tp=2, policy=policy)
    cluster = PDCluster(EngineConfig(model=str(checkpoint), **ENGINE), pd).start()
    pids: set[int] = set()

    def started() -> None:  # every process of the cluster, a worker started again's too
        for name in cluster.launcher.workers:
            if cluster.launcher.pid(name) is not None:
                pids.update(_descendants(cluster.launcher.pid(name)))

    try:
        started()
        held, victim = _rank_of(cluster, "prefill-0"), _rank_of(cluster, f"{role}-0")
        os.kill(held, signal.SIGSTOP)
        replies = []
        client = threading.Thread(target=lambda: replies.append(
            cluster.complete(BATCH["long"], max_tokens=NEW_TOKENS)))
        client.start()
        assert eventually(lambda: cluster.worker_state("prefill-0")["num_running"] == 1, 30)
        os.kill(victim, signal.SIGKILL)
        assert eventually(lambda: _is_gone(victim), 10)
        if victim != held:
            os.kill(held, signal.SIGCONT)  # the prefill ends; the decode worker has lost a rank
        client.join(60)
        assert replies, "no reply within 60 s"
        reply = replies[0]
        if policy == "recompute":
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == default_tokenizer().decode(
                transformers_tokens["long"])
        else:
            assert reply.status_code == 503, reply.text
            message = reply.json()["error"]["message"]
            assert "the KV hand-off from prefill-0 to decode-0 failed" in message, message
            assert f"{role}-0: parallel rank 1 (pid {victim}) was killed by signal 9" in message
    finally:
        started()
        cluster.stop()
    assert eventually(lambda: all(_is_gone(p) for p in pids), 10), \
        [p for p in pids if not _is_gone(p)]
    left = [p for p in shm_pools() for pid in pids if f".{pid}." in os.path.basename(p)]
    assert not left  # every rank's pool unlinked, the dead one's too
