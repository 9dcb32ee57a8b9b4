"""The engine's exception tree. Callers catch the branch they can act on.

    EngineError
    ├── InvalidRequestError        bad sampling parameters or prompt (a 400 at the HTTP layer)
    │   └── PromptTooLongError     prompt + 1 token does not fit in max_model_len
    ├── ModelLoadError             the model cannot be found or read
    │   ├── UnknownModelError      not a known name, nor an existing path
    │   └── UnsupportedModelError  corrupt file, unsupported architecture or tensor type
    ├── ConfigError                an impossible engine configuration
    └── EngineDeadError            the engine loop crashed; every pending request gets this
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    pass


class ModelLoadError(EngineError):
    pass


class UnknownModelError(ModelLoadError):
    pass


class UnsupportedModelError(ModelLoadError):
    pass


class ConfigError(EngineError, ValueError):
    pass


class EngineDeadError(EngineError):
    pass
