"""The shared MoE layers: routers against HF's, the stacked expert weights' loading, the
expert-read counter of the benchmarks' byte floor, and the MoE block against per-expert MLPs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers

from mrv2.layers import FusedMoE, GatedMLP, GroupedTopKRouter, MoEBlock, SoftmaxTopKRouter
from mrv2.layers.moe import COUNT_READS_ENV
from mrv2.model_loader import expert_weight_target, load_stacked_weights

H, E = 32, 8


def _hidden(tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_router_matches_qwen3_moe(renormalize: bool) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = transformers.Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=3,
                                         norm_topk_prob=renormalize)
    hf = Qwen3MoeTopKRouter(config)
    ours = SoftmaxTopKRouter(H, E, 3, renormalize)
    with torch.no_grad():
        hf.weight.normal_(0, 0.5)
        ours.weight.copy_(hf.weight)
    x = _hidden(9)
    _, want_w, want_ids = hf(x)
    got_w, got_ids = ours(x)
    assert got_ids.dtype == torch.int32
    torch.testing.assert_close(got_ids.long(), want_ids)
    torch.testing.assert_close(got_w, want_w.float())


@pytest.mark.parametrize("groups,topk_group,scale", [(4, 2, 2.5), (1, 1, 1.0), (4, 4, 1.0)])
def test_grouped_router_matches_glm4_moe(groups: int, topk_group: int, scale: float) -> None:
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = transformers.Glm4MoeConfig(hidden_size=H, n_routed_experts=E, num_experts_per_tok=3,
                                        n_group=groups, topk_group=topk_group,
                                        routed_scaling_factor=scale, norm_topk_prob=True)
    hf = Glm4MoeTopkRouter(config)
    ours = GroupedTopKRouter(H, E, 3, n_group=groups, topk_group=topk_group,
                             routed_scaling_factor=scale)
    with torch.no_grad():
        hf.weight.normal_(0, 0.5)
        hf.e_score_correction_bias.normal_(0, 0.3)  # large enough to change the picks
        ours.weight.copy_(hf.weight)
        assert ours.e_score_correction_bias is not None
        ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x = _hidden(16, seed=1)
    _, want_w, want_ids = hf(x)
    got_w, got_ids = ours(x)
    order_want, order_got = want_ids.argsort(-1), got_ids.long().argsort(-1)
    assert torch.equal(got_ids.long().gather(1, order_got), want_ids.gather(1, order_want))
    torch.testing.assert_close(got_w.gather(1, order_got), want_w.gather(1, order_want))
    if topk_group < groups:  # every pick lies in the allowed groups: at most topk_group groups
        per_group = E // groups
        assert all(len(set((row // per_group).tolist())) <= topk_group for row in got_ids)


def test_grouped_router_softmax_without_bias_limits_groups() -> None:
    """DeepSeek-V2's group-limited greedy: softmax scores, a group's score is its best."""
    router = GroupedTopKRouter(H, E, 2, n_group=4, topk_group=1, renormalize=False,
                               scoring="softmax", correction_bias=False)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
    x = _hidden(12, seed=2)
    weights, ids = router(x)
    probs = F.linear(x, router.weight).softmax(-1)
    best_group = probs.view(12, 4, 2).amax(-1).argmax(-1)
    assert torch.equal(ids.long() // 2, best_group[:, None].expand(12, 2))
    torch.testing.assert_close(weights, probs.gather(1, ids.long()))


@pytest.mark.parametrize("field,kwargs,match", [
    ("n_group", {"n_group": 3}, "n_group"),
    ("topk_group", {"n_group": 4, "topk_group": 5}, "topk_group"),
    ("top_k", {"n_group": 4, "topk_group": 1}, "num_experts_per_tok"),
    ("scoring", {"scoring": "relu"}, "scoring_func"),
])
def test_grouped_router_rejects_bad_config(field: str, kwargs: dict, match: str) -> None:
    top_k = 3 if field == "top_k" else 2
    with pytest.raises(ValueError, match=match):
        GroupedTopKRouter(H, E, top_k, **kwargs)


def test_correction_bias_stays_fp32_when_the_model_moves_to_bf16() -> None:
    """Loaded first, then ``model.to(bf16)`` (as the engine does): the bias keeps its exact
    fp32 values, not bf16-rounded ones."""
    router = GroupedTopKRouter(H, E, 2)
    assert router.e_score_correction_bias is not None
    values = torch.randn(E, generator=torch.Generator().manual_seed(0)) * 0.1 + 1e-3
    with torch.no_grad():
        router.e_score_correction_bias.copy_(values)
    router.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16
    assert router.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(router.e_score_correction_bias, values)


def test_fp32_weight_and_a_clamped_renormalizing_sum() -> None:
    """``fp32_weight``: the weight is built fp32 and stays so in a bf16 model; ``norm_min``:
    the picked scores are divided by their sum clamped at it (here above every sum: the
    scores over ``norm_min`` itself), the picks made on the scores plus the bias."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        router = GroupedTopKRouter(H, E, 2, scoring="softmax", norm_min=2.0, fp32_weight=True)
    finally:
        torch.set_default_dtype(previous)
    assert router.weight.dtype == torch.float32 and router.to(torch.bfloat16) is router
    assert router.weight.dtype == torch.float32 and router.e_score_correction_bias is not None
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=gen))
        router.e_score_correction_bias.copy_(torch.rand(E, generator=gen))
    x = _hidden(10, seed=4)
    weights, ids = router(x.to(torch.bfloat16))
    probs = F.linear(x.to(torch.bfloat16).float(), router.weight).softmax(-1)
    want = (probs + router.e_score_correction_bias).topk(2, dim=-1)[1]
    assert torch.equal(ids.long(), want)
    torch.testing.assert_close(weights, probs.gather(1, want) / 2.0)


def test_expert_names_map_to_stacked_shards() -> None:
    assert expert_weight_target("model.layers.3.mlp.experts.17.up_proj.weight") == (
        "model.layers.3.mlp.experts.w13_weight", (17, "up"))
    assert expert_weight_target("model.layers.0.block_sparse_moe.experts.2.w2.weight") == (
        "model.layers.0.block_sparse_moe.experts.w2_weight", (2, "down"))
    assert expert_weight_target("model.layers.1.mlp.experts.gate_up_proj") == (
        "model.layers.1.mlp.experts.w13_weight", None)
    assert expert_weight_target("model.layers.1.mlp.shared_experts.up_proj.weight") is None


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MoEBlock(SoftmaxTopKRouter(H, E, 2, True), FusedMoE(E, H, 12),
                            GatedMLP(H, 20))


def test_block_loads_per_expert_or_stacked_and_equals_per_expert_mlps() -> None:
    g = torch.Generator().manual_seed(3)
    ckpt = {"mlp.gate.weight": torch.randn(E, H, generator=g)}
    for e in range(E):
        for name, shape in (("gate_proj", (12, H)), ("up_proj", (12, H)), ("down_proj", (H, 12))):
            ckpt[f"mlp.experts.{e}.{name}.weight"] = torch.randn(*shape, generator=g) * 0.3
    for name, shape in (("gate_proj", (20, H)), ("up_proj", (20, H)), ("down_proj", (H, 20))):
        ckpt[f"mlp.shared_experts.{name}.weight"] = torch.randn(*shape, generator=g) * 0.3
    stacked = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
    block = _Block()
    loaded = load_stacked_weights(block, ckpt.items(), stacked)
    assert loaded == {name for name, _ in block.named_parameters()}
    x = _hidden(7, seed=4)
    with torch.no_grad():
        got = block.mlp(x)
        weights, ids = block.mlp.gate(x)

    def mlp(prefix: str, v: torch.Tensor) -> torch.Tensor:
        act = F.silu(v @ ckpt[f"{prefix}.gate_proj.weight"].T) * (
            v @ ckpt[f"{prefix}.up_proj.weight"].T)
        return act @ ckpt[f"{prefix}.down_proj.weight"].T

    want = mlp("mlp.shared_experts", x)
    for t in range(7):
        for j in range(2):
            want[t] += weights[t, j] * mlp(f"mlp.experts.{int(ids[t, j])}", x[t:t + 1])[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    # transformers 5's stacked layout loads whole and gives the same block
    w13 = torch.stack([torch.cat([ckpt[f"mlp.experts.{e}.gate_proj.weight"],
                                  ckpt[f"mlp.experts.{e}.up_proj.weight"]]) for e in range(E)])
    w2 = torch.stack([ckpt[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])
    other = {k: v for k, v in ckpt.items() if ".experts." not in k or "shared" in k}
    other |= {"mlp.experts.gate_up_proj": w13, "mlp.experts.down_proj": w2}
    block2 = _Block()
    load_stacked_weights(block2, other.items(), stacked)
    with torch.no_grad():
        torch.testing.assert_close(block2.mlp(x), got)


def test_expert_shape_mismatch_is_named() -> None:
    block = _Block()
    bad = {"mlp.experts.3.down_proj.weight": torch.randn(H, 13)}
    with pytest.raises(ValueError, match=r"experts\.3\.down_proj.*\(32, 12\).*\(32, 13\)"):
        load_stacked_weights(block, bad.items())


def _expert_checkpoint() -> dict[str, torch.Tensor]:
    """``_Block``'s tensors, one per expert and projection."""
    g = torch.Generator().manual_seed(5)
    ckpt = {"mlp.gate.weight": torch.randn(E, H, generator=g)}
    for e in range(E):
        for name, shape in (("gate_proj", (12, H)), ("up_proj", (12, H)), ("down_proj", (H, 12))):
            ckpt[f"mlp.experts.{e}.{name}.weight"] = torch.randn(*shape, generator=g)
    for name, shape in (("gate_proj", (20, H)), ("up_proj", (20, H)), ("down_proj", (H, 20))):
        ckpt[f"mlp.shared_experts.{name}.weight"] = torch.randn(*shape, generator=g)
    return ckpt


class _Model(_Block):
    stacked_params = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def load_weights(self, weights: Any) -> set[str]:
        return load_stacked_weights(self, weights, self.stacked_params)


@pytest.mark.parametrize("name,match", [
    ("mlp.experts.8.up_proj.weight", r"'mlp\.experts\.8\.up_proj\.weight'.*expert index must "
                                     r"be in \[0, 8\), got 8"),
    ("mlp.experts.12345.down_proj.weight", r"experts\.12345\.down_proj.*\[0, 8\), got 12345"),
    ("mlp.experts.x.up_proj.weight", r"'mlp\.experts\.x\.up_proj\.weight' matches no parameter"),
    ("mlp.experts.-1.up_proj.weight", r"'mlp\.experts\.-1\.up_proj\.weight' matches no param"),
    ("mlp.experts.2.up_proj.weights", r"'mlp\.experts\.2\.up_proj\.weights' matches no param"),
    ("mlp.experts.2.weight", r"'mlp\.experts\.2\.weight' matches no parameter"),
])
def test_an_expert_id_out_of_range_or_a_malformed_name_is_named(name: str, match: str) -> None:
    """A checkpoint tensor of an expert past ``num_experts`` (or a name that is no expert
    tensor's) is refused naming the tensor (and the allowed range), before it is written."""
    from mrv2.model_loader import load_model_weights

    model = _Model()
    ckpt = _expert_checkpoint()
    with pytest.raises(ValueError, match=match):
        load_model_weights(model, [*ckpt.items(), (name, ckpt["mlp.experts.0.up_proj.weight"]
                                                   .T if "down" in name else
                                                   ckpt["mlp.experts.0.up_proj.weight"])])


@pytest.mark.parametrize("left_out", ["mlp.experts.5.", "mlp.experts.7.up_proj.",
                                      "mlp.experts.0.down_proj."])
def test_an_expert_left_out_of_the_checkpoint_is_named(left_out: str) -> None:
    """A checkpoint without some expert's gate, up or down tensor (its rows of the stack
    would keep uninitialized memory) is refused naming the parameter and the expert's
    tensors; an update of the weights (not strict) may give some experts only."""
    from mrv2.model_loader import load_model_weights

    ckpt = {k: v for k, v in _expert_checkpoint().items() if not k.startswith(left_out)}
    expert = left_out.split(".")[2]
    with pytest.raises(ValueError, match=rf"not found in the checkpoint: .*experts\.w(13|2)"
                                         rf"_weight \(experts\.{expert}\.(gate|up|down)_proj\)"):
        load_model_weights(_Model(), ckpt.items())
    model = _Model()
    load_model_weights(model, _expert_checkpoint().items())
    some = {k: v for k, v in ckpt.items() if ".experts." in k}
    assert load_model_weights(model, some.items(), strict=False) == {
        "mlp.experts.w13_weight", "mlp.experts.w2_weight"}


def test_expert_reads_count_distinct_experts_per_forward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COUNT_READS_ENV, "1")
    layer = FusedMoE(E, H, 12)
    assert layer.count_reads
    with torch.no_grad():
        layer.w13_weight.normal_()
        layer.w2_weight.normal_()
    x = _hidden(3)
    weights = torch.full((3, 2), 0.5)
    layer(x, weights, torch.tensor([[0, 5], [5, 2], [0, 2]], dtype=torch.int32))  # 3 distinct
    layer(x[:1], weights[:1], torch.tensor([[7, 1]], dtype=torch.int32))  # 2 distinct
    assert layer.expert_reads is not None and int(layer.expert_reads) == 5
    assert layer.expert_bytes() == (2 * 12 * H + H * 12) * 4
    monkeypatch.delenv(COUNT_READS_ENV)
    assert not FusedMoE(E, H, 12).count_reads


def test_expert_bytes_count_biases_and_fp8_scales() -> None:
    """What a step reads per distinct expert: every per-expert stack, the biases and an fp8
    layer's per-row scales (fp32, one per 128 inputs: 3% over the fp8 weights) too."""
    from mrv2.layers.fp8 import experts_to_fp8

    biased = FusedMoE(E, H, 12, bias=True)
    assert biased.expert_bytes() == (2 * 12 * H + H * 12 + 2 * 12 + H) * 4
    fp8 = experts_to_fp8(FusedMoE(4, 256, 128), (128, 128), fp8_weights=True)
    weights = 2 * 128 * 256 + 256 * 128  # fp8: a byte each
    scales = (2 * 128 * 2 + 256 * 1) * 4  # a row's scale per 128 inputs, fp32
    assert fp8.expert_bytes() == weights + scales


def test_padding_rows_of_a_graph_step_read_no_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a forward whose metadata has padding rows (a CUDA graph's: tokens past
    ``query_start_loc[num_reqs]``), the routed experts skip them: the real rows are those of
    the real rows alone, and the padding's experts are not counted as read."""
    from mrv2.contract.attention import AttentionMetadata
    from mrv2.contract.forward_context import ForwardContext, set_forward_context

    monkeypatch.setenv(COUNT_READS_ENV, "1")
    layer = FusedMoE(E, H, 12)
    with torch.no_grad():
        layer.w13_weight.normal_()
        layer.w2_weight.normal_()
    x = _hidden(4)
    weights = torch.full((4, 2), 0.5)
    ids = torch.tensor([[0, 5], [5, 2], [7, 1], [3, 4]], dtype=torch.int32)
    alone = layer(x[:2], weights[:2], ids[:2])  # 3 distinct experts
    # 3 requests, the last one padding (empty query); rows 2 and 3 are padding
    metadata = AttentionMetadata(
        num_reqs=3, num_tokens=4, max_query_len=1, max_seq_len=8,
        query_start_loc=torch.tensor([0, 1, 2, 2], dtype=torch.int32),
        seq_lens=torch.tensor([5, 6, 0], dtype=torch.int32),
        block_table=torch.zeros(3, 2, dtype=torch.int32),
        slot_mapping=torch.tensor([4, 13, -1, -1]), block_size=8)
    with set_forward_context(ForwardContext(metadata, [], [])):
        padded = layer(x, weights, ids)
    assert torch.equal(padded[:2], alone) and not padded[2:].any()
    assert layer.expert_reads is not None and int(layer.expert_reads) == 3 + 3
    layer(x, weights, ids)  # outside a forward: every row is real
    assert int(layer.expert_reads) == 6 + 7

