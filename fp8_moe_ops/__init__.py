"""fp8_moe_ops: FP8 Mixture-of-Experts ops for PyTorch.

Importing the package registers the ``torch.ops.fp8_moe`` ops (CPU reference, CUDA
Triton kernels, fake kernels).  See ``docs/ops.md`` for each op's contract.
"""

from . import _source_tree
from . import ops  # noqa: F401  (registers torch.ops.fp8_moe.*)
from .calibration import calibrate_static_scales
from .integrations.convert import convert_linears
from .modules import FP8Experts, FP8Linear
from .quantization import quantize_weight

__all__ = ["FP8Experts", "FP8Linear", "calibrate_static_scales", "convert_linears", "quantize_weight"]
__version__ = "0.1.0"

_source_tree.install_if_checkout()
