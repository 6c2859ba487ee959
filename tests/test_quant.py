"""Weight-only quantization (verispec.quant): the int32 packing, RTN and GPTQ, QuantLinear, loading a
pack-quantized checkpoint (and refusing a bad one), `verispec quantize`, and exactness of speculation on a
quantized target: greedy speculative output equals plain greedy decoding of the same quantized model.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from _checkpoints import edited_copy
from conftest import tiny_model
from safetensors.torch import save_file

from verispec.api import LLM
from verispec.cli import main
from verispec.config import EngineConfig, RequestSpec, SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.engine import Engine
from verispec.kernels import native
from verispec.errors import CheckpointError, ConfigError
from verispec.model.checkpoint import load_model, load_state_dict, save_model
from verispec.quant.bits import pack_int32, unpack_int32
from verispec.quant.convert import QuantizeConfig, quantize_checkpoint
from verispec.quant.gptq import gptq_quantize
from verispec.quant.linear import QuantLinear
from verispec.quant.rtn import dequantize, quantize_rtn
from verispec.quant.scheme import QuantScheme

W4 = QuantizeConfig(scheme="w4a16", group_size=32)
W8 = QuantizeConfig(scheme="w8a16")
W4H = QuantizeConfig(scheme="w4a16", group_size=32, lm_head="w4a16")  # the LM head quantized too, untied
W4H8 = QuantizeConfig(scheme="w4a16", group_size=32, lm_head="w8a16")  # an int8 head beside int4 layers
W4A8 = QuantizeConfig(scheme="w4a8", group_size=32, lm_head="w4a8")  # int8 activations per group, head too
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [3, 44, 17, 90, 2, 61, 28], [1, 2, 3] * 6]


def test_pack_layout_and_round_trip():
    """Element i of a row sits at bits [i*b, (i+1)*b) of the row's little-endian int32 stream, as q + 2^(b-1)."""
    q = torch.tensor([[-8, -7, 0, 7, 1, 2, 3, 4, 5, -1, -2, -3, -4, -5, -6, 6]], dtype=torch.int8)
    words = pack_int32(q, 4)
    assert words.shape == (1, 2) and words.dtype == torch.int32
    u = (q.to(torch.int64) + 8)[0]
    expect = [sum(int(u[8 * w + i]) << (4 * i) for i in range(8)) for w in range(2)]
    assert [int(x) & 0xFFFFFFFF for x in words[0]] == expect
    assert int(pack_int32(torch.tensor([[5, -128, 127, 0]], dtype=torch.int8), 8)[0, 0]) & 0xFFFFFFFF == \
        133 | (0 << 8) | (255 << 16) | (128 << 24)
    g = torch.Generator().manual_seed(0)
    for bits, cols in ((4, 64), (4, 40), (8, 64), (8, 6)):
        q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (5, cols), generator=g, dtype=torch.int8)
        assert torch.equal(unpack_int32(pack_int32(q, bits), bits, cols), q)


def test_rtn_formula():
    """compressed-tensors' symmetric rule: scale = absmax / 7.5 (int4) or / 127.5 (int8); q = clamp(round(w / s))."""
    w = torch.tensor([[1.5, -7.5, 3.0, 0.2] * 8, [0.0] * 32])
    q, s = quantize_rtn(w, QuantScheme(4, 32), torch.float32)
    assert s[0, 0] == 1.0 and s[1, 0] == torch.finfo(torch.float32).eps  # an all-zero group gets eps, not 0
    assert q[0, :4].tolist() == [2, -8, 3, 0]  # round half to even (1.5 -> 2), -7.5 -> -8 fits int4's range
    q8, s8 = quantize_rtn(w, QuantScheme(8, None), torch.float32)
    assert s8.shape == (2, 1) and torch.isclose(s8[0, 0], torch.tensor(7.5 / 127.5))
    assert torch.equal(dequantize(q8, s8), q8.float() * s8)


def test_gptq_error_below_rtn_on_correlated_inputs():
    """GPTQ's output error ||X W^T - X Ŵ^T|| on correlated inputs is lower than round-to-nearest's."""
    g = torch.Generator().manual_seed(0)
    n, d_in, d_out = 2048, 128, 64
    mix = torch.randn(d_in, d_in, generator=g) * 0.3 + torch.eye(d_in)
    low_rank = torch.randn(n, 16, generator=g) @ torch.randn(16, d_in, generator=g)  # strongly correlated columns
    x = low_rank + 0.1 * torch.randn(n, d_in, generator=g) @ mix
    w = torch.randn(d_out, d_in, generator=g)
    h = 2 * x.T @ x / n
    for scheme in (QuantScheme(4, 32), QuantScheme(4, 128), QuantScheme(8, None)):
        q_rtn, s_rtn = quantize_rtn(w, scheme, torch.float32)
        q_gptq, s_gptq = gptq_quantize(w, h, scheme, torch.float32)
        err_rtn = torch.linalg.norm(x @ w.T - x @ dequantize(q_rtn, s_rtn).T)
        err_gptq = torch.linalg.norm(x @ w.T - x @ dequantize(q_gptq, s_gptq).T)
        assert err_gptq < 0.8 * err_rtn, (scheme, err_gptq, err_rtn)
        assert q_gptq.min() >= scheme.qmin and q_gptq.max() <= scheme.qmax


def test_quant_linear_forward_and_concat():
    g = torch.Generator().manual_seed(1)
    parts = []
    for out in (32, 16, 16):
        q, s = quantize_rtn(torch.randn(out, 64, generator=g), QuantScheme(4, 32), torch.bfloat16)
        parts.append(QuantLinear(q, s, 4, torch.randn(out, generator=g)))
    x = torch.randn(3, 5, 64, generator=g)
    ref = [torch.nn.functional.linear(x, p.dequantize(), p.bias) for p in parts]
    for p, r in zip(parts, ref):
        torch.testing.assert_close(p(x), r, rtol=1e-5, atol=1e-5)
    fused = QuantLinear.concat(parts)
    torch.testing.assert_close(fused(x), torch.cat(ref, dim=-1), rtol=1e-5, atol=1e-5)
    assert parts[1].qweight.data_ptr() == fused.qweight[32:].data_ptr()  # views, no copy
    # A row's result does not depend on the rows beside it (the exactness contract of verify steps).
    assert torch.equal(fused(x.reshape(15, 64))[4:5], fused(x.reshape(15, 64)[4:5]))


def test_quant_linear_repacks_after_its_weights_or_scales_change_in_place():
    """The native int pack (QuantLinear.qpacked) is remade when the int weights or the scales change in place or are
    replaced, not only when they move: a stale pack computed with the old scales."""
    if not native.qavailable():
        pytest.skip("the native int kernels do not build here")
    g = torch.Generator().manual_seed(2)
    q, s = quantize_rtn(torch.randn(32, 64, generator=g), QuantScheme(4, 32), torch.float32)
    lin = QuantLinear(q, s, 4)
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.dequantize()), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        lin.scales.mul_(1.5)  # in place: the same storage, a new version
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.dequantize()), rtol=1e-5, atol=1e-5)
        lin.qweight.clamp_(-7, 7).neg_()  # in place, the int weights (kept in the int4 range)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.dequantize()), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dense")
    save_model(tiny_model(0, 0.2), d)
    return d


@pytest.fixture(scope="module", params=[W4, W8, W4H, W4H8, W4A8], ids=["w4a16-g32", "w8a16", "w4a16-g32-head",
                                                                        "w4a16-g32-head8", "w4a8-g32-head"])
def quant_dir(request, dense_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("quant")
    quantize_checkpoint(dense_dir, d, request.param, progress=False)
    return d


@pytest.fixture(scope="module")
def qmodel(quant_dir):
    return load_model(quant_dir, "fp32")


def test_loaded_model_equals_dense_dequantized(quant_dir, qmodel, tmp_path):
    """The quantized model's forward equals a dense model holding the dequantized weights, to fp32 rounding (W4A8:
    to its inputs' int8 rounding, a step of amax / 127 a group)."""
    with torch.inference_mode():  # decoder.c runs QuantLinears through qgemm.c where it builds
        assert qmodel.quantized and qmodel.forward_path == ("native" if native.qavailable() else "torch")
    state = load_state_dict(quant_dir)
    dense = {k: v for k, v in state.items() if not k.endswith(("weight_packed", "weight_scale", "weight_shape"))}
    stored = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")  # not fused
    quantized = {name: m for name, m in qmodel.named_modules()
                 if isinstance(m, QuantLinear) and name.endswith(stored)}
    assert len(quantized) == 7 * qmodel.config.num_hidden_layers + ("lm_head.weight_packed" in state)
    for name, lin in quantized.items():
        dense[f"{name}.weight"] = lin.dequantize()
    (tmp_path / "d").mkdir()
    save_file(dense, str(tmp_path / "d" / "model.safetensors"))
    cfg = json.loads((quant_dir / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    ref = load_model(tmp_path / "d", "fp32")
    tokens = torch.tensor([PROMPTS[0], PROMPTS[2][:14]])
    a8 = any(m.act_bits == 8 for m in quantized.values())
    with torch.inference_mode():
        got, want = qmodel(tokens)[0], ref(tokens)[0]
    if a8:
        assert not torch.equal(got, want) and (got - want).abs().max() < 0.05 * want.abs().max()
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_quantization_changes_the_model_but_not_much(dense_dir, qmodel):
    dense = load_model(dense_dir, "fp32")
    tokens = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        a, b = qmodel(tokens)[0], dense(tokens)[0]
    assert not torch.equal(a, b)
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.9


@pytest.mark.parametrize("drafter", ["ngram", "self", "random"])
def test_greedy_speculation_equals_plain_on_quantized_target(qmodel, drafter):
    """Exact with respect to the quantized target: decode() and the engine give plain greedy's tokens."""
    drafters = {"ngram": NgramDrafter(), "self": ModelDrafter(qmodel), "random": ModelDrafter(tiny_model(123, 0.5))}
    plain = [decode(qmodel, p, GREEDY).token_ids for p in PROMPTS]
    for k in (1, 4):
        for p, ref in zip(PROMPTS, plain):
            assert decode(qmodel, p, GREEDY, drafter=drafters[drafter], spec=SpecConfig(k=k)).token_ids == ref
    engine = Engine(qmodel, None, EngineConfig(k=4, drafter=drafter), drafters=drafters)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, GREEDY, RequestSpec(), f"r{i}")
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
    assert [results[f"r{i}"].token_ids for i in range(len(PROMPTS))] == plain


def test_llm_generate_on_quantized_checkpoint(quant_dir, tokenizer, tmp_path):
    d = tmp_path / "q"
    shutil.copytree(quant_dir, d)
    tokenizer.save(d)
    llm = LLM(str(d), drafter="ngram", dtype="fp32")
    spec = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True), plain=True)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


def test_server_serves_a_quantized_checkpoint(quant_dir, tokenizer, tmp_path):
    """`verispec serve --target` a quantized directory: a speculative request returns the quantized model's plain
    greedy tokens (speculation "off" gives the same)."""
    import asyncio

    import httpx

    from verispec.serve.app import create_app
    from verispec.serve.server import build_state

    d = tmp_path / "q"
    shutil.copytree(quant_dir, d)
    tokenizer.save(d)
    state = build_state(d, EngineConfig(drafter="ngram", k=4), dtype="fp32")
    body = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True}

    async def main() -> list[str]:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            texts = []
            for spec in (None, "off"):
                r = await c.post("/v1/completions", json={**body, "speculation": spec})
                assert r.status_code == 200, r.text
                texts.append(r.json()["choices"][0]["text"])
            return texts

    try:
        spec_text, plain_text = asyncio.run(main())
    finally:
        state.engine.shutdown()
    assert spec_text == plain_text == state.tokenizer.decode(decode(state.engine.engine.target, PROMPTS[0],
                                                                   GREEDY).token_ids[:16])


NAME = "model.layers.1.mlp.down_proj"


def _w8a8(group: dict) -> None:
    """int8 weights with int8 activations in the weights' groups: a well-formed config verispec does not compute."""
    group["weights"] = {**group["weights"], "num_bits": 8}
    group["input_activations"] = {"num_bits": 8, "type": "int", "dynamic": True, "strategy": "group",
                                  "group_size": group["weights"]["group_size"]}

CASES = {
    "method": (lambda c, s: c["quantization_config"].update(quant_method="gptq"), "quant_method"),
    "format": (lambda c, s: c["quantization_config"].update(format="marlin-24") or
               c["quantization_config"]["config_groups"]["group_0"].pop("format"), "format"),
    "bits": (lambda c, s: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=3),
             "num_bits 3"),
    "asymmetric": (lambda c, s: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
        symmetric=False), "asymmetric"),
    "group": (lambda c, s: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
        strategy="group", group_size=48), "group size 48"),
    "scale": (lambda c, s: s.pop(f"{NAME}.weight_scale"), f"missing tensor {NAME}.weight_scale"),
    "packed": (lambda c, s: s.pop(f"{NAME}.weight_packed"), f"missing tensor {NAME}.weight_packed"),
    "shape": (lambda c, s: s.update({f"{NAME}.weight_shape": torch.tensor([64, 64])}), f"{NAME}.weight_shape"),
    "scale_shape": (lambda c, s: s.update({f"{NAME}.weight_scale": s[f"{NAME}.weight_scale"][:, :1].repeat(1, 3)}),
                    f"{NAME}.weight_scale"),
    "activations": (lambda c, s: c["quantization_config"]["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8}), "statically; dynamic symmetric int8"),
    "act_token": (lambda c, s: c["quantization_config"]["config_groups"]["group_0"].update(input_activations={
        "num_bits": 8, "type": "int", "dynamic": True, "strategy": "token"}), "strategy 'token'"),
    "act_bits": (lambda c, s: c["quantization_config"]["config_groups"]["group_0"].update(input_activations={
        "num_bits": 4, "type": "int", "dynamic": True, "strategy": "group", "group_size": 32}), "int8 only"),
    "act_int8_weights": (lambda c, s: _w8a8(c["quantization_config"]["config_groups"]["group_0"]),
                         "w8a8 is unsupported"),
    "outputs": (lambda c, s: c["quantization_config"]["config_groups"]["group_0"].update(
        output_activations={"num_bits": 8}), "output_activations"),
}
HEAD_CASES = {  # a quantized LM head is checked like any Linear
    "head_scale": (lambda c, s: s.pop("lm_head.weight_scale"), "missing tensor lm_head.weight_scale"),
    "head_shape": (lambda c, s: s.update({"lm_head.weight_shape": torch.tensor([96, 64])}), "lm_head.weight_shape"),
}


@pytest.mark.parametrize("case", list(CASES) + list(HEAD_CASES))
def test_bad_quantized_checkpoint_fails_with_one_error(quant_dir, tmp_path, case, capsys):
    if case in HEAD_CASES and "lm_head.weight_packed" not in load_state_dict(quant_dir):
        return  # a dense head: nothing of it to break here (the -head copy runs the case)
    edit, words = {**CASES, **HEAD_CASES}[case]
    d = edited_copy(quant_dir, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=words.replace("(", r"\(")):
        load_model(d)
    assert main(["generate", "--target", str(d), "--prompt", "x", "--drafter", "none", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and words.split()[-1] in err[0]


def test_cli_quantize_rtn_and_gptq(checkpoint_dir, tmp_path, capsys):
    for method in ("rtn", "gptq"):
        out = tmp_path / method
        assert main(["quantize", str(checkpoint_dir), "--out", str(out), "--scheme", "w4a16", "--group-size", "32",
                     "--method", method, "--calib-samples", "4", "--calib-len", "32"]) == 0
        assert (out / "tokenizer.json").is_file() and (out / "quantization.json").is_file()
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc["format"] == "pack-quantized" and qc["ignore"] == ["lm_head"]
        model = load_model(out)
        assert model.quantized
        assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
        assert not isinstance(model.lm_head, QuantLinear) and not isinstance(model.model.embed_tokens, QuantLinear)
    assert "calibration" in capsys.readouterr().out
    assert main(["quantize", str(checkpoint_dir), "--out", str(tmp_path / "x"), "--scheme", "w4a16",
                 "--group-size", "48"]) == 2
    out = tmp_path / "head"
    assert main(["quantize", str(checkpoint_dir), "--out", str(out), "--scheme", "w8a16", "--lm-head"]) == 0  # same
    raw = json.loads((out / "config.json").read_text())
    assert raw["quantization_config"]["ignore"] == [] and raw["tie_word_embeddings"] is False
    model = load_model(out)
    assert isinstance(model.lm_head, QuantLinear) and not isinstance(model.model.embed_tokens, QuantLinear)
    assert model.lm_head.bits == 8 and model.lm_head.group_size == model.lm_head.in_features  # per channel
    dense = load_model(checkpoint_dir)
    with torch.inference_mode():  # the head's weight rounded to the int8 grid, the embedding untouched
        torch.testing.assert_close(model.head_weight(), dense.lm_head.weight, rtol=0, atol=0.01)
        assert torch.equal(model.model.embed_tokens.weight, dense.model.embed_tokens.weight)


def test_a_tied_head_is_untied_and_quantized(tmp_path):
    """--lm-head on a tied checkpoint (the zoo target is one): the embedding stays dense and exact, the head becomes
    a quantized Linear of the same weights; the native forward takes it (decoder.c's LM head through qgemm.c) and
    speculation stays exact with respect to that model."""
    save_model(tiny_model(0, 0.2, tie_word_embeddings=True), tmp_path / "tied")
    quantize_checkpoint(tmp_path / "tied", tmp_path / "q", W4H, progress=False)
    dense, q = load_model(tmp_path / "tied"), load_model(tmp_path / "q")
    assert not q.config.tie_word_embeddings and isinstance(q.lm_head, QuantLinear)
    assert torch.equal(q.model.embed_tokens.weight, dense.model.embed_tokens.weight)
    with torch.inference_mode():
        assert q.forward_path == ("native" if native.qavailable() else "torch")
        torch.testing.assert_close(q.head_weight(), dense.model.embed_tokens.weight, rtol=0, atol=0.1)
        native_logits = q(torch.tensor([PROMPTS[0]]))[0]
        q.fused = None  # the per-layer torch path over the same QuantLinears
        torch.testing.assert_close(q(torch.tensor([PROMPTS[0]]))[0], native_logits, rtol=1e-5, atol=1e-5)
    q = load_model(tmp_path / "q")
    plain = [decode(q, p, GREEDY).token_ids for p in PROMPTS]
    for p, ref in zip(PROMPTS, plain):
        assert decode(q, p, GREEDY, drafter=ModelDrafter(q), spec=SpecConfig(k=4)).token_ids == ref


def test_an_int8_head_beside_int4_layers(tmp_path):
    """--lm-head w8a16 on a w4a16 copy: a second config group targets lm_head by name, which wins over the class
    target "Linear" as compressed-tensors matches (exact name, then regex, then class), in either group order."""
    from verispec.quant.format import parse_quant_config

    save_model(tiny_model(0, 0.2), tmp_path / "dense")
    quantize_checkpoint(tmp_path / "dense", tmp_path / "q", W4H8, progress=False)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_1"]["targets"] == ["lm_head"] and qc["ignore"] == []
    for groups in (qc["config_groups"], dict(reversed(list(qc["config_groups"].items())))):
        parsed = parse_quant_config({**qc, "config_groups": groups}, "x")
        assert parsed.scheme_for("lm_head").bits == 8 and parsed.scheme_for("model.layers.0.mlp.down_proj").bits == 4
    q = load_model(tmp_path / "q")
    assert (q.lm_head.bits, q.model.layers[0].mlp.down_proj.bits) == (8, 4)
    plain = [decode(q, p, GREEDY).token_ids for p in PROMPTS]
    for p, ref in zip(PROMPTS, plain):
        assert decode(q, p, GREEDY, drafter=NgramDrafter(), spec=SpecConfig(k=4)).token_ids == ref
    with pytest.raises(ConfigError, match="unknown scheme"):
        QuantizeConfig(scheme="w4a16", lm_head="w2a16")
