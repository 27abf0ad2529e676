"""OpenAI request models (pydantic v2) and their translation into engine requests.

Requests are validated here, before anything reaches an engine: a bad parameter is a 400 that
names it. Unknown fields are ignored, as the OpenAI API and vLLM do, except fields whose meaning
this service does not implement, which are refused rather than silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.engine.protocol import GenerationRequest, SamplingOptions

MAX_STOP_SEQUENCES = 4


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    user: str | None = None
    # OpenAI's key for requests that share a prefix (a conversation): the session key of the
    # prefix_cache routing policy, else ``user`` (GenerationRequest.session), within the tenant.
    prompt_cache_key: str | None = None
    # Refused when set: features this service does not implement yet.
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_ok(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @model_validator(mode="after")
    def _refuse_unimplemented(self) -> _SamplingFields:
        unsupported = {
            "logprobs": self.logprobs not in (None, False),
            "top_logprobs": self.top_logprobs is not None,
            "logit_bias": bool(self.logit_bias),
            "response_format": bool(self.response_format)
            and self.response_format.get("type") != "text",
            "tools": bool(self.tools),
            "best_of": self.best_of not in (None, 1),
            "echo": self.echo,
            "suffix": bool(self.suffix),
        }
        for name, is_set in unsupported.items():
            if is_set:
                raise ValueError(f"{name} is not supported by this endpoint; remove it")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling(self, max_tokens: int | None) -> SamplingOptions:
        return SamplingOptions(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            n=self.n,
            stop=self.stop or [],  # type: ignore[arg-type]  # normalised by _stop_ok
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt (text or token ids)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], (str, list)):
                if len(v) != 1:
                    raise ValueError(
                        "batched prompts are not supported; send one prompt per request"
                    )
                v = v[0]
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    def to_generation(self, request_id: str) -> GenerationRequest:
        prompt = self.prompt
        return GenerationRequest(
            request_id=request_id,
            sampling=self.sampling(self.max_tokens),
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=list(prompt) if isinstance(prompt, list) else None,  # type: ignore[arg-type]
            session=self.prompt_cache_key or self.user,
        )


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: a conversation rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def to_generation(self, request_id: str) -> GenerationRequest:
        limit = self.max_completion_tokens or self.max_tokens
        return GenerationRequest(
            request_id=request_id,
            sampling=self.sampling(limit),
            messages=[{"role": m.role, "content": m.text()} for m in self.messages],
            session=self.prompt_cache_key or self.user,
        )
