"""Text ↔ token ids for one checkpoint, and its chat template.

A thin wrapper over a ``tokenizers.Tokenizer`` built either from a Hugging Face directory
(``tokenizer.json``) or from a GGUF file's metadata (byte-level BPE only). Chat templates come from
untrusted checkpoints, so they are rendered in jinja2's ``ImmutableSandboxedEnvironment`` with the
same options and helpers as transformers' ``apply_chat_template``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import jinja2
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from specroll.engine.loaders.chat_template import compile_chat_template, read_hf_chat_template
from specroll.engine.loaders.errors import ChatTemplateError, CheckpointError

__all__ = ["ChatTemplateError", "Tokenizer"]

# llama.cpp's GGUF token types (gguf.TokenType): CONTROL tokens are special (skipped when decoding),
# USER_DEFINED ones are added tokens matched whole but kept in decoded text.
_CONTROL, _USER_DEFINED = 3, 4

# `tokenizer.ggml.pre` names whose pre-tokenizer splits every digit on its own before the GPT-2 regex
# (llama.cpp llama-vocab.cpp: regex_exprs = {"\p{N}", <gpt2 regex>}). SmolLM2's own tokenizer.json
# spells the same thing as Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)].
_DIGIT_SPLIT_PRES = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
# Split regexes of other byte-level families (transformers integrations/gguf/gguf_tokenizer_mapping.py).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEXES = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
# Variables apply_chat_template sets itself; chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "documents"}
)



class Tokenizer:
    """Encode/decode text and render chat prompts for one checkpoint.

    Build it with :meth:`from_hf_dir` or :meth:`from_gguf`. Token ids are Python ``int`` lists; the
    BOS token is added by :meth:`encode` only when the checkpoint asks for it (``add_bos_token``).
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: tuple[int, ...],
        add_bos_token: bool,
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self._backend.no_truncation()
        self._backend.no_padding()
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._bos_token_id = _token_id(backend, bos_token, "bos_token")
        self._eos_token_ids = eos_token_ids
        self._add_bos = add_bos_token and self._bos_token_id is not None
        self.chat_template = chat_template
        """The jinja source of the chat template, or ``None`` when the checkpoint has none."""
        self._template = compile_chat_template(chat_template) if chat_template is not None else None

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` plus ``tokenizer_config.json``, ``chat_template.jinja`` and
        ``generation_config.json`` (each optional) from a Hugging Face checkpoint directory.

        Raises:
            CheckpointError: ``tokenizer.json`` is missing or unreadable, a JSON file is malformed,
                a named bos/eos token is not in the vocabulary, or the chat template does not parse.
        """
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{tokenizer_file}: not found; a Hugging Face checkpoint needs one")
        try:
            backend = _Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust parser raises a bare Exception on malformed files
            raise CheckpointError(f"{tokenizer_file}: cannot be parsed as a tokenizers file ({exc})") from exc
        config = _read_json(path / "tokenizer_config.json")
        bos_token = _token_content(config.get("bos_token"))
        eos_token = _token_content(config.get("eos_token"))
        bos_id = _token_id(backend, bos_token, f"{path / 'tokenizer_config.json'} bos_token")
        eos_id = _token_id(backend, eos_token, f"{path / 'tokenizer_config.json'} eos_token")
        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            # No explicit flag: the checkpoint asks for BOS iff tokenizer.json's post-processor adds it.
            with_special = backend.encode("a", add_special_tokens=True).ids
            plain = backend.encode("a", add_special_tokens=False).ids
            add_bos = bos_id is not None and len(with_special) > len(plain) and with_special[0] == bos_id
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        eos_ids = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
        if not all(isinstance(i, int) and 0 <= i < backend.get_vocab_size() for i in eos_ids):
            raise CheckpointError(
                f"{path / 'generation_config.json'}: eos_token_id={generation_eos!r}, expected token ids"
            )
        if eos_id is not None:
            eos_ids.append(eos_id)
        return cls(
            backend,
            bos_token=bos_token,
            eos_token=eos_token,
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            add_bos_token=add_bos,
            chat_template=read_hf_chat_template(path, config),
        )

    @classmethod
    def byte_level(cls) -> Tokenizer:
        """A byte-level tokenizer with no merges: ids 0–255 are the bytes (GPT-2's byte alphabet)
        and id 256 is ``<|im_end|>``, the end token. For random-weight checkpoints in tests and
        benchmarks, where only token ids matter."""
        tokens = [*_bytes_to_unicode().values(), "<|im_end|>"]
        backend = _byte_level_backend(tokens, [], [1] * 256 + [_CONTROL], None)
        return cls(backend, bos_token=None, eos_token="<|im_end|>", eos_token_ids=(256,), add_bos_token=False,
                   chat_template=None)

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Build a byte-level BPE tokenizer from a GGUF file's ``tokenizer.*`` metadata.

        Control tokens become special added tokens; ``tokenizer.ggml.pre`` picks the pre-tokenizer
        (llama.cpp's names; unknown names fall back to the GPT-2 regex).

        Raises:
            CheckpointError: ``tokenizer.ggml.model`` is not ``gpt2`` (only byte-level BPE is
                supported), or the vocabulary/merges/special ids are missing or inconsistent.
        """
        where = f"GGUF {getattr(reader.data, 'filename', '(in memory)')}"
        model_type = _gguf_value(reader, "tokenizer.ggml.model")
        if model_type != "gpt2":
            raise CheckpointError(
                f"{where}: tokenizer.ggml.model={model_type!r} is not supported; only 'gpt2' "
                "(byte-level BPE) tokenizers can be loaded from GGUF"
            )
        tokens = _gguf_value(reader, "tokenizer.ggml.tokens")
        merges = _gguf_value(reader, "tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise CheckpointError(f"{where}: tokenizer.ggml.tokens/merges missing, expected a BPE vocabulary")
        token_types = _gguf_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(token_types) != len(tokens):
            raise CheckpointError(
                f"{where}: tokenizer.ggml.token_type has {len(token_types)} entries, expected {len(tokens)}"
            )
        backend = _byte_level_backend(tokens, merges, token_types, _gguf_value(reader, "tokenizer.ggml.pre"))

        def token_at(key: str) -> str | None:
            index = _gguf_value(reader, key)
            if index is None:
                return None
            if not 0 <= index < len(tokens):
                raise CheckpointError(f"{where}: {key}={index}, expected an id below {len(tokens)}")
            return tokens[index]

        eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")  # EOT: end of turn
        eos_ids = [_gguf_value(reader, key) for key in eos_keys if token_at(key) is not None]
        return cls(
            backend,
            bos_token=token_at("tokenizer.ggml.bos_token_id"),
            eos_token=token_at("tokenizer.ggml.eos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
            # A byte-level vocabulary adds no BOS unless the file says so (as transformers' GPT2Tokenizer).
            add_bos_token=bool(_gguf_value(reader, "tokenizer.ggml.add_bos_token") or False),
            chat_template=_gguf_value(reader, "tokenizer.chat_template"),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """Beginning-of-sequence id, or ``None`` when the checkpoint names no BOS token."""
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation (the EOS token plus generation_config/GGUF EOT ids)."""
        return self._eos_token_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it (``<|im_start|>``) map to their ids.

        With ``add_special_tokens`` a BOS id is prepended when the checkpoint asks for one. The GIL is
        released while encoding (the backend's ``encode`` holds it: seconds for megabytes of text), so
        a worker thread may encode while the event loop runs.
        """
        ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self._add_bos:
            ids.insert(0, self._bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; control tokens are dropped when ``skip_special_tokens``."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render ``messages`` with the checkpoint's template, as transformers' ``apply_chat_template``.

        ``messages`` are OpenAI chat messages: ``{"role", "content"}``, where ``content`` may be
        ``None`` and an assistant message may carry ``tool_calls`` and a tool message
        ``tool_call_id``/``name``; the template decides what it renders of them. ``tools`` (OpenAI
        ``{"type": "function", "function": {...}}`` dicts) reaches the template as ``tools``, and
        ``chat_template_kwargs`` as extra template variables (e.g. ``enable_thinking``).

        A template that never reads ``tools`` ignores them. SmolLM2-135M-Instruct's (the default
        model) is one: it writes each message as ``<|im_start|>{role}\n{content}<|im_end|>\n`` (a
        ``tool`` message too), adds its own system prompt when the first message is not a system one,
        and reads nothing else, so ``tools``, ``tool_calls`` and ``tool_call_id`` leave its prompt
        unchanged, and ``None`` content fails its string ``+`` (a ChatTemplateError). A server then
        writes the tools into the messages itself (``specroll.actors.server.tool_calls``:
        ``tools_system_prompt``, ``hermes_fallback_messages``).

        Raises:
            ChatTemplateError: the checkpoint has no chat template; the template called
                ``raise_exception`` (e.g. roles that do not alternate) or failed on the messages' values
                (a ``TypeError`` or undefined attribute, e.g. ``None`` content it concatenates).
            ValueError: a ``chat_template_kwargs`` key is one of the variables set here
                (``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools``,
                ``documents``).
        """
        if self._template is None:
            raise ChatTemplateError("this checkpoint has no chat template; encode a plain prompt instead")
        extra = dict(chat_template_kwargs or {})
        if clash := sorted(extra.keys() & _RESERVED_TEMPLATE_VARIABLES):
            raise ValueError(
                f"chat_template_kwargs sets {', '.join(map(repr, clash))}, which the chat template gets from "
                f"the request itself; reserved: {', '.join(sorted(_RESERVED_TEMPLATE_VARIABLES))}"
            )
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token or "",
                eos_token=self._eos_token or "",
                tools=tools,
                documents=None,
                **extra,
            )
        except (TypeError, jinja2.UndefinedError) as exc:
            raise ChatTemplateError(
                f"chat template failed on these messages ({type(exc).__name__}: {exc}); a message's "
                "content may be None or of a type the template does not expect"
            ) from exc

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Render the chat template (as :meth:`apply_chat_template`, whose errors it raises), then
        encode it without adding BOS (the template writes it)."""
        text = self.apply_chat_template(
            messages, add_generation_prompt, tools=tools, chat_template_kwargs=chat_template_kwargs
        )
        return self.encode(text, add_special_tokens=False)


def _byte_level_backend(
    tokens: list[str], merges: list[str], token_types: list[int], pre: str | None
) -> _Backend:
    """A GPT-2 style byte-level BPE ``tokenizers.Tokenizer`` from llama.cpp's vocabulary arrays."""
    byte_chars = _bytes_to_unicode()
    alphabet = set(byte_chars.values())
    vocab: dict[str, int] = {}
    for index, (token, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        if not set(token) <= alphabet and token_type not in (_CONTROL, _USER_DEFINED):
            # A normal token spelled in raw UTF-8: respell it in the byte alphabet, as BPE produces it.
            token = "".join(byte_chars[b] for b in token.encode("utf-8"))
        vocab[token] = index
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    if (bad := next((m for m, pair in zip(merges, pairs, strict=True) if len(pair) != 2), None)) is not None:
        raise CheckpointError(f"GGUF tokenizer.ggml.merges entry {bad!r}, expected 'left right'")
    backend = _Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    if pre in _DIGIT_SPLIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in _SPLIT_REGEXES:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEXES[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:  # "gpt2", "default" and names we do not know: the GPT-2 regex
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, token_types, strict=True) if kind == _CONTROL
    ])
    backend.add_tokens([
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, token_types, strict=True) if kind == _USER_DEFINED
    ])
    return backend


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (openai/gpt-2 encoder.py)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _gguf_value(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or ``{}`` when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_content(value: object) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _token_id(backend: _Backend, token: str | None, what: str) -> int | None:
    if token is None:
        return None
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise CheckpointError(f"{what}={token!r} is not in the tokenizer's vocabulary")
    return token_id
