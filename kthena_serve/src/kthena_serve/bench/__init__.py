"""kthena_serve's benchmarks: measure the serving code, never part of it.

Every module here may import the serving modules; no serving module imports this package (an
import-linter contract in the root pyproject.toml; only ``kthena_serve.cli`` may). Modules:

* ``cli``       ``kthena bench serve``, ``soak``, ``layouts``, ``kv``, ``trace``, ``tp-overlap`` and
  ``moe`` (entry point ``bench-serve``)
* ``serve``     ``kthena bench serve``: the engine on three workloads vs transformers / vLLM
* ``peer``      the ``--peer vllm`` system, run from its own venv as a child process
* ``llama_cpp`` the ``--peer llama.cpp`` system: ``llama-server`` on the model's GGUF, its client
* ``children``  a benchmark's server child: own process group, log, ``/health``, warm-up
* ``limits``    the machine's bandwidth and matmul peak, and each workload's roofline
* ``plot``      ``kthena bench serve``'s table and PNG
* ``trace``     ``kthena bench trace``: a Mooncake trace replayed by vLLM's client vs ``vllm serve``
  or ``llama-server``
* ``trace_window``  the trace window, scaled to a small model and machine (Mooncake's format)
* ``trace_report``  the trace bench's figures, ours / vLLM ratios, table and latency CDFs
* ``soak``      ``kthena bench soak``: N streaming clients against one server for T minutes
* ``overload``  ``kthena bench soak --overload``: 4x the sustainable load, TTFT vs the queue bound
* ``layouts``   ``kthena bench layouts``: TP / PP / DP layouts measured vs the planner
* ``kv``        ``kthena bench kv``: multi-turn chat over a small KV pool, tiered offload
* ``model``     ``python -m kthena_serve.bench.model``: the model's batch-1 decode step alone
* ``grammar``   ``python -m kthena_serve.bench.grammar``: decode step time with and without grammars
* ``gguf_decode``  ``python -m kthena_serve.bench.gguf_decode``: batch-1 decode, bf16 / GGUF / int8
* ``moe``       ``kthena bench moe``: a tiny MoE model vs the dense model of equal active parameters
* ``pd``        ``python -m kthena_serve.bench.pd``: PD vs colocated, handoff cost vs KV bytes
* ``pd_plot``   the PD benchmark's figure
* ``kv_move``   ``python -m kthena_serve.bench.kv_move``: article B's KV-move table
* ``machine``   what every benchmark records about the machine it ran on
* ``optional``  matplotlib and transformers: present, or skipped with one line
* ``netns``     two network namespaces as two "hosts" (``kv_move --netns``, multi-host tests)
"""
