"""What weight quantization a model runs with."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("int8", "int4", "fp8")
INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class QuantConfig:
    """int8: symmetric, one scale per output channel. int4: asymmetric groups of
    `group_size` inputs, a scale and a zero point per group. fp8: e4m3 values, one scale per
    output channel."""

    method: str
    group_size: int = 32

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"quantization must be one of {', '.join(METHODS)} (got {self.method!r})")
        if self.method == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"int4 group size must be one of {INT4_GROUP_SIZES} (got {self.group_size})"
            )

    @property
    def takes_gguf_int4(self) -> bool:
        """GGUF Q4_0/Q4_1 blocks are int4 groups of 32: this scheme takes them over as they
        are (load_checkpoint(keep_int4=True)) instead of requantizing float weights."""
        return self.method == "int4" and self.group_size == 32

    @property
    def takes_gguf_int8(self) -> bool:
        """GGUF Q8_0 blocks become int8 rows from their codes (load_checkpoint(keep_int8=True),
        weights.from_gguf_q8) instead of through float weights."""
        return self.method == "int8"

    @classmethod
    def parse(cls, method: str | None, group_size: int = 32) -> QuantConfig | None:
        return None if method in (None, "", "none") else cls(str(method), group_size)
