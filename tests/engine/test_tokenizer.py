"""Tokenizer: GGUF and Hugging Face directory tokenizers against transformers, chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from specroll.engine.loaders.checkpoint import CheckpointError
from specroll.engine.loaders.registry import resolve_model
from specroll.engine.loaders.tokenizer import ChatTemplateError, Tokenizer

# The pre-tokenizers we implement and transformers' GGUF converter agree on these; they cover
# words, digits, whitespace runs, newlines, unicode, code and chat special tokens.
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "Janet has 16 eggs and sells 3 for $2 each: 16 - 3 = 13.",
    "3.14159 and 1,000,000 and 2024-01-01",
    "multiple   internal    spaces and trailing   ",
    "tabs\tand\nnewlines\r\nmixed\n\n\nend",
    "Café naïve résumé — 你好，世界！ Россия 🙂👍🏽",
    "def add(a, b):\n    return a + b  # sum\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>after the end",
    "",
]
CONVERSATION = [
    {"role": "user", "content": "What is 7 times 6?"},
    {"role": "assistant", "content": "7 times 6 is 42."},
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('system message must come first') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def ours(smollm_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(smollm_path))


@pytest.fixture(scope="module")
def reference(smollm_path: Path):  # transformers' tokenizer built from the same GGUF
    return AutoTokenizer.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)


@pytest.mark.slow
def test_gguf_tokenizer_encodes_and_decodes_like_transformers(ours: Tokenizer, reference) -> None:
    assert ours.vocab_size == len(reference) == 49152
    assert (ours.bos_token_id, ours.eos_token_ids) == (reference.bos_token_id, (reference.eos_token_id,))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ours.encode(TEXTS[-3]), skip_special_tokens=False) == TEXTS[-3]


@pytest.mark.slow
def test_smollm_pretokenizer_isolates_digits_like_llama_cpp(ours: Tokenizer, reference) -> None:
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's tokenizer.json) split each digit off first,
    # then apply the GPT-2 regex, so a whitespace run before a digit stays one piece. transformers'
    # GGUF converter has no "smollm" entry and splits it ("\n\n1" -> "Ċ", "Ċ", "1").
    expected = {
        "\n\n1. First": ["ĊĊ", "1", ".", "ĠFirst"],
        "a  1b": ["a", "ĠĠ", "1", "b"],
        "x = 10\n  20": ["x", "Ġ=", "Ġ", "1", "0", "ĊĠĠ", "2", "0"],
    }
    for text, pieces in expected.items():
        assert ours.encode(text) == reference.convert_tokens_to_ids(pieces), text
        assert ours.decode(ours.encode(text)) == text


@pytest.mark.slow
def test_gguf_chat_template_matches_transformers(ours: Tokenizer, reference) -> None:
    for messages in (CONVERSATION, [{"role": "system", "content": "Be terse."}, CONVERSATION[0]]):
        rendered = ours.apply_chat_template(messages, add_generation_prompt=True)
        assert rendered == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.encode_chat(messages) == reference.encode(rendered, add_special_tokens=False)
    no_prompt = reference.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(CONVERSATION, add_generation_prompt=False) == no_prompt


def _tiny_backend() -> Backend:
    """A byte-level BPE trained on a few lines: real merges, ~360 tokens, 3 chat specials first."""
    corpus = [
        "The quick brown fox jumps over the lazy dog. " * 3,
        "def add(a, b):\n    return a + b\n",
        "12 + 345 = 357\n\n1. first\n2. second",
        "Ünïcødé text — 你好 🙂",
    ]
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    return backend


def _write_gguf(path: Path, backend: Backend, pre: str, tokenizer_model: str = "gpt2") -> None:
    model = json.loads(backend.to_str())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    writer = gguf.GGUFWriter(path, "qwen2")
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": 8,
                       "feed_forward_length": 16, "head_count": 2, "head_count_kv": 1}.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges([" ".join(pair) for pair in model["merges"]])
    writer.add_token_types([3 if token in SPECIALS else 1 for token in tokens])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_qwen2_pretokenizer_matches_transformers(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "tiny.gguf", _tiny_backend(), pre="qwen2")
    ours = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "tiny.gguf"))
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    for text in [*TEXTS, "\n\n1. first", "a  1b 12345"]:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    rendered = ours.apply_chat_template(CONVERSATION)
    assert rendered == reference.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)


def test_gguf_sentencepiece_tokenizer_is_rejected(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "spm.gguf", _tiny_backend(), pre="default", tokenizer_model="llama")
    with pytest.raises(CheckpointError, match=r"tokenizer.ggml.model='llama'.*only 'gpt2'"):
        Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "spm.gguf"))


def _write_hf_dir(path: Path, *, add_bos: bool, template_file: bool) -> None:
    _tiny_backend().save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"__type": "AddedToken", "content": "<|im_start|>", "special": True},  # older form
        "eos_token": "<|im_end|>",
        "add_bos_token": add_bos,
    }
    if template_file:
        (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        config["chat_template"] = "{{ 'stale template: chat_template.jinja wins' }}"
    else:
        config["chat_template"] = [
            {"name": "default", "template": CHAT_TEMPLATE}, {"name": "tool_use", "template": "x"}
        ]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))


@pytest.mark.parametrize("add_bos", [True, False])
def test_hf_dir_tokenizer_matches_transformers(tmp_path: Path, add_bos: bool) -> None:
    _write_hf_dir(tmp_path, add_bos=add_bos, template_file=add_bos)
    ours = Tokenizer.from_hf_dir(tmp_path)
    reference = AutoTokenizer.from_pretrained(tmp_path)
    assert ours.bos_token_id == 1
    assert ours.eos_token_ids == (0, 2)  # generation_config's list, then the tokenizer's eos (deduplicated)
    for text in TEXTS:
        bos = [1] if add_bos else []
        assert ours.encode(text) == bos + reference.encode(text, add_special_tokens=False)
        assert ours.decode(ours.encode(text)) == reference.decode(ours.encode(text), skip_special_tokens=True)
    rendered = ours.apply_chat_template(CONVERSATION)
    assert rendered.startswith("<|im_start|><|im_start|>user\nWhat is 7")
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = ours.encode_chat(CONVERSATION)
    assert ids[:2] == [1, 1]  # the template's BOS and the first <|im_start|>, no BOS added on top
    assert ids == ours.encode(rendered, add_special_tokens=False)


def test_tokenizer_json_post_processor_bos_is_honoured(tmp_path: Path) -> None:
    # No add_bos_token flag: the checkpoint asks for BOS through tokenizer.json's post-processor.
    from tokenizers import processors

    backend = _tiny_backend()
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>"}))
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    assert tokenizer.encode("hi") == [0, *tokenizer.encode("hi", add_special_tokens=False)]


def test_chat_template_errors(tmp_path: Path) -> None:
    _tiny_backend().save(str(tmp_path / "tokenizer.json"))
    plain = Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        plain.apply_chat_template(CONVERSATION)

    _write_hf_dir(tmp_path, add_bos=False, template_file=True)
    templated = Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(ChatTemplateError, match="system message must come first"):
        templated.apply_chat_template([*CONVERSATION, {"role": "system", "content": "late"}])

    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(CheckpointError, match="chat template does not parse"):
        Tokenizer.from_hf_dir(tmp_path)


def test_chat_template_is_sandboxed_and_has_hf_helpers(tmp_path: Path) -> None:
    import jinja2

    _tiny_backend().save(str(tmp_path / "tokenizer.json"))

    def render(template: str) -> str:
        (tmp_path / "chat_template.jinja").write_text(template)
        return Tokenizer.from_hf_dir(tmp_path).apply_chat_template(CONVERSATION)

    escapes = ("{{ ''.__class__.__mro__ }}", "{{ messages.append(1) }}", "{{ cycler.__init__.__globals__ }}")
    for escape in escapes:
        with pytest.raises(jinja2.exceptions.SecurityError):
            render(escape)
    assert render("{{ strftime_now('%Y') | length }}") == "4"
    generation = "{% for m in messages %}{% generation %}{{ m.role }}{% endgeneration %}{% endfor %}"
    assert render(generation) == "userassistant"
    assert render("{{ {'a': 'ü<'} | tojson }}") == '{"a": "ü<"}'
    # trim_blocks / lstrip_blocks as transformers sets them: block lines leave no whitespace behind.
    assert render("  {% for m in messages %}\n{{ m.role }},{% endfor %}\n") == "user,assistant,"


def test_hf_dir_without_tokenizer_json_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)
