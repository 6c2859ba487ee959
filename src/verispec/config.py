"""Frozen configuration dataclasses: the one source of defaults for the API and the CLI."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

from verispec.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = ("fp32", "bf16")
# The compute dtype of a loaded target wherever none is given: LLM(), and generate, serve, bench and profile on the
# command line. The exactness contract's greedy equality is tested in fp32 (pass dtype="fp32").
DEFAULT_DTYPE = "bf16"


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer hyper-parameters, named as in Hugging Face `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v (and o for llama/mistral) projections carry a bias
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        # Hugging Face hard-codes these: Qwen2 always has q/k/v biases, Mistral never has any.
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ConfigError("qwen2 models always have q/k/v biases (attention_bias=True)")
        if self.model_type == "mistral" and self.attention_bias:
            raise ConfigError("mistral models have no attention biases (attention_bias=False)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises queries and keys per head before RoPE."""
        return self.model_type == "qwen3"

    @property
    def o_bias(self) -> bool:
        # Qwen2 has q/k/v biases but none on the output projection; Llama and Qwen3 bias all four.
        return self.attention_bias and self.model_type in ("llama", "qwen3")

    @property
    def context_limit(self) -> int:
        """Longest sequence (prompt + output) this model attends over exactly."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            # transformers >= 5 nests RoPE settings under rope_parameters; older configs keep them flat.
            rope = dict(d.get("rope_parameters") or {})
            theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
            scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
            if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
                scaling = None
            eos = d.get("eos_token_id")
            eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
            bias = {"qwen2": True, "mistral": False}.get(model_type, bool(d.get("attention_bias", False)))
            sliding = d.get("sliding_window") if d.get("use_sliding_window", model_type == "mistral") else None
            return cls(
                model_type=model_type,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bias,
                sliding_window=int(sliding) if sliding else None,
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=eos_ids,
                pad_token_id=d.get("pad_token_id"),
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks required key {e.args[0]!r}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.model_type]
        d: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.model_type in ("mistral", "qwen2", "qwen3"):
            d["sliding_window"] = self.sliding_window
            d["use_sliding_window"] = self.sliding_window is not None
        return d

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping. temperature == 0 means greedy."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Wrong types are ConfigErrors too (never a TypeError from a comparison below), found by tests/test_fuzz_api.
        try:
            stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        except TypeError:
            raise ConfigError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}") from None
        if not all(isinstance(s, str) for s in stop):
            raise ConfigError("stop strings must be strings")
        object.__setattr__(self, "stop", stop)
        for name in ("max_tokens", "top_k", "seed"):
            v = getattr(self, name)
            if (v is not None or name != "seed") and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
                raise ConfigError(f"{name} must be an integer, got {type(v).__name__}")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ConfigError(f"{name} must be a number, got {type(v).__name__}")
            try:
                object.__setattr__(self, name, float(v))
            except OverflowError:
                raise ConfigError(f"{name} is out of range") from None
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be a boolean, got {type(self.ignore_eos).__name__}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.temperature < math.inf:  # NaN and inf have no distribution
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


VERIFY_RULES = ("auto", "rejection", "sample-match")
DECODE_POLICIES = ("fixed", "dspark")


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings for one generation. k is the most a round drafts (0 disables drafting)."""

    k: int = 4
    # auto: greedy match at temperature 0, rejection sampling otherwise (exact for point-mass drafts too).
    verify: str = "auto"
    # fixed: verify every drafted token. dspark: verify the prefix DSpark's Algorithm 1 picks from the drafter's
    # confidences (or past acceptance) against the target's measured step time (verispec.policies).
    policy: str = "fixed"
    # Where the target's full KV cache lives between forwards: None = beside the model; a device (e.g. "cpu")
    # keeps it there and swaps it in for each forward (cache.TieredKVCache, VeriCache's host-memory tier).
    kv_tier: str | None = None
    # The draft-tree shape asked of a drafter that draws the tree a request asks for (Capabilities.tree_requests:
    # model, eagle, mtp, medusa); None: the drafter's own (its spec's tree options, chains by default).
    tree: TreeConfig | None = None

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ConfigError(f"k must be >= 0, got {self.k}")
        _check_tier(self.kv_tier)
        if self.verify not in VERIFY_RULES:
            raise ConfigError(f"verify must be one of {VERIFY_RULES}, got {self.verify!r}")
        if self.policy not in DECODE_POLICIES:
            raise ConfigError(f"policy must be one of {DECODE_POLICIES}, got {self.policy!r}")


def _check_tier(tier: str | None) -> None:
    if tier is not None and tier.split(":")[0] not in ("cpu", "cuda"):
        raise ConfigError(f"kv_tier must be a device such as 'cpu' (or None), got {tier!r}")


TREE_MODES = ("off", "auto")
TREE_RANKS = ("calibrated", "q")


@dataclass(frozen=True)
class TreeConfig:
    """Dynamic draft trees (EAGLE-2) for a drafter that can give the top-k tokens at a node: at each depth the
    `width` most valuable new nodes are expanded with their `width` most probable children, for `depth` levels, and
    the best `nodes` of them all are verified (never more than the round's budget, SpecConfig.k / EngineConfig.k, so
    raise k with nodes). A node's value is the product along its path of its drafter's q (`rank="q"`, EAGLE-2's) or
    of q calibrated by past verified drafts (`rank="calibrated"`; Medusa's static trees ignore it). Chains are the
    default; an EAGLE-3/MTP chain's confidences (what the dspark rule cuts by) are calibrated the same way."""

    mode: str = "off"  # off: chains; auto: a dynamic tree each round (a chain where the budget leaves one node)
    width: int = 4  # children per expanded node, and nodes expanded per depth (EAGLE-2's top_k)
    depth: int = 4  # levels below the anchor
    nodes: int = 16  # nodes kept after reranking (EAGLE-2's total_tokens), at most the round's budget
    rank: str = "calibrated"  # calibrated (drafters.tree.TreeCalibration) or q

    def __post_init__(self) -> None:
        if self.mode not in TREE_MODES:
            raise ConfigError(f"tree must be one of {TREE_MODES}, got {self.mode!r}")
        if self.rank not in TREE_RANKS:
            raise ConfigError(f"tree rank must be one of {TREE_RANKS}, got {self.rank!r}")
        for name in ("width", "depth", "nodes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ConfigError(f"tree {name} must be an integer >= 1, got {v!r}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


POLICIES = ("off", "fixed", "batch-table", "dspark")
# k by number of running requests (first row whose bound covers the count), as vLLM and TensorRT-LLM schedule it.
DEFAULT_BATCH_TABLE = ((1, 8), (2, 6), (4, 4), (8, 3), (16, 2), (1 << 30, 1))


@dataclass(frozen=True)
class EngineConfig:
    """The serving engine: batching, admission control and the verification policy."""

    max_running: int = 32  # requests decoded together
    max_queued: int = 256  # waiting requests beyond which new ones are refused (QueueFull)
    # The KV pool: positions allocated over all running requests' caches. A cache starts at its prompt plus one
    # draft round and grows by kv_block positions as it decodes; when the pool runs out the newest request is
    # preempted (its cache freed, recomputed when it is admitted again). A kv_block of at least prompt + max_tokens
    # reserves each request's whole cache at admission instead (no growth, no preemption).
    cache_budget_tokens: int = 1 << 17
    kv_block: int = 64
    prefill_chunk: int = 512  # prompt tokens prefilled per step, all requests together
    policy: str = "fixed"
    k: int = 4  # the draft length for `fixed`; the most any policy verifies per request
    batch_table: tuple[tuple[int, int], ...] = DEFAULT_BATCH_TABLE
    drafter: str | None = "ngram"  # the default drafter spec; None: no drafting unless a request names one
    kv_tier: str | None = None  # SpecConfig.kv_tier for every request's cache
    # Prompt-prefix KV reuse across requests (engine.prefix): bytes of copied rows kept, least recently used
    # first out; 0 turns it off. 64 MiB holds ~4,000 tokens of the zoo target (16 KB a token in fp32).
    prefix_cache_bytes: int = 64 << 20
    prefix_block: int = 32  # tokens a cached block holds

    def __post_init__(self) -> None:
        _check_tier(self.kv_tier)
        if self.prefix_cache_bytes < 0 or self.prefix_block < 1:
            raise ConfigError(f"prefix_cache_bytes must be >= 0 and prefix_block >= 1, got "
                              f"{self.prefix_cache_bytes} and {self.prefix_block}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("max_running", "max_queued", "cache_budget_tokens", "kv_block", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.k < 0:
            raise ConfigError(f"k must be >= 0, got {self.k}")
        object.__setattr__(self, "batch_table", tuple(sorted((int(n), int(k)) for n, k in self.batch_table)))

    def table_k(self, num_running: int) -> int:
        for bound, k in self.batch_table:
            if num_running <= bound:
                return k
        return self.batch_table[-1][1] if self.batch_table else 0


@dataclass(frozen=True)
class RequestSpec:
    """Per-request speculation: None fields take the engine's setting. drafter "none" turns drafting off."""

    drafter: str | None = None
    policy: str | None = None
    k: int | None = None
    verify: str = "auto"
    tree: TreeConfig | None = None  # the request's draft-tree shape (SpecConfig.tree); None: the drafter's own

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.k is not None and self.k < 0:
            raise ConfigError(f"k must be >= 0, got {self.k}")
        if self.verify not in VERIFY_RULES:
            raise ConfigError(f"verify must be one of {VERIFY_RULES}, got {self.verify!r}")
