"""Requests, scheduling, prefill / decode, stop rules, streaming and cancellation (DESIGN.md §3.6).

The parameters, errors and request records import no torch: the command line checks sampling flags
with them at once. `Engine`, `AsyncStream` and `serial_setup` load on first use."""

from typing import TYPE_CHECKING

from hybridlm.engine.errors import EngineClosed, InvalidParameter, PromptTooLong, QueueFull
from hybridlm.engine.params import SamplingParams
from hybridlm.engine.request import Completion, Event, Request, Timings, TokenLogprob, Usage

if TYPE_CHECKING:  # what type checkers and editors see; at run time `__getattr__` below
    from hybridlm.engine.engine import AsyncStream, Engine, serial_setup

__all__ = [
    "AsyncStream",
    "Completion",
    "Engine",
    "EngineClosed",
    "Event",
    "InvalidParameter",
    "PromptTooLong",
    "QueueFull",
    "Request",
    "SamplingParams",
    "Timings",
    "TokenLogprob",
    "Usage",
    "serial_setup",
]


def __getattr__(name: str):
    if name in ("AsyncStream", "Engine", "serial_setup"):
        from hybridlm.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
