"""Model families, built from ops and caches, loaded from Hugging Face checkpoint directories."""

from hybridlm.models import (
    bailing_hybrid,  # noqa: F401 - registers its model types
    bamba,  # noqa: F401 - registers its model types
    dense,  # noqa: F401 - registers its model types
    falcon_h1,  # noqa: F401 - registers its model types
    gemma3,  # noqa: F401 - registers its model types
    gemma4,  # noqa: F401 - registers its model types
    granitemoehybrid,  # noqa: F401 - registers its model types
    kimi_linear,  # noqa: F401 - registers its model types
    lfm2,  # noqa: F401 - registers its model types
    nemotron_h,  # noqa: F401 - registers its model types
    qwen3_5,  # noqa: F401 - registers its model types
    qwen3_next,  # noqa: F401 - registers its model types
)
from hybridlm.models.base import FAMILIES, CausalLM, Config
from hybridlm.models.checkpoint import CheckpointError
from hybridlm.models.loader import load_model

__all__ = ["FAMILIES", "CausalLM", "CheckpointError", "Config", "load_model"]
