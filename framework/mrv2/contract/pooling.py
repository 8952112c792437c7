"""What a pooling (embedding) request asks for, as vLLM's ``PoolingParams`` names it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """An embedding of the prompt instead of generated text: the final hidden state of the
    prompt's last token (last-token pooling, what decoder embedding models such as
    Qwen3-Embedding are trained for), its first ``dimensions`` entries when set (Matryoshka
    models), scaled to unit length with ``normalize``."""

    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int)
                                            or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions must be an int >= 1 or None, got "
                             f"{self.dimensions!r}")

    def check(self, hidden_size: int) -> None:
        """ValueError naming ``dimensions`` when the model's embeddings are shorter."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions={self.dimensions} is invalid: this model's "
                             f"embeddings have {hidden_size} (1 <= dimensions <= "
                             f"{hidden_size})")
