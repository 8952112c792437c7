"""Qwen3-Next's MTP head (``mtp.*``): ``build_mtp()`` shares the main model's embedding and LM
head; it loads every ``mtp.*`` tensor of a whole checkpoint (and nothing else, an unknown
``mtp.*`` name being an error); its forward through its own paged cache layer (a catch-up over
prompts, a decode step, a chained draft step) matches a plain-torch reference written from the
published description (HF's ``Qwen3NextDecoderLayer`` as the decoder block, the rest by
hand: the zero-centered norms, ``fc``, the final norm and head). The engine drafting with it
(an MTP head made to draft the last token repeated) keeps and rejects drafts, its greedy tokens
HF's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextDecoderLayer,
    Qwen3NextRotaryEmbedding,
)

from mrv2 import LLM, SamplingParams
from mrv2.attention import set_forward_context
from mrv2.contract.kv_cache import PagedKVSpec
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.model_loader.build import process_weights_after_loading
from mrv2.model_loader.loader import init_dummy_weights
from mrv2.testing import (
    hf_greedy,
    poisoned_caches,
    step_metadata,
    torch_context,
)
from mrv2_qwen.qwen3_next import Qwen3NextForCausalLM
from mrv2_qwen.qwen3_next_mtp import Qwen3NextMTP
from mrv2_qwen.testing import (
    TINY_QWEN3_NEXT,
    block_config,
    checkpoint_with_mtp,
    identity_mtp,
    save_tiny_qwen3_next,
)

VOCAB = TINY_QWEN3_NEXT["vocab_size"]
HIDDEN = TINY_QWEN3_NEXT["hidden_size"]


def load_both(path: Path) -> tuple[Qwen3NextForCausalLM, Qwen3NextMTP]:
    model = Qwen3NextForCausalLM(transformers.AutoConfig.from_pretrained(path))
    loaded = load_model_weights(model, iter_safetensors(path))
    assert not any(name.startswith(("mtp", "fc", "pre_fc")) for name in loaded)
    mtp = model.build_mtp()
    load_model_weights(mtp, iter_safetensors(path))
    process_weights_after_loading(model)  # as build_model does; then the drafter's
    process_weights_after_loading(mtp)
    return model, mtp


class Reference:
    """The MTP head in plain torch (one sequence, every position at once): zero-centered
    RMSNorms, ``fc`` over ``[norm_e(embed(ids)), norm_h(hidden)]``, HF's full-attention decoder
    layer with a causal mask, then ``lm_head(norm(out))``."""

    def __init__(self, config: Any, tensors: dict[str, torch.Tensor]) -> None:
        cfg = block_config(config)
        self.block = Qwen3NextDecoderLayer(cfg, 0).eval()
        state = {k[len("mtp.layers.0."):]: v for k, v in tensors.items()
                 if k.startswith("mtp.layers.0.") and ".experts." not in k}
        experts = range(config.num_experts)
        state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([
            tensors[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"],
            tensors[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"]]) for e in experts])
        state["mlp.experts.down_proj"] = torch.stack(
            [tensors[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] for e in experts])
        self.block.load_state_dict(state)
        self.rope = Qwen3NextRotaryEmbedding(cfg)
        self.t = tensors
        self.eps = config.rms_norm_eps

    def norm(self, x: torch.Tensor, which: str) -> torch.Tensor:
        w = self.t[f"mtp.{which}.weight"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + w)

    def hidden(self, ids: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """``[T]`` tokens, ``[T, H]`` previous hidden states, positions ``0 .. T - 1`` -> the
        layer output (un-normed) ``[T, H]``."""
        e = self.norm(self.t["model.embed_tokens.weight"][ids], "pre_fc_norm_embedding")
        h = self.norm(previous, "pre_fc_norm_hidden")
        x = torch.cat([e, h], -1) @ self.t["mtp.fc.weight"].T
        n = len(ids)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            cos_sin = self.rope(x[None], torch.arange(n)[None])
            return self.block(x[None], position_embeddings=cos_sin, attention_mask=mask)[0]

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out, "norm") @ self.t["lm_head.weight"].T


def test_mtp_matches_reference(tmp_path: Path) -> None:
    tensors = checkpoint_with_mtp(tmp_path)
    model, mtp = load_both(tmp_path)
    config = model.config
    assert mtp.kv_cache_specs() == {1: PagedKVSpec(config.num_key_value_heads, 16)}
    ref = Reference(config, tensors)

    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (6, 9)]
    sampled = torch.randint(0, VOCAB, (2, 3), generator=gen).tolist()  # 3 tokens a request
    # The target's final (normed) hidden states of each prompt and its first sampled token.
    target = [torch.randn(len(p) + 1, HIDDEN, generator=gen) for p in prompts]
    perm = torch.randperm(32, generator=gen).tolist()
    tables = [perm[:4], perm[4:8]]
    caches = poisoned_caches(config.num_key_value_heads, 16, 2)  # the target's, the MTP's

    def mtp_step(contexts: list[int], tokens: list[list[int]], previous: torch.Tensor,
                 step: int = 0, num_pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        ids = sum(tokens, []) + [0] * num_pad
        positions = sum((list(range(c, c + len(t))) for c, t in zip(contexts, tokens,
                                                                     strict=True)), [])
        metadata = step_metadata(contexts, [len(t) for t in tokens], tables, num_pad)
        with torch.inference_mode(), set_forward_context(torch_context(caches, metadata)):
            out = mtp(torch.tensor(ids, dtype=torch.int32),
                      torch.tensor(positions + [0] * num_pad), previous, step=step)
            return out, mtp.compute_logits(out, step=step)

    # Catch-up over the prompts: each position's hidden state beside the next token (the
    # last: the token just sampled), at the hidden state's position; two padding rows.
    lens = [len(p) for p in prompts]
    shifted = [p[1:] + [s[0]] for p, s in zip(prompts, sampled, strict=True)]
    pad = torch.randn(2, HIDDEN, generator=gen)
    hidden = torch.cat([t[:n] for t, n in zip(target, lens, strict=True)] + [pad])
    _, prefill_logits = mtp_step([0, 0], shifted, hidden, num_pad=2)
    # Decode: the target's hidden state at the sampled token beside the next sampled token.
    out, decode_logits = mtp_step(lens, [[s[1]] for s in sampled],
                                  torch.stack([t[n] for t, n in zip(target, lens, strict=True)]))
    # A chained draft: step 1 (the same layer), fed step 0's output and a draft token.
    _, draft_logits = mtp_step([n + 1 for n in lens], [[s[2]] for s in sampled], out, step=1)

    rows = 0
    for i, (prompt, toks) in enumerate(zip(prompts, sampled, strict=True)):
        n = len(prompt)
        nexts = torch.tensor(prompt[1:] + toks[:2])
        out_ref = ref.hidden(nexts, target[i])
        # vLLM's and SGLang's draft chain: the previous step's *normed* output.
        chained = ref.hidden(torch.cat([nexts, torch.tensor(toks[2:])]),
                             torch.cat([target[i], ref.norm(out_ref[-1:], "norm")]))
        torch.testing.assert_close(out[i], out_ref[n], atol=1e-4, rtol=1e-4)  # (un-normed)
        expected = ref.logits(chained)
        torch.testing.assert_close(prefill_logits[rows:rows + n], expected[:n],
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(decode_logits[i], expected[n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(draft_logits[i], expected[n + 1], atol=1e-4, rtol=1e-4)
        rows += n
    assert caches[0].eq(1e4).all()  # the target's cache layer untouched
    assert caches[1][0, tables[0][0], 0].abs().max() < 1e3  # the MTP layer wrote its own


def test_build_mtp_shares_embedding_and_head(tmp_path: Path) -> None:
    checkpoint_with_mtp(tmp_path)
    model, mtp = load_both(tmp_path)
    assert mtp.embed_tokens is model.model.embed_tokens and mtp.lm_head is model.lm_head
    assert mtp.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert mtp.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    names = {name for name, _ in mtp.named_parameters()}
    assert not any("embed_tokens" in n or "lm_head" in n for n in names), names
    assert {n.split(".")[0] for n in names} == {"fc", "pre_fc_norm_embedding",
                                                "pre_fc_norm_hidden", "layers", "norm"}
    assert {"layers.0.mlp.experts.w13_weight", "layers.0.mlp.experts.w2_weight",
            "layers.0.mlp.shared_experts.gate_up_proj.weight",
            "layers.0.mlp.shared_expert_gate.weight",
            "layers.0.self_attn.qkv_proj.weight"} <= names

    bf16 = Qwen3NextForCausalLM(model.config).to(torch.bfloat16).build_mtp()
    assert bf16.fc.weight.dtype == torch.bfloat16 and torch.get_default_dtype() == torch.float32


def test_loading(tmp_path: Path) -> None:
    """Every ``mtp.*`` tensor lands (norms as ``1 + w``), nothing else does; an unknown
    ``mtp.*`` name, a layer past ``num_nextn_predict_layers`` or a missing tensor is an
    error."""
    tensors = checkpoint_with_mtp(tmp_path)
    model = Qwen3NextForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path))
    mtp = model.build_mtp()
    loaded = mtp.load_weights(tensors.items())
    assert loaded == {n for n, _ in mtp.named_parameters()}
    torch.testing.assert_close(mtp.norm.weight, tensors["mtp.norm.weight"] + 1.0)
    layer: Any = mtp.layers[0]
    torch.testing.assert_close(layer.self_attn.q_norm.weight,
                               tensors["mtp.layers.0.self_attn.q_norm.weight"] + 1.0)
    torch.testing.assert_close(mtp.fc.weight, tensors["mtp.fc.weight"])
    assert mtp.load_weights([("model.norm.weight", torch.randn(HIDDEN)),
                             ("lm_head.weight", torch.randn(VOCAB, HIDDEN)),
                             ("mtp.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(2))]) \
        == set()
    assert mtp.rename("model.mtp.layers.0.mlp.shared_expert.up_proj.weight") == (
        "layers.0.mlp.shared_experts.up_proj.weight")
    for bad in ("mtp.layers.0.mlp.bogus.weight", "mtp.layers.1.input_layernorm.weight",
                "mtp.enorm.weight"):
        with pytest.raises(ValueError, match=f"checkpoint tensor '{bad}' matches no parameter"):
            mtp.load_weights([(bad, torch.randn(HIDDEN))])
    del tensors["mtp.pre_fc_norm_hidden.weight"]
    with pytest.raises(ValueError, match=r"not found in the checkpoint: pre_fc_norm_hidden"):
        load_model_weights(model.build_mtp(), tensors.items())


def test_cache_numbering_layers_and_dummy_weights(tmp_path: Path) -> None:
    save_tiny_qwen3_next(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert getattr(config, "num_nextn_predict_layers", None) is None  # (as published: one)
    spec = PagedKVSpec(config.num_key_value_heads, 16)
    model = Qwen3NextForCausalLM(config)
    assert model.build_mtp(first_layer_idx=5).kv_cache_specs() == {5: spec}
    config.num_nextn_predict_layers = 2
    main = Qwen3NextForCausalLM(config)
    two = main.build_mtp()
    assert two.kv_cache_specs() == {1: spec, 2: spec}  # (after the one full-attention layer)
    config.num_nextn_predict_layers = 0
    with pytest.raises(ValueError, match="num_nextn_predict_layers must be >= 1, got 0"):
        Qwen3NextForCausalLM(config).build_mtp()

    # load_format="dummy" (the MTP speculator's load_or_draw_weights): norms 1 (w = 0).
    init_dummy_weights(main)  # (the shared embedding and LM head are the main model's: left
    init_dummy_weights(two)  # as torch.empty, they made row 0's logits NaN at times)
    process_weights_after_loading(two)
    assert all(bool((m.weight == 1).all()) for name, m in two.named_modules()
               if name.endswith("norm") or name.startswith("pre_fc_norm"))
    caches = poisoned_caches(config.num_key_value_heads, 16, 3)
    metadata = step_metadata([0], [3], [[0, 1]])
    with torch.inference_mode(), set_forward_context(torch_context(caches, metadata)):
        out = two(torch.tensor([5, 6, 7]), torch.arange(3), torch.randn(3, HIDDEN), step=1)
        logits = two.compute_logits(out, step=1)
    assert logits.shape == (3, VOCAB) and bool(logits.isfinite().all())
    assert bool(caches[1].eq(1e4).all()) and not bool(caches[2].eq(1e4).all())  # (layer 1)


def test_engine_mtp_speculation_keeps_and_rejects_drafts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine with MTP drafts (``k = 3``) on the tiny Qwen3-Next (Gated DeltaNet state: ``1 +
    k`` rows a request) whose MTP head drafts the last token repeated
    (:func:`mrv2_qwen.testing.identity_mtp`), so a draft is kept exactly when the target's
    greedy output repeats that token. The prompts were picked from HF's greedy outputs: runs (78
    four times: a step keeps all three drafts; 3 three times; 78 and 127 twice) and changes (the
    third: none, its prompt sharing the first's first block, a prefix-cache hit). Greedy tokens
    equal HF ``generate`` for the three at once, prompts split across steps (8-token budget),
    block size 4, prefix caching on; each verify step keeps the drafts the greedy output
    predicts (recorded at ``Scheduler.correct``), their sum being the engine's count, strictly
    between 0 and the drafts verified."""
    save_file(identity_mtp(checkpoint_with_mtp(tmp_path)), tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    prompts = [[28, 15, 86, 15, 44, 108], [74, 53, 85, 10, 115, 37, 69, 101, 27, 103, 102, 36],
               [28, 15, 86, 15, 44, 108, 5, 17, 42, 9]]
    max_tokens = 12
    want = [hf_greedy(tmp_path, p, max_tokens) for p in prompts]
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=8, enable_prefix_caching=True,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    scheduler = llm.engine.scheduler
    steps: list[tuple[int, int, int, int]] = []  # (request, its tokens out, drafts, kept)

    def correct(request: Any, num_drafts: int, num_accepted: int) -> None:
        steps.append((prompts.index(request.prompt_token_ids), len(request.output_token_ids),
                       num_drafts, num_accepted))
        type(scheduler).correct(scheduler, request, num_drafts, num_accepted)

    monkeypatch.setattr(scheduler, "correct", correct)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = dict(llm.engine.stats())
    llm.engine.shutdown()

    def expected_kept(i: int, done: int, num_drafts: int) -> int:
        """Request ``i``'s drafts after ``done`` tokens out (its last one repeated) kept: the
        leading ones its greedy output repeats."""
        after = want[i][done:done + num_drafts]
        return next((j for j, tok in enumerate(after) if tok != want[i][done - 1]), len(after))

    # Every verify step follows a sampled token (the scheduler gives drafts only after a step
    # that sampled: Request.sampled_last_step).
    assert all(done > 0 for _, done, _, _ in steps), steps
    assert [s[3] for s in steps] == [expected_kept(*s[:3]) for s in steps], steps
    drafted, kept = stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]
    assert (kept, drafted) == (sum(s[3] for s in steps), sum(s[2] for s in steps))
    assert 0 < kept < drafted, (kept, drafted)  # drafts both kept and rejected
    assert stats["spec_num_accepted_per_pos"][2] > 0  # (a step kept all three)
    assert stats["prefix_cache_hits"] > 0
