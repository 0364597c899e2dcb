"""Quantization-aware training (quant.qat) on torchao's QAT API.

    quant.qat = int8-dynact-int4-weight   int8 per-token dynamic activations, int4 weights in
                                          groups of quant.qat_group_size input features (symmetric)
    quant.qat = int8-weight               int8 weights, one scale per output channel (symmetric)

Training ("prepare"): `apply_qat` swaps every nn.Linear inside the model's transformer blocks
for torchao's FakeQuantizedLinear. Its forward rounds the weights (and activations) to the
integer grid and back in floating point, so the loss sees the quantization error while the
gradients flow straight through the rounding. The parameters keep their names and float
values, so a QAT checkpoint is an ordinary checkpoint: it loads into a plain model and a plain
export writes the float weights. The scales are recomputed from the tensor at every forward
(torchao's dynamic quantizers, no range learning), so there is no extra state to save.

Export ("convert"): `convert_qat` runs torchao's convert step: each FakeQuantizedLinear becomes
an nn.Linear whose weight is torchao's quantized tensor (int8 storage, the int4 values unpacked
one per byte), built from the same post-training config the fake quantizers were inferred
from, so its outputs are the fake-quantized ones (torchao's own test,
test/quantization/test_qat.py test_quantize_api_int8_intx / test_quantize_api_intx, requires
prepare and convert to match the PTQ model with SQNR = inf, i.e. bit for bit).

What is quantized: the blocks' linears only (attention projections and the MLP), the common
recipe (torchao's and torchtune's QAT examples on Llama). The token embedding and the output
head stay in full precision: in GPT-2 they are one tied tensor, whose per-row lookups would
need embedding quantization and whose vocabulary-wide head is where low-bit rounding costs the
most loss for the least memory on small models.

quant.qat_start_step: the fake quantizers are off (the forward is exactly fp32's) until that
many optimizer steps are done; `FakeQuantSwitch` turns them on, from the step count alone, so a
resumed run is in the right phase without any saved state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from slipstream.config.schema import QuantConfig
from slipstream.errors import UserError

SCHEMES = ("int8-dynact-int4-weight", "int8-weight")


def import_torchao_qat():
    try:
        from torchao.quantization import qat
    except ImportError:
        raise UserError("quant.qat and --quantize need torchao: pip install torchao "
                        "(or set quant.qat=none)") from None
    return qat


def base_config(scheme: str, group_size: int) -> Any:
    """torchao's post-training config of `scheme`: QAT infers its fake quantizers from it and the
    convert step applies it for real, so training and export round the same way."""
    import_torchao_qat()
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    if scheme == "int8-dynact-int4-weight":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    if scheme == "int8-weight":
        return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    raise UserError(f"unknown quantization scheme '{scheme}'; choose one of: {', '.join(SCHEMES)}")


def _blocks(model: nn.Module) -> nn.Module:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):  # a transformer, or a pipeline stage
        raise UserError("quant.qat works on models with a `blocks` nn.ModuleList (slipstream transformers); "
                        "for your own model call torchao.quantization.quantize_(model, QATConfig(...)) "
                        "yourself, or set --quant.qat=none")
    return blocks


def apply_qat(model: nn.Module, quant: QuantConfig, start_step: int | None = None) -> nn.Module:
    """Swap the blocks' nn.Linear modules for torchao's FakeQuantizedLinear (in place).

    The fake quantizers start enabled only when training starts at or after
    quant.qat_start_step (start_step: the step training starts from; default 0)."""
    qat = import_torchao_qat()
    from torchao.quantization import quantize_

    blocks = _blocks(model)
    from slipstream.models.moe import MoE

    if any(isinstance(m, MoE) for m in blocks.modules()):
        # the router is the MoE block's only nn.Linear: the experts (most of the weights) would
        # stay fp32 under a model reported as quantization-aware
        raise UserError("quant.qat with mixture-of-experts blocks is not implemented yet: the experts' weights "
                        "are not nn.Linear layers; train the MoE model with quant.qat=none")
    if quant.qat == "int8-dynact-int4-weight":
        for name, m in blocks.named_modules():
            if isinstance(m, nn.Linear) and m.in_features % quant.qat_group_size:
                raise UserError(f"quant.qat_group_size = {quant.qat_group_size} does not divide the input width "
                                f"{m.in_features} of blocks.{name}; choose a divisor of every linear's input "
                                "width (d_model and the MLP's hidden width), e.g. 32")
    config = qat.QATConfig(base_config(quant.qat, quant.qat_group_size), step="prepare")
    quantize_(blocks, config, filter_fn=lambda m, _: type(m) is nn.Linear)
    FakeQuantSwitch(model, quant.qat_start_step).update(start_step or 0)
    return model


def fake_quantized_linears(model: nn.Module) -> list[nn.Module]:
    from torchao.quantization.qat import FakeQuantizedLinear

    return [m for m in model.modules() if isinstance(m, FakeQuantizedLinear)]


class FakeQuantSwitch:
    """Fake quantization on from quant.qat_start_step on: `update(step)` with the number of
    optimizer steps done, before each step; it touches the modules only when the phase flips."""

    def __init__(self, model: nn.Module, start_step: int):
        from torchao.quantization.qat.linear import enable_linear_fake_quant

        self._enable = enable_linear_fake_quant
        self.linears = fake_quantized_linears(model)
        self.start_step = start_step
        self.enabled: bool | None = None

    @classmethod
    def attach(cls, model: nn.Module, quant: QuantConfig) -> FakeQuantSwitch | None:
        """The switch of a model that apply_qat prepared (None without quant.qat)."""
        return None if quant.qat == "none" else cls(model, quant.qat_start_step)

    def update(self, step: int) -> None:
        on = step >= self.start_step
        if on != self.enabled:
            for m in self.linears:
                self._enable(m, on)
            self.enabled = on


def convert_qat(model: nn.Module, scheme: str, group_size: int) -> nn.Module:
    """torchao's convert step: the fake-quantized linears become real quantized ones (in place).
    A model that was not prepared (a float checkpoint) is prepared first, which makes this plain
    post-training quantization of the same linears."""
    qat = import_torchao_qat()
    from torchao.quantization import quantize_

    if not fake_quantized_linears(model):
        apply_qat(model, QuantConfig(qat=scheme, qat_group_size=group_size))
    FakeQuantSwitch(model, 0).update(0)
    quantize_(_blocks(model), qat.QATConfig(base_config(scheme, group_size), step="convert"),
              filter_fn=lambda m, _: isinstance(m, qat.FakeQuantizedLinear))
    return model
