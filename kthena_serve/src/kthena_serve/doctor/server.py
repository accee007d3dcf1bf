"""``kthena doctor --url``'s server checks: what a live server's endpoints already say.

Read once per run (``fetch_server``), then judged without the network (``server_checks``)::

    GET /health, /version      is the engine running, which build
    GET /metrics               kthena_prefix_cache_*, kthena_prompts_total{cache},
                               kthena_kv_blocks_*, kthena_kv_leaked_*, kthena_preemptions_total,
                               kthena_step_seconds_total{phase}, kthena_kernels_info
    GET /plan                  the layout served and the plan it came from

Every path but /health takes the server's API key (``Authorization: Bearer``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import httpx
from prometheus_client.parser import text_string_to_metric_families

from kthena_serve.doctor.check import Check, DoctorError
from kthena_serve.engine.step_times import PHASES

__all__ = ["Scrape", "ServerFacts", "fetch_server", "server_checks"]

LOW_HIT_RATE = 0.2  # below this, name what drags the hit rate
DRAG_SHARE = 0.25  # a kind of prompt this common counts as a drag
FULL_KV = 0.9  # KV usage above this is a warning
HOST_SHARE = 0.5  # schedule + sampling above this share of busy time is a warning


@attrs.frozen
class Scrape:
    """One /metrics text, parsed: ``(sample name, labels) -> value``."""

    samples: Mapping[tuple[str, frozenset], float]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
        return cls(samples)

    def value(self, name: str, **labels: str) -> float | None:
        """The sample ``name`` with exactly ``labels`` (None if the server has none)."""
        return self.samples.get((name, frozenset(labels.items())))

    def labels(self, name: str) -> dict[str, str] | None:
        """The labels of the first sample ``name`` (info gauges), or None."""
        for (sample, labels), _ in self.samples.items():
            if sample == name:
                return dict(labels)
        return None


@attrs.frozen
class ServerFacts:
    """What one server answered."""

    url: str
    is_alive: bool
    version: str
    metrics: Scrape
    plan: Mapping[str, Any]


def fetch_server(url: str, api_key: str | None, timeout_s: float = 10.0) -> ServerFacts:
    """GET /health, /version, /metrics and /plan of the server at ``url``.

    Raises:
        DoctorError: the server cannot be reached, refuses the key, or is not a kthena server.
    """
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=timeout_s) as http:
            health = http.get("/health")
            answers = {path: http.get(path) for path in ("/version", "/metrics", "/plan")}
    except httpx.HTTPError as error:
        raise DoctorError(f"--url {url}: cannot reach the server ({type(error).__name__}: "
                          f"{error or 'no answer'})") from None
    for path, reply in answers.items():
        if reply.status_code == 401:
            raise DoctorError(f"--url {url}: {path} answered 401: the API key is "
                              f"{'wrong' if api_key else 'missing'} (give the server's key "
                              "with --api-key or $KTHENA_API_KEY)")
        if reply.status_code != 200:
            raise DoctorError(f"--url {url}: {path} answered {reply.status_code}; is this a "
                              "kthena serve (or PD / DP router) address?")
    try:
        version = answers["/version"].json()["version"]
        plan = answers["/plan"].json()
        metrics = Scrape.parse(answers["/metrics"].text)
    except (ValueError, KeyError, TypeError) as error:
        raise DoctorError(f"--url {url}: not a kthena server's answers ({error})") from None
    return ServerFacts(url, health.status_code == 200, version, metrics, plan)


def server_checks(facts: ServerFacts) -> list[Check]:
    """Every server check, in checklist order."""
    m = facts.metrics
    return [_server(facts), _served_plan(facts.plan), _hit_rate(m), _kv_usage(m), _leaks(m),
            _preemptions(m), _step_time(m), _kernels(m)]


def _server(facts: ServerFacts) -> Check:
    value = f"{facts.url}: kthena-serve {facts.version}"
    if not facts.is_alive:
        return Check("server", "fail", f"{value}; /health: the engine is not running",
                     "read the server's log for the engine's error, then restart it")
    return Check("server", "ok", f"{value}; engine running")


def _served_plan(report: Mapping[str, Any]) -> Check:
    served = report.get("served")
    if not served:
        return Check("served_plan", "skip", "the server does not say what layout it runs")
    layout = " x ".join(f"{k}{served[k]}" for k in ("tp", "pp", "dp") if k in served)
    source = f"planned from {report['config']}" if report.get("config") else "set by flags"
    return Check("served_plan", "ok", f"{layout}, {served.get('mode', '?')}, {source}")


def _hit_rate(m: Scrape) -> Check:
    queries = m.value("kthena_prefix_cache_queries_total") or 0.0
    hits = m.value("kthena_prefix_cache_hits_total") or 0.0
    if not queries:
        return Check("prefix_hit_rate", "skip", "no prompt looked up in the prefix cache yet")
    rate = hits / queries
    kinds = {k: m.value("kthena_prompts_total", cache=k) or 0.0
             for k in ("salted", "short", "plain")}
    num_prompts = sum(kinds.values())
    value = f"{rate:.1%} of {queries:.0f} prompt tokens found cached"
    if num_prompts:
        value += (f"; of {num_prompts:.0f} prompts {kinds['salted'] / num_prompts:.0%} salted, "
                  f"{kinds['short'] / num_prompts:.0%} shorter than a block")
    if rate >= LOW_HIT_RATE:
        return Check("prefix_hit_rate", "ok", value)
    block = (m.labels("kthena_kv_cache_info") or {}).get("block_size", "a block of")
    fixes = []
    if num_prompts and kinds["salted"] / num_prompts >= DRAG_SHARE:
        fixes.append("salted prompts share a prefix only with the same cache_salt: give "
                     "requests that may share one the same salt (or none)")
    if num_prompts and kinds["short"] / num_prompts >= DRAG_SHARE:
        fixes.append(f"prompts of {block} tokens or fewer can never hit (a prefix matches "
                     "whole blocks, never the last token): a smaller --block-size "
                     "(kv_cache.reuse_bucket_size) lets shorter prompts match")
    if not fixes:
        fixes.append("the prompts share little: put what they share (system prompt, "
                     "examples) first, and see kv_usage (a full pool evicts cached blocks)")
    return Check("prefix_hit_rate", "warn", value, "; ".join(fixes))


def _kv_usage(m: Scrape) -> Check:
    used = m.value("kthena_kv_blocks_used")
    free = m.value("kthena_kv_blocks_free")
    if used is None or free is None:
        return Check("kv_usage", "skip", "the server exports no kthena_kv_blocks_* gauges")
    total = used + free
    usage = used / total if total else 0.0
    value = (f"{used:.0f} of {total:.0f} blocks in use ({usage:.0%}), "
             f"{m.value('kthena_kv_blocks_cached') or 0:.0f} cached; "
             f"{m.value('kthena_num_requests_running') or 0:.0f} running, "
             f"{m.value('kthena_num_requests_waiting') or 0:.0f} waiting")
    return _warn_if(usage > FULL_KV, "kv_usage", value, "the pool is nearly full: new requests "
                    "wait and running ones get preempted; raise --kv-cache-memory "
                    "(kv_cache.memory_pool_size) or lower --max-num-seqs")


def _leaks(m: Scrape) -> Check:
    blocks = m.value("kthena_kv_leaked_blocks")
    requests = m.value("kthena_kv_leaked_requests")
    if blocks is None or requests is None:
        return Check("kv_leaks", "skip", "the server exports no kthena_kv_leaked_* gauges "
                     "(an older kthena-serve)")
    if blocks or requests:
        return Check("kv_leaks", "fail", f"{blocks:.0f} block reference(s) held by "
                     f"{requests:.0f} request(s) the engine no longer has",
                     "a request ended without KVCacheManager.free: its blocks never come "
                     "back. Report it with the server log; restart the server to reclaim them")
    return Check("kv_leaks", "ok", "every block reference belongs to a live request")


def _preemptions(m: Scrape) -> Check:
    count = m.value("kthena_preemptions_total")
    if count is None:
        return Check("preemptions", "skip", "the server exports no kthena_preemptions_total")
    generated = m.value("kthena_generation_tokens_total") or 0.0
    value = f"{count:.0f} preemption(s) over {generated:.0f} generated tokens"
    return _warn_if(bool(count), "preemptions", value, "each preemption recomputes a request: "
                    "raise --kv-cache-memory or lower --max-num-seqs so the pool holds the "
                    "batch")


def _step_time(m: Scrape) -> Check:
    found = {p: m.value("kthena_step_seconds_total", phase=p) for p in PHASES}
    if any(s is None for s in found.values()):
        return Check("step_time", "skip", "the server exports no kthena_step_seconds_total")
    seconds = {p: float(s or 0.0) for p, s in found.items()}
    busy = sum(s for p, s in seconds.items() if p != "idle")
    if not busy:
        return Check("step_time", "skip", "no step has run yet")
    shares = ", ".join(f"{p} {seconds[p] / busy:.0%}" for p in PHASES if p != "idle")
    value = f"{busy:.1f} s busy ({shares}); {seconds['idle']:.1f} s idle"
    host_share = (seconds["schedule"] + seconds["sampling"]) / busy
    return _warn_if(host_share > HOST_SHARE, "step_time", value, "scheduling and sampling "
                    "outweigh the forwards: more sequences per step (--max-num-seqs) amortise "
                    "them; logprobs and structured output add to sampling")


def _warn_if(warn: bool, name: str, value: str, fix: str) -> Check:
    """``name``'s check: a warning with ``fix`` when ``warn``, else ok."""
    return Check(name, "warn", value, fix) if warn else Check(name, "ok", value)


def _kernels(m: Scrape) -> Check:
    labels = m.labels("kthena_kernels_info")
    if not labels:
        return Check("kernels", "skip", "the engine reports no kernel choice (a model built "
                     "outside the loader, or a PD router)")
    from mooncake_ops.selection import summary_line

    try:
        line = summary_line(labels)
    except KeyError:
        return Check("kernels", "ok", ", ".join(f"{k}={v}" for k, v in sorted(labels.items())))
    if "provisional" in labels:
        return Check("kernels", "warn", line, "the kernels were timed on a busy host: the "
                     "next start times them again (restart when the host is quieter)")
    return Check("kernels", "ok", line)
