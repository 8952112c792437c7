"""Helpers for tests of mrv2 and of its plugins: tiny random-weight HF checkpoints, and running
a model one step at a time through a paged cache outside the engine (:func:`run_step`).

A checkpoint is built by HF ``transformers`` itself (random weights, ``save_pretrained`` as
safetensors), so HF is an independent oracle for logits and greedy tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from mrv2.contract.params import SamplingParams
    from mrv2.contract.requests import MultiModalItem, NewRequest

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
}
#: DeepSeek's multi-head latent attention at a tiny size (with ``TINY``'s vocabulary).
TINY_MLA: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "tie_word_embeddings": False}
#: The MoE and MLA families' tiny checkpoints the cross-family tests share:
#: ``{name: (architecture, make_tiny_checkpoint overrides)}``.
TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-moe": ("Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                          "moe_intermediate_size": 32}),
    "glm4-moe": ("Glm4MoeForCausalLM", {"n_routed_experts": 4, "num_experts_per_tok": 2,
                                        "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                                        "n_shared_experts": 1, "partial_rotary_factor": 0.5,
                                        "n_group": 1, "topk_group": 1}),
    "deepseek-v2-lite": ("DeepseekV2ForCausalLM", {**TINY_MLA, "q_lora_rank": None,
                                                   "topk_method": "greedy"}),
    # interleaved RoPE (q/k rows reordered as they load), a dense layer then a MoE one:
    # softmax routing with a correction bias, a shared expert
    "ernie4.5-moe": ("Ernie4_5_MoeForCausalLM", {
        "head_dim": 16, "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32,
        "moe_num_shared_experts": 1, "moe_layer_start_index": 1}),
    # a local (sliding-window) layer, then a global one with linearly scaled RoPE
    "gemma3": ("Gemma3ForCausalLM", {
        "head_dim": 16, "sliding_window": 5, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                            "full_attention": {"rope_type": "linear", "factor": 2.0,
                                               "rope_theta": 1e6}}}),
    # attention sinks, a local layer then a global one, YaRN, biased router and experts
    "gpt-oss": ("GptOssForCausalLM", {
        "head_dim": 16, "intermediate_size": 32, "num_local_experts": 4,
        "num_experts_per_tok": 2, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                            "original_max_position_embeddings": 64, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False}}),
}
#: Config classes whose name is not the architecture's prefix + ``Config``.
_CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}


def make_tiny_checkpoint(
    path: str | Path, architecture: str, seed: int = 0, std: float | None = None,
    **overrides: Any
) -> Path:
    """Save a tiny random ``architecture`` (``"Qwen3ForCausalLM"``, ``"LlamaForCausalLM"``,
    ``"Qwen3MoeForCausalLM"``, ``"Qwen3ForSequenceClassification"``...: any ``XFor...`` of
    transformers with an ``XConfig``).

    ``overrides`` change config fields (``tie_word_embeddings=False``, ``head_dim=32``,
    ``num_experts=8``...). ``std``: every weight redrawn with it (:func:`redraw_weights`);
    at HF's init (std 0.02) attention is nearly uniform and the tokens barely depend on
    positions, so a test of RoPE or attention masks through greedy tokens needs ~0.15.
    Returns the checkpoint directory.
    """
    import transformers

    config_cls: Any = getattr(transformers, _CONFIG_CLASSES.get(
        architecture, architecture.split("For")[0] + "Config"))
    model_cls: Any = getattr(transformers, architecture)
    config = config_cls(**{**TINY, "eos_token_id": 1, "bos_token_id": 0, **overrides})
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # norms: away from 1 so their weights matter
                param.uniform_(0.5, 1.5)
    if std is not None:
        redraw_weights(model, seed=seed, std=std)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(model_dir: str | Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by HF transformers itself (full forward per token, no EOS stop)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32
    ).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def random_image(height: int, width: int, seed: int) -> Any:
    """A ``height`` x ``width`` RGB PIL image of random pixels (needs pillow)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def make_tiny_tokenizer(path: str | Path, vocab_size: int = 320,
                        special_tokens: Sequence[str] = (), chat_template: str | None = None
                        ) -> Path:
    """Save a byte-level BPE tokenizer (at most ``vocab_size`` ids) with a chat template;
    ``special_tokens`` are added after the vocabulary (ids ``vocab_size``, ...), and
    ``chat_template`` replaces the default one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False,
        special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(["The capital of France is Paris. Hello world!"] * 4, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
    )
    if special_tokens:
        hf.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>",
                                                             *special_tokens]})
    hf.chat_template = chat_template or (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    path = Path(path)
    hf.save_pretrained(str(path))
    return path


# -- running a model one step at a time, outside the engine -----------------------------------

#: Block size and block count of :func:`poisoned_caches` / :func:`step_metadata` by default.
TEST_BLOCK_SIZE = 4
TEST_NUM_BLOCKS = 32


def redraw_weights(module: torch.nn.Module, seed: int = 0, std: float = 0.15) -> None:
    """Redraw ``module``'s weights far from their init so every part matters in a parity test:
    norms uniform in [0.5, 1.5), the rest normal(0, ``std``), and MoE routers' correction biases
    (``e_score_correction_bias``, a buffer in HF) uniform in [-0.3, 0.3) so they change picks."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        for name, tensor in [*module.named_buffers(), *module.named_parameters()]:
            if name.endswith("e_score_correction_bias"):
                tensor.copy_((torch.rand(tensor.shape, generator=gen) - 0.5) * 0.6)


#: :func:`save_tiny_model`'s ``uniform`` for Mamba-2-style SSM decays in a trained model's
#: range: ``A = exp(A_log)`` in [1, 4.5], ``dt_bias`` in [-3, 0] (``dt`` on both sides of the
#: clamp's ends).
SSM_DECAYS: dict[str, tuple[float, float]] = {"dt_bias": (-3.0, 0.0), "A_log": (0.0, 1.5)}
#: :func:`save_tiny_model`'s ``uniform`` for Gated DeltaNet / KDA decays in a trained model's
#: range: ``A`` in [1, 16], ``dt_bias`` near 0.
DELTA_NET_DECAYS: dict[str, tuple[float, float]] = {"A_log": (0.0, 2.7), "dt_bias": (-0.5, 0.5)}


def save_tiny_model(path: str | Path, architecture: str, config: Any, std: float = 0.15,
                    uniform: dict[str, tuple[float, float]] | None = None) -> torch.nn.Module:
    """Build HF's ``architecture`` (a class of ``transformers``) from ``config`` (its
    ``architectures`` set to it) at seed 0 in fp32, redraw every weight far from its init
    (:func:`redraw_weights` with ``std``), then each parameter or buffer whose name ends with
    a key of ``uniform`` uniformly in its ``(low, high)`` (module by module, the keys' order
    within one) (:data:`SSM_DECAYS`,
    :data:`DELTA_NET_DECAYS`: decays in a trained model's range), save it to ``path``
    (safetensors) and return it: the tiny checkpoints' one recipe."""
    import transformers

    config.architectures = [architecture]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).float().eval()
    redraw_weights(model, std=std)
    with torch.no_grad():  # a module at a time, in ``uniform``'s order within each
        for prefix, module in model.named_modules():
            own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            for suffix, (low, high) in (uniform or {}).items():
                for name, tensor in own:
                    if f"{prefix}.{name}".endswith(suffix):
                        tensor.uniform_(low, high)
    model.save_pretrained(path)
    return model


def step_metadata(
    contexts: list[int], queries: list[int], tables: list[list[int]], num_pad: int = 0,
    block_size: int = TEST_BLOCK_SIZE,
) -> Any:
    """:class:`~mrv2.attention.AttentionMetadata` of a step where request ``i`` has
    ``contexts[i]`` cached tokens and ``queries[i]`` new ones in blocks ``tables[i]``, and
    ``num_pad`` padding tokens (slot -1) follow."""
    from mrv2.attention import AttentionMetadata

    starts = [0]
    slots: list[int] = []
    for ctx, n, blocks in zip(contexts, queries, tables, strict=True):
        starts.append(starts[-1] + n)
        slots += [blocks[p // block_size] * block_size + p % block_size
                  for p in range(ctx, ctx + n)]
    seq_lens = [c + n for c, n in zip(contexts, queries, strict=True)]
    return AttentionMetadata(
        num_reqs=len(queries),
        num_tokens=starts[-1] + num_pad,
        max_query_len=max(queries),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1] * num_pad, dtype=torch.int64),
        block_size=block_size,
    )


def step_inputs(
    contexts: list[int], new_tokens: list[list[int]], num_pad: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat token ids and positions of a step, ``num_pad`` padding tokens at the end."""
    ids = sum(new_tokens, []) + [0] * num_pad
    positions = sum((list(range(c, c + len(t)))
                     for c, t in zip(contexts, new_tokens, strict=True)), []) + [0] * num_pad
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(positions)


def torch_context(caches: list[torch.Tensor], metadata: Any) -> Any:
    """A forward context over ``caches`` (indexed by cache layer) with the torch backend."""
    from mrv2.attention import ForwardContext
    from mrv2.attention.torch_backend import TorchAttentionBackend

    return ForwardContext(metadata, caches, [TorchAttentionBackend()] * len(caches))


def poisoned_caches(
    num_kv_heads: int, head_dim: int, count: int, num_blocks: int = TEST_NUM_BLOCKS,
    block_size: int = TEST_BLOCK_SIZE,
) -> list[torch.Tensor]:
    """``count`` paged KV caches filled with 1e4, so a slot read before it is written shows."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.full(shape, 1e4) for _ in range(count)]


def run_step(
    model: Any, caches: list[torch.Tensor], tables: list[list[int]], contexts: list[int],
    new_tokens: list[list[int]], num_pad: int = 0, block_size: int = TEST_BLOCK_SIZE,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One engine step of ``model`` (the torch backend over ``caches``; padding tokens at the
    end): per-request logits of the new tokens, and the hidden states of every token."""
    from mrv2.attention import set_forward_context

    ids, positions = step_inputs(contexts, new_tokens, num_pad)
    metadata = step_metadata(contexts, [len(t) for t in new_tokens], tables, num_pad, block_size)
    with torch.inference_mode(), set_forward_context(torch_context(caches, metadata)):
        hidden = model(ids, positions)
        logits = model.compute_logits(hidden)
    assert logits.shape == (len(ids), model.config.vocab_size)
    real = len(ids) - num_pad
    return list(logits[:real].split([len(t) for t in new_tokens])), hidden


def check_steps_against_hf(model: Any, hf: torch.nn.Module, caches: list[torch.Tensor],
                           prompt_lens: Sequence[int], vocab: int, max_len: int,
                           atol: float = 1e-4) -> list[list[torch.Tensor]]:
    """A prefill step of random prompts of ``prompt_lens`` tokens (two padding rows too), then
    a decode step of one random token each, through ``model`` over ``caches`` (blocks drawn
    at random, room for ``max_len`` tokens a request): every logit against HF's full forward
    of the same tokens, to ``atol``. Returns both steps' logits per request."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    max_blocks = -(-max_len // TEST_BLOCK_SIZE)
    perm = torch.randperm(TEST_NUM_BLOCKS, generator=gen).tolist()
    tables = [perm[i * max_blocks : (i + 1) * max_blocks] for i in range(len(prompts))]
    prefill, _ = run_step(model, caches, tables, [0] * len(prompts), prompts, num_pad=2)
    with torch.no_grad():
        for prompt, logits in zip(prompts, prefill, strict=True):
            expected = hf(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(logits, expected, atol=atol, rtol=atol)
    next_tokens = torch.randint(0, vocab, (len(prompts),), generator=gen).tolist()
    decode, _ = run_step(model, caches, tables, [len(p) for p in prompts],
                         [[t] for t in next_tokens])
    with torch.no_grad():
        for prompt, token, logits in zip(prompts, next_tokens, decode, strict=True):
            expected = hf(torch.tensor([prompt + [token]])).logits[0, -1:]
            torch.testing.assert_close(logits, expected, atol=atol, rtol=atol)
    return [prefill, decode]


class EagerGraph:
    """A CPU stand-in for a captured CUDA graph: "capture" runs the body once and keeps its
    outputs; :meth:`replay` runs it again (over the same persistent buffers, with the batch
    shapes baked at capture) and copies the new outputs into the kept ones, as a graph's static
    outputs are refreshed. Lets the padded graph path run, and be tested, on the CPU."""

    def __init__(self, body: Callable[[], Any]) -> None:
        self.body = body
        self.outputs = body()
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        new = self.body()
        if isinstance(self.outputs, tuple):
            for kept, fresh in zip(self.outputs, new, strict=True):
                kept.copy_(fresh)


def record_row_order(runner: Any) -> list[list[str]]:
    """From now on, each step's requests in batch-row order (``InputBatch.req_ids``: longest
    sequence first unless ``MRV2_LONGEST_FIRST=0``), appended to the returned list: for
    tests that read per-row outputs (logits) of a runner's steps."""
    order: list[list[str]] = []
    build = runner.builder.build

    def recorded(*args: Any, **kwargs: Any) -> Any:
        plan = build(*args, **kwargs)
        order.append(list(plan.batch.req_ids))
        return plan

    runner.builder.build = recorded
    return order


def prefill_logits(runner: Any, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Run every prompt of ``prompts`` through ``runner`` in one greedy prefill step (blocks
    numbered in order, one spare each) and return the logits the sampler got for them,
    ``[len(prompts), vocab]`` fp32 on the CPU in prompt order. The sampler is where to look:
    a step that replays a CUDA graph runs ``compute_logits`` inside the graph."""
    from mrv2.contract.params import SamplingParams
    from mrv2.contract.requests import NewRequest, SchedulerOutput

    captured: list[torch.Tensor] = []
    sampler = runner.sampler

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(sampler, name)

        def __call__(self, logits: torch.Tensor, *args: Any) -> Any:
            captured.append(logits.float().cpu())
            return sampler(logits, *args)

    runner.sampler = Spy()
    order = record_row_order(runner)
    new, next_block, bs = [], 0, runner.block_size
    for i, prompt in enumerate(prompts):
        blocks = list(range(next_block, next_block + -(-len(prompt) // bs) + 1))
        next_block += len(blocks)
        new.append(NewRequest(str(i), list(prompt), SamplingParams(temperature=0.0), seed=i,
                              block_ids=blocks))
    try:
        runner.execute(SchedulerOutput(
            num_scheduled_tokens={str(i): len(p) for i, p in enumerate(prompts)},
            new_requests=new,
        )).result()
    finally:
        runner.sampler = sampler
    return torch.stack([captured[0][order[0].index(str(i))] for i in range(len(prompts))])


def emulate_cuda_graphs(runner: Any, mixed_cap: int | None = 512) -> None:
    """Give a CPU ``Runner`` the CUDA-graph path with :class:`EagerGraph` stand-ins: decode steps
    are padded to the captured sizes and "replayed", drafting included (the padding requests,
    their stale rows, the baked ``max_seq_len``: all as on the GPU).

    Each stand-in "capture" runs a forward, so where the config leaves
    ``max_mixed_graph_tokens`` unset the mixed graphs stop at ``mixed_cap`` tokens (every
    kind of size is below it; larger steps run eager, as past any cap); ``None`` keeps the
    GPU's default (the whole token budget: ~100K tokens of forwards for 8,192)."""
    device = runner.config.device
    if mixed_cap is not None and device.max_mixed_graph_tokens is None:
        device.max_mixed_graph_tokens = min(mixed_cap, runner._max_mixed_graph_tokens())
    lora = runner.lora

    def capture(batch: Any, body: Callable[[], Any]) -> EagerGraph:
        # a graph keeps what its capture launched: with LoRA, the adapters' kernels or not
        baked = lora.force if lora is not None else None
        if baked is None:
            return EagerGraph(body)

        def replay() -> Any:
            with lora.forced(baked):
                return body()

        return EagerGraph(replay)

    runner.capture_graphs(capture)


def serve_in_thread(app: Any) -> Iterator[str]:
    """Serve the ASGI ``app`` (``mrv2.entrypoints.server.create_app(engine, ...)``) with
    uvicorn on a free local port, in a daemon thread; yields the base URL once ``/health``
    answers, then stops the server (a generator: ``yield from serve_in_thread(app)`` in a
    pytest fixture)."""
    import socket
    import threading
    import time

    import httpx
    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    else:
        raise RuntimeError("the server did not start")
    yield url
    server.should_exit = True
    thread.join(15)


def _requests(runner: Any, prompts: Sequence[tuple[str, Sequence[int], Sequence[MultiModalItem]]],
              params: SamplingParams, seeds: Sequence[int]) -> list[NewRequest]:
    """Request ``name`` for each ``(name, prompt, media items)`` of ``prompts`` with its seed
    and blocks ``8i .. 8i+7``, in the runner's other block tables (``kv_table_windows``) the
    next ``8 x len(prompts)`` blocks each."""
    from mrv2.contract.requests import NewRequest

    num = len(prompts)
    tables = len(getattr(runner, "kv_table_windows", (None,)))
    return [NewRequest(name, list(ids), params, seed=seed,
                       block_ids=[i * 8 + j for j in range(8)], mm_items=list(items),
                       extra_block_ids=[[(t * num + i) * 8 + j for j in range(8)]
                                        for t in range(1, tables)])
            for i, ((name, ids, items), seed) in enumerate(zip(prompts, seeds, strict=True))]


def _execute_without_sync(runner: Any, new: Sequence[NewRequest], first: dict[str, int],
                          decode_steps: int) -> list[dict[str, list[int]]]:
    """Run ``new`` on a CUDA ``runner`` under ``torch.cuda.set_sync_debug_mode("error")``, so
    any host sync in a step raises: a step of ``first[r]`` tokens of each request ``r`` (all
    of ``new`` join in it), a second with the rest of each prompt (requests already done:
    their first decode, after those that finish), then ``decode_steps`` decode steps. Returns
    each step's tokens (read after the mode is reset)."""
    from mrv2.contract.requests import SchedulerOutput

    rest = {r.req_id: len(r.token_ids) - first[r.req_id] for r in new}
    outputs = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs.append(runner.execute(SchedulerOutput(first, new_requests=list(new))))
        outputs.append(runner.execute(SchedulerOutput(
            {r: n for r, n in rest.items() if n} | {r: 1 for r, n in rest.items() if not n})))
        for _ in range(decode_steps):
            outputs.append(runner.execute(SchedulerOutput({r.req_id: 1 for r in new})))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [out.result() for out in outputs]


def run_steps_without_sync(runner: Any, prompts: Sequence[Sequence[int]]
                           ) -> list[dict[str, list[int]]]:
    """Run ``prompts`` (request ``str(i)`` each, sampling at temperature 0.8 with seed ``i``,
    blocks ``8i .. 8i+7``, in the runner's other block tables the next ``8 x len(prompts)``
    blocks each) on a CUDA ``runner`` under ``torch.cuda.set_sync_debug_mode("error")``, so
    any host sync in a step raises: a first step of up to 20 tokens per prompt, a second that
    finishes the longer prompts (mixed with the others' first decode), then six decode steps
    that replay graphs. Returns each step's tokens (read after the mode is reset)."""
    from mrv2.contract.params import SamplingParams

    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    new = _requests(runner, [(str(i), p, ()) for i, p in enumerate(prompts)], params,
                    range(len(prompts)))
    return _execute_without_sync(runner, new, {r.req_id: min(len(r.token_ids), 20) for r in new},
                                 decode_steps=6)


#: The text request's prompt in :func:`run_media_steps_without_sync`.
_TEXT_BESIDE_MEDIA = (5, 17, 42, 9)


def run_media_steps_without_sync(runner: Any, name: str, ids: Sequence[int],
                                 items: Sequence[MultiModalItem], split: int,
                                 seeds: tuple[int, int] = (0, 1)
                                 ) -> list[dict[str, list[int]]]:
    """A media item split across two steps beside a text request, then decode steps, on a
    CUDA ``runner`` (with graphs, for the decode steps to replay them) under
    ``torch.cuda.set_sync_debug_mode("error")``, so any host sync in a step raises.

    Request ``name`` (prompt ``ids`` with media ``items``, as the model's input processor
    expanded them) and request ``"txt"`` (prompt ``[5, 17, 42, 9]``) sample at temperature 0.8
    with ``seeds``, in blocks ``0 .. 7`` and ``8 .. 15`` (in the runner's other block tables
    ``t = 1, 2, ..``: ``16t ..`` and ``16t + 8 ..``). Step 1 computes ``split`` tokens of
    ``name`` (choose it inside an item, for the item to be split) and the whole text prompt,
    step 2 the rest of ``ids`` and the text request's first decode, then four decode steps of
    both. Returns each step's tokens (read after the mode is reset). The caller checks what
    is its model's own (where the items lie, how many times the encoder ran)."""
    if not 0 < split < len(ids):
        raise ValueError(f"split must lie in 1 .. {len(ids) - 1} (the prompt's {len(ids)} "
                         f"tokens are split across two steps); got {split}")
    if name == "txt":
        raise ValueError('name must not be "txt" (the text request\'s); got "txt"')
    from mrv2.contract.params import SamplingParams

    new = _requests(runner, [(name, ids, items), ("txt", _TEXT_BESIDE_MEDIA, ())],
                    SamplingParams(temperature=0.8), seeds)
    return _execute_without_sync(runner, new, {name: split, "txt": len(_TEXT_BESIDE_MEDIA)},
                                 decode_steps=4)


def rank_and_args(runner: Any, *args: Any) -> tuple[int, tuple[Any, ...]]:
    """A ``collective_rpc`` function for tests: this rank and the arguments it got."""
    from mrv2.distributed.parallel_state import tp_rank

    return tp_rank(), args


def fail_past_rank_0(runner: Any) -> int:
    """A ``collective_rpc`` function for tests: 0 on rank 0, a KeyError on every other."""
    from mrv2.distributed.parallel_state import tp_rank

    if tp_rank() > 0:
        raise KeyError("only rank 0 may")
    return 0
