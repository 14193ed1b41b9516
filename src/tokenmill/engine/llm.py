"""The offline API, shaped as vLLM's so users can switch:

    from tokenmill import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", dtype="bfloat16")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    outputs[0].outputs[0].text

generate() submits every prompt, steps the engine until all are done and returns one
cumulative RequestOutput per prompt, in the order given.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tokenmill.engine.core import EngineCore
from tokenmill.engine.engine_args import DEFAULT_MODEL, EngineArgs
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.output_processor import OutputProcessor, RequestOutputAccumulator
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.request import SamplingParams

PromptType = str | dict[str, Any]
Messages = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.engine, self.tokenizer = self.engine_args.create_engine()
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @property
    def core(self) -> EngineCore:
        return self.engine

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: int | Sequence[int] = 0,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        priorities = _per_prompt(priority, len(prompts), "priority")
        request_ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priorities, strict=True):
                request_ids.append(self._add(prompt, p, prio, cache_salt))
        except Exception:
            self._abort(request_ids)
            raise
        return self._run(request_ids)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        **chat_template_kwargs: Any,
    ) -> list[RequestOutput]:
        single = bool(messages) and isinstance(messages[0], dict)
        conversations: list[Messages] = [messages] if single else list(messages)  # type: ignore[list-item, arg-type]
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, **chat_template_kwargs
            )
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text)})
        return self.generate(prompts, sampling_params)

    def _add(self, prompt: PromptType, params: SamplingParams, priority: int, cache_salt: str | None) -> str:
        text, token_ids = self._tokenize(prompt)
        request_id = str(next(self._ids))
        samples = self.processor.add_request(request_id, text, token_ids, params)
        try:
            self.engine.add_samples(
                samples, token_ids, eos_token_ids=self.tokenizer.eos_token_ids,
                priority=priority, cache_salt=cache_salt,
            )
        except Exception:
            self.processor.abort(request_id)
            raise
        return request_id

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError("a prompt is a string, {'prompt': str} or {'prompt_token_ids': [...]}")

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        accumulator = RequestOutputAccumulator()
        while self.engine.has_unfinished_requests():
            deltas, stopped = self.processor.process(self.engine.step())
            if stopped:
                self.engine.finish_requests(stopped)
            for delta in deltas:
                accumulator.add(delta)
        return [accumulator.result(rid) for rid in request_ids]

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort_requests(self.processor.abort(rid))


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
