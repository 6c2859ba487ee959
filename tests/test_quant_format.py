"""verispec's pack-quantized checkpoints against compressed-tensors itself (the library vLLM and llmcompressor use):
a checkpoint compressed-tensors writes (its own ModelCompressor on a tiny random transformers Llama, as
llmcompressor saves one) loads in verispec with weights equal to compressed-tensors' decompression bit for bit, and
what verispec writes decompresses in compressed-tensors to verispec's weights bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

ct = pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.lifecycle.forward import quantize  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402
from conftest import tiny_model  # noqa: E402

from verispec.model.checkpoint import load_model, save_model  # noqa: E402
from verispec.quant.bits import pack_int32, unpack_int32  # noqa: E402
from verispec.quant.convert import QuantizeConfig, quantize_checkpoint  # noqa: E402
from verispec.quant.linear import QuantLinear  # noqa: E402
from verispec.quant.rtn import quantize_rtn  # noqa: E402
from verispec.quant.scheme import QuantScheme  # noqa: E402

SCHEMES = {"w4a16-g32": QuantScheme(4, 32), "w8a16": QuantScheme(8, None), "w4a16-g64": QuantScheme(4, 64),
           "w4a8-g32": QuantScheme(4, 32, act_bits=8)}


def _args(s: QuantScheme) -> QuantizationArgs:
    return QuantizationArgs(num_bits=s.bits, type="int", symmetric=True,
                            strategy="channel" if s.group_size is None else "group", group_size=s.group_size)


def _input_args(s: QuantScheme) -> QuantizationArgs | None:
    """W4A8's activations as compressed-tensors states them: dynamic symmetric int8, the weights' groups."""
    if s.act_bits == 16:
        return None
    return QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="group", group_size=s.group_size,
                            dynamic=True)


def _quant_linears(model) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear) and not n.endswith(("qkv_quant",
                                                                                                     "gate_up_quant"))}


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_equals_compressed_tensors(bits):
    g = torch.Generator().manual_seed(0)
    for cols in (64, 40, 8):
        q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (7, cols), generator=g, dtype=torch.int8)
        assert torch.equal(pack_int32(q, bits), pack_to_int32(q, bits))
        assert torch.equal(unpack_int32(pack_to_int32(q, bits), bits, cols),
                           unpack_from_int32(pack_to_int32(q, bits), bits, torch.Size(q.shape)))


@pytest.mark.parametrize("name", list(SCHEMES))
def test_rtn_equals_compressed_tensors(name):
    """Scales and values of verispec's RTN equal compressed-tensors' calculate_qparams + quantize (fp32)."""
    s = SCHEMES[name]
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1))
    w[3, :64] = 0  # an all-zero group: both give it the dtype's eps
    q, scales = quantize_rtn(w, s, torch.float32)
    g = s.group(128)
    groups = w.unflatten(-1, (-1, g))
    ct_scales, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), _args(s))
    assert torch.equal(scales, ct_scales)
    assert torch.equal(q, quantize(w, ct_scales, zp, _args(s), dtype=torch.int8))


def _ct_checkpoint(path, scheme: QuantScheme, bias: bool = False):
    """A tiny random bf16 transformers Llama, quantized and saved by compressed-tensors as llmcompressor does
    (observer min/max scales, ModelCompressor.compress_model, save_pretrained, update_config)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   attention_bias=bias)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    args = _args(scheme)
    group = QuantizationScheme(targets=["Linear"], weights=args, input_activations=_input_args(scheme))
    qc = QuantizationConfig(config_groups={"group_0": group}, ignore=["lm_head"])
    apply_quantization_config(model, qc)
    for module in model.modules():
        if hasattr(module, "quantization_scheme"):
            w = module.weight.detach()
            groups = w.unflatten(-1, (-1, scheme.group(w.shape[1])))
            module.weight_scale.data.copy_(calculate_qparams(groups.amin(-1), groups.amax(-1), args)[0])
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return scheme


def _ct_decompress(state: dict, name: str, scheme: QuantScheme) -> torch.Tensor:
    module_state = {k: state[f"{name}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
    ct_scheme = QuantizationScheme(targets=["Linear"], weights=_args(scheme))
    return PackedQuantizationCompressor.decompress(module_state, ct_scheme)["weight"]


@pytest.mark.parametrize("name", list(SCHEMES))
def test_loads_a_checkpoint_compressed_tensors_wrote(tmp_path, name):
    scheme = _ct_checkpoint(tmp_path, SCHEMES[name], bias=name == "w4a16-g32")
    state = load_file(str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path, "bf16")
    linears = _quant_linears(model)
    assert len(linears) == 14 and model.quantized
    assert all(lin.act_bits == scheme.act_bits for lin in linears.values())
    for n, lin in linears.items():
        ref = _ct_decompress(state, n, scheme)  # bf16, the scale's dtype
        assert torch.equal(lin.dequantize(ref.dtype), ref), n
    with torch.inference_mode():
        logits = model(torch.tensor([[1, 5, 9, 33]]))[0]
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", list(SCHEMES))
def test_compressed_tensors_decompresses_what_verispec_wrote(tmp_path, name):
    scheme = SCHEMES[name]
    save_model(tiny_model(0, 0.2), tmp_path / "dense", dtype="bf16")
    cfg = QuantizeConfig(scheme=f"w{scheme.bits}a{scheme.act_bits}", group_size=scheme.group_size)
    quantize_checkpoint(tmp_path / "dense", tmp_path / "q", cfg, progress=False)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)  # compressed-tensors reads the config we write
    assert parsed.format == "pack-quantized" and parsed.config_groups["group_0"].weights.num_bits == scheme.bits
    assert parsed.config_groups["group_0"].input_activations == _input_args(scheme)
    state = load_file(str(tmp_path / "q" / "model.safetensors"))
    linears = _quant_linears(load_model(tmp_path / "q", "fp32"))
    assert len(linears) == 14
    for n, lin in linears.items():
        assert state[f"{n}.weight_scale"].dtype == torch.bfloat16  # the model's dtype
        ref = _ct_decompress(state, n, scheme)
        assert torch.equal(lin.dequantize(torch.bfloat16), ref), n


def test_compressed_tensors_reads_a_quantized_head_in_its_own_group(tmp_path):
    """`verispec quantize --lm-head w8a16` on an int4 copy: compressed-tensors validates the two-group config, and
    its decompression of lm_head under the head's group (int8 per channel) equals verispec's."""
    save_model(tiny_model(0, 0.2), tmp_path / "dense", dtype="bf16")
    cfg = QuantizeConfig(scheme="w4a16", group_size=32, lm_head="w8a16")
    quantize_checkpoint(tmp_path / "dense", tmp_path / "q", cfg, progress=False)
    qc = QuantizationConfig.model_validate(
        json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"])
    head_group = qc.config_groups["group_1"]
    assert head_group.targets == ["lm_head"] and head_group.weights.num_bits == 8 and not qc.ignore
    state = load_file(str(tmp_path / "q" / "model.safetensors"))
    linears = _quant_linears(load_model(tmp_path / "q", "fp32"))
    assert len(linears) == 15 and linears["lm_head"].bits == 8
    ref = _ct_decompress(state, "lm_head", SCHEMES["w8a16"])
    assert torch.equal(linears["lm_head"].dequantize(torch.bfloat16), ref)
