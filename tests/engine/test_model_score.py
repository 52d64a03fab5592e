"""``CausalLM.score``, the differentiable dense forward the trainer uses, against transformers."""

from __future__ import annotations

import pytest
import torch

from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.model import CausalLM

LENGTHS = [13, 6, 10]  # unequal rows, right-padded to 13


def load_both(path):
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ckpt = load_checkpoint(path)
    model = CausalLM(ckpt.config)
    model.load_weights(ckpt.weights)
    return model, reference, ckpt.config


def padded_batch(vocab_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (len(LENGTHS), max(LENGTHS)), generator=g)  # [B, T], padding random too
    mask = torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]  # [B, T]
    return ids, mask


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True)])
def test_score_matches_transformers_on_a_padded_batch(tiny_checkpoint, arch, tied):
    model, reference, config = load_both(tiny_checkpoint(arch, tie_word_embeddings=tied))
    ids, mask = padded_batch(config.vocab_size)
    logits = model.score(ids, mask)
    assert logits.shape == (*ids.shape, config.vocab_size) and logits.dtype == torch.float32
    assert logits.requires_grad
    assert torch.isfinite(logits).all()  # padded queries too: no empty softmax row
    with torch.no_grad():
        for b, n in enumerate(LENGTHS):  # each row alone, unpadded: no padding convention to share
            expected = reference(ids[b : b + 1, :n]).logits[0]  # [n, V]
            diff = (logits[b, :n] - expected).abs().max().item()
            assert diff <= 1e-4, f"{arch} row {b}: max |score - transformers| = {diff}"


def test_score_positions_and_padding_follow_the_mask_not_the_column(tiny_checkpoint):
    # right padding alone cannot tell a key-padding mask or per-row positions from a plain causal
    # arange; left padding and an empty row can
    model, _, config = load_both(tiny_checkpoint("qwen3"))
    ids, right = padded_batch(config.vocab_size)
    t = ids.shape[1]
    left_ids, left = torch.zeros_like(ids), torch.zeros_like(right)
    for b, n in enumerate(LENGTHS):
        left_ids[b, t - n :], left[b, t - n :] = ids[b, :n], True
    empty_ids, empty = torch.zeros(1, t, dtype=torch.int64), torch.zeros(1, t, dtype=torch.bool)
    with torch.no_grad():
        expected = model.score(ids, right)
        got = model.score(torch.cat([left_ids, empty_ids]), torch.cat([left, empty]))
    assert torch.isfinite(got).all()
    for b, n in enumerate(LENGTHS):
        torch.testing.assert_close(got[b, t - n :], expected[b, :n], rtol=1e-5, atol=1e-5)


def test_score_ignores_padding_tokens(tiny_checkpoint):
    model, _, config = load_both(tiny_checkpoint("qwen3"))
    ids, mask = padded_batch(config.vocab_size)
    with torch.no_grad():
        a = model.score(ids, mask)
        b = model.score(torch.where(mask, ids, (ids + 7) % config.vocab_size), mask)
    assert torch.equal(a[mask], b[mask])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_score_gradients_reach_every_parameter_and_match_transformers(tiny_checkpoint, arch):
    model, reference, config = load_both(tiny_checkpoint(arch, tie_word_embeddings=False))
    ids, mask = padded_batch(config.vocab_size, seed=1)
    targets = ids[:, 1:]
    valid = mask[:, 1:]

    def loss_of(logits: torch.Tensor) -> torch.Tensor:  # next-token NLL over real tokens
        logp = logits[:, :-1].log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
        return -logp[valid].sum()

    loss_of(model.score(ids, mask)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        assert p.grad.abs().sum() > 0 and torch.isfinite(p.grad).all(), f"bad gradient for {name}"

    loss_of(reference(ids, attention_mask=mask.long()).logits.float()).backward()
    grads = dict(model.named_parameters())
    q, kv, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    fused = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
             "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter)}
    for name, p in reference.named_parameters():
        prefix, leaf = name.rsplit(".", 1)
        module, proj = prefix.rsplit(".", 1) if "." in prefix else ("", prefix)
        if proj in fused:
            target, start, rows = fused[proj]
            ours = grads[f"{module}.{target}.{leaf}"].grad[start : start + rows]
        else:
            ours = grads[name].grad
        torch.testing.assert_close(ours, p.grad, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_score_works_under_no_grad_and_rejects_bad_input(tiny_checkpoint):
    model, _, config = load_both(tiny_checkpoint("llama"))
    ids, mask = padded_batch(config.vocab_size)
    with torch.no_grad():
        assert not model.score(ids, mask).requires_grad
    with pytest.raises(ValueError, match=r"attention_mask must be bool with input_ids' shape \(3, 13\), got "
                                         r"torch.bool \(3, 12\)"):
        model.score(ids, mask[:, :12])
    with pytest.raises(ValueError, match=r"got torch.int64 \(3, 13\)"):
        model.score(ids, mask.long())
    with pytest.raises(ValueError, match=r"input_ids must be int64 or int32 \[B, T\], got torch.int64 \(13,\)"):
        model.score(ids[0], mask[0])
