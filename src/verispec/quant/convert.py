"""`verispec quantize`: a dense Hugging Face checkpoint -> a pack-quantized one (quant.format), by round-to-nearest
or GPTQ over calibration text from the training corpus."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from verispec.errors import CheckpointError, ConfigError
from verispec.quant.format import write_quantized
from verispec.quant.gptq import SITE_OF, collect_hessians, gptq_quantize, site_of
from verispec.quant.rtn import quantize_rtn
from verispec.quant.scheme import QuantScheme

METHODS = ("rtn", "gptq")
# Files beside the weights that a quantized copy keeps (the tokenizer and generation settings); the model card is
# not copied, as it describes the dense model.
COPIED = ("tokenizer*", "special_tokens_map.json", "generation_config.json", "vocab.*", "merges.txt", "*.model",
          "chat_template*")


@dataclass(frozen=True)
class QuantizeConfig:
    scheme: str = "w4a16"
    """w8a16 (int8, per channel by default), w4a16 (int4, group 128 by default) or w4a8 (w4a16's weights, the input
    rounded to int8 per group at run time: the same file with input_activations in its config)."""
    group_size: int | None = None
    """32, 64 or 128 (0 or None: the scheme's default)."""
    method: str = "rtn"
    """rtn: round to nearest; gptq: GPTQ with Hessians from calibration text."""
    calib_samples: int = 128
    """GPTQ: calibration sequences."""
    calib_len: int = 512
    """GPTQ: tokens per calibration sequence."""
    damp: float = 0.01
    """GPTQ: Hessian damping, a fraction of its mean diagonal."""
    seed: int = 0
    """GPTQ: which corpus documents make the calibration set."""
    lm_head: str | None = None
    """Quantize the LM head too, in this scheme (w8a16: int8 per channel; w4a16: int4 in groups of group_size), by
    round to nearest (also under gptq). A tied embedding is untied: the embedding stays dense (a row gather needs no
    matmul), the head becomes a quantized Linear. On a small-vocabulary model the bf16 head is a large share of an
    int4 model's bytes (zoo/target: 8 of 20.6 MB). None: the head stays dense."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown method {self.method!r}; use rtn or gptq")
        if self.calib_samples < 1 or self.calib_len < 2:
            raise ConfigError("--calib-samples must be >= 1 and --calib-len >= 2")
        if self.lm_head is not None:
            self.head_scheme  # an unknown scheme or group size fails here, before anything is read

    @property
    def head_scheme(self) -> QuantScheme | None:
        if self.lm_head is None:
            return None
        return QuantScheme.named(self.lm_head, self.group_size if self.lm_head == self.scheme else None)

    @property
    def quant_scheme(self) -> QuantScheme:
        return QuantScheme.named(self.scheme, self.group_size)


def calibration_batches(
    src: Path, cfg: QuantizeConfig, corpus: Path | None, batch: int = 8
) -> tuple[list[torch.Tensor], str]:  # [B, calib_len] token ids each, and where the text came from
    """calib_samples windows of calib_len tokens from the training split (documents in a seeded order, each
    tokenized and cut into consecutive windows)."""
    from verispec.model.tokenizer import Tokenizer
    from verispec.train.draft_vocab import training_documents

    tokenizer = Tokenizer.from_dir(src)
    documents, source = training_documents(corpus)
    documents = list(documents)
    random.Random(cfg.seed).shuffle(documents)
    windows: list[list[int]] = []
    for doc in documents:
        ids = tokenizer.encode(doc.text)
        windows += [ids[i : i + cfg.calib_len] for i in range(0, len(ids) - cfg.calib_len + 1, cfg.calib_len)]
        if len(windows) >= cfg.calib_samples:
            break
    if not windows:
        raise ConfigError(f"no calibration text of {cfg.calib_len} tokens in {source}")
    t = torch.tensor(windows[: cfg.calib_samples], dtype=torch.int64)
    return list(t.split(batch)), f"{len(t)} x {cfg.calib_len} tokens from {source}"


def quantize_checkpoint(
    src: str | Path, out: str | Path, cfg: QuantizeConfig, corpus: Path | None = None, progress: bool = True
) -> dict:
    """Quantize the decoder layers' projections of the checkpoint at `src` into `out`; returns the summary that is
    also written to `out/quantization.json`."""
    from tqdm import tqdm

    from verispec.model.checkpoint import DRAFTER_KIND_KEY, load_config, load_model, load_state_dict

    src, out = Path(src), Path(out)
    scheme = cfg.quant_scheme
    raw = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else {}
    if DRAFTER_KIND_KEY in raw:  # a block or feature drafter (dspark, block, eagle, mtp): its own Linears, by RTN
        from verispec.quant.drafter import quantize_drafter

        summary = {"scheme": scheme.name, **asdict(cfg), "source": str(src),
                   **quantize_drafter(src, out, scheme, cfg.method)}
        (out / "quantization.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary
    model_cfg = load_config(src)
    if "quantization_config" in raw:
        raise CheckpointError(f"{src} is already quantized")
    state = load_state_dict(src)
    names = [f"model.layers.{i}.{block}.{proj}" for i in range(model_cfg.num_hidden_layers)
             for proj, block in ((p, s.split(".")[0]) for p, s in SITE_OF.items())]
    for n in names:
        w = state.get(f"{n}.weight")
        if w is None:
            raise CheckpointError(f"{src}: missing tensor {n}.weight")
        if w.shape[1] % scheme.group(w.shape[1]):
            raise ConfigError(f"group size {scheme.group_size} does not divide {n}'s {w.shape[1]} input features"
                              + scheme.hint(w.shape[1]))
    scale_dtype = state[f"{names[0]}.weight"].dtype
    summary = {"scheme": scheme.name, **asdict(cfg), "source": str(src)}
    hessians: dict[str, torch.Tensor] = {}
    if cfg.method == "gptq":
        model = load_model(src, "fp32")
        batches, summary["calibration"] = calibration_batches(src, cfg, corpus)
        hessians = collect_hessians(model, batches, progress)
        del model
    quantized = {}
    layers = model_cfg.num_hidden_layers
    for i in tqdm(range(layers), desc=f"{cfg.method} {scheme.name}", unit="layer", disable=not progress):
        for n in (n for n in names if n.startswith(f"model.layers.{i}.")):
            w = state.pop(f"{n}.weight")
            if cfg.method == "gptq":
                quantized[n] = gptq_quantize(w, hessians[site_of(n)], scheme, scale_dtype, cfg.damp)
            else:
                quantized[n] = quantize_rtn(w, scheme, scale_dtype)
    tied = model_cfg.tie_word_embeddings
    head = state.pop("lm_head.weight", None)
    ignore: tuple[str, ...] = ("lm_head",)
    hs = cfg.head_scheme
    if hs is not None:
        head = state["model.embed_tokens.weight"] if tied else head
        if head is None:
            raise CheckpointError(f"{src}: missing tensor lm_head.weight")
        if head.shape[1] % hs.group(head.shape[1]):
            raise ConfigError(f"group size {hs.group_size} does not divide lm_head's {head.shape[1]} input "
                              "features" + hs.hint(head.shape[1]))
        quantized["lm_head"] = quantize_rtn(head, hs, scale_dtype)
        raw, ignore, summary["lm_head"] = {**raw, "tie_word_embeddings": False}, (), f"{hs.name} by rtn"
    elif not tied and head is not None:
        state["lm_head.weight"] = head
    save_quantized(out, raw, state, quantized, scheme, src, summary, ignore, hs)
    return summary


def save_quantized(
    out: Path, raw_config: dict, dense: dict[str, torch.Tensor], quantized: dict, scheme: QuantScheme, src: Path,
    summary: dict, ignore: tuple[str, ...] = ("lm_head",), head: QuantScheme | None = None,
) -> None:
    """A quantized target directory: the weights (quant.format), the tokenizer files of `src` and the summary of how
    it was made (quantization.json)."""
    write_quantized(out, raw_config, dense, quantized, scheme, ignore, head)
    for pattern in COPIED:
        for f in src.glob(pattern):
            if f.is_file():
                shutil.copy2(f, out / f.name)
    (out / "quantization.json").write_text(json.dumps(summary, indent=2) + "\n")
