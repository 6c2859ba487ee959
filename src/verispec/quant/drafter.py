"""Quantized drafters with checkpoints of their own (block drafters, DSpark/DFlash; feature drafters, EAGLE-3/MTP):
the drafter's own Linears in int8/int4, in the same pack-quantized layout as a target (quant.format), with the
drafter meta's config.json gaining a `quantization_config`.

What is quantized: the context projection `fc` and every draft layer's q/k/v/o/gate/up/down projections, the
drafter's matmuls (a feature drafter's: `fc` where it has one, its input projection `w_in` and its layer's). What
stays dense: a block drafter's sequential head `markov_out` (W2, rank -> vocabulary: the drafter's LM head, and its
64 input columns are fewer than a 128-group), the `markov_in` table (a lookup), the confidence head and the RNN cell
(a few thousand weights each), the norms; the target's shared embedding and LM head (a feature drafter's head) are
not the drafter's. Round to nearest only: GPTQ would need the drafter's inputs, which come from the target's hidden
states.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from verispec.errors import CheckpointError, ConfigError
from verispec.quant.format import parse_quant_config, take_quantized, write_quantized
from verispec.quant.linear import QuantLinear
from verispec.quant.rtn import quantize_rtn
from verispec.quant.scheme import QuantScheme

DENSE = ("markov_out", "confidence_head", "rnn_cell")  # never quantized (see above); the config's ignore list
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FEATURE_PROJECTIONS = tuple(p if p.startswith("mlp.") else f"self_attn.{p}" for p in PROJECTIONS)  # its DecoderLayer
# Files beside the weights that a quantized copy keeps: the draft vocabulary and the confidence head's calibration
# (fitted on the dense drafter; refit with `verispec calibrate` for the quantized one's own confidences).
COPIED = ("draft_vocab.json", "calibration.json")


def quantize_drafter(src: Path, out: Path, scheme: QuantScheme, method: str) -> dict:
    """Write a pack-quantized copy of the block or feature drafter at `src` into `out`; returns which modules were
    quantized (quant.convert.quantize_checkpoint adds the settings and writes quantization.json)."""
    if method != "rtn":
        raise ConfigError(f"{src} is a drafter: quantize it with --method rtn (GPTQ's calibration inputs "
                          "would come from the target's hidden states, which this command does not run)")
    meta = json.loads((src / "config.json").read_text())
    if "quantization_config" in meta:
        raise CheckpointError(f"{src} is already quantized")
    weights = src / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{src}: missing model.safetensors")
    state = load_file(str(weights))
    if "feature" in meta:  # EAGLE-3 has the context projection fc, MTP reads one target layer as it is
        names = [*(["fc"] if "fc.weight" in state else []), "w_in", *(f"layer.{p}" for p in FEATURE_PROJECTIONS)]
    else:
        layers = int(meta.get("block", {}).get("num_layers", 0))
        names = ["fc", *(f"layers.{i}.{p}" for i in range(layers) for p in PROJECTIONS)]
    quantized = {}
    for n in names:
        w = state.pop(f"{n}.weight", None)
        if w is None:
            raise CheckpointError(f"{src}: missing tensor {n}.weight")
        if w.shape[1] % scheme.group(w.shape[1]):
            raise ConfigError(f"group size {scheme.group_size} does not divide {n}'s {w.shape[1]} input features"
                              + scheme.hint(w.shape[1]))
        quantized[n] = quantize_rtn(w, scheme, w.dtype)
    dense = () if "feature" in meta else DENSE  # a feature drafter's Linears are all quantized
    write_quantized(out, meta, state, quantized, scheme, ignore=dense)
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    return {"quantized": names, "dense": list(dense)}


def take_drafter_quantized(
    meta: dict, model: nn.Module, state: dict[str, torch.Tensor], where: str | Path
) -> dict[str, tuple[torch.Tensor, torch.Tensor, QuantScheme, torch.Tensor | None]]:
    """A block or feature drafter checkpoint's quantized Linears, checked and unpacked and taken out of `state` (see
    quant.format.take_quantized); {} for a dense drafter. The dense-only modules must stay dense."""
    if "quantization_config" not in meta:
        return {}
    qcfg = parse_quant_config(meta["quantization_config"], where)
    linears = {name: (m.out_features, m.in_features, m.bias is not None)
               for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    for name in linears:
        if name in DENSE and qcfg.scheme_for(name) is not None:
            raise CheckpointError(f"{where}: a quantized {name} is unsupported (add it to quantization_config.ignore)")
    return take_quantized(state, linears, qcfg, where)


def install_quantized(
    model: nn.Module, quantized: dict[str, tuple[torch.Tensor, torch.Tensor, QuantScheme, torch.Tensor | None]]
) -> None:
    """Replace each named Linear of `model` by the QuantLinear of take_drafter_quantized's values."""
    for name, (q, scales, scheme, bias) in quantized.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, QuantLinear(q, scales, scheme.bits, bias, scheme.act_bits))
