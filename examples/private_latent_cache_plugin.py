"""A private plugin whose model caches ONE LATENT VECTOR PER TOKEN (MLA, as DeepSeek does), with
its own KV cache spec and its own attention backend, and no edit to the core.

The pieces, all in this file:

* :class:`ToyLatentForCausalLM`: a tiny MLA-like decoder in plain torch. Each attention layer
  (:class:`ToyLatentAttention`, a :class:`~mrv2.contract.kv_cache.KVCacheLayer`) compresses every
  token into ``c = W_dkv x`` (``kv_lora_rank`` dims) plus a rotary key part ``k_pe``
  (``rope_dim`` dims, shared by all heads) and caches ``[c ; k_pe]``: its spec is
  ``LatentKVSpec(latent_dim=kv_lora_rank + rope_dim)``. Per head, keys and values are expanded
  from the latent (``k_nope_h = W_uk[h] c``, ``v_h = W_uv[h] c``); the layer never materialises
  them but absorbs ``W_uk`` into the query and ``W_uv`` into the output, as MLA decode kernels do.
* :class:`ToyLatentBackend`: the backend of the ``"latent"`` cache kind, plain torch, no host
  syncs: ``write`` stores latents by ``slot_mapping``, ``attend`` gathers them by
  ``block_table`` and runs causal multi-query attention where every head's key is the whole
  latent and its value the ``c`` part.
* :class:`ToyLatentPlugin`: registers both through the ordinary hooks.
* :func:`write_checkpoint` (a tiny random checkpoint), :func:`reference_logits` (the same math
  over a whole sequence at once, no cache, keys and values expanded per head, float64) and
  :func:`main`, which generates greedily with ``LLM`` and checks the tokens against the
  reference.

Run ``python examples/private_latent_cache_plugin.py`` (CPU, a few seconds).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from mrv2 import LLM, SamplingParams, hookimpl
from mrv2.contract.attention import AttentionBackend, AttentionMetadata
from mrv2.contract.forward_context import get_forward_context
from mrv2.contract.kv_cache import KVCacheLayer, LatentKVSpec
from mrv2.model_loader.loader import load_stacked_weights
from mrv2.plugins import PluginManager

ARCHITECTURE = "ToyLatentForCausalLM"
BACKEND_NAME = "toy-latent"

#: config.json of the toy checkpoint: a model_type transformers does not know, so the engine
#: reads it as a plain ``PretrainedConfig``. DeepSeek's field names where they exist.
TOY_CONFIG: dict[str, Any] = {
    "architectures": [ARCHITECTURE],
    "model_type": "toy_latent",
    "vocab_size": 96,
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


# -- the attention backend ---------------------------------------------------------------------


class ToyLatentBackend(AttentionBackend):
    """Plain-torch backend of the ``"latent"`` cache kind (``[num_blocks, block_size, D]``).

    Every shape comes from the tensors or from the metadata's CPU bounds (``num_reqs``,
    ``max_query_len``, ``max_seq_len``); nothing reads device values back, so it runs unchanged
    on CUDA and inside CUDA graphs.
    """

    name = BACKEND_NAME

    def write(self, latent: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Store ``latent`` ``[T, D]`` at its flat slots; rows with a negative slot (padding)
        are not stored.

        Every row is written somewhere (a data-dependent row count would need a host sync): a
        padding row takes the slot and value of the first real row, so its write is a harmless
        duplicate; when no row is real, each writes slot 0's own value back.
        """
        num_tokens = latent.shape[0]
        if num_tokens == 0:
            return
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        slots = slot_mapping[:num_tokens]
        valid = slots >= 0
        first_valid = torch.argmax(valid.to(torch.int32))
        rows = torch.arange(num_tokens, device=slots.device)
        src = torch.where(valid, rows, first_valid)
        target = slots[src].clamp(min=0)
        keep_old = ~valid[src][:, None]
        new_rows = latent[src].to(kv_cache.dtype)
        flat.index_copy_(0, target, torch.where(keep_old, flat[target], new_rows))

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, value_dim: int) -> torch.Tensor:
        """Causal attention of ``query`` ``[T, H, D]`` over the latent cache.

        Multi-query: every head's key is the whole cached latent (``D`` dims), its value the
        first ``value_dim`` dims of it (the compressed ``c``). Returns ``[T, H, value_dim]`` in
        the query's dtype; padding rows (past ``query_start_loc[num_reqs]``) are zeros.
        """
        num_tokens, num_heads, _ = query.shape
        block_size = kv_cache.shape[1]
        device = query.device
        num_reqs, max_q, max_len = metadata.num_reqs, metadata.max_query_len, metadata.max_seq_len
        out_shape = (num_tokens, num_heads, value_dim)
        if num_tokens == 0 or num_reqs == 0 or max_q == 0 or max_len == 0:
            return query.new_zeros(out_shape)
        starts = metadata.query_start_loc[: num_reqs + 1].long()
        seq_lens = metadata.seq_lens[:num_reqs].long()
        query_lens = starts[1:] - starts[:-1]

        # Queries padded per request [B, Q, H, D], and their absolute positions [B, Q].
        offsets = torch.arange(max_q, device=device)
        q_rows = (starts[:-1, None] + offsets).clamp(max=num_tokens - 1)
        q = query.float()[q_rows]
        q_pos = (seq_lens - query_lens)[:, None] + offsets

        # Each request's latents up to max_len through its block table: [B, L, D].
        blocks_needed = -(-max_len // block_size)
        block_ids = metadata.block_table[:num_reqs, :blocks_needed].long()
        latents = kv_cache[block_ids].flatten(1, 2)[:, :max_len].float()
        k_pos = torch.arange(max_len, device=device)
        in_seq = k_pos[None, :] < seq_lens[:, None]  # [B, L]
        latents = torch.where(in_seq[:, :, None], latents, 0.0)  # slots past the sequence
        values = latents[..., :value_dim]

        scores = torch.einsum("bqhd,bld->bhql", q, latents) * scale
        causal = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, L]
        scores = scores.masked_fill(~causal[:, None], torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhql,blr->bqhr", probs, values)  # [B, Q, H, value_dim]

        # Back to token rows; tokens past the last request's queries are padding.
        tokens = torch.arange(num_tokens, device=device)
        req = torch.searchsorted(starts[1:], tokens, right=True).clamp(max=num_reqs - 1)
        pos_in_req = (tokens - starts[req]).clamp(0, max_q - 1)
        is_real = tokens < starts[-1]
        result = torch.where(is_real[:, None, None], out[req, pos_in_req], 0.0)
        return result.to(query.dtype)


# -- the model ---------------------------------------------------------------------------------


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style RoPE of ``x`` ``[T, ..., d]`` at ``positions`` ``[T]`` (halves rotate
    together)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** -(torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * inv_freq  # [T, half]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class ToyRMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class ToyLatentAttention(KVCacheLayer):
    """MLA-like attention that caches ``[c ; k_pe]``, one latent vector per token.

    ``kv_b_proj`` holds ``W_uk`` and ``W_uv`` of every head (``[H * (nope + v), kv_lora_rank]``).
    Rather than expanding keys and values per head over the whole context, the layer folds
    ``W_uk[h]`` into the query (``q_nope . W_uk[h] c = (W_uk[h]^T q_nope) . c``) and applies
    ``W_uv[h]`` to the attention output over ``c``: the backend only ever reads latents.
    """

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        hidden = int(config.hidden_size)
        self.num_heads = int(config.num_attention_heads)
        self.kv_lora_rank = int(config.kv_lora_rank)
        self.nope_dim = int(config.qk_nope_head_dim)
        self.rope_dim = int(config.qk_rope_head_dim)
        self.v_dim = int(config.v_head_dim)
        self.rope_theta = float(config.rope_theta)
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5
        heads = self.num_heads
        self.q_proj = nn.Linear(hidden, heads * (self.nope_dim + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim),
                                   bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=False)

    def kv_cache_spec(self) -> LatentKVSpec:
        """One ``kv_lora_rank + rope_dim`` vector per token."""
        return LatentKVSpec(latent_dim=self.kv_lora_rank + self.rope_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_pe = apply_rope(q_pe, positions, self.rope_theta)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_pe = apply_rope(k_pe, positions, self.rope_theta)
        latent = torch.cat([c, k_pe], dim=-1)  # [T, kv_lora_rank + rope_dim]

        w_kv_b = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim,
                                            self.kv_lora_rank)
        w_uk, w_uv = w_kv_b.split([self.nope_dim, self.v_dim], dim=1)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # W_uk folded into the query
        query = torch.cat([q_latent, q_pe], dim=-1)  # [T, H, kv_lora_rank + rope_dim]

        ctx = get_forward_context()
        kv_cache = ctx.kv_cache(self.layer_idx)
        backend: ToyLatentBackend = ctx.backend(self.layer_idx)
        backend.write(latent, kv_cache, ctx.metadata.slot_mapping)
        out_latent = backend.attend(query, kv_cache, ctx.metadata, self.scale,
                                    value_dim=self.kv_lora_rank)  # [T, H, kv_lora_rank]
        out = torch.einsum("thr,hvr->thv", out_latent, w_uv)  # W_uv applied after attention
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))


class ToyMLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ToyDecoderLayer(nn.Module):
    """Pre-norm attention and pre-norm MLP, each with a residual."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)
        self.input_layernorm = ToyRMSNorm(hidden, eps)
        self.self_attn = ToyLatentAttention(config, layer_idx)
        self.post_attention_layernorm = ToyRMSNorm(hidden, eps)
        self.mlp = ToyMLP(hidden, int(config.intermediate_size))

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class ToyLatentModel(nn.Module):
    """Embedding, decoder layers, final norm."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        self.embed_tokens = nn.Embedding(int(config.vocab_size), hidden)
        self.layers = nn.ModuleList(
            ToyDecoderLayer(config, i) for i in range(int(config.num_hidden_layers))
        )
        self.norm = ToyRMSNorm(hidden, float(config.rms_norm_eps))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, positions)
        return self.norm(hidden)


class ToyLatentForCausalLM(nn.Module):
    """The registered model class: ``cls(hf_config)``; parameter names equal the checkpoint's."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.model = ToyLatentModel(config)
        self.lm_head = nn.Linear(int(config.hidden_size), int(config.vocab_size), bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids and positions -> ``[T, hidden]``."""
        hidden: torch.Tensor = self.model(input_ids, positions)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]``."""
        logits: torch.Tensor = self.lm_head(hidden_states)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint names are the parameter names: nothing fused, nothing renamed."""
        return load_stacked_weights(self, weights)


# -- the plugin --------------------------------------------------------------------------------


class ToyLatentPlugin:
    """Registers the toy architecture and the backend of its ``"latent"`` cache kind.

    Paths are computed from ``__name__`` at run time, so they resolve whether this file runs as
    ``__main__`` or is imported under another name (it must be in ``sys.modules`` then).
    """

    @hookimpl
    def mrv2_register_models(self, register: Callable[..., None]) -> None:
        register(ARCHITECTURE, f"{__name__}:ToyLatentForCausalLM")

    @hookimpl
    def mrv2_register_attention_backends(self, register: Callable[..., None]) -> None:
        register(BACKEND_NAME, f"{__name__}:ToyLatentBackend", devices=("cpu", "cuda"),
                 cache_kinds=("latent",))


# -- checkpoint and the direct reference -------------------------------------------------------


def checkpoint_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name and shape of every tensor of the checkpoint."""
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    inter, heads = int(config["intermediate_size"]), int(config["num_attention_heads"])
    rank, rope = int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"])
    nope, v_dim = int(config["qk_nope_head_dim"]), int(config["v_head_dim"])
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * (nope + rope), hidden),
            p + "self_attn.kv_a_proj_with_mqa.weight": (rank + rope, hidden),
            p + "self_attn.kv_b_proj.weight": (heads * (nope + v_dim), rank),
            p + "self_attn.o_proj.weight": (hidden, heads * v_dim),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return shapes


def write_checkpoint(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random checkpoint (``config.json`` + ``model.safetensors``) in ``path``.

    Projections are drawn with std ``1/sqrt(fan_in)`` so activations and attention scores stay
    of order one (attention is far from uniform, so a wrong cache changes the tokens); norm
    weights are drawn away from 1 so they matter.
    """
    config = {**TOY_CONFIG, **overrides}
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in checkpoint_shapes(config).items():
        if len(shape) == 1:
            tensors[name] = torch.rand(shape, generator=generator) + 0.5
        elif name == "model.embed_tokens.weight":
            tensors[name] = torch.randn(shape, generator=generator)
        else:
            tensors[name] = torch.randn(shape, generator=generator) / math.sqrt(shape[1])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(weights, config)`` of a checkpoint written by :func:`write_checkpoint`."""
    path = Path(path)
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    return load_file(str(path / "model.safetensors")), config


def _reference_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE of ``x`` ``[S, ..., d]`` at positions ``0..S-1``, as a complex rotation of the
    pairs ``(x[i], x[i + d/2])``."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * freqs
    rotation = torch.polar(torch.ones_like(angles), angles)
    rotation = rotation.view((x.shape[0],) + (1,) * (x.dim() - 2) + (half,))
    z = torch.complex(x[..., :half], x[..., half:]) * rotation
    return torch.cat([z.real, z.imag], dim=-1)


def reference_logits(
    weights: Mapping[str, torch.Tensor], config: Mapping[str, Any], token_ids: Sequence[int]
) -> torch.Tensor:
    """Logits ``[S, vocab]`` of every position of ``token_ids``, computed directly in float64:
    the whole sequence at once, no cache, keys and values expanded per head from the latent."""
    w = {name: t.double() for name, t in weights.items()}
    heads, rank = int(config["num_attention_heads"]), int(config["kv_lora_rank"])
    nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    v_dim, eps = int(config["v_head_dim"]), float(config["rms_norm_eps"])
    theta = float(config["rope_theta"])
    scale = 1.0 / math.sqrt(nope + rope)
    seq = len(token_ids)

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    h = w["model.embed_tokens.weight"][torch.tensor(list(token_ids))]
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(seq, heads, nope + rope)
        q_nope, q_pe = q[..., :nope], _reference_rope(q[..., nope:], theta)
        kv_a = x @ w[p + "self_attn.kv_a_proj_with_mqa.weight"].T
        c, k_pe = kv_a[:, :rank], _reference_rope(kv_a[:, rank:], theta)  # k_pe: all heads'
        kv_b = w[p + "self_attn.kv_b_proj.weight"].view(heads, nope + v_dim, rank)
        k_nope = torch.einsum("hnr,sr->shn", kv_b[:, :nope], c)  # k_nope_h = W_uk[h] c
        value = torch.einsum("hvr,sr->shv", kv_b[:, nope:], c)  # v_h = W_uv[h] c
        scores = (torch.einsum("qhn,khn->hqk", q_nope, k_nope)
                  + torch.einsum("qhd,kd->hqk", q_pe, k_pe)) * scale
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        attn = torch.einsum("hqk,khv->qhv", probs, value).reshape(seq, heads * v_dim)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


def reference_greedy(
    weights: Mapping[str, torch.Tensor], config: Mapping[str, Any], prompt: Sequence[int],
    max_new_tokens: int,
) -> list[int]:
    """Greedy continuation by :func:`reference_logits` (a full forward per token, no EOS)."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(int(reference_logits(weights, config, ids)[-1].argmax()))
    return ids[len(prompt):]


# -- the demo ----------------------------------------------------------------------------------

PROMPTS = [[5, 17, 42, 9, 60, 3, 77], [8, 8, 50], [2 + (7 * i) % 90 for i in range(19)]]


def main() -> int:
    """Generate greedily through the engine and compare with the direct reference."""
    manager = PluginManager()
    manager.register(ToyLatentPlugin(), name="toy-latent-example")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(Path(tmp) / "toy-latent")
        weights, config = load_checkpoint(model_dir)
        # attention_backend: the core serves "latent" caches too (multi-head latent attention's
        # "mla"); a model's own plugin's backend comes first, named here to say so.
        llm = LLM(str(model_dir), plugins=manager, device="cpu", dtype="float32", block_size=4,
                  max_model_len=64, num_gpu_blocks_override=64, attention_backend=BACKEND_NAME)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    kv = llm.engine.runner.kv
    for group in kv.groups:
        print(f"KV cache group: layers {group.layer_indices}, {group.spec}, backend "
              f"{group.backend!r}, tensor per layer {tuple(kv.tensors[0].shape)}")
    all_match = True
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        tokens = output.outputs[0].token_ids
        expected = reference_greedy(weights, config, prompt, len(tokens))
        all_match &= tokens == expected
        print(f"prompt {prompt}\n  engine    {tokens}\n  reference {expected}  "
              f"{'match' if tokens == expected else 'MISMATCH'}")
    print("all match the direct reference" if all_match else "MISMATCH with the reference")
    return 0 if all_match else 1


if __name__ == "__main__":
    sys.exit(main())
