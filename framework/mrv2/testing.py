"""Helpers for tests of mrv2 and of its plugins: tiny random-weight HF checkpoints.

A checkpoint is built by HF ``transformers`` itself (random weights, ``save_pretrained`` as
safetensors), so HF is an independent oracle for logits and greedy tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
}


def make_tiny_checkpoint(
    path: str | Path, architecture: str, seed: int = 0, **overrides: Any
) -> Path:
    """Save a tiny random ``architecture`` (``"Qwen3ForCausalLM"``, ``"LlamaForCausalLM"``).

    ``overrides`` change config fields (``tie_word_embeddings=False``, ``head_dim=32``...).
    Returns the checkpoint directory.
    """
    import transformers

    config_cls: Any = {
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "LlamaForCausalLM": transformers.LlamaConfig,
    }[architecture]
    model_cls: Any = getattr(transformers, architecture)
    config = config_cls(**{**TINY, "eos_token_id": 1, "bos_token_id": 0, **overrides})
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # norms: away from 1 so their weights matter
                param.uniform_(0.5, 1.5)
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


def make_tiny_tokenizer(path: str | Path, vocab_size: int = 320) -> Path:
    """Save a byte-level BPE tokenizer (at most ``vocab_size`` ids) with a chat template."""
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
    hf.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    path = Path(path)
    hf.save_pretrained(str(path))
    return path
