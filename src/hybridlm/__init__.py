"""hybridlm: an inference engine for hybrid language models with exact prefix reuse."""

import torch

# Recurrent kernels hit subnormal floats on realistic gates; flushing them avoids 10x slowdowns.
# It must run before the first parallel op, so it runs on import.
torch.set_flush_denormal(True)

from hybridlm.api import Model, load_model  # noqa: E402

__all__ = ["Model", "load_model"]
__version__ = "0.1.0"
