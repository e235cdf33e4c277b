"""Requests, scheduling, prefill / decode, stop rules, streaming and cancellation (DESIGN.md §3.6)."""

from hybridlm.engine.engine import AsyncStream, Engine, serial_setup
from hybridlm.engine.errors import EngineClosed, InvalidParameter, PromptTooLong, QueueFull
from hybridlm.engine.params import SamplingParams
from hybridlm.engine.request import Completion, Event, Request, Timings, TokenLogprob, Usage

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
