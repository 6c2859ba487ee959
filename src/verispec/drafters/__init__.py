"""Built-in drafters register themselves here; `build_drafter("name[:arg]", ...)` picks one."""

from verispec.drafters import block, feature, lookup, medusa, model, ngram, vericache  # noqa: F401  (registration)
from verispec.drafters.base import (
    BENCH_SPECS,
    DRAFTERS,
    EMPTY_DRAFT,
    Capabilities,
    Draft,
    Drafter,
    DraftRequest,
    Verified,
    build_drafter,
    register_drafter,
)
from verispec.drafters.block import BlockDrafter
from verispec.drafters.feature import FeatureDrafter
from verispec.drafters.lookup import LookupFirstDrafter
from verispec.drafters.medusa import MedusaDrafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.vericache import VeriCacheDrafter

__all__ = [
    "BENCH_SPECS", "BlockDrafter", "Capabilities", "DRAFTERS", "EMPTY_DRAFT", "Draft", "DraftRequest", "Drafter",
    "FeatureDrafter", "LookupFirstDrafter", "MedusaDrafter", "ModelDrafter", "NgramDrafter", "VeriCacheDrafter",
    "Verified",
    "build_drafter", "register_drafter",
]
