"""`specroll drafter export` / `import`: an eagle3 drafter as the EAGLE-3 checkpoint vLLM and SGLang load."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.checkpoints import write_tiny_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specroll.actors.cli import main
from specroll.drafter.eagle import EagleProposer
from specroll.drafter.eagle_config import EagleConfig, build_draft_vocab
from specroll.drafter.eagle_head import EagleHead, draft_lm_head
from specroll.drafter.ttt import target_features
from specroll.engine.config import EngineConfig
from specroll.engine.driver import run_to_completion
from specroll.engine.engine import Engine
from specroll.engine.loaders.checkpoint import load_checkpoint
from specroll.engine.model import CausalLM
from specroll.protocol.sampling import SamplingParams

# The tiny target (conftest's Llama with 4 layers) and the head's draft vocabulary.
H, FF, HQ, HKV, D, V, N, LAYERS = 64, 128, 4, 2, 16, 320, 64, 4
TAPS = [0, 2, 3]  # EAGLE-3's low/mid/high for a target under 6 layers: (0, N//2, N-1)

# The EAGLE-3 checkpoint, written from the format (SafeAILab/EAGLE traineagle3/cnets.py, vLLM and SGLang
# llama_eagle3.py, ModelOpt's LLAMA_EAGLE_SINGLE_LAYER), not from specroll's code: name -> (shape, dtype).
# None stands for the weight dtype asked for.
EXPECTED = {
    "fc.weight": ((H, 3 * H), None),
    "midlayer.input_layernorm.weight": ((H,), None),
    "midlayer.hidden_norm.weight": ((H,), None),
    "midlayer.self_attn.q_proj.weight": ((HQ * D, 2 * H), None),
    "midlayer.self_attn.k_proj.weight": ((HKV * D, 2 * H), None),
    "midlayer.self_attn.v_proj.weight": ((HKV * D, 2 * H), None),
    "midlayer.self_attn.o_proj.weight": ((H, HQ * D), None),
    "midlayer.post_attention_layernorm.weight": ((H,), None),
    "midlayer.mlp.gate_proj.weight": ((FF, H), None),
    "midlayer.mlp.up_proj.weight": ((FF, H), None),
    "midlayer.mlp.down_proj.weight": ((H, FF), None),
    "norm.weight": ((H,), None),
    "lm_head.weight": ((N, H), None),
    "d2t": ((N,), torch.int64),
    "t2d": ((V,), torch.bool),
}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict:
    """A 4-layer tiny target and an eagle3 drafter for it whose every weight (norms too) is random."""
    root = tmp_path_factory.mktemp("export")
    model = root / "tiny"
    model.mkdir()
    write_tiny_checkpoint(model, "llama", num_hidden_layers=LAYERS)
    ckpt = load_checkpoint(str(model))
    target = CausalLM(ckpt.config)
    target.load_weights(ckpt.weights)
    target.eval().requires_grad_(False)
    config = EagleConfig.for_target(ckpt.config, tuple(TAPS), N, "eagle3")
    counts = torch.rand(V, generator=torch.Generator().manual_seed(3))  # a draft vocabulary spread over the ids
    d2t = build_draft_vocab(counts, N)
    head = EagleHead.init(config, d2t, seed=7, lm_head=draft_lm_head(target, config, d2t))
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 1:  # norms away from 1, so swapping two of them shows
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.mul_(5.0)  # q·k large enough that attention is far from uniform
    head.save(root / "drafter")
    return dict(root=root, model=model, config=ckpt.config, target=target, head=head, drafter=root / "drafter")


def export(work: dict, out: Path, *flags: str) -> int:
    return main(["drafter", "export", str(work["drafter"]), "--out", str(out), "--model", str(work["model"]), *flags])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_writes_every_eagle3_tensor_and_config_key(work, tmp_path, capsys, dtype):
    out = tmp_path / "eagle3"
    assert export(work, out, "--dtype", dtype) == 0
    assert "EAGLE-3 checkpoint" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["checksums.json", "config.json", "model.safetensors"]
    assert {(out / n).stat().st_mode & 0o777 for n in ("config.json", "model.safetensors")} == {0o644}  # umask 022
    weight_dtype = getattr(torch, dtype)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    assert set(tensors) == set(EXPECTED), set(tensors) ^ set(EXPECTED)  # no embed_tokens: the target's is shared
    for name, (shape, kind) in EXPECTED.items():
        assert tuple(tensors[name].shape) == shape, name
        assert tensors[name].dtype == (kind or weight_dtype), name
    head = work["head"]
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    assert torch.equal(torch.arange(N) + d2t, head.draft_to_target)  # target_id = draft_id + d2t[draft_id]
    assert int(t2d.sum()) == N and bool(t2d[head.draft_to_target].all())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    expected = {"num_hidden_layers": 1, "hidden_size": H, "intermediate_size": FF, "num_attention_heads": HQ,
                "num_key_value_heads": HKV, "head_dim": D, "vocab_size": V, "draft_vocab_size": N,
                "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "max_position_embeddings": 512, "hidden_act": "silu", "torch_dtype": dtype}
    assert {k: config.get(k) for k in expected} == expected
    # vLLM reads the top-level ids (the state entering layer i); SGLang eagle_config's (it captures before id + 1)
    assert config["eagle_aux_hidden_state_layer_ids"] == TAPS
    assert config["eagle_config"] == {"use_aux_hidden_state": True,
                                      "eagle_aux_hidden_state_layer_ids": [i - 1 for i in TAPS]}


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def eagle3_as_vllm_runs_it(t: dict[str, torch.Tensor], taps: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """The checkpoint's logits over the target vocabulary ``[T, V]`` for one sequence, written from the format
    (vLLM llama_eagle3.py: fc, the midlayer with its un-normed residual, norm, lm_head, d2t scatter into -inf)."""
    n = taps.shape[0]
    g = taps @ t["fc.weight"].T  # [T, H]
    x = torch.cat([rms(embeds, t["midlayer.input_layernorm.weight"]), rms(g, t["midlayer.hidden_norm.weight"])], -1)
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, HQ, D)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, HKV, D)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, HKV, D)
    inv_freq = 10000.0 ** (-torch.arange(0, D, 2).float() / D)
    angles = torch.arange(n).float()[:, None] * inv_freq[None]  # [T, D/2], neox-style halves
    cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]

    def rope(z: torch.Tensor) -> torch.Tensor:
        half = torch.cat([-z[..., D // 2:], z[..., : D // 2]], -1)
        return z * cos + half * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(n, HQ * D)
    r = g + o @ t["midlayer.self_attn.o_proj.weight"].T
    m = rms(r, t["midlayer.post_attention_layernorm.weight"])
    gate, up = m @ t["midlayer.mlp.gate_proj.weight"].T, m @ t["midlayer.mlp.up_proj.weight"].T
    out = r + (F.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T
    logits = rms(out, t["norm.weight"]) @ t["lm_head.weight"].T  # [T, N]
    full = torch.full((n, V), float("-inf"))
    full[:, torch.arange(N) + t["d2t"]] = logits
    return full


def test_the_checkpoint_run_as_its_format_says_gives_the_heads_logits(work, tmp_path):
    out = tmp_path / "eagle3"
    assert export(work, out) == 0
    tensors = load_file(out / "model.safetensors")
    target, head = work["target"], work["head"]
    ids = torch.randint(3, V, (1, 24), generator=torch.Generator().manual_seed(1))
    taps, _, _ = target_features(target, ids, torch.ones_like(ids, dtype=torch.bool), tuple(TAPS), None)
    n = ids.shape[1] - 1
    embeds = F.embedding(ids[0, 1:], target.model.embed_tokens.weight)  # x_{t+1}
    expected = eagle3_as_vllm_runs_it(tensors, taps[0, :n], embeds)
    with torch.no_grad():
        hidden, _ = head.forward_dense(embeds[None], taps[:, :n], torch.arange(n)[None], [], from_target=True)
        ours = head.draft_logits(hidden[0])  # [T, N] over the head's draft ids
    torch.testing.assert_close(expected[:, head.draft_to_target], ours, atol=1e-4, rtol=1e-4)
    assert torch.equal(expected.argmax(-1), head.draft_to_target[ours.argmax(-1)])


class RecordingEagleProposer(EagleProposer):
    """An EagleProposer that keeps every chain of drafts it proposed, by request."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drafted: list[tuple[str, list[int]]] = []

    def propose(self, batch, k):
        proposal = super().propose(batch, k)
        for b, seq in enumerate(batch):
            self.drafted.append((seq.request_id, proposal.token_ids[b, : int(proposal.num_drafts[b])].tolist()))
        return proposal


def greedy_drafts(work: dict, head: EagleHead) -> tuple[dict[str, list[int]], list[tuple[str, list[int]]]]:
    proposer = RecordingEagleProposer(head, page_size=8, kv_cache_memory_gb=0.01)
    engine = Engine(EngineConfig(model=str(work["model"]), page_size=8, kv_cache_memory_gb=0.01, max_model_len=128,
                                 dtype="float32", num_draft_tokens=3), proposer=proposer)
    g = torch.Generator().manual_seed(2)
    for i in range(3):
        prompt = torch.randint(3, V, (11 + 5 * i,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), f"r{i}")
    done = run_to_completion(engine)
    return {r: c.token_ids for r, c in done.items()}, proposer.drafted


def test_import_of_the_export_gives_the_same_head_and_the_same_drafts(work, tmp_path, capsys):
    assert export(work, tmp_path / "eagle3") == 0
    assert main(["drafter", "import", str(tmp_path / "eagle3"), "--out", str(tmp_path / "back"),
                 "--model", str(work["model"])]) == 0
    back = EagleHead.load(tmp_path / "back")
    head = work["head"]
    assert back.config == head.config
    assert back.state_dict().keys() == head.state_dict().keys()
    for name, t in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    tokens, drafts = greedy_drafts(work, head)
    tokens_back, drafts_back = greedy_drafts(work, back)
    assert tokens == tokens_back
    assert drafts == drafts_back and sum(len(d) for _, d in drafts) > 0


def test_import_reads_what_other_trainers_write(work, tmp_path):
    """vLLM's ``layers.0.`` names, ids only in eagle_config (SGLang's meaning), no t2d, a d2t given with its
    lm_head rows in another order: the same head."""
    assert export(work, tmp_path / "eagle3") == 0
    tensors = load_file(tmp_path / "eagle3" / "model.safetensors")
    config = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(config))
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(4))
    targets = torch.arange(N) + tensors["d2t"]
    renamed = {name.replace("midlayer.", "layers.0."): t for name, t in tensors.items() if name != "t2d"}
    renamed["lm_head.weight"] = tensors["lm_head.weight"][perm]
    renamed["d2t"] = targets[perm] - torch.arange(N)
    save_file(renamed, other / "model.safetensors")
    from specroll.drafter.eagle3_format import read_eagle3

    back = read_eagle3(other, work["config"])
    assert back.config == work["head"].config  # taps [0, 2, 3] from SGLang's [-1, 1, 2]
    for name, t in work["head"].state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


def other_drafters(work: dict, root: Path) -> dict[str, Path]:
    """Drafters the format cannot hold or that are made for another model."""
    config = work["config"]
    made = {}
    made["eagle"] = root / "eagle"
    EagleHead.init(EagleConfig.for_target(config, tuple(TAPS), N, "eagle"), torch.arange(N)).save(made["eagle"])
    made["two_taps"] = root / "two_taps"
    EagleHead.init(EagleConfig.for_target(config, (0, 2), N), torch.arange(N)).save(made["two_taps"])
    made["final_tap"] = root / "final_tap"
    EagleHead.init(EagleConfig.for_target(config, (0, 2, LAYERS), N), torch.arange(N)).save(made["final_tap"])
    made["not_a_drafter"] = root / "not_a_drafter"
    made["not_a_drafter"].mkdir()
    (made["not_a_drafter"] / "notes.txt").write_text("x")
    return made


EXPORT_ERRORS = {
    "missing_drafter": r"drafter .*nowhere: does not exist",
    "not_a_drafter": r"config.json not found",
    "eagle": r"is an 'eagle' head .* cannot hold this one",
    "two_taps": r"taps target layers \[0, 2\]; the EAGLE-3 format needs 3",
    "final_tap": r"taps target layers \[0, 2, 4\]; .*ids in \[0, 4\)",
    "other_model": r"was made for a target with vocabulary 320, .* this model has vocabulary 400",
    "out_non_empty": r"--out .* is a non-empty directory",
    "out_is_file": r"--out .* exists and is not a directory",
    "out_unwritable": r"cannot write to .*a_file",
    "missing_model": r"--model .*no-such-model",
    "damaged_drafter": r"drafter .*damaged/model\.safetensors: \d+ bytes, checksums\.json says \d+",
}


@pytest.mark.parametrize("case", list(EXPORT_ERRORS))
def test_export_refuses_bad_input_in_one_line_and_writes_nothing(work, tmp_path, capsys, case):
    made = other_drafters(work, tmp_path / "drafters")
    place = tmp_path / "place"
    place.mkdir()
    out = place / "eagle3"
    drafter, model = work["drafter"], work["model"]
    if case == "missing_drafter":
        drafter = tmp_path / "nowhere"
    elif case in made:
        drafter = made[case]
    elif case == "other_model":
        model = tmp_path / "wide"
        model.mkdir()
        write_tiny_checkpoint(model, "llama", num_hidden_layers=LAYERS, vocab_size=400)
    elif case == "out_non_empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif case == "out_is_file":
        out.write_text("mine")
    elif case == "out_unwritable":
        (place / "a_file").write_text("mine")
        out = place / "a_file" / "eagle3"  # its parent is a file
    elif case == "missing_model":
        model = tmp_path / "no-such-model"
    elif case == "damaged_drafter":  # cut short after it was written
        drafter = tmp_path / "damaged"
        shutil.copytree(work["drafter"], drafter)
        os.truncate(drafter / "model.safetensors", 4096)
    before = sorted((p.name, p.read_bytes() if p.is_file() else None) for p in place.rglob("*"))
    capsys.readouterr()
    code = main(["drafter", "export", str(drafter), "--out", str(out), "--model", str(model)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("specroll drafter export: error: ") and err.count("\n") == 1, err
    assert re.search(EXPORT_ERRORS[case], err), err
    after = sorted((p.name, p.read_bytes() if p.is_file() else None) for p in place.rglob("*"))
    assert after == before  # nothing written, no temporary folder left


def test_export_into_an_empty_directory_and_import_refuses_a_model_checkpoint(work, tmp_path, capsys):
    out = tmp_path / "empty"
    out.mkdir()
    assert export(work, out) == 0
    assert sorted(p.name for p in out.iterdir()) == ["checksums.json", "config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]  # the temporary folder was renamed onto it
    capsys.readouterr()
    code = main(["drafter", "import", str(work["model"]), "--out", str(tmp_path / "back"),
                 "--model", str(work["model"])])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("specroll drafter import: error: ") and err.count("\n") == 1, err
    assert "architectures=['LlamaForCausalLM'], expected ['LlamaForCausalLMEagle3']" in err, err
    assert not (tmp_path / "back").exists()


IMPORT_TAPS = {  # eagle_aux_hidden_state_layer_ids (the target has 4 layers) -> the message
    "bool": (True, r"eagle_aux_hidden_state_layer_ids=True, expected 3 integer layer ids from 0 to 3"),
    "strings": (["0", "2", "3"], r"=\['0', '2', '3'\], expected 3 integer layer ids from 0 to 3"),
    "bool_id": ([0, True, 3], r"=\[0, True, 3\], expected 3 integer"),
    "out_of_range": ([0, 2, 30], r"=\[0, 2, 30\], expected 3 integer layer ids from 0 to 3 \(this model has 4"),
    "two": ([0, 2], r"=\[0, 2\], expected 3 integer"),
}


@pytest.mark.parametrize("case", [*IMPORT_TAPS, "out_non_empty"])
def test_import_refuses_bad_taps_and_a_non_empty_out_in_one_line(work, tmp_path, capsys, case):
    assert export(work, tmp_path / "eagle3") == 0
    out = tmp_path / "back"
    if case == "out_non_empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        expected = r"--out .*back is a non-empty directory"
    else:
        config = json.loads((tmp_path / "eagle3" / "config.json").read_text())
        config["eagle_aux_hidden_state_layer_ids"], expected = IMPORT_TAPS[case]
        (tmp_path / "eagle3" / "config.json").write_text(json.dumps(config))
        (tmp_path / "eagle3" / "checksums.json").unlink()  # as another trainer writes it
    capsys.readouterr()
    code = main(["drafter", "import", str(tmp_path / "eagle3"), "--out", str(out), "--model", str(work["model"])])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("specroll drafter import: error: ") and err.count("\n") == 1, err
    assert re.search(expected, err), err
    assert [p.name for p in out.iterdir()] == ["keep.txt"] if case == "out_non_empty" else not out.exists()


def test_serving_an_exported_folder_as_a_drafter_points_to_import(work, tmp_path):
    from specroll.drafter.eagle_config import DrafterError

    assert export(work, tmp_path / "eagle3") == 0
    with pytest.raises(DrafterError, match=r"looks like an EAGLE-3 checkpoint .*'specroll drafter import"):
        EagleHead.load(tmp_path / "eagle3")


def test_init_drafter_makes_an_exportable_eagle3_head_and_an_eagle_one_on_request(work, tmp_path, capsys):
    args = ["init-drafter", "--model", str(work["model"]), "--draft-vocab-size", str(N), "--num-builtin", "8"]
    assert main([*args, "--out", str(tmp_path / "new")]) == 0
    head = EagleHead.load(tmp_path / "new")
    assert head.config.architecture == "eagle3" and head.config.feature_layers == tuple(TAPS)
    assert head.lm_head is not None  # its own LM head starts as the model's rows (tied: the embedding)
    assert torch.equal(head.lm_head.weight, work["target"].lm_head_weight[head.draft_to_target])
    assert main(["drafter", "export", str(tmp_path / "new"), "--out", str(tmp_path / "eagle3"),
                 "--model", str(work["model"])]) == 0
    assert main([*args, "--architecture", "eagle", "--out", str(tmp_path / "old")]) == 0
    assert EagleHead.load(tmp_path / "old").config.architecture == "eagle"
    assert "eagle drafter for" in capsys.readouterr().out
