"""`Tokenizer` (tokenizers + a jinja2 chat template) and `IncrementalDetokenizer` for streaming.

A checkpoint folder supplies ``tokenizer.json`` (the `tokenizers` model), ``tokenizer_config.json``
(special tokens, BOS flag, usually the chat template), optionally ``chat_template.jinja`` and
``generation_config.json`` (extra end-of-sequence ids).
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders as _decoders

from kthena_serve.model.errors import ChatTemplateError, CheckpointError

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_REPLACEMENT = "\ufffd"  # what a decode of incomplete UTF-8 bytes ends with


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def _token_text(value: Any) -> str | None:
    # tokenizer_config spells a special token as a string or as an AddedToken dict.
    return value.get("content") if isinstance(value, Mapping) else value


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the character that spells each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF = _byte_level_alphabet()


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template rejected the messages: {message}")


def _compile_template(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _pick_template(value: str | list[dict[str, str]] | None) -> str | None:
    if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
        named = {item.get("name"): item.get("template") for item in value}
        return named.get("default") or next(iter(named.values()), None)
    return value


class Tokenizer:
    """Text <-> token ids for one checkpoint, plus its chat template.

    Attributes:
        eos_token_ids: ids that end generation (tokenizer EOS and generation_config's).
        bos_token_id: the BOS id, or None.
        vocab_size: number of ids, added tokens included.
    """

    def __init__(self, backend: _HFTokenizer, config: Mapping[str, Any],
                 extra_eos_ids: Sequence[int] = (), chat_template: str | None = None) -> None:
        self._backend = backend
        self._special = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}
        self._add_bos = bool(config.get("add_bos_token", False))
        self.bos_token_id = self.token_to_id(self._special["bos_token"])
        eos = self.token_to_id(self._special["eos_token"])
        self.eos_token_ids = frozenset({*extra_eos_ids, *([eos] if eos is not None else [])})
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        self.special_tokens = frozenset(
            t.content for t in backend.get_added_tokens_decoder().values() if t.special)
        self._literal_lock = threading.Lock()
        self._is_byte_level = isinstance(backend.decoder, _decoders.ByteLevel)
        self._added_ids = frozenset(backend.get_added_tokens_decoder())
        self._bytes: dict[int, bytes] = {}

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike[str]) -> Tokenizer:
        """Read ``tokenizer.json`` and its companions from a checkpoint folder.

        Raises:
            CheckpointError: ``tokenizer.json`` is missing or a JSON file is malformed.
        """
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise CheckpointError(f"{folder} has no tokenizer.json; a checkpoint folder needs one")
        config = _read_json(folder / "tokenizer_config.json")
        template = _pick_template(config.get("chat_template"))
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        extra = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(_HFTokenizer.from_file(str(folder / "tokenizer.json")), config, extra, template)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised as such.

        With `add_special_tokens`, the checkpoint's BOS is prepended if it asks for one.
        """
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self._bos_if_asked(ids) if add_special_tokens else ids

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        """``ids`` with the special tokens ``encode(..., add_special_tokens=True)`` puts around a
        text (the tokenizer's own, e.g. a BOS, then the checkpoint's BOS if it asks for one)."""
        head, tail = self._special_wrap
        return self._bos_if_asked([*head, *ids, *tail])

    def _bos_if_asked(self, ids: list[int]) -> list[int]:
        if self._add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    @functools.cached_property
    def _special_wrap(self) -> tuple[list[int], list[int]]:
        """The ids the backend adds before and after a text: the added tokens that lead and
        trail the encoding of a plain probe (which holds none of its own)."""
        full = self._backend.encode("a", add_special_tokens=True).ids
        start = next((i for i, t in enumerate(full) if t not in self._added_ids), len(full))
        end = len(full)
        while end > start and full[end - 1] in self._added_ids:
            end -= 1
        return full[:start], full[end:]

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry as stored (``'Ġworld'``, ``'<|im_end|>'``).

        Raises:
            ValueError: an id outside the vocabulary.
        """
        pieces = [self._backend.id_to_token(i) for i in ids]
        for token_id, piece in zip(ids, pieces, strict=True):
            if piece is None:
                raise ValueError(f"token id {token_id} is not in the vocabulary")
        return pieces

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """The bytes each token stands for, exactly (a byte-level token can be part of a UTF-8
        character, so a token's bytes need not decode on their own)."""
        return [self._bytes.get(i) or self._token_bytes(i) for i in ids]

    def _token_bytes(self, token_id: int) -> bytes:
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        if self._is_byte_level and token_id not in self._added_ids and all(
                c in _BYTE_OF for c in token):
            value = bytes(_BYTE_OF[c] for c in token)
        elif token_id in self._added_ids:
            value = token.encode("utf-8")
        else:  # other decoders (SentencePiece-style): what the token decodes to alone
            value = self.decode([token_id], skip_special_tokens=False).encode("utf-8")
        self._bytes[token_id] = value
        return value

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render `messages` (``[{"role": ..., "content": ...}, ...]``) with the chat template.

        Raises:
            ChatTemplateError: there is no template, a message lacks role/content, or the template
                rejects the conversation.
        """
        if self._template is None:
            raise ChatTemplateError("this checkpoint has no chat template (tokenizer_config.json "
                                    "'chat_template' or chat_template.jinja); send a plain prompt")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
                raise ChatTemplateError(f"message {i} must be a mapping with 'role' and 'content', got {message!r}")
        return self._template.render(messages=[dict(m) for m in messages],
                                     add_generation_prompt=add_generation_prompt,
                                     **{k: v for k, v in self._special.items() if v is not None}, **extra)


    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    special_tokens_in_content: str = "text", add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of the rendered conversation (generation prompt included by default).

        Args:
            special_tokens_in_content: ``"text"`` (default): a special token typed inside a
                message (``<|im_start|>system``) is encoded as the plain text it is, so a user
                cannot forge a turn or a role; ``"control"``: it becomes the control token, as
                if the template had written it (the Hugging Face default).
            add_generation_prompt: end with the opening of the assistant's turn.
            add_special_tokens: also add the tokenizer's special tokens around the rendered
                text (``with_special_tokens``), on top of what the template writes.
            continue_final_message: end right after the last message's content (no end of
                turn), so the model continues it (a prefilled assistant answer; vLLM's).
            template_kwargs: extra variables for the template (vLLM's ``chat_template_kwargs``,
                e.g. ``enable_thinking``); the names the renderer sets itself are refused.

        Raises:
            ChatTemplateError: see ``apply_chat_template``, a reserved template variable, or
                a last message whose content the rendered text does not end with.
            ValueError: an unknown mode.
        """
        if special_tokens_in_content not in ("text", "control"):
            raise ValueError(f"special_tokens_in_content={special_tokens_in_content!r}; use "
                             "'text' or 'control'")
        extra = dict(template_kwargs or {})
        reserved = sorted(set(extra) & ({"messages", "add_generation_prompt"} | set(self._special)))
        if reserved:
            raise ChatTemplateError(f"chat template variables {reserved} are set by the server "
                                    "(messages, add_generation_prompt, special tokens); leave "
                                    "them out of chat_template_kwargs")
        render = functools.partial(self._render_for, add_generation_prompt,
                                   continue_final_message, extra)
        ids = self._encode_conversation(messages, special_tokens_in_content, render)
        return self.with_special_tokens(ids) if add_special_tokens else ids

    def _render_for(self, add_generation_prompt: bool, continue_final_message: bool,
                    extra: Mapping[str, Any], messages: Sequence[Mapping[str, Any]],
                    last_content: str) -> str:
        """The rendered conversation; with ``continue_final_message`` cut right after the last
        occurrence of ``last_content`` (the final message's text, or its mark)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **extra)
        if not continue_final_message:
            return text
        at = text.rfind(last_content) if last_content else -1
        if at < 0:
            raise ChatTemplateError("continue_final_message: the chat template does not write "
                                    "the last message's content as given; it cannot be "
                                    "continued")
        return text[: at + len(last_content)]

    def _encode_conversation(self, messages: Sequence[Mapping[str, Any]], mode: str,
                             render: Callable[[Sequence[Mapping[str, Any]], str], str],
                             ) -> list[int]:
        contents = [m.get("content") if isinstance(m, Mapping) else None for m in messages]
        last = contents[-1] if contents and isinstance(contents[-1], str) else ""
        if mode == "control" or not any(
                isinstance(c, str) and self._has_special(c) for c in contents):
            return self.encode(render(messages, last))
        marked = [{**m, "content": _MARK.format(i)} if isinstance(c, str) else m
                  for i, (m, c) in enumerate(zip(messages, contents, strict=True))]
        last_mark = _MARK.format(len(messages) - 1) if last else ""
        ids: list[int] = []
        for piece in _MARKS.split(render(marked, last_mark)):
            if piece.startswith("\ue000") and piece.endswith("\ue001"):
                ids += self._encode_literal(contents[int(piece[1:-1])])
            elif piece:
                ids += self.encode(piece)
        return ids

    def _has_special(self, text: str) -> bool:
        return any(token in text for token in self.special_tokens)

    def _encode_literal(self, text: str) -> list[int]:
        """Ids of ``text`` with special-token strings in it encoded as ordinary text."""
        with self._literal_lock:  # the flag lives on the shared backend
            self._backend.encode_special_tokens = True
            try:
                return self._backend.encode(text, add_special_tokens=False).ids
            finally:
                self._backend.encode_special_tokens = False


_MARK = "\ue000{}\ue001"  # private-use code points: a content slot in the rendered template
_MARKS = re.compile("(\ue000\\d+\ue001)")


class IncrementalDetokenizer:
    """Turns generated ids into text one id at a time, never emitting broken UTF-8.

    Byte-level tokens can end in the middle of a multi-byte character (a Chinese character is often
    two or three tokens). Each step decodes a short window of ids before and after the new one and
    emits only the new suffix, holding it back while it ends in U+FFFD (incomplete bytes). The
    window starts a few tokens back so that spacing rules of the decoder see their context.
    """

    _CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids)
        self._read = len(self._ids)
        self._prefix = max(self._read - self._CONTEXT, 0)
        self.text = ""

    def step(self, new_id: int) -> str:
        """Append `new_id`; returns the newly completed text (possibly empty)."""
        self._ids.append(int(new_id))
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix:self._read], self._skip)
        after = decode(self._ids[self._prefix:], self._skip)
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta
