"""GPTQ (Frantar et al., 2023) for one Linear, and the Hessians it needs, collected with forward hooks.

For a Linear with weight W [out, in] reading inputs X [n, in], GPTQ quantizes W column by column and spreads each
column's rounding error over the columns not yet quantized, weighted by the inverse Hessian of the layer's output
error, H = 2 X^T X: the output error ||X W^T - X Ŵ^T|| ends lower than round-to-nearest's. As in the reference
implementation: dead inputs (zero diagonal) are zeroed, H is damped by damp * mean(diag(H)), the upper Cholesky
factor of H^-1 drives the updates, columns go in blocks of 128 with lazy updates of the rest, and a group's scale is
computed from the (already updated) weights when the group is reached; no act-order, so the columns keep their
order and no g_idx is needed. Scales use rtn's formula and are rounded to the stored dtype before use, so what is
stored is what was optimised.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from verispec.quant.rtn import quantize_with, scales_for
from verispec.quant.scheme import QuantScheme

BLOCK = 128  # columns per lazy-update block; a multiple of every group size, so a group never straddles two


def gptq_quantize(
    weight: torch.Tensor,  # [out, in]
    hessian: torch.Tensor,  # [in, in], 2 X^T X (any positive multiple: the damping is relative)
    scheme: QuantScheme,
    scale_dtype: torch.dtype,
    damp: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor]:  # q int8 [out, in], scales [out, in / group] in scale_dtype
    w = weight.detach().float().clone()  # fp32 throughout, as the reference implementation
    out, cols = w.shape
    g = scheme.group(cols)
    h = hessian.detach().float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(cols, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros(out, cols, dtype=torch.int8)
    scales = torch.zeros(out, cols // g, dtype=scale_dtype)
    if scheme.group_size is None:  # one scale per row, from the weights as they are
        scales[:, 0] = scales_for(w, scheme, scale_dtype)
    for b0 in range(0, cols, BLOCK):
        b1 = min(b0 + BLOCK, cols)
        w1, err1, hinv1 = w[:, b0:b1].clone(), torch.zeros(out, b1 - b0, dtype=w.dtype), hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if scheme.group_size is not None and col % g == 0:
                scales[:, col // g] = scales_for(w1[:, i : i + g], scheme, scale_dtype)
            s = scales[:, col // g]
            qi = quantize_with(w1[:, i : i + 1], s, scheme)[:, 0]
            q[:, col] = qi
            e = (w1[:, i] - qi.float() * s.float()) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None]
            err1[:, i] = e
        w[:, b1:] -= err1 @ hinv[b0:b1, b1:]
    return q, scales


class HessianCollector:
    """Accumulates 2 X^T X / n for the inputs of chosen modules (forward pre-hooks), keyed by a name per input
    site: modules reading the same tensor (q/k/v, gate/up) share one site. Use as a context manager."""

    def __init__(self, sites: dict[str, nn.Module]) -> None:
        self.sites = sites
        self.hessians: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}
        self._hooks: list = []

    def _hook(self, name: str):
        def pre_hook(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()  # [n, in]
            n = self.rows.get(name, 0)
            h = self.hessians.get(name)
            # a running mean keeps the scale steady however many rows come (the damping is relative anyway)
            h = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64) if h is None else h * (n / (n + len(x)))
            self.hessians[name] = h + (2.0 / (n + len(x))) * (x.T @ x).double()  # fp32 products, fp64 sum
            self.rows[name] = n + len(x)
        return pre_hook

    def __enter__(self) -> HessianCollector:
        self._hooks = [m.register_forward_pre_hook(self._hook(name)) for name, m in self.sites.items()]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def decoder_sites(model: nn.Module) -> dict[str, nn.Module]:
    """The input sites of a Transformer's decoder layers: the attention block's input (q/k/v), o_proj's input,
    the MLP's input (gate/up) and down_proj's input. Hooks on the blocks, not on q/k/v, since a fused model never
    calls those modules."""
    sites: dict[str, nn.Module] = {}
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        sites.update({f"{p}.self_attn.qkv": layer.self_attn, f"{p}.self_attn.o_proj": layer.self_attn.o_proj,
                      f"{p}.mlp.gate_up": layer.mlp, f"{p}.mlp.down_proj": layer.mlp.down_proj})
    return sites


SITE_OF = {"q_proj": "self_attn.qkv", "k_proj": "self_attn.qkv", "v_proj": "self_attn.qkv",
           "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_up", "up_proj": "mlp.gate_up",
           "down_proj": "mlp.down_proj"}


def site_of(linear_name: str) -> str:
    """`model.layers.3.self_attn.k_proj` -> its input site, `model.layers.3.self_attn.qkv`."""
    prefix, _, proj = linear_name.rpartition(".")
    return f"{prefix.rpartition('.')[0]}.{SITE_OF[proj]}"


@torch.inference_mode()
def collect_hessians(
    model: nn.Module, batches: Iterable[torch.Tensor], progress: bool = True
) -> dict[str, torch.Tensor]:
    """Run `batches` (token ids [B, T] each) through the model without a cache (the per-layer path, where the
    hooks fire) and return each site's Hessian [in, in] fp64."""
    from tqdm import tqdm

    batches = list(batches)
    with HessianCollector(decoder_sites(model)) as c:
        for tokens in tqdm(batches, desc="calibration", unit="batch", disable=not progress):
            model(tokens, num_logits=0)
    return c.hessians
