"""Errors a caller can act on; raised before any tensor work starts."""


class EngineError(ValueError):
    """Base class of the engine's input errors."""


class EmptyPrompt(EngineError):
    pass


class PromptTooLong(EngineError):
    def __init__(self, n_tokens: int, limit: int):
        super().__init__(f"prompt has {n_tokens} tokens; the context window allows {limit}")
        self.n_tokens = n_tokens
        self.limit = limit


class InvalidSampling(EngineError):
    pass


class UnsupportedModel(EngineError):
    """The checkpoint's model_type, or one of its options, is not one the engine computes."""


class EngineUnavailable(RuntimeError):
    """The remote inference server cannot be reached or broke off a reply: not the caller's
    fault, so not an `EngineError` (a 503 in the REST service, not a 400)."""


class EngineRefused(EngineUnavailable):
    """The remote inference server answered but would not serve the request: a parameter it
    does not accept (`param` names it where the server or the request tells), a refusal or a
    content filter. Retrying the same request would not help. A subclass of
    `EngineUnavailable`, so a caller that handles a server that is away handles this too."""

    def __init__(self, message: str, param: str | None = None, status: int | None = None):
        super().__init__(message)
        self.param = param
        self.status = status
