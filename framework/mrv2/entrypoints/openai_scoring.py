"""The pooling routes: OpenAI's ``POST /v1/embeddings``
(:mod:`mrv2.entrypoints.openai_embeddings`), and vLLM's for sequence classifiers and scoring:

- ``POST /classify``: each input's (or one chat's, ``messages``) label probabilities (a
  sequence classifier's; raw logits with ``use_activation: false``), with its most likely
  label's name (``id2label``);
- ``POST /score`` (``/v1/score``): a score per ``(text_1, text_2)`` pair, one ``text_1``
  against every ``text_2`` or the two lists item by item (vLLM's other names of the two
  fields too: ``data_1`` / ``data_2``, ``queries`` / ``documents``, ``queries`` / ``items``);
- ``POST /rerank`` (``/v1/rerank``, ``/v2/rerank``; Jina's and Cohere's shape): the
  ``documents`` (texts, Cohere's ``{"text": ...}`` objects or token id lists) ordered by
  their score against ``query``, the best ``top_n``, each with its document unless
  ``return_documents`` is false;
- ``POST /pooling``: each input's pooled data for any pooling ``task`` (``embed``,
  ``classify``, and per token ``token_embed`` / ``token_classify``: one row per prompt
  token; default: the model's own), as ``LLM.encode`` gives it.

A pair's score is a one-label classifier's (a reranker's) sigmoid over the pair read as one
prompt (two texts as the tokenizer pairs them, vLLM's ``text_pair``; else the first's tokens,
then the second's without special tokens), or an embedding model's cosine similarity of the
two texts' embeddings (:mod:`mrv2.engine.scoring`). Every
prompt of a request runs in the same steps, beside other requests.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import numpy as np
from fastapi import Request
from pydantic import Field, ValidationError

from mrv2.contract.lora import LoRARequest
from mrv2.contract.params import RequestOutputKind, SamplingParams
from mrv2.contract.pooling import PoolingParams
from mrv2.engine.request_inputs import check_truncation
from mrv2.engine.scoring import broadcast_pairs, check_scorer, cosine
from mrv2.entrypoints.openai_embeddings import (
    EmbeddingRequest,
    InputRequest,
    PoolingRequest,
    Texts,
    embedding_response,
    input_items,
)
from mrv2.entrypoints.openai_messages import ChatMessage
from mrv2.entrypoints.responses import APIError
from mrv2.entrypoints.whole_answers import embed_through, unless_disconnected

__all__ = ["ClassifyRequest", "PoolRequest", "RerankRequest", "ScoreRequest",
           "add_pooling_routes"]

#: A pooling route's body.
Body = TypeVar("Body", bound=PoolingRequest)

#: A score request's two fields, each pair under the names vLLM takes.
SCORE_FIELDS = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"),
                ("queries", "items"))


class ActivationRequest(PoolingRequest):
    """vLLM's switch of a classifier's activation, ``use_activation`` (older names
    ``softmax``, ``activation``): ``false`` answers raw logits instead of probabilities
    (softmax; a single label's sigmoid); for an embedding, ``normalize``'s other name."""

    use_activation: bool | None = None
    softmax: bool | None = None
    activation: bool | None = None

    def activated(self) -> bool | None:
        """``use_activation``, else ``softmax``, else ``activation`` (vLLM's order; None:
        unset, yes)."""
        for value in (self.use_activation, self.softmax, self.activation):
            if value is not None:
                return value
        return None


class ClassifyRequest(InputRequest, ActivationRequest):
    """``POST /classify``'s body."""


class PoolRequest(InputRequest, ActivationRequest):
    """``POST /pooling``'s body (``use_activation``: an embedding's ``normalize``)."""

    task: str | None = None  # (None: the model's own)
    dimensions: int | None = None
    normalize: bool | None = None  # (None: the model's default)
    encoding_format: Literal["float", "base64"] = "float"  # (base64: as /v1/embeddings')


class ScoreRequest(ActivationRequest):
    """``POST /score``'s body: one pair of :data:`SCORE_FIELDS`."""

    text_1: Texts | None = None
    text_2: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None

    def sides(self) -> tuple[tuple[str, Texts], tuple[str, Texts]]:
        """The two fields given, each with its name; ValueError naming the fields when
        they are not exactly one pair of :data:`SCORE_FIELDS`."""
        given = {name for pair in SCORE_FIELDS for name in pair
                 if getattr(self, name) is not None}
        for first, second in SCORE_FIELDS:
            if given == {first, second}:
                return (first, getattr(self, first)), (second, getattr(self, second))
        pairs = ", ".join(f"{a} and {b}" for a, b in SCORE_FIELDS)
        raise ValueError(f"text_1: give one pair of fields ({pairs}); got "
                         f"{sorted(given) or 'none'}")


class RerankRequest(ActivationRequest):
    """``POST /rerank``'s body."""

    query: str | list[int]
    #: Texts (Cohere's ``{"text": ...}`` objects too) or token id lists.
    documents: list[str | dict[str, Any]] | list[list[int]]
    top_n: int | None = Field(default=None, ge=0)  # (0 or unset: all)
    #: Jina's and Cohere's: each result carries its document (vLLM's always do).
    return_documents: bool = True

    def document_items(self) -> list[str | list[int]]:
        """The documents as texts and token id lists; ValueError naming ``documents`` for
        an object that is not ``{"text": ...}``."""
        docs = [d["text"] if isinstance(d, dict) and isinstance(d.get("text"), str) else d
                for d in self.documents]
        if any(isinstance(d, dict) for d in docs):
            raise ValueError("documents must be texts, {\"text\": ...} objects or token id "
                             "lists")
        return input_items(docs, "documents") if docs else []  # type: ignore[arg-type]


def add_pooling_routes(app: Any, engine: Any, worker: Any,
                       parse: Callable[[Any, type[Any]], Awaitable[Any]],
                       lora_of: Callable[[Any], LoRARequest | None],
                       tokenizer: Callable[[], Any], model_name: str,
                       chat_ids: Callable[..., Awaitable[tuple[list[int], list[Any]]]]
                       ) -> None:
    """Add ``/v1/embeddings``, ``/classify``, ``/pooling``, ``/score`` and ``/rerank`` (and
    their aliases)
    to ``app``; the server's own helpers: ``parse`` (a body, its ``model`` checked),
    ``lora_of`` (the adapter a body names), ``tokenizer`` (400 when the model has none) and
    ``chat_ids`` (chat messages' token ids and media items through the chat template, as a
    chat request's)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    longest = engine.max_model_len  # (a pooling prompt's longest: truncate_prompt_tokens -1's)

    async def parsed(request: Request, kind: type[Body]) -> Body:
        """The route's body (``parse``'s), its ``truncate_prompt_tokens`` at most the context:
        vLLM's 400 otherwise, before any prompt is read (however short)."""
        body: Body = await parse(request, kind)
        try:
            check_truncation(body.truncate_prompt_tokens, longest)
        except ValueError as error:
            raise APIError(400, str(error), param="truncate_prompt_tokens") from None
        return body

    def encode(item: str | list[int], special: bool = True) -> list[int]:
        return (tokenizer().encode(item, add_special_tokens=special) if isinstance(item, str)
                else list(item))

    async def prompts_of(body: InputRequest) -> list[list[int]]:
        """The body's ``input`` (or its chat, ``messages``) as token ids, each cut as
        ``truncate_prompt_tokens`` says."""
        try:
            items = body.inputs()
        except ValueError as error:
            raise APIError(400, str(error), param="input") from None
        if body.messages is None:
            return [body.truncate(encode(item, body.special_tokens()), longest)
                    for item in items]
        try:
            messages = [ChatMessage.model_validate(m) for m in body.messages]
        except ValidationError as error:
            raise APIError(400, f"messages: {error.errors()[0]['msg']}",
                           param="messages") from None
        if not messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        if any(m.has_media for m in messages):
            raise APIError(400, "messages: images and audio are not supported in a pooling "
                           "request's chat; send text content", param="messages")
        ids, _ = await chat_ids(messages, body.add_generation_prompt,
                                body.chat_template_kwargs, body.continue_final_message,
                                own_template=body.chat_template,
                                add_special_tokens=body.special_tokens())
        return [body.truncate(ids, longest)]

    def param_of(error: ValueError, default: str | None) -> str | None:
        """The field a pooling parameter's ValueError names."""
        return next((name for name in ("dimensions", "use_activation") if name in str(error)),
                    default)

    async def pool(request: Request, body: PoolingRequest, prompts: list[list[int]],
                   pooling: PoolingParams, field: str | list[str]) -> list[list[float]]:
        """Each prompt's pooled data; its requests aborted the moment the client leaves (a
        499 nobody reads). ``field``: the body's field each prompt comes from (one for all)."""
        lora = lora_of(body)
        if worker.unavailable is not None:  # (asleep: the engine would refuse it)
            raise APIError(503, worker.unavailable, "service_unavailable")
        fields = [field] * len(prompts) if isinstance(field, str) else field
        try:
            pooling.check(engine.hidden_size, engine.num_labels, engine.matryoshka,
                          engine.refused_pooling_tasks)
        except ValueError as error:
            raise APIError(400, str(error), param=fields[-1]) from None
        for ids, name in zip(prompts, fields, strict=True):
            try:
                engine.validate(ids, params, lora, pooling=True)
            except ValueError as error:
                raise APIError(400, str(error), param=name) from None
        data = await unless_disconnected(request, embed_through(worker, prompts, params, lora,
                                                                pooling, body.priority))
        if data is None:
            raise APIError(499, "the client disconnected")
        return data

    async def scores(request: Request, body: ActivationRequest,
                     firsts: list[str | list[int]],
                     seconds: list[str | list[int]], names: tuple[str, str]
                     ) -> tuple[list[float], int]:
        """Each pair's score and the prompt tokens read."""
        try:
            pairs = broadcast_pairs(firsts, seconds, names)
            check_scorer(engine.num_labels)
        except ValueError as error:
            raise APIError(400, str(error), param=names[1]) from None
        if engine.num_labels is None:  # an embedding model: the cosine of the two
            prompts = [body.truncate(encode(x), longest) for x in
                       [a for a, _ in pairs] + [b for _, b in pairs]]
            vectors = await pool(request, body, prompts, PoolingParams(),
                                 [names[0]] * len(pairs) + [names[1]] * len(pairs))
            n = len(pairs)
            return ([cosine(a, b) for a, b in zip(vectors[:n], vectors[n:], strict=True)],
                    sum(map(len, prompts)))
        joined = [body.truncate(tokenizer().encode_pair(a, b)
                                if isinstance(a, str) and isinstance(b, str)
                                else encode(a) + encode(b, special=False),
                                longest) for a, b in pairs]
        probs = await pool(request, body, joined,
                           PoolingParams(task="classify", use_activation=body.activated()),
                           names[1])
        return [p[0] for p in probs], sum(map(len, joined))

    def head(body: PoolingRequest, kind: str) -> dict[str, Any]:
        lora = lora_of(body)
        return {"id": f"{kind}-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": lora.lora_name if lora else model_name}

    def usage(tokens: int) -> dict[str, int]:
        return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        """OpenAI's embeddings API (:mod:`mrv2.entrypoints.openai_embeddings`)."""
        body: EmbeddingRequest = await parsed(request, EmbeddingRequest)
        try:
            pooling = PoolingParams(normalize=body.normalize, dimensions=body.dimensions,
                                    use_activation=body.use_activation)
            pooling.check(engine.hidden_size, None, engine.matryoshka,
                          engine.refused_pooling_tasks)
        except ValueError as error:
            raise APIError(400, str(error), param=param_of(error, None)) from None
        prompts = await prompts_of(body)
        lora = lora_of(body)  # (the adapter named now, unloaded or not later)
        vectors = await pool(request, body, prompts, pooling, "input")
        return embedding_response(vectors, sum(map(len, prompts)),
                                  lora.lora_name if lora else model_name,
                                  f"embd-{uuid.uuid4().hex}", int(time.time()),
                                  body.encoding_format)

    @app.post("/classify")
    async def classify(request: Request) -> dict[str, Any]:
        """Each input's label probabilities (a sequence classifier)."""
        body: ClassifyRequest = await parsed(request, ClassifyRequest)
        prompts = await prompts_of(body)
        answer = head(body, "classify")  # (the adapter named now, unloaded or not later)
        probs = await pool(request, body, prompts,
                           PoolingParams(task="classify", use_activation=body.activated()),
                           "input")
        names = engine.id2label
        data = []
        for index, p in enumerate(probs):
            best = max(range(len(p)), key=p.__getitem__)
            data.append({"index": index, "label": names.get(best, str(best)), "probs": p,
                         "num_classes": len(p)})
        return {**answer, "data": data,
                "usage": usage(sum(map(len, prompts)))}

    @app.post("/pooling")
    async def pooling_route(request: Request) -> dict[str, Any]:
        """Each input's pooled data for the body's ``task`` (``LLM.encode``'s)."""
        body: PoolRequest = await parsed(request, PoolRequest)
        prompts = await prompts_of(body)
        try:
            pooling = PoolingParams(task=body.task or engine.default_pooling_task,
                                    normalize=body.normalize, dimensions=body.dimensions,
                                    use_activation=body.activated())
            pooling.check(engine.hidden_size, engine.num_labels, engine.matryoshka,
                          engine.refused_pooling_tasks)
        except ValueError as error:
            raise APIError(400, str(error), param=param_of(error, "task")) from None
        answer = head(body, "pool")
        data = await pool(request, body, prompts, pooling, "input")
        items: list[Any] = data
        if body.encoding_format == "base64":  # (vLLM's: the rows' float32s, flattened)
            items = [base64.b64encode(np.asarray(d, dtype="<f4").tobytes()).decode("ascii")
                     for d in data]
        return {**answer,
                "data": [{"index": i, "object": "pooling", "data": d}
                         for i, d in enumerate(items)],
                "usage": usage(sum(map(len, prompts)))}

    async def score(request: Request) -> dict[str, Any]:
        """A score per ``(text_1, text_2)`` pair."""
        body: ScoreRequest = await parsed(request, ScoreRequest)
        try:
            (name_1, value_1), (name_2, value_2) = body.sides()
            firsts = input_items(value_1, name_1)
            seconds = input_items(value_2, name_2)
        except ValueError as error:
            raise APIError(400, str(error),
                           param=str(error).split(" ", 1)[0].rstrip(":")) from None
        answer = head(body, "score")
        values, tokens = await scores(request, body, firsts, seconds, (name_1, name_2))
        return {**answer,
                "data": [{"index": i, "object": "score", "score": v}
                         for i, v in enumerate(values)],
                "usage": usage(tokens)}

    async def rerank(request: Request) -> dict[str, Any]:
        """``documents`` by their score against ``query``, best first (``top_n`` of them)."""
        body: RerankRequest = await parsed(request, RerankRequest)
        try:
            query = input_items(body.query, "query")
            documents = body.document_items()
        except ValueError as error:
            raise APIError(400, str(error), param=str(error).split(" ", 1)[0]) from None
        if not documents:
            raise APIError(400, "documents must hold at least one document", param="documents")
        answer = head(body, "rerank")
        values, tokens = await scores(request, body, query, documents, ("query", "documents"))
        order = sorted(range(len(values)), key=lambda i: -values[i])
        if body.top_n:
            order = order[: body.top_n]
        results: list[dict[str, Any]] = []
        for i in order:
            doc = documents[i]
            results.append({"index": i, "relevance_score": values[i]})
            if body.return_documents:
                results[-1]["document"] = ({"text": doc} if isinstance(doc, str)
                                           else {"tokens": doc})
        del answer["object"], answer["created"]
        return {**answer, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": results}

    for path in ("/score", "/v1/score"):
        app.post(path)(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(rerank)

