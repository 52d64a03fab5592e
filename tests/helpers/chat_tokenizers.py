"""A Hugging Face tokenizer directory around any chat template, for the chat template tests."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""The special tokens of :func:`write_template_tokenizer`'s vocabulary (ids 256, 257, 258)."""


def write_template_tokenizer(path: Path, chat_template: str) -> Path:
    """Write ``tokenizer.json`` (byte-level BPE with no merges: the 256 byte symbols, then
    :data:`CHAT_SPECIALS`) and a ``tokenizer_config.json`` carrying ``chat_template`` into the
    directory ``path``; both specroll's ``Tokenizer.from_hf_dir`` and transformers' ``AutoTokenizer``
    load it. Returns ``path``."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Backend(BPE(vocab={symbol: i for i, symbol in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in CHAT_SPECIALS])
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": chat_template}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
