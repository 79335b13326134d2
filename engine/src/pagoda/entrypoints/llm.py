"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))`` and ``.chat(...)``."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Optional, Union

from tqdm.auto import tqdm

from pagoda.config import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.lora import LoRARequest
from pagoda.lora.sources import LoRAModule
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import RequestOutputKind, SamplingParams
from pagoda.tokenizer import apply_chat_template

PromptType = Union[str, list[int], dict]
Messages = list[dict]

# generation_config.json keys that become default sampling parameters (as vLLM does).
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class LLM:
    """Generate text for a batch of prompts with continuous batching, all in this process.

    ``model`` is a local Hugging Face directory; without one, the built-in stories260K model.
    Other keyword arguments are :class:`pagoda.config.EngineArgs` fields. With ``tensor_parallel_size`` > 1 the
    worker processes run until :meth:`shutdown` (or the end of a ``with LLM(...)`` block, or this object's garbage
    collection); scripts need an ``if __name__ == "__main__":`` guard, as every ``spawn`` user does.
    """

    def __init__(self, model: Optional[str] = None, **engine_args) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (idempotent); this LLM cannot generate afterwards."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, overridden by the model's generation_config.json when it sets them."""
        if self.engine.args.generation_config == "vllm":
            return SamplingParams()
        defaults = self.engine.model_config.generation_defaults
        return SamplingParams(**{k: defaults[k] for k in _GENERATION_DEFAULTS if k in defaults})

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        use_tqdm: bool = True,
        lora_request: Union[None, LoRARequest, Sequence[Optional[LoRARequest]]] = None,
        priority: Optional[Sequence[int]] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts.

        A prompt is a string, a list of token ids, or ``{"prompt": ...}`` /
        ``{"prompt_token_ids": [...]}``. ``lora_request``: the adapter of every prompt, or one per prompt (None:
        the base model); an adapter not loaded yet is loaded from its ``lora_path`` first. ``priority``: one per
        prompt, lower runs first (needs ``scheduling_policy="priority"``; vLLM's argument).
        """
        batch = _as_prompt_list(prompts)
        params = self._params_list(sampling_params, len(batch))
        if priority is not None:
            priority = list(priority)
            if len(priority) != len(batch):
                raise ValueError("The lengths of prompts and priority must be the same.")
            for value in priority:  # refuse before anything is queued
                self.engine.check_priority(value)
        adapters = self._adapters(lora_request, len(batch))
        return self._run([_prompt_value(p) for p in batch], params, use_tqdm, adapters, priority)

    def _adapters(
        self, lora_request: Union[None, LoRARequest, Sequence[Optional[LoRARequest]]], count: int
    ) -> list[Optional[str]]:
        requests = [lora_request] * count if not isinstance(lora_request, (list, tuple)) else list(lora_request)
        if len(requests) != count:
            raise ValueError(f"got {len(requests)} LoRA requests for {count} prompts")
        for request in {r for r in requests if r is not None}:
            if self.engine.lora_id_or_none(request.lora_name) is None:
                if request.lora_path is None:
                    raise ValueError(f"LoRA adapter {request.lora_name!r} is not loaded and has no lora_path")
                self.engine.add_lora(LoRAModule(request.lora_name, request.lora_path))
        return [r.lora_name if r is not None else None for r in requests]

    def chat(
        self,
        messages: Union[Messages, Sequence[Messages]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
        tools: Optional[list[dict[str, Any]]] = None,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (or ``chat_template``) to each conversation and generate.

        ``tools`` (OpenAI's function tools), ``continue_final_message`` and ``chat_template_kwargs`` (e.g.
        ``{"enable_thinking": False}``) reach the template as in the server."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = chat_template or self.engine.args.chat_template
        prompts = [
            apply_chat_template(
                self.engine.tokenizer,
                conv,
                template,
                add_generation_prompt,
                tools,
                continue_final_message,
                chat_template_kwargs,
            )
            for conv in conversations
        ]
        params = self._params_list(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm)

    def _params_list(
        self, sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]], count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} sampling params for {count} prompts")
        return list(sampling_params)

    def _run(
        self,
        prompts: list,
        params: list[SamplingParams],
        use_tqdm: bool,
        adapters: Optional[list[Optional[str]]] = None,
        priority: Optional[list[int]] = None,
    ) -> list[RequestOutput]:
        engine = self.engine
        order: dict[str, int] = {}
        results: list[Optional[RequestOutput]] = [None] * len(prompts)
        for p in params:  # an invalid schema, regex or grammar is a ValueError here, before anything runs
            if p.structured_outputs is not None:
                engine.compile_structured_output(p.structured_outputs).result()
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                request_id = str(next(self._ids))
                engine.add_request(
                    request_id,
                    prompt,
                    _final_only(p),
                    lora_name=adapters[i] if adapters else None,
                    priority=priority[i] if priority else 0,
                )
                order[request_id] = i
            bar = tqdm(total=len(prompts), desc="Generating", unit="req", disable=not use_tqdm or len(prompts) < 2)
            with bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            results[order[output.request_id]] = output
                            bar.update(1)
        except BaseException:
            # Never leave this call's requests behind in the engine, whatever went wrong.
            engine.abort_request([rid for rid, i in order.items() if results[i] is None])
            raise
        return results


def _final_only(params: SamplingParams) -> SamplingParams:
    if params.output_kind == RequestOutputKind.FINAL_ONLY:
        return params
    return replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]  # a single prompt given as token ids
    return list(prompts)


def _prompt_value(prompt: PromptType) -> Union[str, list[int]]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (str, list)):
        return prompt
    raise ValueError(f"a prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}")
