"""Request bodies: fields the server cannot honour at a value other than their default are refused."""

from __future__ import annotations

import pytest


def test_fields_honoured_only_at_their_defaults_are_refused_naming_them() -> None:
    from specroll.actors.server.errors import ApiError
    from specroll.actors.server.schemas import ChatCompletionRequest, Message, refuse_unsupported

    messages = [Message(role="user", content="hi")]
    refuse_unsupported(ChatCompletionRequest(messages=messages))  # the defaults pass
    for field, value in [("continue_final_message", True), ("frequency_penalty", 0.5), ("logit_bias", {"5": 1.0})]:
        with pytest.raises(ApiError) as e:
            refuse_unsupported(ChatCompletionRequest(messages=messages, **{field: value}))
        assert e.value.status == 400 and e.value.param == field and field in str(e.value)
