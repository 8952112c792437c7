"""The input processor contract: how a multimodal family turns a prompt and its images (or
other media) into prompt token ids and :class:`~mrv2.contract.requests.MultiModalItem` s.

The engine builds one per model at start, ``cls(model_dir, hf_config, tokenizer, config)``,
from the path the family registered with its architecture. ``LLM.generate`` (a prompt dict with
``multi_modal_data``), ``LLM.chat`` (image content parts) and the OpenAI server call
:meth:`InputProcessor.process` on the host when a request arrives, before anything is queued:
bad media raise ``ValueError`` naming the field, and nothing of the request runs.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import platform
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from mrv2.config import EngineConfig
from mrv2.contract.requests import MultiModalItem

__all__ = ["InputProcessor", "content_hash", "load_image_processor", "preprocessor_config",
           "processor_settings", "resize_uint8", "rgb_pixels", "run_image_processor",
           "splice_placeholders"]


class InputProcessor:
    """A family's prompt processor for multimodal inputs (see the module doc).

    ``process`` gets the prompt's token ids, which hold one placeholder per media item where
    the family's chat template puts it (Qwen2.5-VL: ``<|vision_start|><|image_pad|>
    <|vision_end|>`` per image), and ``mm_data`` (``{"image": item or [items]}``); it returns
    the token ids with each placeholder expanded to the item's embedding rows and the items,
    ordered by offset, each with a ``content_hash`` that names its content (prefix caching
    and encoder caches key on it).
    """

    #: Whether :meth:`process` refuses every media item, whatever it is (a checkpoint whose
    #: encoder is not supported yet: the model runs text only and has no media encoders).
    text_only: ClassVar[bool] = False

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: EngineConfig
                 ) -> None:
        self.model_dir = model_dir
        self.hf_config = hf_config
        self.tokenizer = tokenizer
        self.config = config
        #: Images one prompt may carry at most (``--limit-mm-per-prompt``).
        self.limit_per_prompt = config.multimodal.limit_mm_per_prompt
        #: The family's image processor (:meth:`load_images`); None: images are refused, for
        #: the reason in :attr:`images_refused` (text prompts still run).
        self.image_processor: Any = None
        self.images_refused = ""

    def load_images(self, model_dir: str, default_type: str) -> None:
        """Set :attr:`image_processor` from the checkpoint's preprocessor config
        (:func:`load_image_processor`), or leave it None and keep why in
        :attr:`images_refused` when the checkpoint has none."""
        try:
            self.image_processor = load_image_processor(model_dir, default_type)
        except FileNotFoundError as error:  # (text prompts still run; images are refused)
            self.image_processor, self.images_refused = None, str(error)

    def require_images(self) -> Any:
        """The image processor, or ValueError ``multi_modal_data.image: <why>`` where images
        are refused (:attr:`images_refused`)."""
        if self.image_processor is None:
            raise ValueError(f"multi_modal_data.image: {self.images_refused}")
        return self.image_processor

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """``(token ids with expanded placeholders, items)``; ValueError on bad input."""
        raise NotImplementedError

    def checked_images(self, mm_data: Mapping[str, Any], *, only_with_items: bool = False,
                       note: str = "") -> list[Any]:
        """The images of ``mm_data["image"]`` (one item or a list); ValueError naming the
        field for another key (``only_with_items``: only keys that carry items count;
        ``note`` ends that message) or more images than ``--limit-mm-per-prompt``. The first
        half of :meth:`images_and_places`, for a family that finds its placeholders another
        way."""
        unknown = sorted(key for key, value in mm_data.items() if key != "image"
                         and (not only_with_items or _has_items(value)))
        if unknown:
            raise ValueError(f"multi_modal_data has unsupported keys {unknown}; allowed: "
                             f"'image'{note}")
        images = mm_data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if len(images) > self.limit_per_prompt:
            raise ValueError(f"multi_modal_data.image: {len(images)} images; at most "
                             f"{self.limit_per_prompt} per prompt (--limit-mm-per-prompt)")
        return images

    def images_and_places(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any],
                          placeholder: int, label: str | None = None, *,
                          only_with_items: bool = False, note: str = ""
                          ) -> tuple[list[Any], list[int]]:
        """The checks every image family makes before it processes a prompt's images: the
        images of ``mm_data["image"]`` (one item or a list) and the prompt positions of the
        ``placeholder`` token, one per image. ValueError naming the field for another key
        (``only_with_items``: only keys that carry items count; ``note`` ends that message),
        more images than ``--limit-mm-per-prompt``, or as many placeholders as images
        (``label``: the placeholder's name in that message)."""
        images = self.checked_images(mm_data, only_with_items=only_with_items, note=note)
        places = [i for i, t in enumerate(prompt_token_ids) if t == placeholder]
        if len(places) != len(images):
            name = f"token {placeholder}" + (f", {label}" if label else "")
            raise ValueError(f"multi_modal_data.image: {len(images)} images but the prompt has "
                             f"{len(places)} image placeholders ({name}); put one per image")
        return images, places


def splice_placeholders(prompt_token_ids: Sequence[int], places: Sequence[int],
                        expand: Callable[[int, int], tuple[Sequence[int], MultiModalItem]]
                        ) -> tuple[list[int], list[MultiModalItem]]:
    """``(token ids, items)``: the prompt with its placeholder tokens at ``places`` (prompt
    positions, increasing) each replaced by what ``expand`` gives, and the items in that order.

    ``expand(n, offset)`` gives placeholder ``n``'s replacement tokens, which start at
    ``offset`` of the returned ids (any per-item layout: start / end markers, row breaks, tile
    separators), and its :class:`~mrv2.contract.requests.MultiModalItem`, whose ``length``
    placeholder tokens lie among them (``offset=offset + 1`` after a start marker). It is
    called once per placeholder, in order; the text between placeholders is copied as is.
    ValueError where ``places`` do not increase within the prompt or an item lies outside its
    replacement (a family's bug, not bad input)."""
    ids: list[int] = []
    items: list[MultiModalItem] = []
    start = 0  # the first prompt position not yet copied
    for n, place in enumerate(places):
        if not start <= place < len(prompt_token_ids):
            raise ValueError(f"splice_placeholders: placeholder {n} at {place}; places must "
                             f"increase within the prompt's {len(prompt_token_ids)} tokens")
        ids.extend(prompt_token_ids[start:place])
        offset = len(ids)
        tokens, item = expand(n, offset)
        if item.offset < offset or item.offset + item.length > offset + len(tokens):
            raise ValueError(f"splice_placeholders: placeholder {n}'s item (offset "
                             f"{item.offset}, length {item.length}) lies outside its "
                             f"{len(tokens)} tokens at offset {offset}")
        items.append(item)
        ids.extend(tokens)
        start = place + 1
    ids.extend(prompt_token_ids[start:])
    return ids, items


def run_image_processor(processor: Any, images: list[Any], **kwargs: Any) -> Any:
    """``processor(images=images, return_tensors="pt", **kwargs)``, any failure of it (a bad
    or undecodable image) a ValueError naming the field."""
    try:
        return processor(images=images, return_tensors="pt", **kwargs)
    except Exception as error:  # noqa: BLE001 (any decoding / format failure of an image)
        raise ValueError(f"multi_modal_data.image: could not process the images: "
                         f"{type(error).__name__}: {error}") from error


def content_hash(*parts: Any) -> str:
    """``"image:"`` and a SHA-256 over ``parts``: each tensor's dtype, shape and bytes, the
    ``repr`` of anything else (an image's grid or size). Two items hash alike exactly when
    their processed pixels (and those values) are alike."""
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            tensor = part.detach().cpu().contiguous()
            digest.update(repr((tensor.dtype, tuple(tensor.shape))).encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(part).encode())
    return "image:" + digest.hexdigest()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def processor_settings(model_dir: str | Path, section: str, *files: str
                       ) -> dict[str, Any] | None:
    """A checkpoint's processor settings where HF transformers 5 finds them first:
    ``processor_config.json``'s ``section`` (``"image_processor"``, ``"video_processor"``:
    what a processor's ``save_pretrained`` writes now), else the first of ``files`` (the
    older layouts) that holds a non-empty JSON object, else the last one's object (empty);
    None where none holds one."""
    nested = _read_json(Path(model_dir) / "processor_config.json")
    if isinstance(nested, dict) and isinstance(nested.get(section), dict):
        return dict(nested[section])
    for name in files:
        flat = _read_json(Path(model_dir) / name)
        if isinstance(flat, dict) and (flat or name == files[-1]):
            return flat
    return None


def _image_processor_settings(model_dir: str | Path) -> dict[str, Any] | None:
    """The checkpoint's image processor settings: ``processor_config.json``'s
    ``image_processor`` section, else ``preprocessor_config.json``; None where neither holds
    them."""
    return processor_settings(model_dir, "image_processor", "preprocessor_config.json")


def preprocessor_config(model_dir: str | Path | None) -> dict[str, Any]:
    """The checkpoint's image processor settings as a dict (``processor_config.json``'s
    ``image_processor`` section, else ``preprocessor_config.json``; empty where there is none
    to read): what a model state sizes its encoder profile by."""
    if not model_dir:
        return {}
    return _image_processor_settings(model_dir) or {}


def _has_items(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, (list, tuple)):
        return len(value) > 0
    return True


def load_image_processor(model_dir: str | Path, default_type: str) -> Any:
    """The checkpoint's HF image processor (its settings in ``processor_config.json``'s
    ``image_processor`` section, as transformers 5 saves them, or in
    ``preprocessor_config.json``), or the PIL backend of the same processor (``<Name>Pil``,
    same settings) where torchvision, which transformers' default backend needs, is not
    installed (the CPU CI has none). ``default_type``: the processor class of configs that
    name none. ValueError or FileNotFoundError naming the files where neither loads."""
    path = Path(model_dir)
    settings = _image_processor_settings(path)
    if settings is None:
        raise FileNotFoundError(
            f"no image processor settings in {str(path)!r} (processor_config.json's "
            "image_processor section or preprocessor_config.json): a vision-language "
            "checkpoint ships its image processor's config")
    import transformers

    if importlib.util.find_spec("torchvision") is not None:
        return transformers.AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
    kind = str(settings.get("image_processor_type", default_type))
    name = kind.removesuffix("Fast").removesuffix("Pil") + "Pil"
    # The class from its model's module first: transformers 5.17 lists some PIL backends
    # (Idefics3's, SmolVLM's) under torchvision's lazy group, where the top-level name is a
    # placeholder that needs torchvision; their own modules import without it.
    model = name.removesuffix("ImageProcessorPil").lower()
    try:
        module = importlib.import_module(
            f"transformers.models.{model}.image_processing_pil_{model}")
        cls = getattr(module, name, None)
    except ImportError:
        cls = None
    if cls is None:
        cls = getattr(transformers, name, None)
    if cls is None:
        raise ValueError(f"image processor {kind!r} needs torchvision, and transformers has no "
                         f"PIL backend {name!r} for it")
    return cls.from_pretrained(str(path), local_files_only=True)


def rgb_pixels(image: Any, convert_rgb: bool = True) -> torch.Tensor:
    """An image as ``uint8`` ``[3, H, W]``: a PIL image (converted to RGB where
    ``convert_rgb``, as HF converts it) or a ``uint8`` ``[H, W, 3]`` array; ValueError naming
    ``multi_modal_data.image`` for anything else."""
    from PIL import Image

    if isinstance(image, Image.Image):
        if image.mode != "RGB" and convert_rgb:
            image = image.convert("RGB")
        array = np.array(image, copy=True)
    elif isinstance(image, np.ndarray):
        array = np.ascontiguousarray(image)
    else:
        raise ValueError(f"multi_modal_data.image: expects PIL images or uint8 [H, W, 3] "
                         f"arrays, got {type(image).__name__}")
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3 \
            or min(array.shape[:2]) < 1:
        raise ValueError(f"multi_modal_data.image: an image must be RGB uint8 [H, W, 3], got "
                         f"{array.dtype} {tuple(array.shape)}"
                         + (" (do_convert_rgb is false)" if not convert_rgb else ""))
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def resize_uint8(pixels: torch.Tensor, size: tuple[int, int], mode: str = "bilinear"
                 ) -> torch.Tensor:
    """torchvision's ``resize`` of ``uint8`` ``[3, H, W]`` CPU pixels to ``size`` with
    antialiasing, restated (what HF's torchvision-backed image processors do, for the families
    that have no PIL backend): ``torch.nn.functional.interpolate`` with ``antialias=True``
    (bilinear, or bicubic for ``mode="bicubic"``) on the ``uint8`` tensor where torchvision
    does that (bicubic; bilinear where the CPU's capability is AVX2 or AVX512, or on ARM64, as
    torchvision 0.29 decides: pytorch/vision#9190 added AVX512), else in fp32, then rounded
    (bicubic clamped first) to ``uint8``: the same torch call torchvision makes, so the same
    pixels on the same CPU. Pixels already of ``size`` come back unchanged, as from
    torchvision."""
    if tuple(pixels.shape[-2:]) == tuple(size):
        return pixels
    native = mode == "bicubic" or torch.backends.cpu.get_cpu_capability() in (
        "AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")
    x = pixels[None] if native else pixels[None].to(torch.float32)
    x = F.interpolate(x, size=list(size), mode=mode, align_corners=False, antialias=True)
    if not native:
        if mode == "bicubic":
            x = x.clamp_(min=0, max=255)
        x = x.round_().to(torch.uint8)
    return x[0]
