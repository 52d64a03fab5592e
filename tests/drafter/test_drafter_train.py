"""Offline EAGLE drafter training: the dense TTT path, learning, the engine, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import hf_tiny_config, write_tiny_tokenizer

from specroll.actors.cli import main
from specroll.drafter.eagle import EagleProposer
from specroll.drafter.eagle_config import EagleConfig, build_draft_vocab, eagle3_feature_layers
from specroll.drafter.eagle_head import EagleHead, draft_lm_head
from specroll.drafter.learner import DrafterLearner, LearnerConfig
from specroll.drafter.train import expected_acceptance_length, train_drafter
from specroll.drafter.ttt import Rollout, target_features, ttt_loss
from specroll.engine.attention import allocate_kv_cache
from specroll.engine.batch import build_metadata
from specroll.engine.config import EngineConfig
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.model import CausalLM
from specroll.engine.torch_attention import TorchAttention
from specroll.protocol.sampling import SamplingParams

PROMPT_LEN, RESPONSE_LEN, K, DRAFT_VOCAB = 8, 32, 4, 128


def write_smooth_checkpoint(path: Path) -> None:
    """A tiny 2-layer Llama with untied, normal(0, 0.07) weights: random, yet smooth enough that its
    greedy next token generalises across contexts (at std 0.2 a head can only memorise rollouts)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_tiny_config("llama", tie_word_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.07)
    model.save_pretrained(path)
    write_tiny_tokenizer(path)


def greedy_rollouts(path: Path, n: int, seed: int) -> list[Rollout]:
    engine = Engine(EngineConfig(model=str(path), page_size=8, kv_cache_memory_gb=0.01, max_model_len=128,
                                 dtype="float32"))
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=RESPONSE_LEN, ignore_eos=True), f"r{i}")
    done = run_to_completion(engine)
    return [Rollout(p + done[f"r{i}"].token_ids, PROMPT_LEN) for i, p in enumerate(prompts)]


def fresh_head(config, rollouts: list[Rollout], taps: tuple[int, ...] | None = None, seed: int = 0,
               architecture: str = "eagle3", target: CausalLM | None = None) -> EagleHead:
    """A new head as init-drafter makes one (an eagle3 head's lm_head from ``target``'s rows when given)."""
    counts = torch.zeros(config.vocab_size)
    for r in rollouts:
        counts += torch.bincount(torch.tensor(r.token_ids), minlength=config.vocab_size)
    layers = taps if taps is not None else (config.num_layers,)
    head_config = EagleConfig.for_target(config, layers, DRAFT_VOCAB, architecture)
    d2t = build_draft_vocab(counts, DRAFT_VOCAB)
    lm_head = draft_lm_head(target, head_config, d2t) if target is not None else None
    return EagleHead.init(head_config, d2t, seed=seed, lm_head=lm_head)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A smooth tiny target, 128 training and 16 held-out greedy rollouts, and a head trained 400 steps."""
    torch.set_num_threads(2)
    path = tmp_path_factory.mktemp("drafter-train") / "tiny"
    path.mkdir()
    write_smooth_checkpoint(path)
    ckpt = load_checkpoint(str(path))
    target = CausalLM(ckpt.config)
    target.load_weights(ckpt.weights)
    target.eval().requires_grad_(False)
    train, held = greedy_rollouts(path, 128, seed=1), greedy_rollouts(path, 16, seed=2)
    # eagle3 heads with a random lm_head: untrained, they agree with the target about 1/128 of the time
    # (from the target's rows, as init-drafter starts one, a head on this smooth target's last hidden state
    # starts near the identity and already agrees often: test_a_cold_started_learner_... covers that start)
    head = fresh_head(ckpt.config, train)
    untrained = fresh_head(ckpt.config, train)
    history = train_drafter(head, target, train, steps=400, lr=5e-3, batch=8, window=40, ttt_steps=3, seed=0)
    return dict(path=path, config=ckpt.config, target=target, train=train, held=held, head=head,
                untrained=untrained, history=history)


@pytest.mark.parametrize(("architecture", "taps"), [("eagle3", None), ("eagle3", (0, 1, 2)), ("eagle", None),
                                                   ("eagle", (0, 1, 2))])
def test_dense_step0_matches_the_paged_forward(setup, architecture, taps):
    """Step 0 of the dense TTT path computes what EagleHead.forward computes over the paged cache."""
    target = setup["target"]
    head = fresh_head(setup["config"], setup["train"], taps, seed=4, architecture=architecture, target=target)
    r = setup["held"][0].token_ids
    ids = torch.tensor([r])
    features, _, _ = target_features(target, ids, torch.ones_like(ids, dtype=torch.bool), head.config.feature_layers,
                                     head.draft_to_target)
    t = ids.shape[1] - 1
    embeds = torch.nn.functional.embedding(ids[:, 1:], target.model.embed_tokens.weight)  # x_{t+1}
    dense, _ = head.forward_dense(embeds, features[:, :t], torch.arange(t)[None], [], from_target=True)
    mc = head.config.as_model_config()
    cache = allocate_kv_cache(mc, 16, 8, torch.float32, torch.device("cpu"))[0]
    backend = TorchAttention(mc.num_heads, mc.num_kv_heads, mc.head_dim, torch.device("cpu"))
    backend.plan(build_metadata([t], [t], [list(range(-(-t // 8)))], 8))
    with torch.no_grad():
        paged = head(embeds[0], features[0, :t], torch.arange(t), cache, backend, from_target=True)
    torch.testing.assert_close(dense[0], paged, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("architecture", ["eagle3", "eagle"])
def test_dense_step1_is_a_draft_step_over_the_paged_cache(setup, architecture):
    """Row t of unrolled step 1 is the engine's second draft from last verified position t: the head's
    own output as feature, at position t + 1, attending to the step-0 K/V of rows 0..t and itself."""
    from specroll.drafter.ttt import unroll

    target = setup["target"]
    head = setup["head"] if architecture == "eagle3" else fresh_head(setup["config"], setup["train"], (0, 1, 2),
                                                                      seed=5, architecture=architecture)
    ids = torch.tensor([setup["held"][1].token_ids])
    features, _, _ = target_features(target, ids, torch.ones_like(ids, dtype=torch.bool), head.config.feature_layers,
                                     head.draft_to_target)
    weight = target.lm_head_weight.index_select(0, head.draft_to_target)
    with torch.no_grad():
        dense = unroll(head, target, ids, features, steps=2)[1][0]  # [T, Vd] step-1 logits
    mc = head.config.as_model_config()
    backend = TorchAttention(mc.num_heads, mc.num_kv_heads, mc.head_dim, torch.device("cpu"))
    embed = target.model.embed_tokens.weight
    for t in (PROMPT_LEN, PROMPT_LEN + 9):
        cache = allocate_kv_cache(mc, 16, 8, torch.float32, torch.device("cpu"))[0]
        pages = list(range(-(-(t + 2) // 8)))
        with torch.no_grad():
            backend.plan(build_metadata([t + 1], [t + 1], [pages], 8))  # catch-up over positions 0..t
            h = head(embed[ids[0, 1 : t + 2]], features[0, : t + 1], torch.arange(t + 1), cache, backend, True)
            backend.plan(build_metadata([1], [t + 2], [pages], 8))  # one draft step at position t + 1
            h1 = head(embed[ids[0, t + 2 : t + 3]], h[-1:], torch.tensor([t + 1]), cache, backend, False)
        torch.testing.assert_close(dense[t], head.draft_logits(h1, weight)[0], atol=1e-4, rtol=1e-4)


def test_ttt_loss_decreases_and_top1_rises(setup):
    history = setup["history"]
    first = sum(h["loss"] for h in history[:20]) / 20
    last = sum(h["loss"] for h in history[-20:]) / 20
    assert last < first, (first, last)
    for i in range(3):  # the loss is mostly the teacher's entropy; its excess, KL(p ‖ q), halves
        kl_first = sum(h[f"kl_{i}"] for h in history[:20]) / 20
        kl_last = sum(h[f"kl_{i}"] for h in history[-20:]) / 20
        assert kl_last < 0.5 * kl_first, (i, kl_first, kl_last)
    for i in range(3):
        assert sum(h[f"top1_{i}"] for h in history[-20:]) / 20 > 0.2  # untrained: about 1/128


@pytest.mark.parametrize("architecture", ["eagle3", "eagle"])
def test_eagle3_taps_train_too(setup, architecture):
    """The fused-taps head gets gradients through its fusion (eagle3: fc, eagle: fuse) and every other
    parameter — an eagle3 head's own lm_head included — and its loss falls."""
    target, train = setup["target"], setup["train"]
    head = fresh_head(setup["config"], train, taps=(0, 1, 2), architecture=architecture, target=target)
    before = {name: p.detach().clone() for name, p in head.named_parameters()}
    history = train_drafter(head, target, train, steps=60, lr=5e-3, batch=4, window=40, ttt_steps=2, seed=1)
    fusion = head.fc if architecture == "eagle3" else head.fuse
    assert fusion is not None and fusion.weight.grad is not None
    assert (head.lm_head is not None) == (architecture == "eagle3")
    moved = {name for name, p in head.named_parameters() if not torch.equal(p, before[name])}
    assert moved == set(before), set(before) - moved
    assert history[-1]["loss"] < history[0]["loss"]


def test_a_cold_started_learner_makes_an_eagle3_head_from_the_targets_lm_head(setup):
    target, train = setup["target"], setup["train"]
    heads = {}
    for architecture in ("eagle3", "eagle"):
        learner = DrafterLearner(target, LearnerConfig(min_rollouts=4, batch=2, window=40, draft_vocab_size=64,
                                                       architecture=architecture))
        for r in train[:4]:
            learner.add_rollout(r.token_ids, r.prompt_len)
        assert learner.head is None
        learner.step()
        heads[architecture] = learner.head
    head = heads["eagle3"]
    assert head is not None and head.config.architecture == "eagle3" and head.lm_head is not None
    rows = target.lm_head_weight[head.draft_to_target]
    assert 0 < (head.lm_head.weight - rows).abs().max().item() < 0.05  # started there, one AdamW step away
    assert heads["eagle"] is not None and heads["eagle"].lm_head is None
    with pytest.raises(ValueError, match="architecture='medusa', expected 'eagle3' or 'eagle'"):
        LearnerConfig(architecture="medusa")


def test_trained_head_drafts_far_better_than_untrained_on_held_out_rollouts(setup):
    target, held = setup["target"], setup["held"]
    before = expected_acceptance_length(setup["untrained"], target, held, K)
    after = expected_acceptance_length(setup["head"], target, held, K)
    print(f"held-out acceptance length at k={K}: untrained {before:.3f}, trained {after:.3f}")
    # An untrained head agrees with the target's argmax about 1/128 of the time: ≈1.01.
    assert before < 1.1
    assert after > 1.5 and after - before > 0.4


def test_saved_trained_head_loads_and_speeds_up_the_engine(setup, tmp_path):
    setup["head"].save(tmp_path / "drafter")
    loaded = EagleHead.load(tmp_path / "drafter")
    for name, t in setup["head"].state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t)
    prompts = [r.token_ids[:PROMPT_LEN] for r in setup["held"][:8]]
    greedy = SamplingParams(temperature=0.0, max_tokens=RESPONSE_LEN, ignore_eos=True)
    results = {}
    for name, head in (("trained", str(tmp_path / "drafter")), ("untrained", setup["untrained"])):
        engine = Engine(EngineConfig(model=str(setup["path"]), page_size=8, kv_cache_memory_gb=0.01,
                                     max_model_len=128, dtype="float32", num_draft_tokens=K),
                        proposer=EagleProposer(head, page_size=8, kv_cache_memory_gb=0.01))
        for i, p in enumerate(prompts):
            engine.add_request(p, greedy, f"r{i}")
        done = run_to_completion(engine)
        results[name] = (engine.spec_stats.acceptance_length, {r: c.token_ids for r, c in done.items()})
    print(f"engine acceptance length at k={K}: trained {results['trained'][0]:.3f}, "
          f"untrained {results['untrained'][0]:.3f}")
    assert results["trained"][1] == results["untrained"][1]  # lossless either way
    assert results["trained"][1] == {f"r{i}": setup["held"][i].token_ids[PROMPT_LEN:] for i in range(8)}
    assert results["trained"][0] > results["untrained"][0] + 0.25


def test_replay_buffer_is_bounded_and_keeps_the_newest(setup):
    learner = DrafterLearner(setup["target"], LearnerConfig(buffer_rollouts=3, min_rollouts=1))
    for i in range(5):
        learner.add_rollout([i + 3, i + 4, i + 5], 1)
    assert learner.num_rollouts == 3
    assert [e.rollout.token_ids[0] for e in learner._buffer] == [5, 6, 7]


def test_ttt_loss_masks_prompt_tokens(setup):
    """Only rows predicting response tokens count: a batch whose prompt covers everything has no loss rows."""
    target, head = setup["target"], setup["untrained"]
    ids = torch.tensor([setup["held"][0].token_ids])
    mask = torch.ones_like(ids, dtype=torch.bool)
    features, teacher, _ = target_features(target, ids, mask, head.config.feature_layers, head.draft_to_target)
    loss, metrics = ttt_loss(head, target, ids, mask, torch.tensor([ids.shape[1]]), features, teacher, steps=2)
    assert loss.item() == 0.0 and metrics["top1_0"] == 0.0


def test_optional_hidden_regression_adds_smooth_l1_to_the_final_hidden_state(setup):
    target, head = setup["target"], setup["untrained"]
    ids = torch.tensor([r.token_ids for r in setup["held"][:2]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    layers = (*head.config.feature_layers, target.config.num_layers)
    taps, teacher, _ = target_features(target, ids, mask, layers, head.draft_to_target)
    h = target.config.hidden_size
    features, final = taps[..., :-h], taps[..., -h:]
    prompt_lens = torch.tensor([PROMPT_LEN, PROMPT_LEN])
    plain, _ = ttt_loss(head, target, ids, mask, prompt_lens, features, teacher, steps=2)
    with_reg, metrics = ttt_loss(head, target, ids, mask, prompt_lens, features, teacher, steps=2,
                                 final_hidden=final, hidden_weight=0.5)
    assert metrics["hidden_0"] > 0 and metrics["hidden_1"] > 0
    expected = plain + 0.5 * (metrics["hidden_0"] + 0.8 * metrics["hidden_1"])
    torch.testing.assert_close(with_reg, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs final_hidden"):
        ttt_loss(head, target, ids, mask, prompt_lens, features, teacher, steps=2, hidden_weight=0.5)


def test_tv_objective_is_one_minus_the_acceptance_of_a_sampled_draft(setup):
    """``tv_i`` is 1 − Σ min(p, q) over step i's rows (the probability that a draft sampled from q is
    rejected against p), the ``tv`` loss is their 0.8-weighted sum and ``kl+tv`` adds the soft CE."""
    from specroll.drafter.ttt import response_mask, shift, unroll

    target, head = setup["target"], setup["untrained"]
    ids = torch.tensor([r.token_ids for r in setup["held"][:2]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    features, teacher, _ = target_features(target, ids, mask, head.config.feature_layers, head.draft_to_target)
    prompt_lens = torch.tensor([PROMPT_LEN, PROMPT_LEN])
    kl, _ = ttt_loss(head, target, ids, mask, prompt_lens, features, teacher, steps=2)
    tv, metrics = ttt_loss(head, target, ids, mask, prompt_lens, features, teacher, steps=2, objective="tv")
    both, _ = ttt_loss(head, target, ids, mask, prompt_lens, features, teacher, steps=2, objective="kl+tv")
    with torch.no_grad():
        logits = unroll(head, target, ids, features, 2)
    for i, q in enumerate(logits):
        rows = response_mask(mask, prompt_lens, i)
        accept = torch.minimum(shift(teacher, i + 1).exp(), q.softmax(-1)).sum(-1)  # [B, T]
        assert metrics[f"tv_{i}"] == pytest.approx(1 - accept[rows].mean().item(), abs=1e-5)
    torch.testing.assert_close(tv, torch.tensor(metrics["tv_0"] + 0.8 * metrics["tv_1"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(both, kl + tv, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="objective='js'"):
        ttt_loss(head, target, ids, mask, prompt_lens, features, teacher, steps=2, objective="js")
    with pytest.raises(ValueError, match="objective='js'"):
        LearnerConfig(objective="js")


def write_rollouts(path: Path, rollouts: list[Rollout]) -> None:
    with path.open("w") as f:
        for r in rollouts:
            f.write(json.dumps({"prompt_token_ids": r.token_ids[:r.prompt_len],
                                "token_ids": r.token_ids[r.prompt_len:]}) + "\n")


def test_cli_trains_from_scratch_and_warm_starts(setup, tmp_path, capsys):
    rollouts = tmp_path / "rollouts.jsonl"
    write_rollouts(rollouts, setup["train"][:16])
    model = str(setup["path"])
    args = ["drafter", "train", "--rollouts", str(rollouts), "--model", model, "--steps", "5", "--batch", "2",
            "--window", "40", "--draft-vocab-size", "64", "--lr", "0.005"]
    assert main([*args, "--out", str(tmp_path / "fresh")]) == 0
    fresh = EagleHead.load(tmp_path / "fresh")
    fresh.check_target(setup["config"])
    assert fresh.config.draft_vocab_size == 64 and fresh.config.feature_layers == eagle3_feature_layers(2)
    assert "drafter trained on 16 rollouts" in capsys.readouterr().out
    assert main([*args, "--init", str(tmp_path / "fresh"), "--out", str(tmp_path / "warm")]) == 0
    warm = EagleHead.load(tmp_path / "warm")
    assert torch.equal(warm.draft_to_target, fresh.draft_to_target)
    assert fresh.config.architecture == "eagle3" and warm.config.architecture == "eagle3"
    assert fresh.fc is not None and warm.fc is not None
    assert not torch.equal(warm.fc.weight, fresh.fc.weight)  # trained further from the warm start
    assert main([*args, "--architecture", "eagle", "--out", str(tmp_path / "older")]) == 0
    assert EagleHead.load(tmp_path / "older").config.architecture == "eagle"


@pytest.mark.parametrize("case", ["missing", "bad-line", "out-is-file", "bad-init", "foreign-ids", "bool-id",
                                  "features-vs-init", "vocab-vs-init", "architecture-vs-init"])
def test_cli_errors_are_one_line_exit_2(setup, tmp_path, capsys, case):
    rollouts = tmp_path / "rollouts.jsonl"
    write_rollouts(rollouts, setup["train"][:2])
    out = tmp_path / "out"
    extra: list[str] = []
    if case == "missing":
        rollouts = tmp_path / "nope.jsonl"
    elif case == "bad-line":
        rollouts.write_text(rollouts.read_text() + '{"token_ids": [1]}\n')
    elif case == "out-is-file":
        out.write_text("x")
    elif case == "bad-init":
        extra = ["--init", str(tmp_path / "no-drafter")]
    elif case == "foreign-ids":
        rollouts.write_text(json.dumps({"prompt_token_ids": [1], "token_ids": [100000]}) + "\n")
    elif case == "bool-id":  # bool is an int in Python: JSON true must not train as token 1
        rollouts.write_text(rollouts.read_text() + '{"prompt_token_ids": [1, 2], "token_ids": [5, true, 7]}\n')
    elif case in ("features-vs-init", "vocab-vs-init", "architecture-vs-init"):  # a warm start keeps its shape
        EagleHead.init(EagleConfig.for_target(setup["config"], (2,), 64), torch.arange(64)).save(tmp_path / "last")
        flag = {"features-vs-init": ["--features", "eagle3"], "vocab-vs-init": ["--draft-vocab-size", "128"],
                "architecture-vs-init": ["--architecture", "eagle"]}[case]
        extra = ["--init", str(tmp_path / "last"), *flag]
    code = main(["drafter", "train", "--rollouts", str(rollouts), "--model", str(setup["path"]), "--out", str(out),
                 "--steps", "1", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("specroll drafter train: error:") and "\n" not in err, err
    assert not out.is_dir()
    if case == "bad-line":
        assert "rollouts.jsonl:3" in err
    if case == "bool-id":
        assert "rollouts.jsonl:3: 'token_ids' [1] is true, expected a non-negative integer token id" in err, err
    if case == "features-vs-init":
        assert f"--features eagle3 conflicts with --init {tmp_path / 'last'}, whose head taps last" in err, err
    if case == "vocab-vs-init":
        assert "--draft-vocab-size 128 conflicts with" in err and "drafts from 64 tokens" in err, err
    if case == "architecture-vs-init":
        assert f"--architecture eagle conflicts with --init {tmp_path / 'last'}, an eagle3 head" in err, err


BAD_FLAGS = {
    "window-1": (["--window", "1"], "--window 1"),
    "window-below-ttt": (["--window", "5", "--ttt-steps", "4"], "--ttt-steps 4"),
    "device-banana": (["--device", "banana"], "device 'banana' is not a torch device"),
}
if not torch.cuda.is_available():
    BAD_FLAGS["cuda-without-cuda"] = (["--device", "cuda"], "device 'cuda': this torch build or machine has no CUDA")


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_cli_refuses_a_bad_device_or_a_window_too_short_to_train(tiny_checkpoint, tmp_path, capsys, case):
    rollouts = tmp_path / "rollouts.jsonl"
    g = torch.Generator().manual_seed(0)
    write_rollouts(rollouts, [Rollout(torch.randint(3, 300, (24,), generator=g).tolist(), 8) for _ in range(4)])
    flags, words = BAD_FLAGS[case]
    model = tiny_checkpoint()
    capsys.readouterr()  # what writing the checkpoint printed
    code = main(["drafter", "train", "--rollouts", str(rollouts), "--model", str(model),
                 "--out", str(tmp_path / "out"), "--steps", "2", "--batch", "2", "--draft-vocab-size", "64", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("specroll drafter train: error:") and "\n" not in err, err
    assert words in err, err
    assert not (tmp_path / "out").exists()


def test_a_window_must_hold_the_first_draft_of_every_ttt_step():
    LearnerConfig(window=5, ttt_steps=3)  # x_t, x_{t+1}, and the drafts of x_{t+2}..x_{t+4}
    with pytest.raises(ValueError, match=r"window=4.*ttt_steps \+ 2 = 5"):
        LearnerConfig(window=4, ttt_steps=3)
