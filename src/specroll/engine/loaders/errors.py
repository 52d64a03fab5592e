"""Error types shared by the checkpoint loaders, the tokenizer and the chat template.

They live here, below every module that raises them, so that no import has to hide inside a
function to dodge a circle (``checkpoint.py`` imports the loaders, which raise these).
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or describes a model specroll does not implement."""


class ChatTemplateError(ValueError):
    """The checkpoint has no chat template, or its template rejected the conversation."""
