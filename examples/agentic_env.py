"""A multi-turn environment of your own, for `task.environment` (docs/agentic.md): the model answers,
and when it is wrong the "user" says so and lets it try again; reward 1 at the first try, 0.5 at the
second, 0 after. Run it on the built-in problems:

    PYTHONPATH=examples .venv/bin/specroll launch examples/agentic_smollm2.toml \
        --set 'task.environment="agentic_env:second_chance"' --set task.digits=1 --set 'task.operators="+-*"'
"""

import openai

from specroll.actors import gsm8k_reward
from specroll.envs.base import EpisodeOutcome, EpisodePrompt

TRIES = 2


async def second_chance(client: openai.AsyncOpenAI, prompt: EpisodePrompt) -> EpisodeOutcome:
    """One episode: up to TRIES answers, the user's verdict between them."""
    messages = [{"role": "user", "content": f"{prompt.question} Answer with just the number."}]
    for attempt in range(TRIES):
        reply = await client.chat.completions.create(model=prompt.model, messages=messages, **prompt.sampling)
        answer = reply.choices[0].message.content or ""
        if gsm8k_reward(answer, prompt.answer) == 1.0:
            return EpisodeOutcome(reward=1.0 / (attempt + 1), metrics={"tries": attempt + 1})
        messages += [{"role": "assistant", "content": answer},  # as the server returned it: the turn continues
                     {"role": "user", "content": "That is not right. Try again."}]
    return EpisodeOutcome(reward=0.0, metrics={"tries": TRIES})
