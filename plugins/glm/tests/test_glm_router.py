"""The core's GroupedTopKRouter, as this plugin builds it, against HF's Glm4MoeTopkRouter:
same experts (as sets: HF's top-k is unsorted) with the same weights, on random inputs with a
nonzero correction bias, with and without group limits and renormalization."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from glm_common import glm_config
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

from mrv2.layers import GroupedTopKRouter
from mrv2_glm.model import glm4_moe_block


@pytest.mark.parametrize(
    "overrides",
    [{},
     {"n_routed_experts": 16, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 4},
     {"n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0},
     {"n_routed_experts": 12, "n_group": 3, "topk_group": 3, "num_experts_per_tok": 5}],
    ids=["4-groups-keep-2", "4-groups-keep-1", "one-group-raw", "keep-all-groups"],
)
def test_router_matches_hf(overrides: dict[str, Any]) -> None:
    config = glm_config(**overrides)
    gen = torch.Generator().manual_seed(0)
    hf = Glm4MoeTopkRouter(config)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=gen))
        hf.e_score_correction_bias.copy_(torch.randn(config.n_routed_experts, generator=gen))
    router = glm4_moe_block(config).gate
    assert isinstance(router, GroupedTopKRouter)
    with torch.no_grad():
        router.weight.copy_(hf.weight)
        assert router.e_score_correction_bias is not None
        router.e_score_correction_bias.copy_(hf.e_score_correction_bias)

    x = torch.randn(64, config.hidden_size, generator=gen)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf(x)
        weights, ids = router(x)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    # Compare per token in expert order: sets of ids, and each expert's weight.
    hf_order, order = hf_ids.argsort(dim=-1), ids.long().argsort(dim=-1)
    torch.testing.assert_close(ids.long().gather(1, order), hf_ids.gather(1, hf_order),
                               rtol=0, atol=0)
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order),
                               rtol=1e-6, atol=1e-6)
    # The bias and the groups must have changed some choice, or the case tests little.
    plain = torch.sigmoid(x @ hf.weight.T).topk(config.num_experts_per_tok, dim=-1)[1]
    assert not torch.equal(plain.sort(dim=-1)[0], ids.long().sort(dim=-1)[0])
