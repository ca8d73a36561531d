"""``FP8Linear`` and ``FP8Experts``: modules holding fp8 weights, calling ``torch.ops.fp8_moe``.

Their parameters use the attribute names of transformers' FineGrainedFP8 layers
(``weight_scale_inv``, ``gate_up_proj_scale_inv``, ``*_activation_scale``) so that
checkpoints map one to one.  Static activation scales are set by
:func:`fp8_moe_ops.calibrate_static_scales` or loaded from a checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from . import ops as _ops  # noqa: F401  (registers torch.ops.fp8_moe)
from .functional import ACTIVATIONS, cdiv, gated_activation
from .quantization import quantize_weight

SCHEMES = ("dynamic", "static")
DISPATCHES = ("eager", "grouped", "batched")


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}")


def _scale_grid(rows: int, cols: int, block_size: Sequence[int]) -> tuple[int, int]:
    return cdiv(rows, block_size[0]), cdiv(cols, block_size[1])


class FP8Linear(nn.Module):
    """A linear layer with block-quantised fp8 weights: ``y = x @ W^T (+ bias)``.

    Attributes:
        weight: (out_features, in_features) ``float8_e4m3fn``.
        weight_scale_inv: (ceil(out/bn), ceil(in/bk)) float32 or UE8M0.
        activation_scale: (1,) float32, static scheme only (else ``None``).
        bias: (out_features,) or ``None``.

    ``forward`` takes (..., in_features) in bf16/fp16/fp32 and returns the same dtype.
    """

    def __init__(self, in_features: int, out_features: int, block_size: Sequence[int] = (128, 128),
                 activation_scheme: str = "dynamic", scale_dtype: torch.dtype = torch.float32,
                 bias: bool = False, device=None):
        super().__init__()
        _check_choice("activation_scheme", activation_scheme, SCHEMES)
        self.in_features, self.out_features = in_features, out_features
        self.block_size = [int(b) for b in block_size]
        self.activation_scheme = activation_scheme
        grid = _scale_grid(out_features, in_features, self.block_size)
        self.weight = _frozen(torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        self.weight_scale_inv = _frozen(torch.ones(grid, device=device).to(scale_dtype))
        act = torch.ones(1, device=device) if activation_scheme == "static" else None
        self.activation_scale = None if act is None else _frozen(act)
        self.bias = _frozen(torch.zeros(out_features, device=device)) if bias else None

    @classmethod
    def from_float(cls, linear: nn.Linear, block_size: Sequence[int] = (128, 128),
                   scale_dtype: torch.dtype = torch.float32) -> FP8Linear:
        """Quantises an ``nn.Linear`` (dynamic scheme; see ``calibrate_static_scales``)."""
        w = linear.weight.detach()
        mod = cls(linear.in_features, linear.out_features, block_size, "dynamic", scale_dtype,
                  bias=linear.bias is not None, device=w.device)
        q, s = quantize_weight(w, block_size, scale_dtype)
        mod.weight.data, mod.weight_scale_inv.data = q, s
        if linear.bias is not None:
            mod.bias.data = linear.bias.detach().to(w.dtype).clone()
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self._observer is not None:
            self._observer.copy_(torch.maximum(self._observer, x2.detach().float().abs().amax()))
        y = torch.ops.fp8_moe.linear(x2, self.weight, self.weight_scale_inv, self.block_size, self.activation_scale)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    _observer: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block_size={self.block_size}, "
                f"activation_scheme={self.activation_scheme!r}, scale_dtype={self.weight_scale_inv.dtype}, "
                f"bias={self.bias is not None}")


class FP8Experts(nn.Module):
    """Gated MoE experts with fp8 block-quantised weights.

    Attributes:
        gate_up_proj: (E, 2I, H) e4m3 (first I rows gate, last I up);
        gate_up_proj_scale_inv: (E, ceil(2I/bn), ceil(H/bk)) float32 or UE8M0;
        down_proj: (E, H, I) e4m3; down_proj_scale_inv: (E, ceil(H/bn), ceil(I/bk));
        gate_up_proj_activation_scale, down_proj_activation_scale: (E,) float32
        (static scheme only, else ``None``).

    ``forward(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)``.
    ``dispatch``: ``"eager"`` is a Python loop over ``range(num_experts)`` calling
    ``torch.ops.fp8_moe.linear`` (what the graph pass rewrites); ``"grouped"`` and
    ``"batched"`` call ``torch.ops.fp8_moe.grouped_experts`` / ``batched_experts``.
    All three give the same result up to float32 summation order.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 block_size: Sequence[int] = (128, 128), activation: str = "silu",
                 activation_scheme: str = "dynamic", dispatch: str = "eager",
                 scale_dtype: torch.dtype = torch.float32, swiglu_limit: float | None = None, device=None):
        super().__init__()
        _check_choice("activation", activation, ACTIVATIONS)
        _check_choice("activation_scheme", activation_scheme, SCHEMES)
        _check_choice("dispatch", dispatch, DISPATCHES)
        E, H, I = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.block_size = [int(b) for b in block_size]
        self.activation, self.activation_scheme, self.dispatch = activation, activation_scheme, dispatch
        self.swiglu_limit = swiglu_limit
        fp8 = torch.float8_e4m3fn
        self.gate_up_proj = _frozen(torch.zeros(E, 2 * I, H, dtype=fp8, device=device))
        self.gate_up_proj_scale_inv = _frozen(torch.ones(E, *_scale_grid(2 * I, H, self.block_size), device=device).to(scale_dtype))
        self.down_proj = _frozen(torch.zeros(E, H, I, dtype=fp8, device=device))
        self.down_proj_scale_inv = _frozen(torch.ones(E, *_scale_grid(H, I, self.block_size), device=device).to(scale_dtype))
        static = activation_scheme == "static"
        self.gate_up_proj_activation_scale = _frozen(torch.ones(E, device=device)) if static else None
        self.down_proj_activation_scale = _frozen(torch.ones(E, device=device)) if static else None

    @classmethod
    def from_float(cls, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, block_size: Sequence[int] = (128, 128),
                   activation: str = "silu", dispatch: str = "eager", scale_dtype: torch.dtype = torch.float32,
                   swiglu_limit: float | None = None) -> FP8Experts:
        """Quantises float expert weights gate_up_proj (E, 2I, H) and down_proj (E, H, I).

        The result uses the dynamic scheme; :func:`fp8_moe_ops.calibrate_static_scales`
        turns it static."""
        if gate_up_proj.dim() != 3 or gate_up_proj.shape[1] % 2:
            raise ValueError(f"gate_up_proj: expected shape (E, 2I, H), got {tuple(gate_up_proj.shape)}")
        E, two_i, H = gate_up_proj.shape
        if tuple(down_proj.shape) != (E, H, two_i // 2):
            raise ValueError(f"down_proj: expected shape {(E, H, two_i // 2)}, got {tuple(down_proj.shape)}")
        mod = cls(E, H, two_i // 2, block_size, activation, "dynamic", dispatch, scale_dtype, swiglu_limit,
                  device=gate_up_proj.device)
        mod.gate_up_proj.data, mod.gate_up_proj_scale_inv.data = quantize_weight(gate_up_proj, block_size, scale_dtype)
        mod.down_proj.data, mod.down_proj_scale_inv.data = quantize_weight(down_proj, block_size, scale_dtype)
        return mod

    def _op_args(self):
        return (self.gate_up_proj, self.gate_up_proj_scale_inv, self.down_proj, self.down_proj_scale_inv,
                self.block_size, self.activation, self.gate_up_proj_activation_scale,
                self.down_proj_activation_scale, self.swiglu_limit)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.dispatch == "eager" or self._observer is not None:
            return self._forward_eager(hidden_states, top_k_index, top_k_weights)
        op = torch.ops.fp8_moe.grouped_experts if self.dispatch == "grouped" else torch.ops.fp8_moe.batched_experts
        return op(hidden_states, top_k_index, top_k_weights, *self._op_args())

    _observer: torch.Tensor | None = None  # (2, E) running amax of gate_up and down inputs

    def _forward_eager(self, hidden_states, top_k_index, top_k_weights):
        gu_scale, down_scale = self.gate_up_proj_activation_scale, self.down_proj_activation_scale
        out = torch.zeros_like(hidden_states, dtype=torch.float32)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            x = hidden_states[tok]
            h = torch.ops.fp8_moe.linear(x, self.gate_up_proj[e], self.gate_up_proj_scale_inv[e], self.block_size,
                                         None if gu_scale is None else gu_scale[e])
            a = gated_activation(h, self.activation, self.swiglu_limit)
            y = torch.ops.fp8_moe.linear(a, self.down_proj[e], self.down_proj_scale_inv[e], self.block_size,
                                         None if down_scale is None else down_scale[e])
            out.index_add_(0, tok, y.float() * top_k_weights[tok, pos, None].float())
            if self._observer is not None:
                self._observe(e, x, a)
        return out.to(hidden_states.dtype)

    def _observe(self, e: int, x: torch.Tensor, a: torch.Tensor) -> None:
        if x.numel():
            self._observer[0, e] = torch.maximum(self._observer[0, e], x.detach().float().abs().amax())
            self._observer[1, e] = torch.maximum(self._observer[1, e], a.detach().float().abs().amax())

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, block_size={self.block_size}, "
                f"activation={self.activation!r}, activation_scheme={self.activation_scheme!r}, "
                f"dispatch={self.dispatch!r}, scale_dtype={self.gate_up_proj_scale_inv.dtype}")
