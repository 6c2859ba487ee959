"""Hugging Face checkpoint directories <-> Transformer, safetensors only.

A directory holds `config.json`, `model.safetensors` (or `model.safetensors.index.json` with shards) and usually
`tokenizer.json`. What verispec saves, transformers loads, and the other way round.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from verispec.config import ModelConfig
from verispec.errors import CheckpointError, ConfigError
from verispec.model.transformer import Transformer
from verispec.quant.format import parse_quant_config, take_quantized
from verispec.quant.linear import QuantLinear
from verispec.quant.scheme import QuantScheme

# The key of a block drafter's config.json naming its kind (block, dspark): see drafters.block.save_block_drafter.
DRAFTER_KIND_KEY = "verispec_drafter"
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointError(f"unsupported dtype {name!r}; use fp32 or bf16") from None


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {path}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} has no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    kind = raw.get(DRAFTER_KIND_KEY) if isinstance(raw, dict) else None
    if kind is not None:  # a block drafter's directory: no model_type, and it only runs beside its target
        raise ConfigError(f"{path} holds a verispec {kind} drafter, not a model checkpoint; "
                          f"use it as the drafter {kind}:{path}")
    return ModelConfig.from_hf_dict(raw)


def _weight_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is malformed: {e}") from None
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path} is missing shard(s) {', '.join(missing)}")
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise CheckpointError(f"{path} holds only pickle weights (.bin/.pt); verispec loads safetensors only")
    raise CheckpointError(f"{path} has no model.safetensors or model.safetensors.index.json")


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(Path(path)):
        try:
            state.update(load_file(f))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {f}: {e}") from None
    return state


def _more(names: list[str]) -> str:
    return f" (+{len(names) - 1} more)" if len(names) > 1 else ""


def _take_quantized(
    path: str | Path, model: Transformer, state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor, QuantScheme, torch.Tensor | None]]:
    """A quantized checkpoint's Linears (see quant.format), checked and unpacked, their tensors taken out of
    `state` and `expected`; {} for a dense checkpoint."""
    raw = json.loads((Path(path) / "config.json").read_text())
    if "quantization_config" not in raw:
        return {}
    qcfg = parse_quant_config(raw["quantization_config"], path)
    # A tied head is the embedding, which stays dense; an untied one may be quantized (`verispec quantize --lm-head`)
    tied = model.config.tie_word_embeddings
    linears = {name: (m.out_features, m.in_features, m.bias is not None)
               for name, m in model.named_modules() if isinstance(m, nn.Linear) and (name != "lm_head" or not tied)}
    quantized = take_quantized(state, linears, qcfg, path)
    for name in quantized:
        expected.pop(f"{name}.weight")
        expected.pop(f"{name}.bias", None)
    return quantized


def load_model(
    path: str | Path, dtype: str | torch.dtype = "fp32", device: str | torch.device = "cpu", pack: bool = True
) -> Transformer:
    """Build the model from `config.json` and fill it from the safetensors weights, checking every tensor.

    The model is prepared for inference: fused projections and, with `pack` (where supported), packed weights.
    A checkpoint with a compressed-tensors `quantization_config` gets QuantLinears (verispec.quant.format)."""
    cfg = load_config(path)
    state = load_state_dict(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {k: v for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        state.pop("lm_head.weight", None)
    quantized = _take_quantized(path, model, state, expected)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{path}: missing tensor {missing[0]}" + _more(missing))
    # Rotary tables are derived, never weights; anything else unexpected means config and weights disagree.
    unexpected = sorted(k for k in set(state) - set(expected) if not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise CheckpointError(
            f"{path}: unexpected tensor {unexpected[0]}{_more(unexpected)}; does config.json match the weights?"
        )
    for name, ref in expected.items():
        if tuple(state[name].shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{path}: tensor {name} has shape {tuple(state[name].shape)}, config implies {tuple(ref.shape)}"
            )
    dt = parse_dtype(dtype)
    model.load_state_dict({k: state[k].to(dt) for k in expected}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for name, (q, scales, scheme, bias) in quantized.items():
        parent, _, child = name.rpartition(".")
        bias = None if bias is None else bias.to(dt)
        setattr(model.get_submodule(parent), child, QuantLinear(q, scales, scheme.bits, bias, scheme.act_bits))
    # Non-persistent buffers (RoPE tables) were built on the meta device: rebuild them for real.
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    model = model.to(device).eval().fuse_projections()
    return model.pack_weights() if pack else model


def save_model(model: Transformer, path: str | Path, dtype: str | torch.dtype | None = None) -> None:
    """Write config.json and model.safetensors in the Hugging Face layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dt = parse_dtype(dtype) if dtype is not None else model.dtype
    # clone: fused projections are views of one tensor, and safetensors refuses shared storage.
    state = {k: v.detach().to(dt).clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_hf_dict()
    cfg["torch_dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dt]
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
