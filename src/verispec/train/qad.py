"""`verispec train qad`: quantization-aware distillation of a weight-only int4/int8 target.

The integer grid is fixed: every decoder projection keeps the scales of its starting point (a pack-quantized
checkpoint made by RTN or GPTQ, or RTN scales computed from the teacher at start). What trains is a latent fp32
weight per projection, starting at that checkpoint's dequantized weights (or the teacher's dense ones), seen by the
forward as clamp(round(w / scale), qmin, qmax) * scale with the straight-through estimator for round. The loss is
the per-token KL(teacher || student) over windows of the training split, the teacher being the dense (bf16) model.
Embeddings, norms, biases and the LM head stay frozen and dense, as the quantizer leaves them. The result is a
pack-quantized checkpoint in `verispec quantize`'s layout (quant.format.write_quantized), on the same scales.
Resumable from RUN_DIR/state, like the other trainers.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from verispec.errors import CheckpointError, ConfigError
from verispec.model import Transformer, load_model
from verispec.quant.convert import save_quantized
from verispec.quant.gptq import SITE_OF
from verispec.quant.linear import QuantLinear
from verispec.quant.rtn import dequantize, quantize_rtn
from verispec.quant.scheme import QuantScheme
from verispec.train.checkpointing import load_state, save_state
from verispec.train.data import TokenWindows, write_tokens
from verispec.train.target import TrainConfig, lr_at

# Config fields a resumed run may change; any other change would train a different model from the saved state.
RESUMABLE_CHANGES = ("max_steps", "checkpoint_every_s", "eval_every")


@dataclass(frozen=True)
class QADConfig:
    scheme: str = "w4a16"
    """w4a16 (int4, group 128 by default) or w8a16 (int8, per channel by default)."""
    group_size: int | None = None
    """32, 64 or 128 input columns per scale (None: the scheme's default); must match a quantized --init's."""
    seq_len: int = 512
    """Tokens per training window."""
    batch_size: int = 2
    """Windows per step."""
    lr: float = 1e-5
    """Peak AdamW learning rate of the latent weights. Adam moves every weight by ~lr a step whatever its gradient,
    so lr against the grid step (~1e-2 on the zoo target at w4a16-g128) sets how many values flip by noise: 1e-4
    tripled the zoo target's KL to the teacher in 14 steps from a GPTQ start."""
    warmup_steps: int = 5
    min_lr_ratio: float = 0.1
    """Cosine decay to this fraction of lr at max_steps."""
    max_steps: int = 100
    grad_clip: float = 1.0
    dtype: str = "fp32"
    """Compute dtype: fp32, or bf16 (teacher in bf16, student under bf16 autocast; the latent weights stay fp32).
    fp32 is the default: on the 2-core dev machine the bf16 backward was 4x slower."""
    eval_every: int = 50
    """Steps between held-out KL evaluations (also at the start and the end)."""
    eval_windows: int = 8
    """Held-out windows of seq_len tokens for the KL evaluation."""
    checkpoint_every_s: float = 300.0
    seed: int = 0
    """The data order: step s's windows are a pure function of (seed, s)."""

    def __post_init__(self) -> None:
        if self.dtype not in ("bf16", "fp32"):
            raise ConfigError(f"dtype must be bf16 or fp32, got {self.dtype!r}")
        if min(self.seq_len, self.batch_size, self.max_steps, self.eval_every, self.eval_windows) < 1:
            raise ConfigError("seq_len, batch_size, max_steps, eval_every and eval_windows must be >= 1")
        if QuantScheme.named(self.scheme, self.group_size).act_bits != 16:  # an unknown scheme fails here too
            raise ConfigError(f"qad trains weight-only schemes (w4a16, w8a16), not {self.scheme}: its student "
                              "does not round its activations")

    @property
    def quant_scheme(self) -> QuantScheme:
        return QuantScheme.named(self.scheme, self.group_size)


class _RoundSTE(torch.autograd.Function):
    """round() forward, identity backward (the straight-through estimator)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class FakeQuantLinear(nn.Module):
    """A Linear whose forward weight is its latent weight on a fixed int grid: clamp(round(w / s), qmin, qmax) * s.

    Round passes gradients straight through; clamp keeps its own gradient, so a latent weight pushed past the grid's
    ends stops moving. The forward weight equals rtn.dequantize(self.quantized()) bit for bit (the same fp32 ops)."""

    def __init__(
        self,
        weight: torch.Tensor,  # [out, in] latent start
        scales: torch.Tensor,  # [out, in / group], the checkpoint's dtype: the fixed grid
        scheme: QuantScheme,
        bias: torch.Tensor | None = None,  # [out], frozen
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.scheme = scheme
        self.weight = nn.Parameter(weight.detach().float().clone())
        self.register_buffer("weight_scale", scales.detach().clone())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def _values(self, round_fn) -> torch.Tensor:  # [out, groups, group] the int values, as floats
        s = self.weight_scale.float()[:, :, None]
        w = self.weight.view(self.out_features, s.shape[1], -1)
        return torch.clamp(round_fn(w / s), self.scheme.qmin, self.scheme.qmax)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        w = (self._values(_RoundSTE.apply) * self.weight_scale.float()[:, :, None]).view_as(self.weight)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    @torch.no_grad()
    def quantized(self) -> torch.Tensor:  # [out, in] int8
        return self._values(torch.round).view_as(self.weight).to(torch.int8)


def projection_names(num_layers: int) -> list[str]:
    """The Linears verispec quantizes (as `verispec quantize` names them)."""
    return [f"model.layers.{i}.{site.split('.')[0]}.{proj}"
            for i in range(num_layers) for proj, site in SITE_OF.items()]


def _checkpoint_dtype(path: Path, fallback: torch.dtype) -> torch.dtype:
    raw = json.loads((path / "config.json").read_text())
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(raw.get("torch_dtype"), fallback)


def build_student(
    init: Path, scheme: QuantScheme, teacher: Transformer | None = None
) -> tuple[Transformer, torch.dtype]:
    """The student at its start, equal to `init`'s model: every projection a FakeQuantLinear on init's grid
    (pack-quantized: its scales; dense: RTN scales of its weights), everything else frozen. Each latent weight starts
    at the dense weight (the teacher's, where given and init is quantized) when that rounds to init's value, else
    at init's grid point: an RTN copy starts from the teacher's weights, a GPTQ copy where it rounded otherwise from
    its own values. Also returns the dtype the checkpoint stores dense tensors in (the output's)."""
    src = load_model(init, "fp32", pack=False)  # checks every tensor: a bad --init fails here with one message
    names = projection_names(src.config.num_hidden_layers)
    owned = set(names)
    quantized = isinstance(src.get_submodule(names[0]), QuantLinear)
    dtype = _checkpoint_dtype(init, src.get_submodule(names[0]).scales.dtype if quantized else torch.float32)
    dense = {k: v for k, v in src.state_dict().items() if k.rpartition(".")[0] not in owned}
    with torch.device("meta"):
        student = Transformer(src.config)
    student.load_state_dict(dense, strict=False, assign=True)
    if src.config.tie_word_embeddings:
        student.lm_head.weight = student.model.embed_tokens.weight
    student.model.rotary_emb = type(src.model.rotary_emb)(src.config)  # non-persistent tables, built for real
    for name in names:
        lin = src.get_submodule(name)
        if quantized != isinstance(lin, QuantLinear):
            raise CheckpointError(f"{init}: {name} is {'not ' if quantized else ''}quantized, unlike {names[0]}")
        if quantized:
            if (lin.bits, lin.group_size) != (scheme.bits, scheme.group(lin.in_features)):
                raise ConfigError(f"{init} is int{lin.bits} with group {lin.group_size} ({name}), not {scheme.name}: "
                                  "pass its --scheme and --group-size")
            weight, scales, bias = dequantize(lin.qweight, lin.scales), lin.scales, lin.bias
            if teacher is not None:
                dense_w = teacher.get_submodule(name).weight.detach().float()
                start = FakeQuantLinear(dense_w, scales, scheme).quantized()
                weight = torch.where(start == lin.qweight, dense_w, weight)
        else:
            if lin.in_features % scheme.group(lin.in_features):
                raise ConfigError(f"group size {scheme.group_size} does not divide {name}'s {lin.in_features} "
                                  "input features")
            _, scales = quantize_rtn(lin.weight.detach(), scheme, dtype)
            weight, bias = lin.weight, lin.bias
        parent, _, child = name.rpartition(".")
        setattr(student.get_submodule(parent), child, FakeQuantLinear(weight, scales, scheme, bias))
    for p in student.parameters():
        p.requires_grad_(False)
    for m in student.modules():
        if isinstance(m, FakeQuantLinear):
            m.weight.requires_grad_(True)
    return student.train(), dtype


def fake_quant_modules(model: Transformer) -> dict[str, FakeQuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)}


def kl_per_token(
    teacher_logits: torch.Tensor,  # [B, T, V], p
    student_logits: torch.Tensor,  # [B, T, V], the quantized model's
) -> torch.Tensor:  # scalar: mean over the B*T positions of KL(p || p_student), nats
    logp = F.log_softmax(teacher_logits.float(), -1)
    logq = F.log_softmax(student_logits.float(), -1)
    return (logp.exp() * (logp - logq)).sum(-1).mean()


def _forward(model: Transformer, tokens: torch.Tensor, dtype: str) -> torch.Tensor:  # [B, T] -> logits [B, T, V]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16" and tokens.device.type == "cpu"):
        return model(tokens)[0]


@torch.no_grad()
def heldout_kl(teacher: Transformer, student: Transformer, windows: TokenWindows, cfg: QADConfig) -> float:
    total, n = 0.0, 0
    for inputs, _ in windows.sequential(cfg.batch_size, cfg.eval_windows):
        total += kl_per_token(_forward(teacher, inputs, cfg.dtype), _forward(student, inputs, cfg.dtype)).item() \
            * len(inputs)
        n += len(inputs)
    return total / max(n, 1)


def token_files(tokens: Path | None, teacher: Path, run_dir: Path, max_tokens: int = 4_000_000,
                log=print) -> tuple[Path, Path, str]:
    """(train.bin, val.bin, where they come from): `tokens`'s (as `verispec train target` prepares data/tokens),
    else the standard library's train and val splits (code only) tokenized with the teacher's tokenizer into
    run_dir/tokens once, documents in a seeded order, up to max_tokens (train) and max_tokens / 20 (val)."""
    if tokens is not None:
        for split in ("train", "val"):
            if not (tokens / f"{split}.bin").is_file():
                raise ConfigError(f"no {tokens / split}.bin: prepare the data (verispec train target) or omit it")
        return tokens / "train.bin", tokens / "val.bin", str(tokens)
    from verispec.model.tokenizer import Tokenizer
    from verispec.train.corpus import split_of, stdlib_documents

    out = run_dir / "tokens"
    source = "the Python standard library's train/val split (code only), tokenized into " + str(out)
    if (out / "train.bin").is_file() and (out / "val.bin").is_file():
        return out / "train.bin", out / "val.bin", source
    log(f"tokenizing {source}")
    tok = Tokenizer.from_dir(teacher)
    docs = list(stdlib_documents())
    random.Random(0).shuffle(docs)
    for split, cap in (("val", max_tokens // 20), ("train", max_tokens)):
        write_tokens([d.text for d in docs if split_of(d.part, d.path) == split], tok, out / f"{split}.bin", cap, 64)
    return out / "train.bin", out / "val.bin", source


def _check_tokens(path: Path, vocab_size: int) -> None:
    top = int(np.memmap(path, dtype=np.uint16, mode="r").max())
    if top >= vocab_size:
        raise ConfigError(f"{path} holds token id {top}, beyond the teacher's vocabulary of {vocab_size}")


def train_qad(
    teacher_dir: Path,
    init: Path | None,
    run_dir: Path,
    save_dir: Path,
    cfg: QADConfig = QADConfig(),
    tokens: Path | None = None,
    progress: bool = True,
    stop_at: int | None = None,
) -> dict | None:
    """Distill (or resume distilling) into run_dir/state, then write the pack-quantized checkpoint to save_dir.

    `init`: a pack-quantized copy of the teacher (its grid and starting weights) or a dense one (RTN grid on its
    weights); None: the teacher. `tokens`: a directory with train.bin/val.bin (uint16 ids); None: see
    token_files. With `stop_at`, checkpoint at that step and return None (rerun to continue). Returns the
    summary also written to save_dir/quantization.json."""
    from tqdm import tqdm

    from verispec.model.checkpoint import load_config

    scheme = cfg.quant_scheme
    init = init if init is not None else teacher_dir
    if load_config(teacher_dir) != load_config(init):
        raise ConfigError(f"--init {init} is not a copy of the teacher {teacher_dir}: their config.json differ")
    student, out_dtype = build_student(init, scheme, load_model(teacher_dir, "fp32", pack=False))
    teacher = load_model(teacher_dir, cfg.dtype).eval()
    train_bin, val_bin, data_source = token_files(tokens, teacher_dir, run_dir)
    for f in (train_bin, val_bin):
        _check_tokens(f, student.config.vocab_size)
    train = TokenWindows(train_bin, cfg.seq_len, cfg.seed)
    val = TokenWindows(val_bin, cfg.seq_len)
    fq = fake_quant_modules(student)
    start_q = {n: m.quantized() for n, m in fq.items()}
    params = [m.weight for m in fq.values()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    schedule = TrainConfig(lr=cfg.lr, min_lr_ratio=cfg.min_lr_ratio, warmup_steps=cfg.warmup_steps,
                           max_steps=cfg.max_steps)
    config = json.loads(json.dumps({**asdict(cfg), "teacher": str(teacher_dir), "init": str(init)}))
    state_dir, step, elapsed, log = run_dir / "state", 0, 0.0, []
    if (state_dir / "meta.json").is_file():
        meta = load_state(state_dir, student, opt)
        step, elapsed, log = meta["step"], meta["elapsed_s"], meta["log"]
        changed = [k for k in config if k not in RESUMABLE_CHANGES and meta["config"].get(k) != config[k]]
        if changed:
            raise ConfigError(f"{state_dir} was trained with {changed[0]}={meta['config'].get(changed[0])!r}, not "
                              f"{config[changed[0]]!r}: rerun with the same options or use a new --out")
    t_start, last_save = time.perf_counter() - elapsed, time.perf_counter()

    def checkpoint() -> None:
        save_state(state_dir, student, opt, {"step": step, "elapsed_s": time.perf_counter() - t_start, "log": log,
                                             "config": config})

    if not log:
        log.append({"step": 0, "heldout_kl": heldout_kl(teacher, student, val, cfg), "elapsed_s": 0.0})
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not progress, desc=f"train qad ({scheme.name})",
               unit="step")
    while step < cfg.max_steps:
        if stop_at is not None and step >= stop_at:
            checkpoint()
            bar.close()
            return None
        inputs, _ = train.batch(step, cfg.batch_size)
        with torch.no_grad():
            p_logits = _forward(teacher, inputs, cfg.dtype)
        loss = kl_per_token(p_logits, _forward(student, inputs, cfg.dtype))
        for g in opt.param_groups:
            g["lr"] = lr_at(schedule, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        entry = {"step": step, "kl": loss.item(), "elapsed_s": time.perf_counter() - t_start}
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            entry["heldout_kl"] = heldout_kl(teacher, student, val, cfg)
        log.append(entry)
        bar.update(1)
        bar.set_postfix(kl=f"{loss.item():.4f}")
        if time.perf_counter() - last_save > cfg.checkpoint_every_s:
            checkpoint()
            last_save = time.perf_counter()
    checkpoint()
    bar.close()
    return save_qad(student, init, teacher_dir, save_dir, scheme, out_dtype, start_q, {
        "method": "qad", "scheme": scheme.name, "teacher": str(teacher_dir), "init": str(init),
        "data": data_source, "steps": step, "tokens": step * cfg.batch_size * cfg.seq_len,
        "wall_s": time.perf_counter() - t_start,
        "heldout_kl": [{"step": e["step"], "kl": e["heldout_kl"]} for e in log if "heldout_kl" in e],
        "config": config})


def save_qad(student: Transformer, init: Path, teacher_dir: Path, save_dir: Path, scheme: QuantScheme,
             dtype: torch.dtype, start_q: dict[str, torch.Tensor], summary: dict) -> dict:
    """Write the student as a pack-quantized checkpoint (the layout `verispec quantize` writes), the teacher's
    tokenizer files beside it, and quantization.json (`summary` plus the share of int values training moved)."""
    fq = fake_quant_modules(student)
    quantized = {n: (m.quantized(), m.weight_scale) for n, m in fq.items()}
    moved = sum(int((q != start_q[n]).sum()) for n, (q, _) in quantized.items())
    summary["values_changed"] = moved / sum(q.numel() for q, _ in quantized.values())
    dense = {}
    for name, t in student.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        if owner in fq:
            if leaf == "bias" and t is not None:
                dense[name] = t.to(dtype)
            continue
        dense[name] = t.detach().to(dtype).clone()
    if student.config.tie_word_embeddings:
        dense.pop("lm_head.weight", None)
    raw = json.loads((init / "config.json").read_text())
    raw.pop("quantization_config", None)
    save_quantized(save_dir, raw, dense, quantized, scheme, teacher_dir, summary)
    return summary

