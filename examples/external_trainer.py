"""A foreign training loop (its own model, loss, optimizer) driving specroll generators through the
embedding API. Start generators anywhere: `python -m specroll.actors.generator --model M --connect tcp://H:P`;
this script starts one itself:  python examples/external_trainer.py [--model smollm2-135m] [--steps 2]
"""

import argparse
import subprocess
import sys

import torch

from specroll.actors import SyncRolloutClient, builtin_prompts, format_question, gsm8k_reward
from specroll.engine import CausalLM, SamplingParams, load_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="smollm2-135m")
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--max-tokens", type=int, default=64)
args = parser.parse_args()

ckpt = load_checkpoint(args.model)  # the trainer's own copy of the policy (any module with HF names works)
model = CausalLM(ckpt.config)
model.load_weights(ckpt.weights)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
prompts = builtin_prompts(2 * args.steps)
sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)

with SyncRolloutClient("tcp://127.0.0.1:0") as client:
    cmd = [sys.executable, "-m", "specroll.actors.generator", "--connect", client.endpoint, "--model", args.model]
    generator = subprocess.Popen(cmd, start_new_session=True)
    try:
        client.wait_for_generators(1, timeout=600)
        for step in range(1, args.steps + 1):
            batch = prompts[2 * step - 2 : 2 * step]
            for p in batch:  # a group of 4 samples per prompt; rollouts come back with behavior logprobs
                client.submit(ckpt.tokenizer.encode_chat(format_question(p.question)), 4, sampling, payload=p)
            groups = [client.next_finished(timeout=1800) for _ in batch]
            loss, rewards = torch.zeros(()), []
            for g in groups:  # REINFORCE with the group mean as baseline: the user's own loss
                texts = [ckpt.tokenizer.decode(s.token_ids) for s in g.samples]
                r = torch.tensor([gsm8k_reward(text, g.payload.answer) for text in texts])
                rewards += r.tolist()
                for s, advantage in zip(g.samples, r - r.mean(), strict=True):
                    ids = torch.tensor([g.prompt_token_ids + s.token_ids])
                    logits = model.score(ids, ids >= 0)[0, len(g.prompt_token_ids) - 1 : -1]
                    logp = logits.log_softmax(-1).gather(-1, torch.tensor(s.token_ids)[:, None]).sum()
                    loss = loss - advantage * logp / (len(groups) * len(g.samples))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            client.publish_weights(model.hf_weights(), version=step)  # generators swap it in between steps
            client.wait_for_version(step, timeout=600)
            print(f"step {step}: mean reward {sum(rewards) / len(rewards):.2f}, policy version {step} served")
    finally:
        generator.terminate()
        generator.wait()
