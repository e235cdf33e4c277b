"""The errors a request or the engine raises (`InvalidParameter` names the parameter, as OpenAI's
`param` does). A module of its own so that the modules checking requests (`params`, `grammar`) share
it without importing each other."""

from __future__ import annotations


class InvalidParameter(ValueError):
    """A request parameter with a value the engine cannot serve; `param` names it (OpenAI's `param`) and
    the message starts with that name."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class PromptTooLong(InvalidParameter):
    """The prompt leaves no room to generate within the context length."""


class QueueFull(RuntimeError):
    """The engine's waiting queue is at its bound; the caller should retry later."""


class EngineClosed(RuntimeError):
    """The engine no longer accepts requests (shutting down)."""
