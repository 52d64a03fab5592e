"""What every route of one server reads: the router over the hub, the tokenizer, the limits, the
model's name, the tool parser, and how (whether) it may replace the policy's weights."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from specroll.actors.config.server_section import ServerConfig
from specroll.actors.server.errors import ApiError
from specroll.actors.server.request_fields import Limits
from specroll.actors.server.requests import Router
from specroll.actors.server.tool_calls import ToolParser
from specroll.engine.loaders.tokenizer import Tokenizer

UpdateWeights = Callable[[str, "int | None"], Awaitable[int]]
"""``(path, version)`` → the version published (``POST /update_weights``)."""


@dataclass
class ServerState:
    """One server's shared state.

    Attributes:
        update_weights: publishes a folder of safetensors as the next policy version; None where
            the trainer owns the policy (``specroll launch``): the route answers 409.
    """

    config: ServerConfig
    router: Router
    tokenizer: Tokenizer
    limits: Limits
    model_name: str
    tool_parser: ToolParser | None
    template_reads_tools: bool
    """The chat template renders ``tools`` itself (else the server writes the Hermes tools prompt)."""
    update_weights: UpdateWeights | None = None

    def check_model(self, model: str | None) -> None:
        """A request naming another model is a 404 (omitted: this one).

        Raises:
            ApiError: 404 naming the model and the one served.
        """
        if model is not None and model != self.model_name:
            shown = model if len(model) <= 200 else model[:197] + "..."
            raise ApiError(404, f"the model {shown!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
