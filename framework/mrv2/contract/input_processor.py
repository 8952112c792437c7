"""The input processor contract: how a multimodal family turns a prompt and its images (or
other media) into prompt token ids and :class:`~mrv2.contract.requests.MultiModalItem` s.

The engine builds one per model at start, ``cls(model_dir, hf_config, tokenizer, config)``,
from the path the family registered with its architecture. ``LLM.generate`` (a prompt dict with
``multi_modal_data``), ``LLM.chat`` (image content parts) and the OpenAI server call
:meth:`InputProcessor.process` on the host when a request arrives, before anything is queued:
bad media raise ``ValueError`` naming the field, and nothing of the request runs.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mrv2.config import EngineConfig
from mrv2.contract.requests import MultiModalItem

__all__ = ["InputProcessor", "load_image_processor"]


class InputProcessor:
    """A family's prompt processor for multimodal inputs (see the module doc).

    ``process`` gets the prompt's token ids, which hold one placeholder per media item where
    the family's chat template puts it (Qwen2.5-VL: ``<|vision_start|><|image_pad|>
    <|vision_end|>`` per image), and ``mm_data`` (``{"image": item or [items]}``); it returns
    the token ids with each placeholder expanded to the item's embedding rows and the items,
    ordered by offset, each with a ``content_hash`` that names its content (prefix caching
    and encoder caches key on it).
    """

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: EngineConfig
                 ) -> None:
        self.model_dir = model_dir
        self.hf_config = hf_config
        self.tokenizer = tokenizer
        self.config = config
        #: Images one prompt may carry at most (``--limit-mm-per-prompt``).
        self.limit_per_prompt = config.multimodal.limit_mm_per_prompt

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """``(token ids with expanded placeholders, items)``; ValueError on bad input."""
        raise NotImplementedError


def load_image_processor(model_dir: str | Path, default_type: str) -> Any:
    """The checkpoint's HF image processor (``preprocessor_config.json``), or the PIL backend of
    the same processor (``<Name>Pil``, same config file) where torchvision, which transformers'
    default backend needs, is not installed (the CPU CI has none). ``default_type``: the
    processor class of configs that name none. ValueError or FileNotFoundError naming the
    file where neither loads."""
    path = Path(model_dir)
    config_file = path / "preprocessor_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no preprocessor_config.json in {str(path)!r}: a "
                                "vision-language checkpoint ships its image processor's config")
    import transformers

    if importlib.util.find_spec("torchvision") is not None:
        return transformers.AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
    kind = str(json.loads(config_file.read_text()).get("image_processor_type", default_type))
    name = kind.removesuffix("Fast").removesuffix("Pil") + "Pil"
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ValueError(f"image processor {kind!r} needs torchvision, and transformers has no "
                         f"PIL backend {name!r} for it")
    return cls.from_pretrained(str(path), local_files_only=True)
