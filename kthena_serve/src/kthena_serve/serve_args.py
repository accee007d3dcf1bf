"""The flags of ``kthena serve`` (its engine flags are shared with ``kthena bench serve``) and
the lines it prints. A flag here only parses: ``ServeSpec.resolve`` (spec.py) turns the flags a
user gave into typed values, with the config's plan and the defaults below them."""

from __future__ import annotations

import argparse
import json
import shlex

from kthena_core import dtypes

__all__ = ["ENGINE_FLAG_FIELDS", "SHUTDOWN_MESSAGE", "TOOL_CALL_PARSERS", "add_engine_args",
           "add_kv_events_args", "add_api_key_args", "add_connection_args",
           "add_public_metrics_arg", "add_structured_output_args", "add_tool_args",
           "check_tool_call_parser", "curl_line", "flag_name"]

SHUTDOWN_MESSAGE = ("the server shut down before this request finished; retry it on another "
                    "replica")

# The EngineConfig fields add_engine_args gives a flag (each flag's dest is its field).
ENGINE_FLAG_FIELDS = ("model", "max_num_seqs", "max_num_batched_tokens", "target_step_ms",
                      "max_queue_delay_s", "max_queued_tokens", "block_size",
                      "kv_cache_memory", "max_model_len", "dtype", "kv_cache_dtype",
                      "quantization", "device", "tp", "pp", "pipeline_split_points",
                      "enable_prefix_caching",
                      "prefix_index", "hash_algorithm", "kv_offload", "chat_special_tokens",
                      "kernels", "sp", "sp_min_tokens", "tp_overlap", "tp_overlap_tiles",
                      "expert_parallel")

# --tool-call-parser's names (vLLM's); server/tool_parsers/ has a parser for each.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")


# Settings whose flag is not --<name with dashes>.
_FLAG_NAMES = {"enable_prefix_caching": "--no-prefix-caching", "redis_url": "--kv-events",
               "expert_parallel": "--enable-expert-parallel",
               "max_queue_delay_s": "--max-queue-delay",
               "pod": "--pod-name", "chunk_size": "--kv-events-chunk-size",
               "max_chunks": "--kv-events-max-chunks"}


def flag_name(setting: str, value: object = None) -> str:
    """The command-line flag of a setting (``tp`` -> ``--tp``; ``enable_prefix_caching`` ->
    ``--no-prefix-caching``): messages name what the user typed. With ``value``, the flag that
    sets that value (``enable_prefix_caching`` True -> ``--enable-prefix-caching``)."""
    if setting == "enable_prefix_caching" and value is True:
        return "--enable-prefix-caching"
    return _FLAG_NAMES.get(setting, "--" + setting.replace("_", "-"))


def _default(field: str) -> object:
    """An ``EngineConfig`` field's default (the help shows it; the flag itself has none)."""
    from kthena_serve.engine.config import EngineConfig

    return EngineConfig.defaults()[field]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every ``EngineConfig`` knob a user sets from the command line, each stored under its
    field's name. The flags have no defaults of their own (the parser's
    ``argument_default=argparse.SUPPRESS``): a flag not given is absent, and
    ``ServeSpec.resolve`` takes it from the config or ``EngineConfig``'s default."""
    _add_model_args(parser)
    _add_scheduling_args(parser)
    _add_kv_args(parser)
    _add_parallel_args(parser)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model, its dtypes and kernels, and the device."""
    parser.add_argument("--model", metavar="MODEL",
                        help="'default' (SmolLM2-135M-Instruct), a Hugging Face checkpoint "
                             "folder, a llama .gguf file (converted once into "
                             "$KTHENA_CACHE_DIR) or a Hugging Face Hub repo id ORG/NAME (its "
                             "cached snapshot, else downloaded into $HF_HUB_CACHE; "
                             "HF_HUB_OFFLINE=1: the cache only) (default: default). A "
                             "request's 'model' may be the served name (--served-model-name), "
                             "'default', this value as given, and for a catalog model its "
                             "catalog name, served name and Hub id (smollm2-135m-instruct, "
                             "SmolLM2-135M-Instruct, HuggingFaceTB/SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=[dtypes.torch_name(k) for k in dtypes.ENGINE_DTYPES],
                        help=f"weight and compute dtype (default {_default('dtype')})")
    parser.add_argument("--quantization", choices=("int8", "gguf"),
                        help="int8: weight-only int8 matmul weights (one scale per output "
                             "channel; decode reads half bf16's bytes); gguf: a GGUF model's "
                             "quantized matmul weights kept as the file has them, dequantised "
                             "inside the matmul (the default model or a .gguf file only); "
                             "default: --dtype")
    parser.add_argument("--kernels", choices=("auto", "native", "torch"),
                        help="how CPU matmul and attention kernels are chosen: auto (each "
                             "candidate timed once on this machine at the model's shapes, the "
                             "fastest taken, cached), native (by the CPU's features) or torch "
                             "(F.linear and SDPA); default auto, or KTHENA_KERNELS when set "
                             "(this flag wins over it)")
    parser.add_argument("--device",
                        help="cpu (default), cuda[:N] or npu[:N], refused where this host "
                             "lacks it; with --tp/--pp > 1 no index: each rank binds "
                             "cuda:LOCAL_RANK / npu:LOCAL_RANK (only cpu is verified on "
                             "hardware)")
    parser.add_argument("--chat-special-tokens", choices=("text", "control"),
                        help="special tokens typed in chat content: text (no forged turns, "
                             "default) or control tokens")


def _add_scheduling_args(parser: argparse.ArgumentParser) -> None:
    """Batching, decode protection and overload control."""
    parser.add_argument("--max-num-seqs", type=int,
                        help=f"requests running at once (default {_default('max_num_seqs')})")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="tokens computed per step (prefill chunks + decodes; default "
                             f"{_default('max_num_batched_tokens')})")
    parser.add_argument("--target-step-ms", type=float, metavar="MS",
                        help="decode protection: while requests decode, cap each step's "
                             "prefill tokens so the step's predicted time (a cost model fitted "
                             "to the engine's measured steps) stays within MS milliseconds; "
                             "long prompts are split over steps; 0: off, every step fills "
                             "--max-num-batched-tokens (default "
                             f"{_default('target_step_ms'):g})")
    parser.add_argument("--max-queue-delay", dest="max_queue_delay_s", type=float,
                        metavar="SECONDS",
                        help="overload control: refuse a request at once (503 with Retry-After) "
                             "when its estimated wait for a first token (prompt tokens queued "
                             "ahead and its own, over the rate the queue has been served at, "
                             "measured) exceeds SECONDS; 0: off, requests queue without bound "
                             f"(default {_default('max_queue_delay_s'):g})")
    parser.add_argument("--max-queued-tokens", type=int, metavar="N",
                        help="overload control by size: refuse a request (503) that would make "
                             "the prompt tokens queued without a first token exceed N; 0: off "
                             "(the default)")


def _add_kv_args(parser: argparse.ArgumentParser) -> None:
    """The KV pool, its dtype, prefix reuse and the tiers below it."""
    parser.add_argument("--block-size", type=int,
                        help=f"tokens per KV block (default {_default('block_size')})")
    parser.add_argument("--kv-cache-memory",
                        help="KV pool size, e.g. 512MiB, 2GiB (default 1GiB)")
    parser.add_argument("--gpu-memory-utilization", action=_RefusedFlag, metavar="FRACTION",
                        instead="the KV pool is sized in bytes here, not as a fraction of the "
                                "device's memory: use --kv-cache-memory SIZE (e.g. 2GiB)",
                        help="vLLM's flag, refused: the KV pool is sized by --kv-cache-memory")
    parser.add_argument("--max-model-len", type=int,
                        help="context length cap (default: the model's, capped by the pool)")
    parser.add_argument("--kv-cache-dtype",
                        help="KV pool dtype: 'auto' (= --dtype, the default) or 'int8' (int8 "
                             "K/V with a float32 scale per token per KV head: ~1.9x the blocks "
                             "of bf16 in the same --kv-cache-memory; the model still computes "
                             "in --dtype)")
    parser.add_argument("--no-prefix-caching", "--no-enable-prefix-caching",
                        dest="enable_prefix_caching", action="store_false",
                        help="turn prefix reuse off (default on)")
    parser.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                        action="store_const", const=True,
                        help="vLLM's flag: prefix reuse on, also over a config's "
                             "service.kv_cache_reuse: false (default on)")
    parser.add_argument("--prefix-index", choices=("hash", "radix"),
                        help="prefix index of the KV manager: hash chain (default) or radix tree")
    parser.add_argument("--hash-algorithm", choices=("xxh3_128", "sha256"),
                        help="block-hash digest (one per deployment; default xxh3_128)")
    parser.add_argument("--kv-offload",
                        metavar="host=SIZE[,store=mooncake@HOST:PORT]",
                        help="tiers below the KV pool: committed blocks are copied to host "
                             "memory in the background and promoted back on a prefix hit "
                             "instead of recomputed; blocks the host tier pushes out go to the "
                             "Mooncake Store of that mooncake_master (shared by every engine "
                             "pointed at it); write=through sends every block to the store at "
                             "once. Also segment=SIZE (RAM lent to the store, default "
                             "64MiB), queue=N (offload queue bound, default 256), "
                             "timeout=SECONDS (a promotion's wait, default 5); "
                             "see docs/kthena_serve.md (default: none)")


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Tensor, pipeline and sequence parallelism, and TP overlap."""
    parser.add_argument("--tp", "--tensor-parallel-size", type=int,
                        help="tensor-parallel ranks (one core each; default 1)")
    parser.add_argument("--pp", "--pipeline-parallel-size", type=int,
                        help="pipeline-parallel stages (layers split into PP stages, each of "
                             "--tp ranks; tp x pp processes; default 1)")
    parser.add_argument("--sp", type=int,
                        help="sequence parallelism: 1 (off, the default) or --tp: a long "
                             "prompt's tokens are split over the TP ranks for norms, residuals "
                             "and the embedding (all-gather before, reduce-scatter after each "
                             "sharded matmul); not with --pp > 1 or --mode pd")
    parser.add_argument("--sp-min-tokens", type=int, metavar="N",
                        help="with --sp > 1, forwards of fewer than N tokens (and every "
                             f"decode) run as plain TP (default {_default('sp_min_tokens')})")
    parser.add_argument("--tp-overlap", action="store_true",
                        help="with --tp > 1, run each row-parallel matmul and its all-reduce "
                             "(with --sp, each all-gather + matmul and matmul + reduce-scatter) "
                             "as one MC2 op overlapping communication and compute: tiled on "
                             "cpu (gloo gives no overlap there), torch symm_mem async-TP on "
                             "cuda, torch_npu MC2 on npu (both unverified); the YAML's "
                             "parallelism.fused_communication (default off)")
    parser.add_argument("--tp-overlap-tiles", type=int, metavar="N",
                        help="with --tp-overlap, row tiles of the tiled op (default: the "
                             "device's, 1 on cpu)")
    parser.add_argument("--enable-expert-parallel", "--ep", dest="expert_parallel",
                        action="store_true",
                        help="with --tp > 1 and an MoE model, split the experts whole over "
                             "the TP ranks (EP = tp; tp must divide the experts) instead of "
                             "each expert over every rank (default off)")
    parser.add_argument("--pipeline-split-points", type=split_points_arg, metavar="L1[,L2...]",
                        help="where pipeline stages 1..PP-1 start: their first layer indices, "
                             "strictly increasing (--pp 2 --pipeline-split-points 10: layers "
                             "0..9 on stage 0, the rest on stage 1); default: equal stages")


class _RefusedFlag(argparse.Action):
    """A vLLM flag that has no meaning here: giving it is a usage error saying what to use
    instead (``instead``), so a vLLM command line does not run with a setting silently
    dropped."""

    def __init__(self, option_strings: list[str], dest: str, *, instead: str,
                 **kwargs: object) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.instead = instead

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        parser.error(f"{option_string} is not supported: {self.instead}")


def split_points_arg(text: str) -> tuple[int, ...]:
    """``--pipeline-split-points 10,20`` as (10, 20); the engine config checks count and order.

    Raises:
        argparse.ArgumentTypeError: not comma-separated ints.
    """
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not comma-separated layer indices, e.g. 10 or 10,20") from None


def add_api_key_args(parser: argparse.ArgumentParser, key: str) -> None:
    """``--api-key`` and ``--api-key-file``: ``key`` says whose key it is; either wins over
    $KTHENA_API_KEY (``kthena_serve.deployment.api_key`` reads the three)."""
    parser.add_argument("--api-key", help=f"{key} (visible in ps: prefer --api-key-file or "
                                          "$KTHENA_API_KEY)")
    parser.add_argument("--api-key-file", help="read the API key from this file (first line)")


def add_public_metrics_arg(parser: argparse.ArgumentParser, credential: str) -> None:
    """``--public-metrics`` (``kthena serve``, the PD router, PD workers): /metrics without
    ``credential``, as vLLM's --api-key guards only /v1; everything else still needs it."""
    parser.add_argument("--public-metrics", action="store_true",
                        help=f"serve GET /metrics without {credential} (the Kthena router and "
                             "Prometheus scrape without credentials; it shows totals only, see "
                             "docs/security.md); every other route still needs it (default: "
                             "off)")


def curl_line(host: str, port: int, model_name: str, with_key: bool) -> str:
    """A chat request that works against the server just started."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    body = {"model": model_name, "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of Japan?"}]}
    auth = ' -H "Authorization: Bearer $KTHENA_API_KEY"' if with_key else ""
    return (f"curl http://{shown}:{port}/v1/chat/completions -H 'Content-Type: application/json'"
            f"{auth} -d {shlex.quote(json.dumps(body))}")


def check_tool_call_parser(name: str) -> str:
    """``name`` if it names a tool-call parser.

    Raises:
        ValueError: one line naming the allowed parsers.
    """
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser: {name!r} is not a tool-call parser; allowed: "
                         f"{', '.join(TOOL_CALL_PARSERS)}")
    return name


class _AcceptedFlag(argparse.Action):
    """A vLLM flag that asks for what this server always does: accepted, nothing stored."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        pass


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's tool-calling flags: the wire format chat output is parsed in, and the switch vLLM
    needs for ``tool_choice: auto`` (always on here)."""
    parser.add_argument("--tool-call-parser", metavar="NAME",
                        help="how chat output is parsed into tool calls, as the model writes "
                             f"them: {', '.join(TOOL_CALL_PARSERS)} (vLLM's names; default "
                             "hermes: <tool_call> blocks); in every mode (colocated, --dp, "
                             "--mode pd)")
    parser.add_argument("--enable-auto-tool-choice", action=_AcceptedFlag,
                        help="vLLM's flag, accepted: tool_choice auto is always served here "
                             "(parsed by --tool-call-parser)")


def add_structured_output_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's server-wide structured-output setting."""
    parser.add_argument("--structured-outputs-config", metavar="JSON",
                        help="server-wide structured outputs, as a JSON object; its one key "
                             "disable_any_whitespace (default true: JSON constraints produce "
                             "compact JSON; false: any whitespace between JSON's tokens) is "
                             "what a request's structured_outputs.disable_any_whitespace "
                             "defaults to (a request that sets it wins), in every mode")


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """The public server's connection timeouts (run_server's ``keep_alive_s`` /
    ``header_timeout_s``); ``ServeSpec.resolve`` refuses a value that is not positive."""
    parser.add_argument("--timeout-keep-alive", type=float, metavar="SECONDS",
                        help="close a connection idle between requests after SECONDS "
                             "(uvicorn's flag; default 75)")
    parser.add_argument("--timeout-header-read", type=float, metavar="SECONDS",
                        help="close a connection that has not sent a complete request header "
                             "SECONDS after it opened (or after its next request's first "
                             "byte); a request whose header came in time runs as long as it "
                             "needs (default 30)")


def add_kv_events_args(parser: argparse.ArgumentParser) -> None:
    """The flags of KV-cache-aware routing data for the Kthena router (docs/kv_events.md)."""
    parser.add_argument("--kv-events", metavar="redis://HOST:PORT",
                        help="publish the KV cache's router chunks to this Redis (the Kthena "
                             "router's kvcache-aware plugin reads it); needs --pod-name")
    parser.add_argument("--pod-name", metavar="NAME.NAMESPACE",
                        help="this server's owner name in those keys: its pod's name and "
                             "namespace, as the router names candidate pods")
    parser.add_argument("--kv-events-chunk-size", type=int,
                        help="tokens per router chunk (the plugin's blockSizeToHash; default 16)")
    parser.add_argument("--kv-events-max-chunks", type=int,
                        help="leading chunks the router matches (the plugin's "
                             "maxBlocksToMatch; default 128)")
