"""The EAGLE heads against plain-torch references written from the published descriptions
(SafeAILab/EAGLE ``cnets1.py`` for EAGLE-1/2, ``cnets.py`` for EAGLE-3), on the tiny targets:
the head modules' logits equal the reference's on the same random weights, and the drafts the
engine writes after a prefill are the reference's draft chain. The target's hidden states come
from HF transformers itself (its ``hidden_states[i]`` is the input of layer ``i``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mrv2 import EngineConfig, Runner, SamplingParams
from mrv2.attention import set_forward_context
from mrv2.contract.requests import NewRequest, SchedulerOutput
from mrv2.testing import hf_greedy, poisoned_caches, step_metadata, torch_context

PROMPT = [1 + (7 * i) % 200 for i in range(19)]
K = 3

# -- the reference ----------------------------------------------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotation of ``x`` ``[T, heads, d]`` (the two halves rotate together)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions[:, None].double() * inv[None]
    cos = torch.cat([angles.cos()] * 2, -1).float()[:, None]
    sin = torch.cat([angles.sin()] * 2, -1).float()[:, None]
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def attention(t: dict[str, torch.Tensor], p: str, x: torch.Tensor, positions: torch.Tensor,
              cfg: dict[str, Any]) -> torch.Tensor:
    """Causal GQA self-attention with RoPE: ``p`` is the ``...self_attn.`` prefix."""
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4))
    q = rope((x @ t[p + "q_proj.weight"].T).view(len(x), heads, hd), positions, theta)
    k = rope((x @ t[p + "k_proj.weight"].T).view(len(x), kv, hd), positions, theta)
    v = (x @ t[p + "v_proj.weight"].T).view(len(x), kv, hd)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(positions[None, :] > positions[:, None], float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(x), heads * hd)
    return out @ t[p + "o_proj.weight"].T


def mlp(t: dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = x @ t[p + "gate_proj.weight"].T, x @ t[p + "up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ t[p + "down_proj.weight"].T


def eagle_reference(t: dict[str, torch.Tensor], cfg: dict[str, Any], embed: torch.Tensor,
                    lm_head: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-1/2: ``fc(cat(embedding, hidden))``, HF decoder layers (layer 0's input norm is
    absent in EAGLE-1), then the target's LM head on the un-normed output."""
    eps = cfg["rms_norm_eps"]
    x = torch.cat([embed[tokens], hidden], -1) @ t["fc.weight"].T
    if "fc.bias" in t:
        x = x + t["fc.bias"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        norm = t.get(p + "input_layernorm.weight")
        h = x if norm is None else rms(x, norm, eps)
        x = x + attention(t, p + "self_attn.", h, positions, cfg)
        x = x + mlp(t, p + "mlp.", rms(x, t[p + "post_attention_layernorm.weight"], eps))
    return x, x @ lm_head.T


def eagle3_reference(t: dict[str, torch.Tensor], cfg: dict[str, Any], embed: torch.Tensor,
                     tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's midlayer: attention over ``cat(input_layernorm(embedding),
    hidden_norm(hidden))`` with the un-normed hidden as residual, the MLP block, then
    ``lm_head(norm(out))`` over the draft vocabulary, placed at target ids ``i + d2t[i]``."""
    eps, p = cfg["rms_norm_eps"], "midlayer."
    e = rms(embed[tokens], t[p + "input_layernorm.weight"], eps)
    h = rms(hidden, t[p + "hidden_norm.weight"], eps)
    x = hidden + attention(t, p + "self_attn.", torch.cat([e, h], -1), positions, cfg)
    x = x + mlp(t, p + "mlp.", rms(x, t[p + "post_attention_layernorm.weight"], eps))
    draft = rms(x, t["norm.weight"], eps) @ t["lm_head.weight"].T
    logits = torch.full((len(x), cfg["vocab_size"]), float("-inf"))
    logits[:, torch.arange(draft.shape[1]) + t["d2t"]] = draft
    return x, logits


def aux_ids(cfg: dict[str, Any], num_layers: int) -> list[int]:
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return sorted(ids or (2, num_layers // 2, num_layers - 3))


# -- the tests --------------------------------------------------------------------------------


def reference_chain(method: str, target_dir: Path, head_dir: Path, known: list[int]
                    ) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """The reference's ``K`` drafts after ``known`` tokens: catch-up rows ``p = 0 .. n - 2``
    (the target's hidden state at ``p`` beside token ``p + 1``), then each draft fed back
    with the head's own output. Returns the drafts, and the last pass's tokens, hidden states
    and logits."""
    cfg = json.loads((head_dir / "config.json").read_text())
    t = load_file(head_dir / "model.safetensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([known[:-1]]), output_hidden_states=True).hidden_states
        embed, lm_head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
        if method == "eagle":
            hidden = states[-1][0]  # the final, normed hidden states
        else:
            embed = t.get("embed_tokens.weight", embed)  # an EAGLE-3 head's own, if any
            layers = hf.config.num_hidden_layers
            aux = torch.cat([states[i][0] for i in aux_ids(cfg, layers)], -1)
            hidden = aux @ t["fc.weight"].T
        tokens = known[1:]
        drafts: list[int] = []
        for _ in range(K):
            positions = torch.arange(len(tokens))
            if method == "eagle":
                out, logits = eagle_reference(t, cfg, embed, lm_head, torch.tensor(tokens),
                                              hidden, positions)
            else:
                out, logits = eagle3_reference(t, cfg, embed, torch.tensor(tokens), hidden,
                                               positions)
            drafts.append(int(logits[-1].argmax()))
            tokens = tokens + drafts[-1:]
            hidden = torch.cat([hidden, out[-1:]])
    return drafts, tokens[:-1], hidden[:-1], logits


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("target", ["qwen3", "llama"])
def test_head_matches_the_reference(target: str, method: str, target_dirs: dict[str, Path],
                                    head_dirs: dict[tuple[str, str], Path]) -> None:
    """After a prefill, and after a decode step verifying ``K`` drafts, the engine's ``K``
    drafts are the reference's chain over the tokens known then (the first from the catch-up
    row at ``n - 2``, each next one feeding back the draft and the head's own output); the
    head module's logits over the chain equal the reference's."""
    target_dir, head_dir = target_dirs[target], head_dirs[(target, method)]
    config = EngineConfig.from_kwargs(
        model=str(target_dir), device="cpu", dtype="float32", block_size=4,
        speculative_config={"method": method, "model": str(head_dir),
                            "num_speculative_tokens": K})
    runner = Runner.from_config(config)
    request = NewRequest("r", PROMPT, SamplingParams(temperature=0.0), seed=0,
                         block_ids=list(range(12)))
    table, row, n = runner.table, -1, 0
    # a prefill, then decode steps: the head's own drafts (random: rejected), drafts replaced
    # by the target's greedy tokens (all accepted), by a mix (the first accepted)
    accepted = []
    for step, correct in enumerate([0, 0, K, 1]):
        if correct:
            greedy = hf_greedy(target_dir, table.token_ids[row, :n].tolist(), K)
            table.token_ids[row, n: n + correct] = torch.tensor(greedy[:correct])
        scheduled = (SchedulerOutput({"r": len(PROMPT)}, new_requests=[request]) if step == 0
                     else SchedulerOutput({"r": 1 + K}, num_draft_tokens={"r": K}))
        runner.execute(scheduled).result()
        row = table.row_of("r")
        accepted.append(int(table.num_tokens[row]) - n - 1)
        n = int(table.num_tokens[row])
        drafts = table.token_ids[row, n: n + K].tolist()
        want, tokens, hidden, logits = reference_chain(method, target_dir, head_dir,
                                                       table.token_ids[row, :n].tolist())
        assert drafts == want, f"after {n} tokens"
    assert accepted[2:] == [K, 1]

    # the module itself over the last chain, on fresh caches
    cfg = json.loads((head_dir / "config.json").read_text())
    head = runner.speculator.head  # type: ignore[union-attr]
    kv = cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    caches = poisoned_caches(kv, hd, 1)
    metadata = step_metadata([0], [len(tokens)], [list(range(12))])
    with torch.inference_mode(), set_forward_context(torch_context(caches, metadata)):
        got = head.compute_logits(head(torch.tensor(tokens, dtype=torch.int32),
                                       torch.arange(len(tokens)), hidden.clone()))
    finite = torch.isfinite(logits)
    assert torch.equal(torch.isfinite(got), finite)
    torch.testing.assert_close(got[finite], logits[finite], atol=2e-4, rtol=1e-4)
