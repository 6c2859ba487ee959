"""The exactness contract on a CUDA device, through PyTorch's own kernels (verispec's native kernels are CPU-only):
greedy speculative output equals plain greedy decoding on the same device for every drafter family, in `decode`
and the engine, on dense fp32, bf16 and weight-only quantized targets (QuantLinear falls back to dequantized
matmuls there), with the tiered KV cache in pinned host memory, and seeded sampling reproduces itself.

Where no CUDA device is present (CI has none) the same checks run on the CPU, so that they stay runnable between the
runs on a GPU; `VERISPEC_TEST_DEVICE=cuda` insists on the GPU (and fails without one).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import tiny_model
from test_block_drafter import make_block
from test_feature_drafters import make_feature, make_medusa

from verispec.config import EngineConfig, RequestSpec, SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import ModelDrafter, build_drafter
from verispec.drafters.block import save_block_drafter
from verispec.drafters.feature import save_feature_drafter
from verispec.drafters.medusa import save_medusa
from verispec.drafters.ngram import NgramDrafter
from verispec.engine import Engine
from verispec.model.checkpoint import load_model, save_model
from verispec.quant.convert import QuantizeConfig, quantize_checkpoint

DEVICE = os.environ.get("VERISPEC_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [3, 44, 17, 90, 2, 61, 28], [1, 2, 3] * 6]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Saved tiny checkpoints: the target, a random draft model, a block (DFlash-style) and a DSpark drafter."""
    root = tmp_path_factory.mktemp("cuda")
    cpu_target = tiny_model(0, 0.2)
    save_model(cpu_target, root / "target")
    save_model(tiny_model(123, 0.5), root / "draft")
    save_block_drafter(make_block(cpu_target), root / "block")
    save_block_drafter(make_block(cpu_target, head="markov", confidence=True, block_size=6), root / "dspark")
    for kind in ("eagle", "mtp"):
        save_feature_drafter(make_feature(cpu_target, kind), root / kind)
    save_medusa(make_medusa(cpu_target), root / "medusa")
    return root


def load(path, dtype="fp32"):
    model = load_model(path, dtype, device=DEVICE)
    assert model.device.type == torch.device(DEVICE).type
    return model


def drafter_specs(root) -> dict[str, str]:
    return {
        "ngram": "ngram",
        "self": "model",
        "model": f"model:{root / 'draft'}",
        "model-tree": f"model(path={root / 'draft'}, tree=auto, width=2, depth=3, nodes=6)",
        "block": f"block:{root / 'block'}",
        "dspark": f"dspark:{root / 'dspark'}",
        "lookup:dspark": f"lookup:dspark:{root / 'dspark'}",
        "vericache": "vericache(compress=streaming, budget=12)",
        "eagle": f"eagle:{root / 'eagle'}",
        "eagle-tree": f"eagle(path={root / 'eagle'}, tree=auto, width=2, depth=3, nodes=6)",
        "mtp": f"mtp:{root / 'mtp'}",
        "medusa": f"medusa:{root / 'medusa'}",
    }


def build(spec: str, target):
    return build_drafter(spec, target=target, dtype=target.dtype, device=target.device)


def run_engine(target, drafters: dict, specs: list[RequestSpec], params=GREEDY, **cfg) -> list[list[int]]:
    engine = Engine(target, None, EngineConfig(k=4, **cfg), drafters=drafters)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, params, specs[i % len(specs)], f"r{i}")
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
    return [results[f"r{i}"].token_ids for i in range(len(PROMPTS))]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_drafter_equals_plain_in_decode(dirs, dtype):
    target = load(dirs / "target", dtype)
    plain = [decode(target, p, GREEDY).token_ids for p in PROMPTS]
    assert len({tuple(t) for t in plain}) == len(PROMPTS)  # not degenerate
    for name, spec in drafter_specs(dirs).items():
        for k in (1, 4, 8):
            for p, ref in zip(PROMPTS, plain):
                out = decode(target, p, GREEDY, drafter=build(spec, target), spec=SpecConfig(k=k))
                assert out.token_ids == ref, (name, k, p)
                if name == "self":
                    assert out.stats.num_accepted_tokens == out.stats.num_draft_tokens


@pytest.mark.parametrize("policy", ["fixed", "dspark"])
def test_engine_batches_every_drafter_exactly(dirs, policy):
    target = load(dirs / "target")
    plain = [decode(target, p, GREEDY).token_ids for p in PROMPTS]
    specs = drafter_specs(dirs)
    specs.pop("model-tree"), specs.pop("eagle-tree")  # chains here; trees in decode above
    drafters = {name: build(spec, target) for name, spec in specs.items()}
    for name in drafters:
        got = run_engine(target, drafters, [RequestSpec(drafter=name, k=6, policy=policy),
                                            RequestSpec(drafter="none"), RequestSpec(drafter="ngram", k=3)])
        assert got == plain, name


@pytest.mark.parametrize("scheme", ["w4a16", "w8a16", "w4a8"])
def test_quantized_target_is_exact_with_respect_to_itself(dirs, scheme, tmp_path):
    qdir = tmp_path / scheme
    quantize_checkpoint(dirs / "target", qdir, QuantizeConfig(scheme=scheme, group_size=32), progress=False)
    q = load(qdir)
    assert q.quantized
    cpu = load_model(qdir, "fp32")  # the same checkpoint on the CPU (its native or torch kernels)
    tokens = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        torch.testing.assert_close(q(tokens.to(q.device))[0].cpu(), cpu(tokens)[0], rtol=1e-4, atol=1e-4)
    plain = [decode(q, p, GREEDY).token_ids for p in PROMPTS]
    for spec in ("ngram", f"model:{dirs / 'draft'}", f"dspark:{dirs / 'dspark'}"):
        for p, ref in zip(PROMPTS, plain):
            assert decode(q, p, GREEDY, drafter=build(spec, q), spec=SpecConfig(k=4)).token_ids == ref, spec
    drafters = {"ngram": NgramDrafter(), "self": ModelDrafter(q)}
    assert run_engine(q, drafters, [RequestSpec(drafter="self", k=4), RequestSpec(drafter="ngram", k=8)]) == plain
    qb = load(qdir, "bf16")  # bf16 activations on the device: exact with respect to that model too
    plain_b = [decode(qb, p, GREEDY).token_ids for p in PROMPTS]
    for p, ref in zip(PROMPTS, plain_b):
        assert decode(qb, p, GREEDY, drafter=build("ngram", qb), spec=SpecConfig(k=4)).token_ids == ref


@pytest.mark.parametrize("compress", ["streaming", "snapkv, recent=4, window=4", "retrieval, recent=4, window=4",
                                      "snapkv+kivi, recent=4, window=4"])
def test_tiered_cache_in_pinned_host_memory_equals_plain(dirs, compress):
    target = load(dirs / "target")
    plain = [decode(target, p, GREEDY).token_ids for p in PROMPTS]
    for p, ref in zip(PROMPTS, plain):
        drafter = build(f"vericache(compress={compress}, budget=12)", target)
        out = decode(target, p, GREEDY, drafter=drafter, spec=SpecConfig(k=6, kv_tier="cpu"))
        assert out.token_ids == ref, compress
    assert run_engine(target, {}, [RequestSpec(drafter="ngram", k=4)], kv_tier="cpu", prefill_chunk=8) == plain


def test_seeded_sampling_reproduces_and_stays_in_vocabulary(dirs):
    target = load(dirs / "target")
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    for spec in ("ngram", f"model:{dirs / 'draft'}", f"dspark:{dirs / 'dspark'}"):
        a = decode(target, PROMPTS[1], params, drafter=build(spec, target), spec=SpecConfig(k=4)).token_ids
        b = decode(target, PROMPTS[1], params, drafter=build(spec, target), spec=SpecConfig(k=4)).token_ids
        assert a == b and len(a) == 24 and all(0 <= t < target.config.vocab_size for t in a), spec
    drafters = {"m": build(f"model:{dirs / 'draft'}", target)}
    sampled = run_engine(target, drafters, [RequestSpec(drafter="m", k=4)], params=params)
    assert all(len(t) == 24 for t in sampled)


def test_sampling_follows_the_target_and_the_check_catches_the_draft(tmp_path):
    """The statistical test on the device: 2,500 seeded runs of k = 2 with a far-off draft model match the exact
    joints of the target's first tokens (computed on the CPU from the same weights); the negative control, the draft
    model's own samples, fails the same check."""
    from test_exactness import S_N, S_PARAMS, S_PROMPT, SV, exact_pair_joints, failures, sample_runs

    cfg = {"vocab_size": SV, "max_position_embeddings": 16, "num_hidden_layers": 1}
    cpu_target, cpu_draft = tiny_model(0, 0.25, **cfg), tiny_model(1, 0.25, **cfg)
    save_model(cpu_target, tmp_path / "t")
    save_model(cpu_draft, tmp_path / "d")
    target, draft = load(tmp_path / "t"), load(tmp_path / "d")
    joints = exact_pair_joints(cpu_target, S_PROMPT, S_PARAMS)
    assert failures(sample_runs(target, lambda: ModelDrafter(draft), S_N), joints) == []
    control = sample_runs(draft, lambda: ModelDrafter(draft), S_N)  # the draft's distribution, not the target's
    assert failures(control, joints) != []
