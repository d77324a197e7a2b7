"""torch dtypes and TIDE's, both ways: the dtypes TIDE computes on (floats), and those it only moves
or casts into (u8: an all-gather extension's input bytes, _extension.py; e4m3: a float8 weight TIDE
casts, _float8.py)."""

from __future__ import annotations

import torch

from .. import _tide

TORCH_TO_TIDE = {torch.bfloat16: _tide.DType.bf16, torch.float16: _tide.DType.fp16,
                 torch.float32: _tide.DType.fp32}
TIDE_TO_TORCH = {**{v: k for k, v in TORCH_TO_TIDE.items()}, _tide.DType.u8: torch.uint8,
                 _tide.DType.e4m3: torch.float8_e4m3fn}
