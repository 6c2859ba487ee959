"""Quantized checkpoints in compressed-tensors' "pack-quantized" format, as vLLM and llmcompressor read and write
them (checked against compressed-tensors 0.20: compressors/pack_quantized, quantization/quant_config.py).

Per quantized Linear `<name>` the safetensors file holds
- `<name>.weight_packed`: int32 [out, ceil(in * bits / 32)], quant.bits' packing of the values q;
- `<name>.weight_scale`: [out, in / group] (group strategy) or [out, 1] (channel), in the model's dtype;
- `<name>.weight_shape`: int64 [2], (out, in);
and everything else (embeddings, norms, biases, ignored Linears such as lm_head) as ordinary dense tensors. The
config.json of the model gains `quantization_config` (see `quant_config_dict`). A Linear is quantized when a config
group's `targets` match it ("Linear", its exact name, or "re:" + a regex matched at the start of its name, as
compressed-tensors' utils/match.py does) and `ignore` does not. Only what verispec computes is accepted: symmetric
int weights of 4 or 8 bits, group (32/64/128) or channel scales; input activations unquantized, or (int4 weights
only, W4A8) dynamic symmetric int8 with the weights' group strategy and size (one scale per row and group, made at
run time: quant.act8); no output-activation or KV-cache quantization. Anything else is a CheckpointError naming
what is wrong, raised before any module is built.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from verispec.errors import CheckpointError, ConfigError
from verispec.quant.bits import pack_int32, packed_words, unpack_int32
from verispec.quant.scheme import QuantScheme

QUANT_METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's quantization_config, reduced to what loading needs."""

    groups: tuple[tuple[tuple[str, ...], QuantScheme], ...]  # (targets, scheme) per config group
    ignore: tuple[str, ...] = ()

    def scheme_for(self, name: str) -> QuantScheme | None:
        """The scheme of the nn.Linear named `name`, or None where it stays dense."""
        if any(_matches(t, name) for t in self.ignore):
            return None
        # compressed-tensors' precedence (utils.match.match_targets): an exact name, then a regex, then the class
        for hit in (lambda t: t == name, lambda t: t.startswith("re:") and _matches(t, name), lambda t: t == "Linear"):
            for targets, scheme in self.groups:
                if any(hit(t) for t in targets):
                    return scheme
        return None


def _matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _act_bits(group: str, acts: Any, weights: dict, where: str) -> int:
    """input_activations -> 16 (none) or 8: dynamic symmetric int8, one scale per weight group (what qgemm.c and
    quant.act8 compute); any other activation scheme is a CheckpointError."""
    if acts is None:
        return 16
    what = f"{where}: group {group} quantizes input_activations"
    if not isinstance(acts, dict):
        raise CheckpointError(f"{what} with a {type(acts).__name__}, not an object")
    if acts.get("type", "int") != "int" or acts.get("num_bits") != 8:
        raise CheckpointError(f"{what} as {acts.get('type', 'int')}{acts.get('num_bits')}; int8 only")
    if not acts.get("symmetric", True) or not acts.get("dynamic", False):
        raise CheckpointError(f"{what} {'asymmetrically' if not acts.get('symmetric', True) else 'statically'}; "
                              "dynamic symmetric int8 only")
    if acts.get("strategy") != "group" or acts.get("group_size") != weights.get("group_size"):
        raise CheckpointError(f"{what} with strategy {acts.get('strategy')!r} (group size {acts.get('group_size')})"
                              f"; verispec takes the weights' groups (group, {weights.get('group_size')})")
    return 8


def _scheme(group: str, weights: Any, where: str, acts: Any = None) -> QuantScheme:
    if not isinstance(weights, dict):
        raise CheckpointError(f"{where}: quantization_config group {group} has no weight quantization (weights)")
    if weights.get("type", "int") != "int":
        raise CheckpointError(f"{where}: unsupported weight type {weights.get('type')!r} in group {group} (int only)")
    if not weights.get("symmetric", True):
        raise CheckpointError(f"{where}: asymmetric quantization (group {group}) is unsupported; symmetric only")
    if weights.get("dynamic", False):
        raise CheckpointError(f"{where}: dynamic weight quantization (group {group}) is unsupported")
    if weights.get("actorder") not in (None, "static", "weight"):
        raise CheckpointError(f"{where}: actorder {weights.get('actorder')!r} (group {group}) needs a g_idx; "
                              "unsupported")
    strategy, group_size = weights.get("strategy"), weights.get("group_size")
    if strategy == "channel":
        group_size = None
    elif strategy != "group":
        raise CheckpointError(f"{where}: unsupported weight strategy {strategy!r} in group {group} "
                              "(group or channel)")
    try:  # the weights' own scheme first: a bad group size is named before what the activations say of it
        weight_only = QuantScheme(bits=int(weights.get("num_bits", 0)), group_size=group_size)
        return replace(weight_only, act_bits=_act_bits(group, acts, weights, where))
    except ConfigError as e:
        raise CheckpointError(f"{where}: group {group}: {e}") from None


def parse_quant_config(qc: Any, where: str | Path) -> QuantConfig:
    """config.json's quantization_config -> QuantConfig, or a CheckpointError saying what is unsupported."""
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where}: quantization_config is not an object")
    if qc.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"{where}: unsupported quant_method {qc.get('quant_method')!r} "
                              f"(verispec reads {QUANT_METHOD})")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise CheckpointError(f"{where}: quantization_status {qc.get('quantization_status')!r}: verispec reads "
                              "compressed checkpoints only")
    if qc.get("kv_cache_scheme") is not None:
        raise CheckpointError(f"{where}: KV-cache quantization (kv_cache_scheme) is unsupported")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}: quantization_config has no config_groups")
    parsed = []
    for gname, g in groups.items():
        fmt = g.get("format") or qc.get("format")
        if fmt != FORMAT:
            raise CheckpointError(f"{where}: unsupported format {fmt!r} in group {gname} (verispec reads {FORMAT})")
        if g.get("output_activations") is not None:
            raise CheckpointError(f"{where}: group {gname} quantizes output_activations; unsupported")
        targets = g.get("targets")
        if not isinstance(targets, list) or not targets:
            raise CheckpointError(f"{where}: group {gname} has no targets")
        parsed.append((tuple(targets), _scheme(gname, g.get("weights"), where, g.get("input_activations"))))
    return QuantConfig(tuple(parsed), tuple(qc.get("ignore") or ()))


def take_quantized(
    state: dict[str, torch.Tensor],
    linears: dict[str, tuple[int, int, bool]],  # module name -> (out, in, has_bias) for every candidate Linear
    qcfg: QuantConfig,
    where: str | Path,
) -> dict[str, tuple[torch.Tensor, torch.Tensor, QuantScheme, torch.Tensor | None]]:
    """Check and unpack every quantized Linear's tensors, popping them (and its bias) from `state`.

    Returns {name: (q int8 [out, in], scales [out, in / group], its scheme, bias [out] or None)}. Nothing is built
    here, so a bad tensor anywhere fails before a module exists."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor, QuantScheme, torch.Tensor | None]] = {}
    for name, (n_out, n_in, has_bias) in linears.items():
        scheme = qcfg.scheme_for(name)
        if scheme is None:
            continue
        g = scheme.group(n_in)
        if n_in % g:
            raise CheckpointError(f"{where}: group size {g} does not divide {name}'s {n_in} input features")
        for suffix in SUFFIXES:
            if f"{name}.{suffix}" not in state:
                raise CheckpointError(f"{where}: missing tensor {name}.{suffix}")
        packed, scale, shape = (state[f"{name}.{s}"] for s in SUFFIXES)
        if shape.dtype not in (torch.int64, torch.int32) or tuple(shape.flatten().tolist()) != (n_out, n_in):
            raise CheckpointError(f"{where}: tensor {name}.weight_shape is {shape.tolist()}, config implies "
                                  f"{[n_out, n_in]}")
        words = packed_words(n_in, scheme.bits)
        if packed.dtype != torch.int32 or tuple(packed.shape) != (n_out, words):
            raise CheckpointError(f"{where}: tensor {name}.weight_packed is {packed.dtype} {tuple(packed.shape)}, "
                                  f"expected int32 {(n_out, words)}")
        if not scale.is_floating_point() or tuple(scale.shape) != (n_out, n_in // g):
            raise CheckpointError(f"{where}: tensor {name}.weight_scale is {scale.dtype} {tuple(scale.shape)}, "
                                  f"expected a float tensor of shape {(n_out, n_in // g)}")
        bias = None
        if has_bias:
            bias = state.get(f"{name}.bias")
            if bias is None:
                raise CheckpointError(f"{where}: missing tensor {name}.bias")
            if tuple(bias.shape) != (n_out,):
                raise CheckpointError(f"{where}: tensor {name}.bias has shape {tuple(bias.shape)}, config implies "
                                      f"{(n_out,)}")
        out[name] = (unpack_int32(packed, scheme.bits, n_in), scale, scheme, bias)
    for name in out:
        for suffix in (*SUFFIXES, "bias"):
            state.pop(f"{name}.{suffix}", None)
    return out


def quant_config_dict(scheme: QuantScheme, ignore: tuple[str, ...] = ("lm_head",),
                      head: QuantScheme | None = None) -> dict:
    """config.json's quantization_config for one scheme over every Linear but `ignore` (and, with `head`, another
    for the LM head, a group targeting it by name), as compressed-tensors writes it (ModelCompressor.update_config)."""
    def group(s: QuantScheme, targets: list[str]) -> dict:
        weights = {
            "num_bits": s.bits, "type": "int", "symmetric": True,
            "strategy": "channel" if s.group_size is None else "group", "group_size": s.group_size,
            "dynamic": False, "actorder": None, "observer": "minmax",
        }
        acts = None if s.act_bits == 16 else {  # compressed-tensors' QuantizationArgs, made at run time (dynamic)
            "num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": s.group_size,
            "dynamic": True, "actorder": None, "observer": None}
        return {"targets": targets, "weights": weights, "input_activations": acts, "output_activations": None,
                "format": FORMAT}

    groups = {"group_0": group(scheme, ["Linear"])}
    if head is not None:
        groups["group_1"] = group(head, ["lm_head"])
    return {
        "quant_method": QUANT_METHOD, "format": FORMAT, "quantization_status": "compressed",
        "config_groups": groups, "ignore": list(ignore), "kv_cache_scheme": None, "sparsity_config": {},
    }


def quantized_tensors(name: str, q: torch.Tensor, scales: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """The three tensors one quantized Linear [out, in] is stored as."""
    return {f"{name}.weight_packed": pack_int32(q, bits), f"{name}.weight_scale": scales.contiguous(),
            f"{name}.weight_shape": torch.tensor(list(q.shape), dtype=torch.int64)}


def write_quantized(
    out: str | Path,
    hf_config: dict,  # the source model's config.json
    dense: dict[str, torch.Tensor],  # every tensor kept dense (embeddings, norms, biases, lm_head)
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]],  # name -> (q int8 [out, in], scales)
    scheme: QuantScheme,
    ignore: tuple[str, ...] = ("lm_head",),
    head: QuantScheme | None = None,  # the LM head's own scheme, where it has one (quantized["lm_head"])
) -> None:
    """Write model.safetensors and config.json of a pack-quantized checkpoint."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in dense.items()}
    for name, (q, scales) in quantized.items():
        bits = head.bits if name == "lm_head" and head is not None else scheme.bits
        state.update(quantized_tensors(name, q, scales, bits))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(hf_config)
    cfg["quantization_config"] = quant_config_dict(scheme, ignore, head)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
