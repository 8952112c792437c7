"""examples/private_latent_cache_plugin.py: a private plugin brings an MLA-like model with its own
latent KV cache kind and backend; the engine's tokens and logprobs equal a direct reference's."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.contract.kv_cache import LatentKVSpec
from mrv2.engine.outputs import PositionLogprobs
from mrv2.plugins import PluginManager

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "private_latent_cache_plugin.py"
MODULE_NAME = "private_latent_cache_plugin"
BLOCK_SIZE = 4
NEW_TOKENS = 8
# Different lengths: shorter than a block, a block and a bit, several blocks.
PROMPTS = [[5, 17, 42, 9, 60, 3, 77], [8, 8, 50], [2 + (7 * i) % 90 for i in range(19)]]
PREFIX = [3 + (11 * i) % 90 for i in range(14)]  # three full blocks and a half

Weights = dict[str, torch.Tensor]
Config = dict[str, Any]


@pytest.fixture(scope="module")
def example() -> ModuleType:
    """The example imported by file path (in ``sys.modules``, so its lazy paths resolve)."""
    spec = importlib.util.spec_from_file_location(MODULE_NAME, EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checkpoint(example: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = example.write_checkpoint(tmp_path_factory.mktemp("toy-latent"))
    return path


@pytest.fixture(scope="module")
def ckpt(example: ModuleType, checkpoint: Path) -> tuple[Weights, Config]:
    loaded: tuple[Weights, Config] = example.load_checkpoint(checkpoint)
    return loaded


@pytest.fixture(scope="module")
def greedy(example: ModuleType, ckpt: tuple[Weights, Config]) -> Callable[[list[int]], list[int]]:
    """The direct reference's greedy continuation of a prompt (memoised)."""
    cache: dict[tuple[int, ...], list[int]] = {}

    def run(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            cache[key] = example.reference_greedy(*ckpt, prompt, NEW_TOKENS)
        return cache[key]

    return run


def _llm(example: ModuleType, checkpoint: Path, **kwargs: Any) -> LLM:
    """An engine on a fresh plugin manager: no entry point, only the example's plugin."""
    manager = PluginManager(autoload=True, allow=[], block=[])
    manager.register(example.ToyLatentPlugin(), name="toy-latent-example")
    engine_kwargs: dict[str, Any] = {
        "device": "cpu", "dtype": "float32", "block_size": BLOCK_SIZE, "max_model_len": 64,
        "num_gpu_blocks_override": 64, **kwargs,
    }
    return LLM(str(checkpoint), plugins=manager, **engine_kwargs)


def _greedy_params(**kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **kwargs)


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for output, prompt in zip(outputs, prompts, strict=True):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].finish_reason == "length"
    return [output.outputs[0].token_ids for output in outputs]


def test_batched_greedy_matches_direct_reference(
    example: ModuleType, checkpoint: Path, greedy: Callable[[list[int]], list[int]]
) -> None:
    llm = _llm(example, checkpoint)
    assert _generate(llm, PROMPTS, _greedy_params()) == [greedy(p) for p in PROMPTS]


def test_logprobs_match_direct_reference(
    example: ModuleType, checkpoint: Path, ckpt: tuple[Weights, Config]
) -> None:
    """Every prompt position (the prefill's logits) and every generated position (the decode
    steps'): the top-5 ids and their raw logprobs equal the reference's ``log_softmax``."""
    llm = _llm(example, checkpoint)
    params = _greedy_params(logprobs=5, prompt_logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    checked = 0
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        completion = output.outputs[0]
        sequence = prompt + completion.token_ids
        ref = torch.log_softmax(example.reference_logits(*ckpt, sequence), dim=-1)
        assert output.prompt_logprobs is not None and completion.logprobs is not None
        assert output.prompt_logprobs[0] is None
        # Position j's dict scores token j given tokens < j: the reference's row j - 1.
        per_position: list[PositionLogprobs | None] = [
            *output.prompt_logprobs[1:], *completion.logprobs
        ]
        assert len(per_position) == len(sequence) - 1
        for j, logprobs in enumerate(per_position, start=1):
            assert logprobs is not None and sequence[j] in logprobs
            top5 = set(ref[j - 1].topk(5).indices.tolist())
            assert top5 <= set(logprobs), f"position {j}: top-5 ids differ"
            for token, lp in logprobs.items():
                assert lp.logprob == pytest.approx(float(ref[j - 1, token]), abs=1e-4)
                checked += 1
    assert checked >= 5 * (sum(len(p) for p in PROMPTS) + len(PROMPTS) * (NEW_TOKENS - 1))


def test_reference_depends_on_context(example: ModuleType, ckpt: tuple[Weights, Config]) -> None:
    """The checks above are not vacuous: the last position's logits move when a token two
    blocks back changes, so a backend that lost or misplaced cached latents would show."""
    prompt = PROMPTS[2]
    changed = [prompt[0] + 1, *prompt[1:]]
    last = example.reference_logits(*ckpt, prompt)[-1]
    last_changed = example.reference_logits(*ckpt, changed)[-1]
    assert (last - last_changed).abs().max() > 1e-2


def test_kv_cache_is_one_latent_per_token(
    example: ModuleType, checkpoint: Path, ckpt: tuple[Weights, Config]
) -> None:
    weights, config = ckpt
    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    latent_dim = rank + rope
    llm = _llm(example, checkpoint)
    _generate(llm, PROMPTS, _greedy_params())
    runner = llm.engine.runner
    kv = runner.kv
    assert len(kv.groups) == 1
    group = kv.groups[0]
    assert isinstance(group.spec, LatentKVSpec) and group.spec.kind == "latent"
    assert group.spec.latent_dim == latent_dim
    assert group.backend == "toy-latent"
    assert group.layer_indices == tuple(range(config["num_hidden_layers"]))
    assert all(isinstance(b, example.ToyLatentBackend) for b in kv.backends)
    assert len(kv.tensors) == config["num_hidden_layers"]
    for tensor in kv.tensors:
        assert tensor.shape == (runner.num_kv_blocks, BLOCK_SIZE, latent_dim)

    # Layer 0's cache holds [c ; k_pe] of every prompt token, as the checkpoint defines it.
    prompt = PROMPTS[2]
    x = weights["model.embed_tokens.weight"][torch.tensor(prompt)]
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"])
    x = x * weights["model.layers.0.input_layernorm.weight"]
    kv_a = x @ weights["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].T
    positions = torch.arange(len(prompt))
    k_pe = example.apply_rope(kv_a[:, rank:], positions, config["rope_theta"])
    expected = torch.cat([kv_a[:, :rank], k_pe], dim=-1)  # [S, latent_dim]
    rows = kv.tensors[0].reshape(-1, latent_dim)
    nearest = (expected[:, None] - rows[None]).abs().amax(dim=-1).min(dim=1).values
    assert nearest.max() < 1e-4, "a prompt token's latent is not in layer 0's cache"


def test_chunked_prefill_and_prefix_cache(
    example: ModuleType, checkpoint: Path, greedy: Callable[[list[int]], list[int]]
) -> None:
    """A 5-token budget chunks every prompt; later requests share a long prefix with earlier
    ones, so they reuse cached latent blocks. Tokens stay the reference's."""
    llm = _llm(example, checkpoint, max_num_batched_tokens=5)
    rounds = [[PREFIX + [11]], [PREFIX + [12, 13, 14], PREFIX[:9] + [40], PROMPTS[1]]]
    for prompts in rounds:
        assert _generate(llm, prompts, _greedy_params()) == [greedy(p) for p in prompts]
    assert llm.engine.stats()["prefix_cache_hits"] > 0


def test_backend_skips_padding_rows(example: ModuleType) -> None:
    """``write`` leaves slots of negative-slot rows alone (also when a step is all padding);
    ``attend`` zeroes padding token rows, ignores padding requests, and its real rows equal a
    per-token computation over the latents read through the block table."""
    backend = example.ToyLatentBackend()
    gen = torch.Generator().manual_seed(1)
    dim, value_dim, heads, scale = 6, 4, 2, 0.5
    cache = torch.randn(4, BLOCK_SIZE, dim, generator=gen)
    before = cache.clone()
    latent = torch.randn(5, dim, generator=gen)
    backend.write(latent, cache, torch.tensor([5, -1, 2, -1, 7]))
    flat, old = cache.view(-1, dim), before.view(-1, dim)
    for slot, row in ((5, 0), (2, 2), (7, 4)):
        assert torch.equal(flat[slot], latent[row])
    untouched = [s for s in range(flat.shape[0]) if s not in (2, 5, 7)]
    assert torch.equal(flat[untouched], old[untouched])
    written = cache.clone()
    backend.write(latent, cache, torch.full((5,), -1))  # a step of padding only
    assert torch.equal(cache, written)

    from mrv2.contract.attention import AttentionMetadata

    # Request 0: 2 queries at positions 3-4 (blocks 2, 0); request 1: 1 query at position 1
    # (block 3); request 2 is padding (no query, no tokens); token rows 3-4 are padding.
    block_table = torch.tensor([[2, 0], [3, 1], [0, 0]], dtype=torch.int32)
    query = torch.randn(5, heads, dim, generator=gen)

    def metadata(num_reqs: int, num_tokens: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_reqs=num_reqs, num_tokens=num_tokens, max_query_len=2, max_seq_len=5,
            query_start_loc=torch.tensor([0, 2, 3, 3], dtype=torch.int32)[: num_reqs + 1],
            seq_lens=torch.tensor([5, 2, 0], dtype=torch.int32)[:num_reqs],
            block_table=block_table[:num_reqs], slot_mapping=torch.full((num_tokens,), -1),
            block_size=BLOCK_SIZE,
        )

    padded = backend.attend(query, cache, metadata(3, 5), scale, value_dim)
    real = backend.attend(query[:3], cache, metadata(2, 3), scale, value_dim)
    assert padded.shape == (5, heads, value_dim)
    assert torch.equal(padded[3:], torch.zeros(2, heads, value_dim))
    torch.testing.assert_close(padded[:3], real)
    for row, (req, pos) in enumerate([(0, 3), (0, 4), (1, 1)]):
        slots = [int(block_table[req, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                 for p in range(pos + 1)]
        keys = flat[slots]
        probs = torch.softmax(query[row] @ keys.T * scale, dim=-1)
        torch.testing.assert_close(real[row], probs @ keys[:, :value_dim])


def test_main_runs_beside_the_installed_plugins(example: ModuleType,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``python examples/private_latent_cache_plugin.py`` as the docs run it: every installed
    entry point loaded too, beside the core's "mla" backend of the same "latent" kind."""
    assert "mla" in PluginManager().registries.attention_backends
    assert example.main() == 0
    out = capsys.readouterr().out
    assert "backend 'toy-latent'" in out and "all match the direct reference" in out
