"""Audio clips for an input processor: ``multi_modal_data["audio"]`` checked and brought to the
feature extractor's sampling rate, and the checkpoint's HF feature extractor.

**Clips** come as vLLM takes them: ``(samples, sampling_rate)`` (a tuple), a bare ``samples``
array (taken to be at the feature extractor's rate, as vLLM takes it), or a list of those.
``samples`` is a 1-D float numpy array or torch tensor of mono samples (in [-1, 1] for PCM
audio), ``sampling_rate`` a positive integer in Hz (an integral float passes too).

**Resampling** (:func:`resample`): numpy only, polyphase with a Kaiser-windowed sinc low-pass
(scipy's ``resample_poly`` defaults: ``10 * max(up, down)`` taps each side, beta 5, unity DC
gain), so a clip at 44.1 or 48 kHz reaches a 16 kHz extractor without aliasing.
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["audio_clips", "load_feature_extractor", "resample"]

_FIELD = "multi_modal_data.audio"


_HALF = (torch.float16, torch.bfloat16)


def _is_array(value: Any) -> bool:
    return isinstance(value, (np.ndarray, torch.Tensor))


def audio_clips(value: Any) -> list[tuple[np.ndarray, int | None]]:
    """``multi_modal_data["audio"]`` as ``[(float samples [n], rate or None)]`` (None: the
    extractor's rate); ValueError naming the field and the clip for anything else (a clip
    that is not a 1-D float array, empty or not finite; a sampling rate that is not a
    positive integer)."""
    if value is None:
        return []
    if isinstance(value, tuple) and len(value) == 2 and _is_array(value[0]) and not (
            _is_array(value[1]) or isinstance(value[1], (list, tuple))):
        items: list[Any] = [value]  # (one clip with its rate, as vLLM takes it)
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [value]
    return [_clip(item, i) for i, item in enumerate(items)]


def _clip(item: Any, index: int) -> tuple[np.ndarray, int | None]:
    where = f"{_FIELD}[{index}]"
    rate: int | None = None
    if isinstance(item, tuple):
        if len(item) != 2:
            raise ValueError(f"{where}: a clip is (samples, sampling_rate) or samples; got a "
                             f"tuple of {len(item)}")
        item, raw_rate = item
        number = (float(raw_rate) if isinstance(raw_rate, numbers.Real)
                  and not isinstance(raw_rate, bool) else math.nan)
        if not (math.isfinite(number) and number == int(number) and number >= 1):
            raise ValueError(f"{where}: the sampling rate must be a positive integer (Hz), got "
                             f"{raw_rate!r}")
        rate = int(number)
    if not _is_array(item):
        raise ValueError(f"{where}: samples must be a 1-D float numpy array or torch tensor, "
                         f"got {type(item).__name__}")
    if isinstance(item, np.ndarray):
        samples = item
    else:  # (numpy has no bf16: half-precision tensors widen first; integer ones are refused)
        tensor = item.detach().cpu()
        samples = (tensor.float() if tensor.dtype in _HALF else tensor).numpy()
    if not (np.issubdtype(samples.dtype, np.floating) and samples.ndim == 1 and samples.size):
        raise ValueError(f"{where}: samples must be a non-empty 1-D float array (mono), got "
                         f"dtype {samples.dtype} shape {tuple(samples.shape)}")
    if not np.isfinite(samples).all():
        raise ValueError(f"{where}: samples must be finite")
    return samples, rate


def resample(samples: np.ndarray, rate: int, target: int, chunk: int = 1 << 14, *,
             limit: int | None = None) -> np.ndarray:
    """``samples`` at ``rate`` Hz -> at ``target`` Hz (float32): upsample by ``up``, low-pass,
    downsample by ``down`` (``target / rate = up / down`` reduced), computed polyphase; the
    output has ``ceil(n * up / down)`` samples, aligned with the input (module doc), or only
    the first ``limit`` of them (what a feature extractor that cuts there reads: a clip
    declared at 1 Hz would otherwise grow 16000-fold)."""
    gcd = math.gcd(int(rate), int(target))
    up, down = int(target) // gcd, int(rate) // gcd
    x = np.asarray(samples, dtype=np.float64)
    if up == down:
        return x.astype(np.float32)
    most = max(up, down)
    half = 10 * most
    taps = np.arange(-half, half + 1)
    h = np.sinc(taps / most) * np.kaiser(2 * half + 1, 5.0)
    h *= up / h.sum()
    width = -(-len(h) // up)
    bank = np.zeros((up, width))  # bank[r, j] = h[r + j * up]
    for r in range(up):
        phase = h[r::up]
        bank[r, : len(phase)] = phase
    n_out = -(-len(x) * up // down)
    if limit is not None:
        n_out = min(n_out, limit)
    padded = np.concatenate([x, np.zeros(1)])  # (index len(x): a zero for out-of-range taps)
    out = np.empty(n_out)
    for start in range(0, n_out, chunk):
        at = np.arange(start, min(start + chunk, n_out)) * down + half  # upsampled index
        idx = (at // up)[:, None] - np.arange(width)[None, :]
        idx = np.where((idx >= 0) & (idx < len(x)), idx, len(x))
        out[start: start + len(at)] = (bank[at % up] * padded[idx]).sum(axis=1)
    return out.astype(np.float32)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_feature_extractor(model_dir: str | Path, type_name: str) -> Any:
    """The checkpoint's HF audio feature extractor of class ``type_name``: its settings from
    ``processor_config.json``'s ``feature_extractor`` section (transformers 5's layout) or a
    ``preprocessor_config.json`` of that type. FileNotFoundError saying so where neither
    has them; ValueError where they name another extractor type."""
    import transformers

    path = Path(model_dir)
    processor = _read_json(path / "processor_config.json")
    settings = processor.get("feature_extractor", processor.get("audio_processor"))
    if not isinstance(settings, dict):
        flat = _read_json(path / "preprocessor_config.json")
        if flat.get("feature_extractor_type") != type_name:
            raise FileNotFoundError(
                f"no audio feature extractor in {str(path)!r}: a processor_config.json with a "
                f"'feature_extractor' section or a preprocessor_config.json of {type_name}")
        settings = flat
    kind = settings.get("feature_extractor_type", type_name)
    if kind != type_name:
        raise ValueError(f"the checkpoint's feature extractor is {kind!r}; {type_name} expected")
    return getattr(transformers, type_name).from_dict(dict(settings))
