"""Weight-only quantization of a trained model for inference (`slipstream generate --quantize`).

    int8   torchao Int8WeightOnlyConfig: int8 weights, one scale per output row (symmetric)
    int4   torchao IntxWeightOnlyConfig(weight_dtype=torch.int4): int4 weights, one scale per
           group of INT4_GROUP_SIZE input features (symmetric)

The activations stay in floating point: each matmul dequantizes the weight and multiplies as
before, so the saving is weight memory (and file size), not arithmetic.

What is quantized: the blocks' nn.Linear modules (attention projections and the MLP), the same
set as quant.qat and `checkpoint export --quantize` (optimize/qat.py). The token embedding and
the output head stay in full precision: in GPT-2-shaped models they are one tied tensor, and
quantizing the head as a linear would untie it (a second copy: more bytes, not fewer); the
head's vocabulary-wide logits are also where low-bit rounding costs the most quality.
Mixture-of-experts models are refused: their experts are 3-D tensors (not nn.Linear), so only
the routers would be quantized while most of the blocks' weights stayed in full precision.

int4 on CPU: torchao 0.18's Int4WeightOnlyConfig has no CPU path (its PLAIN / PRESHUFFLED
formats need the mslk package, PLAIN_INT32 refuses device 'cpu', TILE_PACKED_TO_4D needs CUDA
and bf16; measured here), so int4 uses IntxWeightOnlyConfig, which runs on any device but
stores each int4 value unpacked in one int8 byte (IntxUnpackedToInt8Tensor). Its weights are
therefore no smaller than int8's (slightly larger: a scale per group instead of per row) and it
rounds more coarsely: on CPU it shows the quality packed int4 would have, not its size.
`weight_bytes` reports the bytes as they are.
"""

from __future__ import annotations

import io

import torch
import torch.nn as nn

from slipstream.errors import UserError
from slipstream.models.moe import MoE

KINDS = ("int8", "int4")
# Same default group as quant.qat_group_size (config/schema.py QuantConfig) so generate's int4
# rounds like the int4 QAT recipe.
INT4_GROUP_SIZE = 32


def _torchao():
    try:
        import torchao.quantization as quantization
    except ImportError:
        raise UserError("--quantize needs torchao: pip install torchao (or drop --quantize)") from None
    return quantization


def _blocks(model: nn.Module) -> nn.Module:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):
        raise UserError("--quantize works on models with a `blocks` nn.ModuleList (slipstream transformers); for "
                        "your own model call torchao.quantization.quantize_(model, Int8WeightOnlyConfig()) yourself")
    return blocks


def _is_linear(module: nn.Module, _fqn: str = "") -> bool:
    return type(module) is nn.Linear


def quantize_weights(model: nn.Module, kind: str) -> nn.Module:
    """Replace the weights of the blocks' linears with torchao's quantized tensors (in place).
    Inference only: the quantized weights do not train."""
    if kind not in KINDS:
        raise UserError(f"unknown weight quantization '{kind}'; choose one of: {', '.join(KINDS)}")
    quantization = _torchao()
    from torchao.quantization.granularity import PerGroup

    blocks = _blocks(model)
    if any(isinstance(m, MoE) for m in blocks.modules()):
        raise UserError("--quantize with mixture-of-experts models is not implemented yet: the experts' weights are "
                        "3-D tensors, not linear layers, so only the routers would be quantized; drop --quantize")
    linears = [(name, m) for name, m in blocks.named_modules() if _is_linear(m)]
    if not linears:
        raise UserError("the model's blocks hold no nn.Linear to quantize; drop --quantize")
    if kind == "int8":
        # set_inductor_config=False: we do not compile here, so leave the global inductor settings alone
        config = quantization.Int8WeightOnlyConfig(set_inductor_config=False)
    else:
        for name, m in linears:
            if m.in_features % INT4_GROUP_SIZE:
                raise UserError(f"int4 quantizes in groups of {INT4_GROUP_SIZE} input features, which do not divide "
                                f"the input width {m.in_features} of blocks.{name}; use --quantize int8")
        config = quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(INT4_GROUP_SIZE))
    with torch.no_grad():
        quantization.quantize_(blocks, config, filter_fn=_is_linear)
    return model


class _ByteCounter(io.RawIOBase):
    """A write-only file that keeps only the number of bytes written."""

    def __init__(self):
        self.bytes = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.bytes += n
        return n


def weight_bytes(model: nn.Module) -> int:
    """Exact size in bytes of `torch.save(model.state_dict())`: the file the weights would make
    (quantized tensors with their scales, tied weights once, the zip container's overhead),
    counted as it is written, without holding the file in memory."""
    counter = _ByteCounter()
    torch.save(model.state_dict(), counter)
    return counter.bytes
