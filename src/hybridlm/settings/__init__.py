"""One place that turns settings into a server: `Settings` declares every `hybridlm serve` flag once
(`declared`), `build` makes the model, speculator, engine and HTTP limits from them. Below the CLI
and the Ray integration; never imports either."""

from hybridlm.settings.build import (
    limits,
    load,
    make_engine,
    make_prefix_cache,
    make_speculator,
    served_name,
    summary,
)
from hybridlm.settings.declared import DEMO_MODEL_NAME, ENGINE, MODEL, SERVER, Settings, add_flags
from hybridlm.settings.values import DTYPES

__all__ = [
    "DEMO_MODEL_NAME",
    "DTYPES",
    "ENGINE",
    "MODEL",
    "SERVER",
    "Settings",
    "add_flags",
    "limits",
    "load",
    "make_engine",
    "make_prefix_cache",
    "make_speculator",
    "served_name",
    "summary",
]
