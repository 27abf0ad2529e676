"""How vLLM's refusal of a request for its content becomes the client's 400: which exceptions
are refusals, whatever the vLLM version, and which request field each names. Part of the vLLM
adapter (with :mod:`serve_app.engine.vllm_adapter`, :mod:`serve_app.engine.vllm_stats` and
:mod:`serve_app.engine.vllm_scheduler`, the only modules that import vllm)."""

from __future__ import annotations

import dataclasses

from serve_app.engine.protocol import EngineRequestError, SamplingOptions

# The request's sampling fields, by the names the OpenAI body and vLLM's messages use.
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingOptions))


def vllm_validation_errors() -> tuple[type[Exception], ...]:
    """vLLM's exception for a request it refuses for its content. vLLM 0.32 made
    ``VLLMValidationError`` a ``VLLMClientError`` instead of a ``ValueError``, so an
    ``except ValueError`` no longer sees it (a ``min_tokens`` over ``max_tokens`` became a 503,
    found by the schema fuzzer); older vLLM raise ValueErrors, and have no such class."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return ()
    return (VLLMValidationError,)


def request_error(err: Exception) -> EngineRequestError:
    """The 400 for vLLM's refusal ``err`` of a request, naming the field at fault: the one vLLM
    names, else the sampling field its message starts with ("min_tokens must be ...")."""
    message = str(err.args[0]) if err.args else str(err)
    param = getattr(err, "parameter", None)
    if param is None:
        first = message.split(" ", 1)[0]
        param = first if first in SAMPLING_FIELDS else None
    return EngineRequestError(message, param=param)
