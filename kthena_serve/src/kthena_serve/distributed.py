"""The source article's Python entry points, over the serving path that already exists.

    config = load_config("kthena_config.yaml")                      # kthena_core's loader
    model = DistributedModel("default", tp_size=2, enable_kv_cache_reuse=True)
    model.generate("The capital of France is")                      # offline: an LLM
    launch_distributed_inference(lambda: model, config)             # kthena serve --config

Nothing here is a second engine or server. ``DistributedModel`` is an ``EngineConfig`` plus an
``LLM`` built on first use; ``launch_distributed_inference`` is ``kthena serve --config FILE``
(the same ``ServeSpec.resolve`` and the same ``serve``), with the arguments the caller gave
``DistributedModel`` as the flags, so they override the config and the plan decides the rest:

    DistributedModel(model=...)                   -> model (--model)
    tp_size / pp_size                             -> tp / pp (--tp / --pp)
    enable_kv_cache_reuse                         -> enable_prefix_caching (--no-prefix-caching)
    any other EngineConfig field with a flag      -> that field (max_num_seqs: --max-num-seqs)
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from kthena_core.config import KthenaConfig, load_config
from kthena_serve.engine.config import SETTINGS, ConfigError, EngineConfig

if TYPE_CHECKING:
    from kthena_serve.engine.request import RequestOutput
    from kthena_serve.engine.sampling_params import SamplingParams
    from kthena_serve.llm import LLM

__all__ = ["DistributedArgumentError", "DistributedModel", "launch_distributed_inference",
           "load_config"]

# EngineConfig fields with a DistributedModel argument of their own (the rest go in **kwargs).
_ARGUMENTS = {"model": "model", "tp": "tp_size", "pp": "pp_size",
              "enable_prefix_caching": "enable_kv_cache_reuse"}
# The same sentence kthena_core's loader gives for ``service.api_type: grpc``.
_NO_FLAG_HINTS = {"num_kv_blocks": "size the served pool with the config's kv_cache.max_tokens "
                                    "or with kv_cache_memory="}
_HTTP_ONLY = ("http (the OpenAI-compatible HTTP API is the only one served; there is no gRPC "
              "server)")


class DistributedArgumentError(ValueError):
    """An argument of ``DistributedModel`` or ``launch_distributed_inference`` is refused.

    The message reads ``<argument>: <what was wrong>; <what is allowed>``.

    Attributes:
        argument: the argument's name (``tp_size``, ``model``, ``service_type`` ...).
    """

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument


class DistributedModel:
    """A model and the parallel layout to run it with; an offline ``generate`` API.

    The engine (and its ``tp_size * pp_size`` processes) is built on the first ``generate`` or
    ``chat``, not here, so a model handed to ``launch_distributed_inference`` is loaded once, by
    the server.

    Args:
        model: ``"default"`` (SmolLM2-135M-Instruct), a Hugging Face checkpoint folder, or a
            transformers model loaded from a local folder (``from_pretrained(FOLDER)``): its
            weights are read again from that folder, so changes made in memory only are not
            served (``save_pretrained`` them first).
        tp_size: tensor-parallel ranks; None: 1 offline, the config's plan when served.
        pp_size: pipeline stages (``tp_size * pp_size`` processes); None as for ``tp_size``.
        enable_kv_cache_reuse: reuse cached prompt blocks across requests; None: True offline,
            the config's ``service.kv_cache_reuse`` when served.
        **engine_kwargs: other ``EngineConfig`` fields (``max_num_seqs``, ``kv_cache_memory``,
            ``dtype`` ...). When served, each needs a ``kthena serve`` flag of the same name.

    Raises:
        DistributedArgumentError: a value ``EngineConfig`` refuses (named by this argument), an
            unknown keyword, or a model with no checkpoint folder behind it.
    """

    def __init__(self, model: Any, tp_size: int | None = None, pp_size: int | None = None,
                 enable_kv_cache_reuse: bool | None = None, **engine_kwargs: Any) -> None:
        _check_keywords(engine_kwargs)
        given = {"tp": tp_size, "pp": pp_size, "enable_prefix_caching": enable_kv_cache_reuse}
        choices = {"model": _checkpoint(model), **engine_kwargs,
                   **{field: value for field, value in given.items() if value is not None}}
        try:
            self._config = EngineConfig(**choices)
        except ConfigError as error:
            raise DistributedArgumentError(_ARGUMENTS.get(error.field, error.field),
                                           str(error)) from None
        self._choices = MappingProxyType(choices)
        self._llm: LLM | None = None

    @property
    def engine_config(self) -> EngineConfig:
        """The ``EngineConfig`` offline generation uses (unset choices at their defaults)."""
        return self._config

    @property
    def explicit_choices(self) -> Mapping[str, Any]:
        """The ``EngineConfig`` fields the caller set (by field name); only these override a
        config when served."""
        return self._choices

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """``LLM.generate``: run every prompt to completion; outputs in prompt order."""
        return self._loaded().generate(prompts, params)

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        """``LLM.chat``: one chat turn through the model's chat template."""
        return self._loaded().chat(messages, params)

    def close(self) -> None:
        """Stop the offline engine and its worker processes, if one was built (idempotent)."""
        if self._llm is not None:
            self._llm.close()
            self._llm = None

    def __enter__(self) -> DistributedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        shown = ", ".join(f"{_ARGUMENTS.get(key, key)}={value!r}"
                          for key, value in self._choices.items())
        return f"DistributedModel({shown})"

    def _loaded(self) -> LLM:
        if self._llm is None:
            from kthena_serve.llm import LLM

            self._llm = LLM(**self._choices)
        return self._llm


def launch_distributed_inference(model_init_fn: Callable[..., Any],
                                 config: str | os.PathLike[str] | KthenaConfig | Mapping[str, Any],
                                 service_type: str = "http") -> int:
    """Serve a model over the OpenAI HTTP API exactly as ``kthena serve --config FILE`` does.

    The config is planned and the plan printed; the plan and the config's keys set tp, pp, dp,
    PD, the pool and the address. The arguments the caller gave the ``DistributedModel``
    (``explicit_choices``) then win over the config, as explicit command-line flags do, and
    ``kthena serve`` prints which ones did. Blocks until SIGTERM or SIGINT, then drains like
    ``kthena serve`` (run it as a script's main program: the signals go to the main thread).

    The server builds its own engine: a model already used offline keeps its engine until its
    ``close()``. Run as one process (``python serve.py``), it starts its tp x pp workers itself;
    under ``kthena-run`` (WORLD_SIZE > 1) every rank runs the script, and ``kthena serve``'s
    launcher rule applies: rank 0 serves the API, the others run its steps.

    Args:
        model_init_fn: called once, with no arguments or, as in the seed's API, with
            ``(rank, world_size)`` (this process's rank under ``kthena-run``; 0 and 1 run as
            one process); returns a ``DistributedModel`` or a checkpoint path (``"default"``
            or a folder).
        config: a ``kthena_config.yaml`` path (relative paths in it are relative to the file),
            a ``KthenaConfig`` or a mapping (relative paths are relative to the current folder).
        service_type: ``"http"``; gRPC is refused, as in the config's ``service.api_type``.

    Returns:
        The exit status ``kthena serve`` would have: 0 after a clean shutdown, 2 when the plan
        cannot be served (the reason is printed).

    Raises:
        DistributedArgumentError: a bad ``service_type``, ``model_init_fn`` or ``config`` type,
            or a ``DistributedModel`` choice with no ``kthena serve`` flag.
        kthena_core.config.ConfigError: the config is invalid (checked before the model).
    """
    if service_type != "http":
        raise DistributedArgumentError("service_type", f"got {service_type!r}; allowed: "
                                       f"{_HTTP_ONLY}")
    if not callable(model_init_fn):
        raise DistributedArgumentError("model_init_fn", f"got a {type(model_init_fn).__name__}; "
                                       "allowed: a function returning the DistributedModel "
                                       "(e.g. lambda: model)")
    from kthena_serve.deployment import launcher_world, resolve_spec, serve
    from kthena_serve.serve_args import ENGINE_FLAG_FIELDS

    with _config_path(config) as path:
        model = _init_model(model_init_fn)
        for field in model.explicit_choices:
            if field not in ENGINE_FLAG_FIELDS:
                raise DistributedArgumentError(
                    field, "kthena serve has no flag for it, so the server cannot take it; "
                    + _NO_FLAG_HINTS.get(field, "leave it out of the DistributedModel you serve"))
        print(f"launch_distributed_inference: {model!r} serves as kthena serve --config "
              f"FILE {_flags(model.explicit_choices)}".rstrip(), file=sys.stderr, flush=True)
        try:
            spec = resolve_spec(dict(model.explicit_choices), path, launcher_world())
        except ValueError as error:
            print(f"kthena serve: {error}", file=sys.stderr)
            return 2
        return serve(spec)


# ---- helpers ------------------------------------------------------------------------------------
def _flags(choices: Mapping[str, Any]) -> str:
    """The ``kthena serve`` flags that set ``choices`` (what the server is really given)."""
    from kthena_serve.serve_args import flag_name

    words = []
    for field, value in choices.items():
        flag = flag_name(field, value)
        if field == "enable_prefix_caching" or value is True:
            words.append(flag)  # the flag is the value
        else:  # a switch set off has no flag: the setting is named instead
            words.append(f"{field}=False" if value is False else f"{flag} {value}")
    return " ".join(words)


def _check_keywords(engine_kwargs: Mapping[str, Any]) -> None:
    fields = sorted(SETTINGS - set(_ARGUMENTS))
    for key in engine_kwargs:
        if key in _ARGUMENTS:
            raise DistributedArgumentError(key, f"pass it as {_ARGUMENTS[key]}=")
        if key not in fields:
            raise DistributedArgumentError(key, "unknown keyword argument; allowed: tp_size, "
                                           "pp_size, enable_kv_cache_reuse and the EngineConfig "
                                           f"fields {', '.join(fields)}")


def _checkpoint(model: Any) -> str:
    """The checkpoint ``model`` names: ``"default"``, a folder, or a transformers model's own."""
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not isinstance(path, str):
            raise DistributedArgumentError("model", f"got {model!r}; allowed: a str path")
        return path if path == "default" else _check_folder(path, "")
    folder = getattr(model, "name_or_path", None)
    if folder is None:
        folder = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not isinstance(folder, str):
        raise DistributedArgumentError("model", f"got a {type(model).__name__}; allowed: "
                                       "'default', a checkpoint folder, or a transformers model "
                                       "loaded from a local folder")
    if not folder or not os.path.isdir(folder):
        raise DistributedArgumentError(
            "model", f"this {type(model).__name__} has no local folder behind it (name_or_path "
            f"{folder!r} is not a folder here); save it with model.save_pretrained(FOLDER) and "
            "pass FOLDER")
    return _check_folder(folder, f"the {type(model).__name__}'s folder ")


def _check_folder(folder: str, what: str) -> str:
    from kthena_serve.model import CheckpointError, resolve_checkpoint

    try:
        resolve_checkpoint(folder)
    except CheckpointError as error:
        raise DistributedArgumentError("model", f"{what}{error}") from None
    return folder


def _init_model(model_init_fn: Callable[..., Any]) -> DistributedModel:
    """Call ``model_init_fn`` as it asks: with no arguments, or with ``(rank, world_size)``
    as the seed's API does (this process's launcher rank; 0 and 1 without a launcher)."""
    from kthena_serve.deployment import launcher_rank

    wanted = _positional_parameters(model_init_fn)
    if wanted == 0:
        model = model_init_fn()
    elif wanted == 2:
        model = model_init_fn(*launcher_rank())
    else:
        raise DistributedArgumentError("model_init_fn", f"takes {wanted} positional "
                                       "arguments; allowed: none, or (rank, world_size)")
    if isinstance(model, DistributedModel):
        return model
    if isinstance(model, (str, os.PathLike)):
        return DistributedModel(model)
    raise DistributedArgumentError("model_init_fn", f"returned a {type(model).__name__}; "
                                   "allowed: a DistributedModel or a checkpoint path")


def _positional_parameters(fn: Callable[..., Any]) -> int:
    """How many positional arguments ``fn`` requires (2 if it takes ``*args``)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: call it bare
        return 0
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return 2
    return sum(1 for p in parameters if p.kind in kinds and p.default is p.empty)


@contextlib.contextmanager
def _config_path(config: Any) -> Iterator[str]:
    """A path ``kthena serve --config`` reads: the caller's file, or a temporary copy of a
    loaded config (validated here, so a bad one fails before the model loads)."""
    if isinstance(config, (str, os.PathLike)):
        load_config(config)
        yield os.fspath(config)
        return
    if isinstance(config, KthenaConfig):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise DistributedArgumentError("config", f"got a {type(config).__name__}; allowed: a "
                                       "kthena_config.yaml path, a KthenaConfig or a mapping")
    data = load_config(config).to_dict()
    _absolute_paths(data)
    import yaml

    with tempfile.TemporaryDirectory(prefix=f"kthena-config-{os.getpid()}-") as folder:
        path = os.path.join(folder, "kthena_config.yaml")
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(data, f)
        yield path


def _absolute_paths(data: dict[str, Any]) -> None:
    """Paths in a mapping are relative to the current folder; the copy lives elsewhere."""
    model, cluster = data["model"], data["cluster"]
    if model["checkpoint_path"] != "default":
        model["checkpoint_path"] = os.path.abspath(os.path.expanduser(model["checkpoint_path"]))
    if cluster["topology"].endswith((".yaml", ".yml")):
        cluster["topology"] = os.path.abspath(cluster["topology"])
