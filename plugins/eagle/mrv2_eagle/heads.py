"""The EAGLE draft heads as published: EAGLE-1/2 (``fc`` over ``[embedding, hidden]`` and
decoder layers, the target's LM head) and EAGLE-3 (``fc`` fusing three target layers, one
``midlayer`` whose attention reads ``[normed embedding, normed hidden]``, its own norm and
reduced-vocabulary LM head).

Both share the target's token embedding (an EAGLE-3 checkpoint's own ``embed_tokens`` is used
when it has one) and cache their attention in paged KV cache layers ``0 .. n - 1`` of their
own (the speculator hands them the cache layers numbered after the target's). Row ``j`` of a
forward takes the hidden state of position ``p`` and the token at ``p + 1``, at position
``p``, and predicts the token at ``p + 2``.

EAGLE-1/2 (SafeAILab/EAGLE ``cnets1.py``; vLLM ``llama_eagle.py``)::

    x = fc(cat([embed(token), hidden], -1))        # [T, 2H] -> [T, H]; fc.bias optional
    x = layers(x)                                  # layer 0 has no input_layernorm (EAGLE-1)
    logits = target.lm_head(x)                     # no norm before the head

``hidden`` is the target's final (normed) hidden state for the catch-up, the head's own output
``x`` afterwards.

EAGLE-3 (SafeAILab/EAGLE ``cnets.py``; vLLM ``llama_eagle3.py``)::

    h = fc(cat([aux_0, aux_1, aux_2], -1))         # catch-up only: [T, 3H_target] -> [T, H]
    residual = h                                   # hidden_norm(h) with norm_before_residual
    a = self_attn(cat([input_layernorm(embed(token)), hidden_norm(h)], -1))   # q/k/v: 2H -> .
    residual = residual + a
    out = residual + mlp(post_attention_layernorm(residual))   # fed back as the next h
    logits = lm_head(norm(out))                    # [T, draft_vocab]; target id = i + d2t[i]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch
from torch import nn

from mrv2.contract.kv_cache import KVCacheSpec, layer_specs
from mrv2.layers import (
    STACKED_PARAMS,
    GatedMLP,
    LinearBase,
    LMHead,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    VocabEmbedding,
    head_dim_of,
    norm_linear,
    norm_mlp,
    rope_parameters_of,
)
from mrv2.model_loader import load_stacked_weights


def head_rope(config: Any, max_position: int) -> RotaryEmbedding:
    """The head's RoPE (its config's theta and scaling) over at least ``max_position``
    positions: a head trained at a shorter context still drafts at the target's lengths."""
    base, scaling = rope_parameters_of(config)
    return RotaryEmbedding(head_dim_of(config), max_position=max_position, base=base,
                           scaling=scaling)


def _attention(config: Any, layer_idx: int, rope: RotaryEmbedding, *, qkv_bias: bool,
               o_bias: bool, qk_norm: bool = False, input_size: int | None = None
               ) -> SelfAttention:
    attn = SelfAttention(config, layer_idx, rope, qkv_bias=qkv_bias, o_bias=o_bias,
                         qk_norm=qk_norm)
    if input_size is not None:  # EAGLE-3: q/k/v read [embedding, hidden], 2H wide
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        attn.qkv_proj = QKVLinear(input_size, attn.head_dim, heads, kv_heads, bias=qkv_bias)
    return attn


def _mlp(config: Any) -> GatedMLP:
    return GatedMLP(config.hidden_size, config.intermediate_size,
                    getattr(config, "hidden_act", "silu"),
                    bias=bool(getattr(config, "mlp_bias", False)))


Fn = Callable[[torch.Tensor], torch.Tensor]


class _Head(nn.Module):
    """What both heads share: the token embedding (the head's own, or the target's
    ``embed_input_ids``), the target's logits (its ``compute_logits``), the cache layers.

    The target's two are kept in a tuple, outside the module tree: not parameters of the head
    (``named_parameters``, ``.to()`` and the strict load check see the head's own weights)."""

    embed_tokens: VocabEmbedding | None

    def __init__(self, embed: Fn, target_logits: Fn) -> None:
        super().__init__()
        self._target = (embed, target_logits)
        self.embed_tokens = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: the head's own ``embed_tokens`` if its checkpoint has one, else
        the target's."""
        if self.embed_tokens is not None:
            return cast(torch.Tensor, self.embed_tokens(input_ids))
        return self._target[0](input_ids)

    def kv_cache_specs(self, first_layer_idx: int) -> dict[int, KVCacheSpec]:
        """The head's cache layers (``0 .. n - 1`` inside the head) as the engine numbers
        them: from ``first_layer_idx`` on. Run the head under a forward context whose cache
        list starts at ``first_layer_idx``."""
        return {first_layer_idx + i: spec for i, spec in sorted(layer_specs(self).items())}


class EagleLayer(nn.Module):
    """One decoder layer of an EAGLE-1/2 head, HF's names; ``input_layernorm`` is None on
    layer 0 of EAGLE-1 checkpoints (the fc output goes to the attention unnormed)."""

    def __init__(self, config: Any, self_attn: SelfAttention, mlp: nn.Module,
                 input_norm: bool) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps) if input_norm else None
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.input_layernorm is None:
            if residual is not None:
                hidden_states = hidden_states + residual
            residual = hidden_states
            qkv = self.self_attn.qkv_proj(hidden_states)
        else:
            qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj,
                                        hidden_states, residual)
        out = self.self_attn.attend(positions, qkv)
        return norm_mlp(self.post_attention_layernorm, self.mlp, out, residual)


class EagleHead(_Head):
    """An EAGLE-1/2 head (``fc``, ``layers.{i}``) drafting with the target's embedding and LM
    head (see the module docstring for the math). A checkpoint's ``embed_tokens`` (EAGLE-1/2
    save a frozen copy of the target's) is skipped unless ``own_embedding``, as vLLM does.

    ``fc_bias``, ``first_input_norm``, ``own_embedding``, ``qkv_bias``, ``o_bias``,
    ``qk_norm``: what the checkpoint holds (:func:`eagle_head_options`).
    """

    def __init__(self, config: Any, embed: Fn, target_logits: Fn, *, max_position: int,
                 fc_bias: bool = False, first_input_norm: bool = False,
                 own_embedding: bool = False, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: bool = False) -> None:
        super().__init__(embed, target_logits)
        hidden = int(config.hidden_size)
        if own_embedding:
            self.embed_tokens = VocabEmbedding(int(config.vocab_size), hidden)
        self.fc = LinearBase(2 * hidden, hidden, bias=fc_bias)
        rope = head_rope(config, max_position)
        self.layers = nn.ModuleList(
            EagleLayer(config, _attention(config, i, rope, qkv_bias=qkv_bias, o_bias=o_bias,
                                          qk_norm=qk_norm),
                       _mlp(config), input_norm=i > 0 or first_input_norm)
            for i in range(int(config.num_hidden_layers))
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T]`` tokens (each the token after its hidden state's position), ``[T]``
        positions (the hidden states'), ``[T, H]`` hidden states -> ``[T, H]`` outputs (what
        the next draft step takes as its hidden states)."""
        x = self.fc(torch.cat([self.embed(input_ids), hidden_states.to(self.fc.weight.dtype)],
                              dim=-1))
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        assert residual is not None
        return x + residual

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` outputs -> ``[N, vocab]``: the target's LM head, no norm before it."""
        return self._target[1](hidden_states)

    def rename(self, name: str) -> str | None:
        """Checkpoint names -> parameters: ``model.`` prefixes dropped; the LM head (the
        target's is used) and RoPE caches skipped."""
        name = name.removeprefix("model.")
        if name.startswith("lm_head.") or "rotary_emb.inv_freq" in name:
            return None
        if name.startswith("embed_tokens.") and self.embed_tokens is None:
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the head's checkpoint tensors; returns the parameter names filled."""
        return load_stacked_weights(self, weights, STACKED_PARAMS, self.rename)


class Eagle3MidLayer(nn.Module):
    """EAGLE-3's one decoder layer (``midlayer.*``): ``input_layernorm`` on the embedding,
    ``hidden_norm`` on the hidden state, attention over both side by side, then the usual
    ``post_attention_layernorm`` and MLP. The residual is the un-normed hidden state (the
    normed one with ``norm_before_residual``)."""

    def __init__(self, config: Any, rope: RotaryEmbedding, *, qkv_bias: bool = False,
                 o_bias: bool = False) -> None:
        super().__init__()
        hidden, eps = int(config.hidden_size), config.rms_norm_eps
        self.self_attn = _attention(config, 0, rope, qkv_bias=qkv_bias, o_bias=o_bias,
                                    input_size=2 * hidden)
        self.mlp = _mlp(config)
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.hidden_norm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor,
                hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` embeddings and hidden states -> ``[T, H]`` (block output plus residual,
        not normed). ``hidden_states`` is consumed (the residual add may write into it)."""
        e = cast(torch.Tensor, self.input_layernorm(embeds))
        h = cast(torch.Tensor, self.hidden_norm(hidden_states))
        residual = h if self.norm_before_residual else hidden_states
        out = self.self_attn.attend(positions, self.self_attn.qkv_proj(torch.cat([e, h], -1)))
        out, residual = norm_mlp(self.post_attention_layernorm, self.mlp, out, residual)
        return out + residual


class Eagle3Head(_Head):
    """An EAGLE-3 head: ``fc`` (``num_aux * target_hidden -> H``), ``midlayer``, ``norm``,
    ``lm_head`` (``draft_vocab`` rows; the target's when the checkpoint has none and the
    vocabularies are equal), ``d2t`` (draft id -> target id offsets), optionally
    ``embed_tokens``. See the module docstring for the math."""

    def __init__(self, config: Any, embed: Fn, target_logits: Fn, *, max_position: int,
                 num_aux: int, target_hidden: int, vocab_size: int,
                 own_embedding: bool = False, own_lm_head: bool = True,
                 qkv_bias: bool = False, o_bias: bool = False) -> None:
        super().__init__(embed, target_logits)
        hidden = int(config.hidden_size)
        self.vocab_size = vocab_size
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or vocab_size)
        if own_embedding:
            self.embed_tokens = VocabEmbedding(vocab_size, hidden)
        self.fc = LinearBase(num_aux * target_hidden, hidden, bias=False)
        self.midlayer = Eagle3MidLayer(config, head_rope(config, max_position),
                                       qkv_bias=qkv_bias, o_bias=o_bias)
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = LMHead(self.draft_vocab_size, hidden) if own_lm_head else None
        #: target id of each draft id (``arange + d2t``: identity until ``d2t`` is loaded)
        self.draft_to_target: torch.Tensor
        self.register_buffer("draft_to_target", torch.arange(self.draft_vocab_size),
                             persistent=False)
        #: whether draft ids differ from target ids (then logits are scattered)
        self.remaps = self.draft_vocab_size != vocab_size

    def combine(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, num_aux * target_hidden]`` target layers -> ``[T, H]`` (the catch-up's hidden
        states)."""
        return cast(torch.Tensor, self.fc(aux_hidden_states.to(self.fc.weight.dtype)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T]`` tokens, positions, ``[T, H]`` hidden states (:meth:`combine`'s, or the
        previous output) -> ``[T, H]`` un-normed outputs."""
        return cast(torch.Tensor, self.midlayer(positions, self.embed(input_ids), hidden_states))

    def draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` outputs -> ``[N, draft_vocab]`` (the head's norm, then its LM head)."""
        normed = cast(torch.Tensor, self.norm(hidden_states))
        if self.lm_head is None:
            return self._target[1](normed)
        return cast(torch.Tensor, self.lm_head(normed))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` outputs -> ``[N, vocab]`` over the target's vocabulary: each draft id's
        logit at its target id, ``-inf`` at the ids outside the draft vocabulary."""
        logits = self.draft_logits(hidden_states)
        if not self.remaps:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.draft_to_target, logits)

    def rename(self, name: str) -> str | None:
        """Checkpoint names -> parameters (``midlayer.*``, or the speculators format's
        ``layers.0.*``; ``model.`` prefixes dropped)."""
        name = name.removeprefix("model.")
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        if "rotary_emb.inv_freq" in name:
            return None
        if name.startswith("embed_tokens.") and self.embed_tokens is None:
            return None
        if name.startswith("lm_head.") and self.lm_head is None:
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the head's checkpoint tensors (``d2t`` into :attr:`draft_to_target`, checked;
        ``t2d`` checked only: drafting needs d2t); returns the parameter names filled."""
        rest = []
        for name, tensor in weights:
            short = name.removeprefix("model.")
            if short == "d2t":
                self._load_d2t(tensor)
            elif short == "t2d":
                check_t2d(tensor, self.vocab_size)
            else:
                rest.append((name, tensor))
        return load_stacked_weights(self, rest, STACKED_PARAMS, self.rename)

    def _load_d2t(self, d2t: torch.Tensor) -> None:
        if d2t.dim() != 1 or d2t.shape[0] != self.draft_vocab_size:
            raise ValueError(
                f"speculative_config.model: the EAGLE-3 head's d2t has shape "
                f"{tuple(d2t.shape)}, expected [{self.draft_vocab_size}] (draft_vocab_size)"
            )
        target = torch.arange(self.draft_vocab_size) + d2t.long().cpu()
        if int(target.min()) < 0 or int(target.max()) >= self.vocab_size:
            raise ValueError(
                f"speculative_config.model: the EAGLE-3 head's d2t maps draft ids to "
                f"{int(target.min())}..{int(target.max())}, outside the target's vocabulary "
                f"(vocab_size {self.vocab_size})"
            )
        if self.draft_vocab_size == self.vocab_size and int(d2t.abs().max()) == 0:
            return  # the target's vocabulary, in its order
        if int(target.unique().numel()) != self.draft_vocab_size:
            raise ValueError("speculative_config.model: the EAGLE-3 head's d2t maps two draft "
                             "ids to the same target id")
        self.draft_to_target.copy_(target)
        self.remaps = True


def check_t2d(t2d: torch.Tensor, vocab_size: int) -> None:
    """An EAGLE-3 ``t2d`` (one flag per target id) must cover the target's vocabulary."""
    if t2d.dim() != 1 or t2d.shape[0] != vocab_size:
        raise ValueError(
            f"speculative_config.model: the EAGLE-3 head's t2d has {t2d.numel()} entries "
            f"(shape {tuple(t2d.shape)}); it must have one per token of the target's "
            f"vocabulary (vocab_size {vocab_size})"
        )


def eagle_head_options(names: Iterable[str]) -> dict[str, bool]:
    """:class:`EagleHead`'s options from the checkpoint's tensor names."""
    found = {n.removeprefix("model.") for n in names}
    return {  # no own_embedding: EAGLE-1/2 heads ship a frozen copy of the target's (shared)
        "fc_bias": "fc.bias" in found,
        "first_input_norm": "layers.0.input_layernorm.weight" in found,
        "qkv_bias": "layers.0.self_attn.q_proj.bias" in found,
        "o_bias": "layers.0.self_attn.o_proj.bias" in found,
        "qk_norm": "layers.0.self_attn.q_norm.weight" in found,
    }


def eagle3_head_options(names: Iterable[str]) -> dict[str, bool]:
    """:class:`Eagle3Head`'s options from the checkpoint's tensor names."""
    found = {n.removeprefix("model.").replace("layers.0.", "midlayer.", 1) for n in names}
    return {
        "own_embedding": "embed_tokens.weight" in found,
        "own_lm_head": "lm_head.weight" in found,
        "qkv_bias": "midlayer.self_attn.q_proj.bias" in found,
        "o_bias": "midlayer.self_attn.o_proj.bias" in found,
    }


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a head checkpoint directory: ``*.safetensors`` (with or without an
    index), else ``pytorch_model*.bin`` (how most EAGLE heads are published; loaded with
    ``weights_only=True``)."""
    from pathlib import Path

    from mrv2.model_loader import iter_safetensors

    root = Path(path)
    bins = sorted(root.glob("pytorch_model*.bin"))
    if bins and not any(root.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        for file in bins:
            loaded: Mapping[str, Any] = torch.load(file, map_location="cpu", weights_only=True)
            tensors.update({k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)})
        return tensors
    return dict(iter_safetensors(root))
