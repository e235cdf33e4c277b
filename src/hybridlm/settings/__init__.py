"""One place that turns settings into a server: `Settings` declares every `hybridlm serve` flag once
(`declared`), `build` makes the model, speculator, engine and HTTP limits from them. Below the CLI
and the Ray integration; never imports either.

`declared` and `values` import no torch, so parsing flags (and `--help`) takes no second; `build`'s
names load on first use."""

from hybridlm.settings.declared import DEMO_MODEL_NAME, ENGINE, MODEL, SERVER, Settings, add_flags
from hybridlm.settings.values import DTYPES, torch_dtype

_BUILT = ("limits", "load", "make_engine", "make_prefix_cache", "make_speculator", "served_name", "summary")

__all__ = [
    "DEMO_MODEL_NAME",
    "DTYPES",
    "ENGINE",
    "MODEL",
    "SERVER",
    "Settings",
    "add_flags",
    "torch_dtype",
    *_BUILT,
]


def __getattr__(name: str):
    if name in _BUILT:
        from hybridlm.settings import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
