"""Mamba-2 (state-space layers only: no KV cache layer at all) through the engine against HF
transformers: greedy tokens of several requests at once (HF's full forward per token: its
chunked SSD scan, an independent form of our token-serial recurrence), prompts split across
steps (the SSM and convolution states carried between chunks), preemption (the request
computed again from a zero state), a second round on the rows the first left, every prompt
position's log-probability, the mixers' Triton kernels (interpreted), prefix caching from
state snapshots, tensor parallelism by whole groups and with one replicated group; checkpoint
names of both layouts; bad configs refused by name.

HF's eager gated norm normalises all of a mixer's channels at once; the original Mamba-2 (and
this plugin) per group: the references of the two-group checkpoint are HF's with its norm made
per group (:func:`mrv2_mamba.testing.hf_gated_norm_per_group`); the one-group checkpoint is
compared with HF as it is."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.contract.attention import AttentionMetadata
from mrv2.contract.forward_context import ForwardContext, set_forward_context
from mrv2.contract.kv_cache import layer_specs
from mrv2.contract.request_state import allocate_request_states, request_state_layers
from mrv2.testing import hf_greedy, redraw_weights
from mrv2.testing_engine import (
    check_prompt_logprobs,
    check_state_prefix_cache,
    check_state_speculation,
    tokens_at_tp,
)
from mrv2_mamba import model as mamba_model
from mrv2_mamba.model import FinalNorm, Mamba2Block, Mamba2ForCausalLM, Mamba2Mixer
from mrv2_mamba.testing import TINY_MAMBA2, hf_gated_norm_per_group, save_tiny_mamba2

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + (7 * i) % 120 for i in range(29)]]
MAX_TOKENS = 8
#: Mamba-2 configs carry no ``max_position_embeddings``: the engine needs ``max_model_len``.
ENGINE: dict[str, Any] = {"device": "cpu", "dtype": "float32", "block_size": 4,
                          "max_model_len": 256}
#: name -> overrides of TINY_MAMBA2: two groups, biased projections, an untied head; one
#: group (HF's norm as it is), no biases, tied embeddings, no dt clamp; the Triton case's two
#: groups of 2 heads of 32 channels (the same 128 as 8 x 16: its interpreted delta-rule
#: kernel launches a program per head, half as many).
VARIANTS: dict[str, dict[str, Any]] = {
    "groups2": {},
    "groups2-wide-heads": {"num_heads": 4, "head_dim": 32},
    "one-group": {"n_groups": 1, "use_bias": False, "use_conv_bias": False,
                  "tie_word_embeddings": True, "time_step_limit": (0.0, float("inf"))},
}
Checkpoint = tuple[Path, torch.nn.Module, list[list[int]]]


def _groups(variant: str) -> int:
    return int(VARIANTS[variant].get("n_groups", 2))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    out = {}
    for name, overrides in VARIANTS.items():
        path = tmp_path_factory.mktemp(name)
        hf = save_tiny_mamba2(path, **overrides)
        with hf_gated_norm_per_group(_groups(name)):
            out[name] = (path, hf, [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS])
    return out


def _prompt_logprobs_match(llm: LLM, hf: torch.nn.Module, groups: int) -> None:
    ids = PROMPTS[2]
    with torch.no_grad(), hf_gated_norm_per_group(groups):
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)


def _use_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels on the CPU need TRITON_INTERPRET=1")
    from mrv2_kernels import linear_attention

    monkeypatch.setattr(linear_attention, "use_triton", lambda t: True)


@pytest.mark.parametrize("variant,kwargs", [
    ("groups2", {"max_num_batched_tokens": 8}),
    ("groups2", {"num_gpu_blocks_override": 12}),
    ("one-group", {"max_num_batched_tokens": 8}),
    ("groups2-wide-heads", {"max_num_batched_tokens": 8, "triton": True}),
], ids=["chunked", "preempt", "one-group-chunked", "chunked-triton"])
def test_greedy_and_logprobs_match_hf(checkpoints: dict[str, Checkpoint], variant: str,
                                      kwargs: dict[str, Any],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``triton``: the mixers' conv and delta-free rule on their Triton kernels (interpreted on
    the CPU; the other ops stay on torch; one round and 4 heads, for time)."""
    path, hf, want = checkpoints[variant]
    kwargs = dict(kwargs)
    triton = kwargs.pop("triton", False)
    if triton:
        _use_triton(monkeypatch)
    llm = LLM(str(path), enable_prefix_caching=True, **ENGINE, **kwargs)
    runner = llm.engine.runner
    assert runner.kv.specs == {} and runner.keeps_request_state  # (no KV cache at all)
    assert runner.kv.tensors == [] and runner.startup.facts["kv_bytes"] == 0
    assert llm.engine.prefix_caching is True  # (with snapshots of the state)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    if triton:
        return
    if "num_gpu_blocks_override" in kwargs:
        # the blocks hold no memory, yet their count still bounds the running requests
        assert runner.num_kv_blocks == kwargs["num_gpu_blocks_override"]
        assert llm.engine.scheduler.num_preemptions > 0
    # a second round on the rows the first one left (each request starts from a zero state)
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[::-1]], params,
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want[::-1]
    _prompt_logprobs_match(llm, hf, _groups(variant))


def _count_calls(obj: Any, name: str, counts: dict[str, int]) -> None:
    run = getattr(obj, name)

    def counted(*args: Any) -> Any:
        counts[name] += 1
        return run(*args)
    setattr(obj, name, counted)


def test_graph_path_matches_hf(checkpoints: dict[str, Checkpoint]) -> None:
    """The CUDA-graph step path (emulated on the CPU: padded decode and mixed steps over the
    persistent buffers, padding requests on stale state rows) with no attention backend at
    all: HF's tokens, twice."""
    from mrv2.testing import emulate_cuda_graphs

    path, _, want = checkpoints["groups2"]
    llm = LLM(str(path), max_num_batched_tokens=16, **ENGINE)
    emulate_cuda_graphs(llm.engine.runner)
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    replays = {"replay": 0, "replay_mixed": 0}
    for name in replays:
        _count_calls(graphs, name, replays)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompts, expected in ((PROMPTS, want), (PROMPTS[::-1], want[::-1])):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert min(replays.values()) > 0, replays


def test_prefix_cache_resumes_from_state_snapshots(checkpoints: dict[str, Checkpoint]) -> None:
    """Requests resume from snapshots of the SSM and conv states, the blocks' hashes the only
    cache there is (the reference ops; the kernels' snapshot paths under Triton are the same
    as the hybrid families', whose tests run them: 40 s interpreted)."""
    check_state_prefix_cache(checkpoints["one-group"][0], max_tokens=4, max_model_len=256)


def test_speculative_decoding_keeps_only_accepted_states(
        checkpoints: dict[str, Checkpoint]) -> None:
    """n-gram drafts verified through the Mamba-2 mixers of a model with no KV cache at all:
    rejected drafts leave no trace in the SSM or conv state (greedy tokens equal HF's)."""
    check_state_speculation(checkpoints["one-group"][0], max_model_len=256)


def test_structure_and_names(checkpoints: dict[str, Checkpoint]) -> None:
    """No KV cache layer, the mixers' sizes and state shapes, the fp32 residual stream's
    norms; transformers' ``backbone.*`` names (saved and in memory), the original
    ``backbone.embedding`` and a tied head load every parameter alike."""
    from mrv2.model_loader import iter_safetensors, load_model_weights

    path, hf, _ = checkpoints["groups2"]
    config = transformers.AutoConfig.from_pretrained(path)
    model = Mamba2ForCausalLM(config)
    assert layer_specs(model) == {}
    blocks = list(model.model.layers)
    assert len(blocks) == 3 and all(isinstance(b, Mamba2Block) for b in blocks)
    assert isinstance(model.model.norm, FinalNorm) and model.residual_in_fp32
    mixer = model.mixers[0]
    assert isinstance(mixer, Mamba2Mixer)
    assert mixer.request_state_shapes() == {"conv": ((3, 128 + 2 * 2 * 16), None),
                                            "ssm": ((8, 16, 16), torch.float32)}
    assert (mixer.dt_min, mixer.dt_max) == (0.05, 0.6)
    assert mixer.norm is not None and mixer.norm.group_size == 64  # (128 channels / 2 groups)
    assert mixer.in_proj.bias is not None and mixer.conv_bias is not None

    every = {n for n, _ in model.named_parameters()}
    names = [n for n, _ in iter_safetensors(path)]
    assert "backbone.embeddings.weight" in names and "lm_head.weight" in names
    assert load_model_weights(model, iter_safetensors(path)) == every
    again = Mamba2ForCausalLM(config)
    state = hf.state_dict()
    original = [(n.replace("embeddings.", "embedding."), t) for n, t in state.items()]
    assert again.load_weights(original) == every
    for (name, mine), theirs in zip(again.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(mine, theirs), name
    hf_mixer: Any = cast(Any, hf).backbone.layers[0].mixer
    assert torch.equal(mixer.conv_weight, hf_mixer.conv1d.weight[:, 0])
    assert torch.equal(mixer.A_log, hf_mixer.A_log)

    tied_path = checkpoints["one-group"][0]
    tied = Mamba2ForCausalLM(transformers.AutoConfig.from_pretrained(tied_path))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.mixers[0].norm is not None and tied.mixers[0].norm.group_size == 128
    assert tied.mixers[0].in_proj.bias is None and tied.mixers[0].conv_bias is None
    every = {n for n, _ in tied.named_parameters()}
    assert load_model_weights(tied, iter_safetensors(tied_path)) == every


def test_fp32_residual_stream_is_hfs() -> None:
    """bf16 with ``residual_in_fp32``: the residual stream stays fp32 between blocks and the
    model's output is, bit for bit, HF's ``Mamba2Block`` / ``norm_f`` math around the same
    mixers (each block norms the stream rounded to bf16 with ``Mamba2RMSNorm`` and adds its
    mixer's bf16 output in fp32; ``norm_f`` norms the fp32 stream, weight times the fp32 normed
    value, rounded once). (A whole bf16 model against HF's differs by the scans' bf16 noise,
    which would hide these roundings.)"""
    from transformers.models.mamba2.modeling_mamba2 import Mamba2RMSNorm

    config = transformers.Mamba2Config(**{**TINY_MAMBA2, "n_groups": 1})
    model = Mamba2ForCausalLM(config)
    redraw_weights(model, std=0.15)
    model = model.to(torch.bfloat16)
    allocate_request_states(request_state_layers(model), 1, torch.bfloat16,
                            torch.device("cpu"))
    ids = torch.tensor(PROMPTS[2])
    n = len(ids)
    md = AttentionMetadata(num_reqs=1, num_tokens=n, max_query_len=n, max_seq_len=n,
                           query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                           seq_lens=torch.tensor([n], dtype=torch.int32),
                           block_table=torch.zeros(1, 1, dtype=torch.int32),
                           slot_mapping=torch.zeros(n, dtype=torch.int64), block_size=4)
    context = ForwardContext(md, [], [], state_rows=torch.zeros(1, dtype=torch.int32))

    def hf_norm(norm: torch.nn.Module) -> torch.nn.Module:
        theirs = Mamba2RMSNorm(64, eps=1e-5).to(torch.bfloat16)
        theirs.weight.data.copy_(norm.weight)
        return theirs

    streams: list[torch.Tensor] = []
    hook = model.model.layers[1].register_forward_hook(
        lambda mod, args, out: streams.append(out[1]))
    with torch.no_grad(), set_forward_context(context):
        got = model(ids, torch.arange(n))
        hook.remove()
        h = model.model.embed_tokens(ids)
        for block in model.model.layers:  # (HF's Mamba2Block.forward, our mixers)
            residual = h.float()
            h = residual + block.mixer(hf_norm(block.norm)(h.to(torch.bfloat16)))
        want = hf_norm(model.model.norm)(h)
    assert streams[0].dtype == torch.float32 and want.dtype == torch.float32
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))


def test_refusals(checkpoints: dict[str, Checkpoint], monkeypatch: pytest.MonkeyPatch) -> None:
    path = checkpoints["groups2"][0]

    def bad(**fields: Any) -> Any:
        config = transformers.AutoConfig.from_pretrained(path)
        for key, value in fields.items():
            setattr(config, key, value)
        return config

    with pytest.raises(ValueError, match=r"num_heads \* head_dim \(8 \* 16\) must equal "
                                         r"expand \* hidden_size \(192\)"):
        Mamba2ForCausalLM(bad(expand=3))
    with pytest.raises(ValueError, match=r"num_heads \(8\) must be a multiple of n_groups "
                                         r"\(3\)"):
        Mamba2ForCausalLM(bad(n_groups=3))
    with pytest.raises(ValueError, match="hidden_act .* must be one of .* got 'quick_gelu'"):
        Mamba2ForCausalLM(bad(hidden_act="quick_gelu"))
    with pytest.raises(ValueError, match="time_step_limit must be"):
        Mamba2ForCausalLM(bad(time_step_limit=(0.5, 0.1)))
    with pytest.raises(ValueError, match="num_hidden_layers must be at least 1"):
        Mamba2ForCausalLM(bad(num_hidden_layers=0))
    # four ranks: the two groups' per-group norms would span ranks
    monkeypatch.setattr(mamba_model, "resolve_tp", lambda size: (0, 4))
    with pytest.raises(ValueError, match=r"n_groups \(2\) must be divisible by "
                                         r"tensor_parallel_size \(4\), or 1"):
        Mamba2ForCausalLM(bad())
    with pytest.raises(ValueError, match=r"num_heads \(2\) must be divisible by "
                                         r"tensor_parallel_size \(4\)"):
        Mamba2ForCausalLM(bad(num_heads=2, head_dim=64, n_groups=1))
    monkeypatch.undo()
    with pytest.raises(ValueError, match="max_model_len is required"):
        LLM(str(path), device="cpu", dtype="float32", block_size=4)


@pytest.mark.parametrize("variant", ["groups2", "one-group"])
def test_tensor_parallel_matches_hf(checkpoints: dict[str, Checkpoint], variant: str) -> None:
    """Two ranks (processes on the CPU): each holds four heads of every mixer and one group
    (``groups2``: its own of two, its norm groups whole; ``one-group``: the one group,
    replicated, the gated norm's statistics all-reduced) and half the vocabulary; greedy
    tokens equal HF's, prompts split across steps."""
    path, _, want = checkpoints[variant]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    kwargs = {k: v for k, v in ENGINE.items() if k != "device"}
    for tp, got in tokens_at_tp(path, PROMPTS, params, (2,), max_num_batched_tokens=8,
                                **kwargs).items():
        assert got == want, tp
