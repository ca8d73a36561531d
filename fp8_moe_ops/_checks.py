"""Argument checks shared by the ops and the public Python API.

Every check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong value
or shape) whose message names the argument and says what was expected and what came:
``"<name>: expected <what>, got <value>"``.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Mapping, Sequence

import torch

SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu)
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # activations, routing weights
INDEX_DTYPES = (torch.int32, torch.int64)  # expert ids


def fail(exc: type[Exception], name: str, expected: str, got: object) -> None:
    raise exc(f"{name}: expected {expected}, got {got}")


def shape_str(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}"


def check_sizes(name: str, got: Sequence, expected: Sequence, what: Callable[[], str], t: torch.Tensor) -> None:
    """``got == expected`` size by size, else ``fail(ValueError, name, what(), shape_str(t))``
    (the texts made only then: the ops' per-call checks cost microseconds). Sizes may be
    symbolic: a token count marked unbacked (one graph for every T) cannot be compared
    in Python while tracing, so there the equality is asserted to the shape environment
    (``torch._check``), which Dynamo turns into a guard on the inputs' sizes: a
    mismatched call fails that guard instead of indexing out of bounds."""
    if len(got) != len(expected):
        fail(ValueError, name, what(), shape_str(t))
    for g, e in zip(got, expected):
        if g.__class__ is int and e.__class__ is int:
            if g != e:
                fail(ValueError, name, what(), shape_str(t))
            continue
        from torch.fx.experimental.symbolic_shapes import guard_or_true  # not imported by ``import torch``

        if not guard_or_true(g == e):  # backed sizes: compared (a guard); unbacked: assumed
            fail(ValueError, name, what(), shape_str(t))
        torch._check(g == e)  # unbacked: a guard on the inputs' sizes


def _is_int(v: object) -> bool:
    return isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool)


def check_block_size(block_size: object, name: str = "block_size") -> tuple[int, int]:
    """A pair ``(bn, bk)`` of positive ints (a list, tuple or ``torch.Size``)."""
    if not isinstance(block_size, Sequence) or isinstance(block_size, str):
        fail(TypeError, name, "a pair (bn, bk) of positive ints", repr(block_size))
    if len(block_size) != 2 or not all(_is_int(b) for b in block_size):
        fail(ValueError if all(_is_int(b) for b in block_size) else TypeError,
             name, "a pair (bn, bk) of positive ints", repr(block_size))
    bn, bk = block_size
    if not (bn > 0 and bk > 0):
        fail(ValueError, name, "a pair (bn, bk) of positive ints", repr(block_size))
    return bn, bk


def check_positive_int(name: str, value: object) -> int:
    if not _is_int(value):
        fail(TypeError, name, "a positive int", repr(value))
    if not value > 0:
        fail(ValueError, name, "a positive int", repr(value))
    return value


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        fail(ValueError, name, f"one of {tuple(choices)}", repr(value))
    return value


def check_batches(batches: object, example: str, name: str = "calibration_batches") -> None:
    """Refuses one batch passed where an iterable of batches is expected: iterating a
    tensor, or a mapping, would feed the model its rows, or its keys, as batches
    (``example``: how to wrap one batch in a list).  A tuple of tensors is refused too: it
    is one batch of positional arguments (``(input_ids, attention_mask)``) as often as it
    is several batches, and running each tensor as a batch can succeed silently (a
    language model takes an attention mask as token ids); several batches go in a list."""
    if isinstance(batches, (torch.Tensor, Mapping)):
        fail(TypeError, name, f"an iterable of batches (wrap a single batch in a list: {example})",
             type(batches).__name__)
    if isinstance(batches, tuple) and batches and all(isinstance(b, torch.Tensor) for b in batches):
        fail(TypeError, name, f"an iterable of batches, not a tuple of tensors, which reads as one batch of "
             f"positional arguments (wrap it in a list: {example}; several tensor batches go in a list)",
             f"a tuple of {len(batches)} tensors")


def check_scale_dtype(scale_dtype: object, name: str = "scale_dtype") -> torch.dtype:
    if scale_dtype not in SCALE_DTYPES:
        fail(TypeError, name, "torch.float32 or torch.float8_e8m0fnu", scale_dtype)
    return scale_dtype


def check_swiglu_limit(swiglu_limit: object) -> float | None:
    if swiglu_limit is None:
        return None
    if isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, numbers.Real):  # numpy's reals too
        fail(TypeError, "swiglu_limit", "None or a positive float", repr(swiglu_limit))
    if not swiglu_limit > 0:
        fail(ValueError, "swiglu_limit", "None or a positive float", swiglu_limit)
    return float(swiglu_limit)


def check_scale_values(name: str, s: torch.Tensor | None) -> None:
    """Finite positive scales (the ops check them on CPU only: on CUDA a check would
    cost a device sync per call)."""
    if s is None or s.numel() == 0:
        return
    sf = s.float()
    if not bool(torch.isfinite(sf).all()) or bool((sf <= 0).any()):
        fail(ValueError, name, "finite positive scales", f"min {sf.min().item()}, max {sf.max().item()}")


def _typed(a) -> tuple:
    # 1, 1.0 and True (and numpy's 1) are equal keys, and the checks refuse some of them
    return type(a), a


def meta_key(args: tuple) -> tuple:
    """Everything the metadata checks and the launch plans read from the experts ops'
    arguments: each tensor's dtype, shape, strides, device and whether its address is
    a multiple of 16 bytes, and the other arguments' values with their types (a list's
    elements each)."""
    return tuple((a.dtype, a.shape, a.stride(), a.device, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                 else tuple(map(_typed, a)) if isinstance(a, list) else _typed(a) for a in args)


@functools.cache
def _guard_factory() -> Callable[..., object] | None:
    """``tensors -> a guard object`` built on torch's C++ tensor-metadata guard class
    (``torch._C._dynamo.guards.TensorGuards``, which Dynamo's guards are built on), or
    None where this torch has none that behaves as :func:`metadata_guard` needs: the
    class is internal, so it is tried once on CPU tensors before it is trusted."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        def factory(*ts):
            return TensorGuards(*ts, dynamic_dims_sizes=[list(t.shape) for t in ts],
                                dynamic_dims_strides=[list(t.stride()) for t in ts])

        a, b = torch.zeros(2, 3), torch.zeros(3, 1, dtype=torch.float8_e4m3fn)
        g = factory(a, b)
        keeps = g.check(torch.ones(2, 3), torch.ones(3, 1).to(torch.float8_e4m3fn))
        refuses = not any(g.check(a, other) for other in (
            torch.zeros(2, 2, dtype=torch.float8_e4m3fn)[:, :1],  # strides
            b.float(), torch.zeros(4, 1, dtype=torch.float8_e4m3fn), b.view(3, 1, 1),  # dtype, shape, rank
            b.to("meta"), a))  # device, another tensor's everything
    except Exception:  # an internal API: anything unexpected means "not available"
        return None
    return factory if keeps and refuses else None


def metadata_guard(tensors: Sequence[torch.Tensor]) -> Callable[..., bool] | None:
    """A C++ check ``guard(*others) -> bool``, for ``others`` as many tensors as
    ``tensors``: whether each has exactly its counterpart's metadata (dtype, device,
    shape, strides, dispatch keys, requires_grad).  It costs 60-180 ns a tensor (the
    CPU machine and the H200's host), and keeps no reference to the tensors.  None where
    this torch offers no such check: callers then run their checks on every call.

    For ops taking hundreds of tensors (``grouped_experts_list``: four lists over every
    expert), where a Python key of every tensor's metadata would cost as much as the
    checks it would save: the checks run once, and a later call whose tensors pass the
    guard of checked ones skips them."""
    factory = _guard_factory()
    return None if factory is None else factory(*tensors).check


def keep_newest(table: dict, key, entry, per_key: int, max_keys: int) -> None:
    """Appends ``entry`` to ``table[key]`` (a list, newest last), keeping the last
    ``per_key``; a new key when ``table`` holds ``max_keys`` clears it first.  The
    bounded tables of guards (:func:`metadata_guard`) that skip per-call Python."""
    if key not in table and len(table) >= max_keys:
        table.clear()
    table[key] = [*table.get(key, ()), entry][-per_key:]
