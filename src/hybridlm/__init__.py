"""hybridlm: an inference engine for hybrid language models with exact prefix reuse."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers and editors see; at run time `__getattr__` below
    from hybridlm.api import Model, load_model

__all__ = ["Model", "load_model"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The library imports torch (over a second); the command line's parser and `--help` need none of
    # it, so `hybridlm.load_model` and `hybridlm.Model` load on first use.
    if name in __all__:
        from hybridlm import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
