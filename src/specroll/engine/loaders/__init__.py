"""Reading a model from disk: a registered name, a Hugging Face directory or a GGUF file, its
tokenizer and its chat template. The engine's core takes what these return (a :class:`Checkpoint`)
and never reads a file itself.

Which file holds what:

- ``checkpoint.py``: :func:`load_checkpoint` (any of the three sources → :class:`Checkpoint`: a
  :class:`~specroll.engine.model_config.ModelConfig`, weights under Hugging Face Llama names, a
  tokenizer), Hugging Face directories (config.json, sharded safetensors), :func:`check_weights`,
  :func:`load_model_config` and :func:`random_checkpoint` (random-weight stand-ins at real size).
- ``gguf.py``: GGUF files, dequantized with the ``gguf`` package; llama.cpp's permuted Q/K rows
  undone on load.
- ``tokenizer.py``: :class:`Tokenizer` over ``tokenizers`` (from tokenizer.json or a GGUF's own
  vocabulary), with the chat template applied by ``encode_chat``.
- ``chat_template.py``: the checkpoint's jinja2 chat template, compiled in a sandbox.
- ``registry.py``: names of checkpoints found without a path (a file inside an installed
  distribution, located through ``importlib.metadata``).
- ``errors.py``: :class:`CheckpointError`, :class:`ChecksumError` and :class:`ChatTemplateError`,
  below every module that raises them.
- ``sealed.py``: folders written whole or not at all, with every file's size and SHA-256 in
  ``checksums.json``, checked on load (trainer checkpoints, drafters); ``tensor_files.py`` a
  safetensors write whose failure is the ``OSError`` it is (a full disk: ENOSPC).
"""
