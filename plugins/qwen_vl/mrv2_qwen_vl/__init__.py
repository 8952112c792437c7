"""mrv2-plugin-qwen-vl: Qwen2.5-VL / Qwen3-VL for mrv2 (in progress: M-RoPE, the vision encoder)."""
