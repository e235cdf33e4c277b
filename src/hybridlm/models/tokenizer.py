"""Tokenizer and chat-template rendering for Hugging Face checkpoint directories.

``Tokenizer.from_dir(path)`` reads the files a Hugging Face checkpoint ships:

* ``tokenizer.json`` -- the ``tokenizers`` backend (required);
* ``tokenizer_config.json`` -- named special tokens (strings or ``{"content": ...}`` dicts),
  ``add_bos_token`` and ``chat_template`` (a string, or a list of ``{"name", "template"}`` dicts);
* ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` -- when present they replace the config's
  templates, as in transformers 5;
* ``special_tokens_map.json`` -- legacy special tokens, read only when the config has no
  ``added_tokens_decoder`` (the rule transformers follows);
* ``generation_config.json`` and ``config.json`` -- extra EOS ids (``eos_token_id`` may be an int or a list).

Chat templates are rendered the way ``transformers`` 5 renders them (``utils/chat_template_utils.py``): the
same sandboxed Jinja environment, globals and filters, the same message normalisation, and the named special
tokens as template variables, so a prompt built here is byte-identical to
``apply_chat_template(..., tokenize=False)``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.utils
import numpy as np
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["IncrementalDecoder", "Tokenizer"]

# Named special-token attributes transformers exposes to templates (``special_tokens_map``), in its order.
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Names a message's reasoning may arrive under; transformers copies it to the first and to "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_REPLACEMENT_CHAR = "\ufffd"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise OSError(f"cannot read {path}: {e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _read_optional_json(path: Path) -> dict[str, Any]:
    return _read_json(path) if path.is_file() else {}


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise OSError(f"cannot read {path}: {e}") from e


def _token_content(value: Any) -> str | None:
    """A special token as stored in a config: a string, a ``{"content": ...}`` dict (AddedToken), or null."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    """``eos_token_id`` fields: an int, a list of ints, or absent/null."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """Encode/decode text and render chat prompts for one checkpoint.

    Build it with ``Tokenizer.from_dir``. Token ids are plain ``int``s in ``[0, vocab_size)``.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        add_bos_token: bool | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | Mapping[str, str] | None = None,
    ) -> None:
        """Wrap a ``tokenizers.Tokenizer``.

        Args:
            backend: the loaded ``tokenizer.json``.
            special_tokens: template-visible special tokens by attribute name (``bos_token``, ``eos_token``,
                ..., and model-specific ``*_token`` names) mapped to their text.
            add_bos_token: whether ``encode(..., add_special_tokens=True)`` prepends the BOS token; ``None``
                means "whatever the backend's post-processor does" (Llama 3 style ``tokenizer.json`` files).
            extra_eos_token_ids: stop ids beyond the EOS token itself (from generation/model configs).
            chat_template: one Jinja template, or named templates (``"default"``, ``"tool_use"``, ...).
        """
        self._backend = backend
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.bos_token_id: int | None = None if self.bos_token is None else self.token_to_id(self.bos_token)
        if add_bos_token is None:
            # No explicit setting: follow tokenizer.json (its post-processor adds BOS for Llama, Gemma, ...).
            with_specials = backend.encode("", add_special_tokens=True).ids
            add_bos_token = self.bos_token_id is not None and with_specials[:1] == [self.bos_token_id]
        self.add_bos_token: bool = add_bos_token and self.bos_token_id is not None
        eos_ids = set(extra_eos_token_ids)
        if self.eos_token is not None and (eos_id := self.token_to_id(self.eos_token)) is not None:
            eos_ids.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.chat_template: str | dict[str, str] | None = (
            dict(chat_template) if isinstance(chat_template, Mapping) else chat_template
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer files of a Hugging Face checkpoint directory (see the module docstring).

        Raises ``FileNotFoundError`` when the directory or its ``tokenizer.json`` is missing, ``OSError`` for
        an unreadable file and ``ValueError`` for a malformed one; every message names the file.
        """
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"tokenizer directory {root} does not exist")
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file} not found (hybridlm needs a fast tokenizer.json)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust loader raises bare Exceptions for malformed files
            raise ValueError(f"cannot load {tokenizer_file}: {e}") from e

        config = _read_optional_json(root / "tokenizer_config.json")
        token_values = dict(config)
        if "added_tokens_decoder" not in config:
            token_values.update(_read_optional_json(root / "special_tokens_map.json"))
        special_tokens: dict[str, str] = {}
        for name in _NAMED_SPECIAL_TOKENS:
            if (text := _token_content(token_values.get(name))) is not None:
                special_tokens[name] = text
        # Model-specific named tokens (Gemma 3's boi_token, ...) are template variables too.
        model_specific = {k: v for k, v in token_values.items() if k.endswith("_token")}
        if isinstance(token_values.get("extra_special_tokens"), Mapping):
            model_specific.update(token_values["extra_special_tokens"])
        for name, value in model_specific.items():
            if name not in special_tokens and (text := _token_content(value)) is not None:
                special_tokens[name] = text

        extra_eos: list[int] = []
        for file in ("generation_config.json", "config.json"):
            cfg = _read_optional_json(root / file)
            extra_eos += _as_id_list(cfg.get("eos_token_id"))
            if isinstance(cfg.get("text_config"), Mapping):  # multimodal wrappers (Qwen3.5, Gemma 3)
                extra_eos += _as_id_list(cfg["text_config"].get("eos_token_id"))

        add_bos = config.get("add_bos_token")
        return cls(
            backend,
            special_tokens=special_tokens,
            add_bos_token=bool(add_bos) if add_bos is not None else None,
            extra_eos_token_ids=extra_eos,
            chat_template=_load_chat_template(root, config),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (model embeddings may be padded)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def backend_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what grammar libraries build their vocabulary from)."""
        return self._backend.to_str()

    def max_token_chars(self) -> int:
        """Most characters of one vocabulary entry or added token (byte-level pieces count one per
        byte): no token stands for more characters of a text than this."""
        return max(map(len, self._backend.get_vocab(with_added_tokens=True)), default=1)

    def token_to_id(self, token: str) -> int | None:
        """Id of one vocabulary entry or added token, or ``None`` if it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for ``text``; ``add_special_tokens`` prepends the BOS id if the checkpoint wants one.

        Special-token text inside ``text`` (e.g. ``<|im_start|>``) becomes the special token. No EOS is
        appended: prompts for generation never end in one. Rendered chat prompts already carry their BOS text,
        so encode them with ``add_special_tokens=False``.
        """
        # encode_batch releases the GIL while it works; encode held it for the whole call in the
        # server (a 15 MiB prompt: /health waited 12.8 s, 1.5 s with encode_batch, same ids).
        ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``. Bytes of an incomplete UTF-8 character decode to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render one conversation to prompt text, exactly as ``transformers``' ``apply_chat_template`` does.

        Args:
            messages: ``{"role", "content", ...}`` dicts (OpenAI-style ``tool_calls`` and
                ``reasoning_content`` are passed through); keys whose value is ``None`` are dropped first,
                like transformers does.
            tools: JSON-schema tool definitions, passed to the template as ``tools``.
            documents: RAG documents, passed to the template as ``documents``.
            add_generation_prompt: end with the header that opens an assistant turn.
            chat_template: a template name (of the checkpoint's named templates) or a Jinja template string to
                use instead of the checkpoint's default.
            **template_kwargs: extra template variables (e.g. ``enable_thinking=False``); they override the
                special tokens of the same name.
        """
        template = self._select_template(chat_template, tools)
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        for message in messages:
            if not isinstance(message, Mapping):
                raise TypeError(f"chat messages must be dicts, got {message!r}")
        if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
            raise TypeError("tools must be JSON-schema dicts")
        if documents is not None and not all(isinstance(doc, Mapping) for doc in documents):
            raise TypeError("documents must be dicts with 'title' and 'text' keys")
        chat = _with_reasoning_aliases(
            _plain_template_data([{k: v for k, v in m.items() if v is not None} for m in messages])
        )
        variables = _plain_template_data({**self.special_tokens, **template_kwargs})
        return _compile_template(template).render(
            messages=chat,
            tools=_plain_template_data(list(tools)) if tools is not None else None,
            documents=_plain_template_data(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def _select_template(self, chat_template: str | None, tools: Any) -> str:
        # Mirrors PreTrainedTokenizerBase.get_chat_template.
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None and chat_template in templates:
                return templates[chat_template]
            if chat_template is not None:
                return chat_template
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(
                f"this checkpoint has several chat templates and no default; pick one of {sorted(templates)}"
            )
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("this checkpoint has no chat template (not in tokenizer_config.json or *.jinja)")
        return templates


def _load_chat_template(root: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """Template files win over ``tokenizer_config.json``; several templates come back as name -> text."""
    templates: dict[str, str] = {}
    if (default_file := root / "chat_template.jinja").is_file():
        templates["default"] = _read_text(default_file)
    if (extra_dir := root / "additional_chat_templates").is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = _read_text(file)
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(t, Mapping) and "name" in t and "template" in t for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    config_file = root / "tokenizer_config.json"
    raise ValueError(f"{config_file}: chat_template must be a string or a list of {{name, template}} dicts")


def _plain_template_data(value: Any) -> Any:
    """A copy of ``value`` built from plain JSON types, as transformers hands to templates.

    Rich objects would expose methods to the sandbox, so dataclasses and pydantic models become dicts and any
    other object becomes an inert ``"<TypeName>"`` placeholder.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_template_data(k): _plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_template_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_template_data(v) for v in value)
    if isinstance(value, np.generic):
        return _plain_template_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain_template_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Reasoning sent as "thinking" or "reasoning" is also exposed as "reasoning_content" (what templates read)
    # and as "thinking" (what gpt-oss templates read), with transformers' key order.
    aliased = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; here it renders."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


class _TemplateDict:
    # Exposes dict() and dict.fromkeys() without the dict type itself, as transformers does.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Underscore attributes on namespaces could reach CPython internals, so they are refused.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Unlike Jinja's own tojson this does not HTML-escape, and it takes json.dumps' formatting options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


class IncrementalDecoder:
    """Turns a growing stream of token ids into text deltas for streaming output.

    Byte-level BPE can split one UTF-8 character across tokens, and SentencePiece-style decoders change a
    token's text depending on what precedes it. So each step decodes a short window that starts at the last
    emitted boundary and emits only the text beyond what that window had already produced; while the window
    still ends in an incomplete character (U+FFFD) nothing is emitted. Concatenating every ``add`` result and
    the final ``flush`` gives ``tokenizer.decode(all_ids)`` (or, with ``context``, the text those ids add
    after it).
    """

    def __init__(
        self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False, context: Sequence[int] = ()
    ) -> None:
        """Args:
        tokenizer: decodes the ids.
        skip_special_tokens: drop special tokens from the text, as in ``Tokenizer.decode``.
        context: ids that precede the stream (e.g. the prompt's last few tokens); they condition spacing but
            are never emitted.
        """
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(context)
        self._prefix = 0  # start of the decode window
        self._read = len(self._ids)  # ids before this are emitted

    def add(self, ids: int | Sequence[int]) -> str:
        """Append generated id(s); return the newly completed text ('' while a character is still partial)."""
        self._ids.extend([ids] if isinstance(ids, int) else ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (at end of stream); an unfinished character comes out as U+FFFD."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self._tokenizer.decode
        seen = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip_special)
        text = decode(self._ids[self._prefix :], skip_special_tokens=self._skip_special)
        if len(text) <= len(seen) or (text.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen) :]
