"""specroll's ``verifiers`` harness: the chat and tool loop of a ``verifiers`` rollout, run in this
process (``verifiers.v1.Harness``; imported only with the ``verifiers`` extra installed).

``verifiers``' bundled chat loop (the ``null`` harness) is a script that ``uv`` runs in a fresh
subprocess per rollout (it needs ``uv`` on the PATH and, the first time, PyPI); the Harness contract
allows the loop to run in-process instead, as long as every model call goes through the rollout's
interception ``endpoint`` with bearer ``secret`` — that is how the trace (its turns, its reward) is
built (``Harness.launch``'s docstring). The loop: the task's system prompt and prompt; one
non-streamed ``chat.completions`` request per turn with the task's MCP tools; each tool call answered
through MCP (a call the model wrote badly is answered with an error, never raised); until a reply
without a tool call, or the interception refuses the next call because a ``@vf.stop`` or
``max_turns`` ended the rollout. Sampling is not set here: the interception applies the run's.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp
from verifiers.v1.runtimes import ProgramResult

__all__ = ["InProcessHarness"]


class InProcessHarnessConfig(vf.HarnessConfig):
    """The harness's config (``verifiers``' ``HarnessConfig``: ``tool_timeout`` in seconds per tool
    call, ``disabled_tools`` not offered); ``id`` is the name specroll registers it under
    (``verifiers_env.HARNESS_ID``)."""

    id: str = "specroll_inprocess"


class InProcessHarness(vf.Harness[InProcessHarnessConfig]):
    """The chat and tool loop in this process (module docstring); a stateless value shared by
    every rollout of a process."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData,
                     tool_interception_url: str | None = None) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(m) for m in prompt]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            async with AsyncExitStack() as stack:
                servers_config = {"mcpServers": {name: {"url": url, "timeout": self.config.tool_timeout}
                                                 for name, url in mcp_urls.items()}}
                tools, dispatch, servers = await connect_mcp(servers_config, stack) if mcp_urls else ([], {}, {})
                disabled = set(self.config.disabled_tools or ())
                tools = [t for t in tools if t["function"]["name"] not in disabled]
                dispatch = {name: target for name, target in dispatch.items() if name not in disabled}
                while True:
                    try:
                        reply = await client.chat.completions.create(
                            model=ctx.model, messages=messages, **({"tools": tools} if tools else {}))
                    except Exception:
                        if trace.stop_condition is not None:
                            break  # a @stop or a limit ended the rollout by refusing this call
                        raise
                    message = reply.choices[0].message
                    messages.append(message.model_dump(exclude_none=True))
                    if not message.tool_calls:
                        break
                    for call in message.tool_calls:
                        name = getattr(call, "function", None) and call.function.name
                        content = await _tool_result(servers, dispatch, name, call.function.arguments if name else "")
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
        finally:
            await client.close()
        return ProgramResult(exit_code=0, stdout="", stderr="")


async def _tool_result(servers: dict[str, Any], dispatch: dict[str, tuple[str, str]], name: str | None,
                       arguments: str) -> Any:
    """The tool message's content for one call: the MCP tool's result, or an error the model reads
    (an unknown tool, arguments that are not a JSON object)."""
    if not name or name not in dispatch:
        return f"error: no tool {name!r} (expected one of {sorted(dispatch)})"
    try:
        args = json.loads(arguments or "{}")
    except ValueError as e:
        return f"error: the arguments are not JSON ({e})"
    if not isinstance(args, dict):
        return "error: the arguments are not a JSON object"
    return await call_mcp(servers, dispatch, name, args)
