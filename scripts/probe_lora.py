"""What serving LoRA adapters costs a decode step (the GPU's numbers; runs on the CPU too).

Builds a bundled config with random weights (``--load-format dummy``) and random PEFT adapters
of ``--rank`` on every attention and MLP projection, then times greedy decoding of
``--tokens`` tokens at each batch size: the engine without ``enable_lora``, with it but no
adapter in the batch, every request on one adapter, and the requests spread over
``--adapters`` adapters. Prints ms per output token (the whole batch's decode steps over its
tokens per request) and the ratio to the plain engine.

    python scripts/probe_lora.py --model Qwen3-0.6B --batch 1 8 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from mrv2 import LLM, LoRARequest, SamplingParams
from mrv2.bench.measure import CONFIGS


def write_adapter(config: dict, path: Path, rank: int, seed: int) -> Path:
    """A PEFT adapter of ``rank`` on every projection of ``config``'s layers."""
    gen = torch.Generator().manual_seed(seed)
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config[
        "num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    inter = config["intermediate_size"]
    shapes = {"self_attn.q_proj": (heads * d, h), "self_attn.k_proj": (kv * d, h),
              "self_attn.v_proj": (kv * d, h), "self_attn.o_proj": (h, heads * d),
              "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (out_size, in_size) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, in_size, generator=gen) / in_size ** 0.5).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(out_size, rank, generator=gen) * 0.01).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
         "target_modules": [m.split(".")[1] for m in shapes]}))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Qwen3-0.6B",
                        help="a bundled config's name, or a checkpoint directory")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    args = parser.parse_args()
    model = args.model if Path(args.model).is_dir() else str(CONFIGS / args.model)
    config = json.loads((Path(model) / "config.json").read_text())
    root = Path(tempfile.mkdtemp())
    loras = [LoRARequest(f"a{i}", i + 1, str(write_adapter(config, root / f"a{i}", args.rank, i)))
             for i in range(args.adapters)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    common = dict(load_format="dummy", max_model_len=min(1024, int(config.get(
        "max_position_embeddings", 1024))), max_num_seqs=max(args.batch))
    rows = []
    for label, kwargs, pick in [
        ("plain", {}, lambda i: None),
        ("lora on, no adapter", {"enable_lora": True}, lambda i: None),
        ("one adapter", {"enable_lora": True}, lambda i: loras[0]),
        (f"{args.adapters} adapters", {"enable_lora": True}, lambda i: loras[i % len(loras)]),
    ]:
        llm = LLM(model, **common, **kwargs, **({"max_loras": args.adapters,
                                                 "max_lora_rank": max(16, args.rank)}
                                                if kwargs else {}))
        for batch in args.batch:
            prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(32)]}
                       for i in range(batch)]
            lora = [pick(i) for i in range(batch)]
            llm.generate(prompts, params, use_tqdm=False, lora_request=lora)  # warm
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
            rows.append((label, batch, (time.perf_counter() - start) / args.tokens * 1e3))
        llm.shutdown()
    plain = {b: ms for label, b, ms in rows if label == "plain"}
    print(f"{'engine':<22} {'batch':>5} {'ms/token':>9} {'vs plain':>8}")
    for label, batch, ms in rows:
        print(f"{label:<22} {batch:>5} {ms:>9.3f} {ms / plain[batch]:>8.2f}")


if __name__ == "__main__":
    main()
