"""Grammars: ``StructuredOutputsParams`` compiled by xgrammar (cached), matched, turned into the
token bitmask the sampler applies.

::

    API layer  Grammars.compile(spec)        off the engine thread (asyncio.to_thread); an LRU
                                             keyed by the spec; a bad spec: InvalidRequestError
    engine     Grammars.matcher(spec)        one xgrammar GrammarMatcher per live request
               Grammars.fill_bitmask(rows)   int32 [rows, ceil(vocab / 32)]: bit j of a row set
                                             = token j may come next (unconstrained rows: all set)
    sampler    apply_token_bitmask(...)      -inf where the bit is clear, for the whole batch
    engine     matcher.accept_token(token)   with each sampled token; terminated: "stop"

The vocabulary xgrammar matches against is this server's tokenizer's own (``TokenizerInfo``
from each token's exact bytes; special tokens are never text, the EOS ids end a grammar). Ids
past the tokenizer's (a model's padded vocabulary) are masked.

xgrammar is imported on first use. Its wheel declares triton, which CPU serving does not need,
so it is installed with ``--no-deps`` (``INSTALL``); it imports transformers when it is
imported, which kthena_serve declares as a dependency of its own.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kthena_serve.engine.errors import InvalidRequestError
from kthena_serve.engine.structured_output import StructuredOutputsParams

if TYPE_CHECKING:
    from kthena_serve.model import Tokenizer

__all__ = ["INSTALL", "Grammars", "apply_token_bitmask", "apply_token_bitmask_reference",
           "choice_grammar", "xgrammar_problem"]

INSTALL = 'pip install --no-deps "xgrammar==0.2.8" "apache-tvm-ffi>=0.1.11"'
_CACHE_SIZE = 256  # compiled grammars kept (a compiled JSON schema is tens of KiB)
_LOCATION = re.compile(r"^\s*(\[[\d:]+\]\s*)?\S+\.(cc|h|cpp):\d+:\s*")  # xgrammar's C++ prefix


def xgrammar_problem() -> str | None:
    """Why xgrammar cannot be imported here, with the import's own error and the fix; None
    when it imports (``kthena doctor``'s structured_output check, and every 400 it causes)."""
    try:
        import xgrammar  # noqa: F401
    except ImportError as error:
        if error.name == "xgrammar":
            return (f"xgrammar is not installed; install it with {INSTALL} (no deps: its "
                    "declared triton is not needed; transformers, which it imports, comes "
                    "with kthena_serve)")
        return (f"xgrammar is installed but its import failed ({type(error).__name__}: "
                f"{error}); install what it names, or reinstall it with {INSTALL}")
    return None


def _xgrammar() -> Any:
    problem = xgrammar_problem()
    if problem is not None:
        raise InvalidRequestError(f"structured output needs xgrammar: {problem}",
                                  "structured_outputs")
    import xgrammar

    return xgrammar


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (vLLM's escaping)."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}

    def literal(text: str) -> str:
        return "".join(escapes.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F
                                          else c) for c in text)

    return "root ::= " + " | ".join(f'"{literal(c)}"' for c in choices)


class Grammars:
    """Compiles specs for one tokenizer (thread-safe) and builds matchers and bitmasks.

    Args:
        tokenizer: the model's tokenizer (its bytes per token and EOS ids).
        vocab_size: the model's vocabulary (logits width; may exceed the tokenizer's), or a
            function that returns it (read at the first compile).
        cache_size: compiled grammars kept, least recently used evicted first.
        max_threads: threads xgrammar may use for one compile, and to fill a batch's bitmask
            (rows in parallel; the engine passes its torch threads: idle while it fills).
        serialize: also keep each compiled grammar as xgrammar's JSON (``serialized``), made
            where it was compiled: a front whose engine runs in another process sends it
            there (``load``), so the engine never compiles on its loop.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | Callable[[], int], *,
                 cache_size: int = _CACHE_SIZE, max_threads: int = 2,
                 serialize: bool = False) -> None:
        self.tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.cache_size = cache_size
        self.max_threads = max_threads
        self.serialize = serialize
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[StructuredOutputsParams, Any] = (
            collections.OrderedDict())
        self._json: dict[StructuredOutputsParams, str] = {}  # with serialize: the cache's JSON
        self._compiler: Any = None
        self._info: Any = None  # the compiler's xgrammar TokenizerInfo
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher: fills rows on max_threads
        self.num_compiled = 0  # compiles run (cache misses)

    @property
    def vocab_size(self) -> int:
        """The bitmask's vocabulary: the model's, at least the tokenizer's."""
        size = self._vocab_size if isinstance(self._vocab_size, int) else self._vocab_size()
        return max(size, self.tokenizer.vocab_size)

    def compile(self, spec: StructuredOutputsParams, param: str = "structured_outputs") -> Any:
        """The compiled grammar of ``spec`` (cached; slow on a miss: not on the engine thread).

        Raises:
            InvalidRequestError: the spec does not compile (the message is the compiler's,
                ``param`` names the request field it came from), or xgrammar is missing.
        """
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
        compiled = self._compile(spec, param)
        text = compiled.serialize_json() if self.serialize else None
        with self._lock:
            self.num_compiled += 1
            self._keep(spec, compiled, text)
        return compiled

    def serialized(self, spec: StructuredOutputsParams) -> str:
        """``spec``'s compiled grammar as xgrammar's JSON (compiled first on a miss; made then
        and kept with ``serialize``, else made now)."""
        with self._lock:
            text = self._json.get(spec)
        return text if text is not None else self.compile(spec).serialize_json()

    def load(self, spec: StructuredOutputsParams, text: str) -> None:
        """Keep ``text`` (``serialized``'s JSON, made in another process over the same
        tokenizer) as ``spec``'s compiled grammar, unless one is kept already."""
        with self._lock:
            if spec in self._cache:
                return
        self._xgr_compiler()  # and its TokenizerInfo
        compiled = _xgrammar().CompiledGrammar.deserialize_json(text, self._info)
        with self._lock:
            self._keep(spec, compiled, None)

    def _keep(self, spec: StructuredOutputsParams, compiled: Any, text: str | None) -> None:
        """Cache ``compiled`` (and its JSON) as the newest entry; the lock is held."""
        self._cache[spec] = compiled
        self._cache.move_to_end(spec)
        if text is not None:
            self._json[spec] = text
        while len(self._cache) > self.cache_size:
            old, _ = self._cache.popitem(last=False)
            self._json.pop(old, None)

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh ``xgrammar.GrammarMatcher`` at the start of ``spec``'s language."""
        return _xgrammar().GrammarMatcher(self.compile(spec))

    def fill_bitmask(self, matchers: Sequence[Any | None]) -> torch.Tensor | None:
        """The next-token bitmask of a batch: int32 [len(matchers), ceil(vocab / 32)] on the
        CPU, row i from ``matchers[i]`` (all bits set where it is None); None if all are.

        A row is cheap where xgrammar precomputed the grammar state's mask (~10 us) and costs
        a pass over the vocabulary where it did not (~10 ms, e.g. inside a string with a
        ``maxLength``): several rows are filled in parallel on ``max_threads``."""
        rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return None
        bitmask = torch.full((len(matchers), -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        if len(rows) == 1 or self.max_threads == 1:
            for row in rows:
                matchers[row].fill_next_token_bitmask(bitmask, row)
            return bitmask
        if self._batch is None:
            self._batch = _xgrammar().BatchGrammarMatcher(self.max_threads)
        self._batch.batch_fill_next_token_bitmask([matchers[r] for r in rows], bitmask, rows)
        return bitmask

    # ---- compiling ------------------------------------------------------------------------------
    def _xgr_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo(self._encoded_vocab(), xgr.VocabType.RAW,
                                         vocab_size=self.vocab_size,
                                         stop_token_ids=sorted(self.tokenizer.eos_token_ids))
                # one cache (ours, keyed by the spec): xgrammar's own is off
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads,
                                                     cache_enabled=False)
                self._info = info
            return self._compiler

    def _encoded_vocab(self) -> list[bytes]:
        """Each id's exact bytes; b"" for special tokens (xgrammar's mark: never text)."""
        special = self.tokenizer.special_tokens
        out = []
        for token_id in range(self.tokenizer.vocab_size):
            try:
                (name,) = self.tokenizer.token_strs([token_id])
                out.append(b"" if name in special else self.tokenizer.token_bytes([token_id])[0])
            except ValueError:  # a hole in the vocabulary: no text
                out.append(b"")
        return out

    def _compile(self, spec: StructuredOutputsParams, param: str) -> Any:
        compiler = self._xgr_compiler()
        kind = spec.kind
        try:
            if kind in ("json", "json_object"):
                schema = _bounded_strings(spec.json) if kind == "json" else '{"type":"object"}'
                # vLLM's: no space, also after separators; None (no server filled it in): compact
                tight = spec.disable_any_whitespace is not False
                return compiler.compile_json_schema(schema, any_whitespace=not tight,
                                                    separators=(",", ":") if tight else None)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choice))
            if kind == "grammar":
                return compiler.compile_grammar(spec.grammar)
            return self._compile_tag(compiler, spec.structural_tag)
        except (RuntimeError, ValueError, TypeError, KeyError) as error:
            message = _LOCATION.sub("", str(error).strip().splitlines()[0] if str(error).strip()
                                    else type(error).__name__)
            raise InvalidRequestError(f"{param}: the {kind} constraint does not compile: "
                                      f"{message}", param) from None

    @staticmethod
    def _compile_tag(compiler: Any, text: str) -> Any:
        """A structural tag: xgrammar's format, or vLLM's legacy ``{structures, triggers}``."""
        tag = json.loads(text)
        if isinstance(tag, dict) and "structures" in tag:
            xgr = _xgrammar()
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=_bounded_strings(
                json.dumps(s["schema"])), end=s["end"]) for s in tag["structures"]]
            return compiler.compile_structural_tag(items, tag["triggers"])
        return compiler.compile_structural_tag(json.dumps(_tag_strings(tag)))


# ---- xgrammar 0.2.8's strings with a length --------------------------------------------------
# A string schema with minLength / maxLength compiles to ``"[^"\\\r\n]{m,n}"``, which lets
# control characters through (JSON forbids them raw: the output would not parse). The same
# bound as a pattern compiles to the class below, which excludes them; like xgrammar's own
# rule it takes no escapes.
_NOT_DATA = frozenset({"enum", "const", "default", "examples"})  # values, not schemas


def _bounded_strings(schema_text: str) -> str:
    """The schema with each length-bounded string as a pattern (what xgrammar compiles)."""
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError:
        return schema_text  # xgrammar says what is wrong with it
    return json.dumps(_strings(schema))


def _strings(node: Any) -> Any:
    if isinstance(node, list):
        return [_strings(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _NOT_DATA else _strings(v) for k, v in node.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and _NOT_DATA.isdisjoint(out) \
            and "pattern" not in out and "format" not in out:
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{high}}}$'
    return out


def _tag_strings(node: Any) -> Any:
    """A structural tag with its ``json_schema`` contents' strings as ``_strings`` makes them."""
    if isinstance(node, list):
        return [_tag_strings(item) for item in node]
    if not isinstance(node, dict):
        return node
    return {k: _strings(v) if k == "json_schema" and isinstance(v, dict) else _tag_strings(v)
            for k, v in node.items()}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: Sequence[int]) -> None:
    """Set ``logits[r, j] = -inf`` where bit j of ``bitmask[r]`` is clear, for r in ``rows``
    (in place; ids past the bitmask are masked too). CPU: xgrammar's kernel; else the torch
    reference."""
    if not rows:
        return
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous():
        apply_token_bitmask_reference(logits, bitmask.to(logits.device), rows)
        return
    from xgrammar.kernels.apply_token_bitmask_inplace_cpu import apply_token_bitmask_inplace_cpu

    width = min(logits.shape[1], bitmask.shape[1] * 32)
    apply_token_bitmask_inplace_cpu(logits, bitmask, width, list(rows))
    if logits.shape[1] > width:  # a padded model vocabulary: ids no token spells
        logits[list(rows), width:] = float("-inf")


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor,
                                  rows: Sequence[int]) -> None:
    """Pure PyTorch ``apply_token_bitmask`` (any device; the parity reference)."""
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask[index].unsqueeze(-1) >> shifts) & 1  # [R, words, 32], bit j of word w
    allowed = bits.flatten(1).bool()[:, : logits.shape[1]]
    if allowed.shape[1] < logits.shape[1]:
        pad = torch.zeros(len(rows), logits.shape[1] - allowed.shape[1], dtype=torch.bool,
                          device=logits.device)
        allowed = torch.cat([allowed, pad], dim=1)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
