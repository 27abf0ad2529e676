"""vLLM's refusal of a request for its content is the client's 400, naming the field, whatever
vLLM version raises it (a ValueError before 0.32, a VLLMValidationError, not a ValueError,
since)."""

from __future__ import annotations

import pytest

from serve_app.config import ModelSettings
from serve_app.engine.protocol import EngineRequestError, GenerationRequest, SamplingOptions
from serve_app.engine.vllm_adapter import VLLMEngine
from serve_app.engine.vllm_errors import request_error


@pytest.fixture(scope="module")
def engine() -> VLLMEngine:
    e = VLLMEngine(ModelSettings(name="m", path="unused", device="cpu"))
    e._max_model_len = 2048  # all _sampling_params reads of a started engine
    return e


def _request(**sampling) -> GenerationRequest:
    return GenerationRequest(request_id="r", sampling=SamplingOptions(**sampling), prompt="x")


def test_min_tokens_over_max_tokens_is_a_400_naming_min_tokens_regression_503(engine):
    """Found by the schema fuzzer: `min_tokens` 10 with `max_tokens` 4 got "the model is
    unavailable right now" (503, Retry-After 1) on vLLM 0.32, every time it was asked."""
    with pytest.raises(EngineRequestError) as info:
        engine._sampling_params(_request(max_tokens=4, min_tokens=10), prompt_len=2)
    assert info.value.status_code == 400 and info.value.param == "min_tokens"
    assert "min_tokens must be less than or equal to max_tokens" in info.value.message


@pytest.mark.parametrize("sampling", [{"repetition_penalty": 0.0}, {"min_p": 2.0},
                                      {"presence_penalty": 5.0}])
def test_every_sampling_refusal_of_vllm_is_a_400(engine, sampling):
    with pytest.raises(EngineRequestError) as info:
        engine._sampling_params(_request(max_tokens=4, **sampling), prompt_len=2)
    assert info.value.status_code == 400 and info.value.param == next(iter(sampling))


def test_an_older_vllms_value_error_keeps_its_message_and_names_the_field_it_starts_with():
    err = request_error(ValueError("top_p must be in (0, 1], got 0."))
    assert (err.message, err.param, err.status_code) == ("top_p must be in (0, 1], got 0.",
                                                         "top_p", 400)
    assert request_error(ValueError("the prompt is empty")).param is None
