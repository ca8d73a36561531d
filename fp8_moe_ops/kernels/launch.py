"""Launching a Triton kernel without the JIT's per-call work.

``kernel[grid](*args, **meta)`` re-derives, on every call, the specialisation of each
argument (dtype, 16-byte alignment, integer divisibility), a cache key from it and
the launch options, then looks the compiled kernel up: 7-9 µs of CPU per launch on
the H200 machine's host (14 µs through the JIT, 5.5-6.7 µs through :class:`Launch`, for
the combine kernel; ``bench/host_parts.py``).  A decode step
is a handful of microsecond-sized kernels, so that work is most of its cost.

:class:`Launch` is one kernel at one grid with fixed compile-time arguments.  Its
first call goes through the JIT (which compiles, or finds, the binary and returns
it); later calls hand the arguments straight to that binary's launcher.  That is
only right while every later call's arguments specialise as the first call's did:
:func:`launch` keys its cache of ``Launch`` objects on everything that decides it
(each scalar argument's value; each tensor's dtype, device and whether its address is
a multiple of 16 bytes).  Triton's launch hooks (``knobs.runtime.launch_enter_hook``, used by
Triton's own profiler) are not called on the fast path; ``torch.profiler`` and Nsight
see the kernels as usual.  Under ``TRITON_INTERPRET=1`` every call goes through the
interpreter.

Triton's CUDA launcher is a Python object whose ``__call__`` allocates the kernel's
scratch memory (none for this package's kernels) before it calls the compiled C
function; :func:`direct` calls that function itself where the kernel needs no scratch.
Triton 3.6 hands the C function the kernel's arguments one by one; 3.7 as one sequence,
after the signature they are read by (:data:`CONVENTIONS`).
For a kernel that takes TMA descriptors (the Gluon GEMM, :mod:`.ws_gemm`) that function
is a Python wrapper that builds each descriptor's ``CUtensorMap`` from its base's
address, shape and strides on every launch (``fill_tma_descriptor``), so a cached launch
takes a new call's descriptors as it takes its tensors: the cache keys a descriptor on
what the JIT specialises it on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import NamedTuple

import torch
from triton.compiler.compiler import CompiledKernel
from triton.runtime import driver

try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon's Hopper API: no argument is one (isinstance of () is False)
    TensorDescriptor = ()


class Convention(NamedTuple):
    """How a Triton version's CUDA launcher object calls its C function, for a kernel
    without scratch memory: ``launch(gx, gy, gz, stream, *head(run, function, metadata),
    *args)``, or with ``packed``, ``..., *head(...), args)``."""

    head: Callable
    packed: bool


CONVENTIONS = (
    # Triton 3.6: function, cooperative grid, PDL, global and profile scratch, metadata,
    # launch metadata, enter and exit hooks, then the arguments
    Convention(lambda run, function, metadata: (function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                                                metadata, None, None, None), packed=False),
    # Triton 3.7: function, cooperative grid, PDL, metadata, launch metadata, enter and
    # exit hooks, global and profile scratch, argument annotations, kernel signature, then
    # the arguments as one sequence
    Convention(lambda run, function, metadata: (function, run.launch_cooperative_grid, run.launch_pdl, metadata,
                                                None, None, None, None, None, run.arg_annotations,
                                                run.kernel_signature), packed=True),
)

_CONVENTION: dict[type, Convention | None] = {}  # launcher class -> the convention its __call__ was seen to follow


def _convention(cls: type) -> Convention | None:
    """The :data:`CONVENTIONS` entry that ``cls.__call__`` follows for a kernel without
    scratch memory, or None: checked once per class, by calling it on a stand-in whose
    ``launch`` records what it gets (Triton's launcher object is internal; another
    version may call its C function otherwise)."""
    got = []
    stand_in = SimpleNamespace(launch=lambda *a: got.append(a), num_ctas=1, launch_cooperative_grid=False,
                               launch_pdl=True, global_scratch_size=0, global_scratch_align=1,
                               profile_scratch_size=0, profile_scratch_align=1, arg_annotations="annotations",
                               kernel_signature="signature")
    try:
        cls.__call__(stand_in, 2, 3, 1, "stream", "function", "metadata", None, None, None, "arg", 7)
    except Exception:  # a launcher that needs more than the stand-in has: not called directly
        return None
    for convention in CONVENTIONS:
        args = (("arg", 7),) if convention.packed else ("arg", 7)
        if got == [(2, 3, 1, "stream", *convention.head(stand_in, "function", "metadata"), *args)]:
            return convention
    return None


class Direct(NamedTuple):
    """A compiled kernel's launch: ``launcher(gx, gy, gz, stream, *head, *args)``, or
    with ``packed``, ``launcher(gx, gy, gz, stream, *head, args)`` (``args``: the
    launcher's full argument list)."""

    launcher: Callable
    head: tuple
    packed: bool


def direct(run, function, metadata) -> Direct:
    """How to launch as ``run(gx, gy, gz, stream, function, metadata, None, None, None,
    *full_args)`` (``run``: a compiled kernel's launcher, no launch hooks).  For Triton's
    CUDA launcher of a kernel without global or profile scratch memory, its compiled C
    function, without the Python frame around it (where the launcher's class is seen to
    call it so: :func:`_convention`); otherwise ``run`` itself."""
    c_launch = getattr(run, "launch", None)
    if c_launch is not None and getattr(run, "global_scratch_size", 1) == 0 \
            and getattr(run, "profile_scratch_size", 1) == 0:
        cls = type(run)
        if cls not in _CONVENTION:
            _CONVENTION[cls] = _convention(cls)
        convention = _CONVENTION[cls]
        if convention is not None:
            return Direct(c_launch, convention.head(run, function, metadata), convention.packed)
    return Direct(run, (function, metadata, None, None, None), False)


class Launch:
    """``kernel[grid](*args, **constexprs, **options)`` with ``args`` the kernel's
    run-time arguments in order (every parameter not in ``constexprs``)."""

    __slots__ = ("kernel", "grid", "meta", "_constexpr_at", "_direct", "_device")

    def __init__(self, kernel, grid: Sequence[int], constexprs: dict, **options):
        self.kernel = kernel
        self.grid = (*grid, *(1,) * (3 - len(grid)))
        self.meta = {**constexprs, **options}
        # where the compile-time values go in the launcher's full argument list
        self._constexpr_at = [(i, constexprs[n]) for i, n in enumerate(kernel.arg_names) if n in constexprs]
        self._direct = None

    def full_args(self, args) -> list:
        """``args`` with the compile-time values inserted: the launcher's argument list."""
        full = list(args)
        for i, value in self._constexpr_at:
            full.insert(i, value)
        return full

    def compiled(self) -> tuple[Direct, int] | None:
        """After a first call on a GPU, ``(direct, device)``: the compiled binary's
        :class:`Direct` launch, on ``device``; else None (interpreter)."""
        if self._direct is None:
            return None
        return self._direct, self._device

    def __call__(self, *args) -> None:
        if self._direct is not None:
            device = driver.active.get_current_device()
            if device == self._device:
                g = self.grid
                launcher, head, packed = self._direct
                stream = driver.active.get_current_stream(device)
                if packed:
                    launcher(g[0], g[1], g[2], stream, *head, self.full_args(args))
                else:
                    launcher(g[0], g[1], g[2], stream, *head, *self.full_args(args))
                return
        compiled = self.kernel[self.grid](*args, **self.meta)
        if self._direct is None and isinstance(compiled, CompiledKernel):
            self._device = driver.active.get_current_device()
            self._direct = direct(compiled.run, compiled.function, compiled.packed_metadata)


class KernelCall(NamedTuple):
    """One launch, as data: ``kernel[grid](*args, **constexprs, **options)``."""

    kernel: object
    grid: tuple
    args: tuple
    constexprs: dict
    options: dict


_LAUNCHES: dict[tuple, Launch] = {}
_MAX_LAUNCHES = 4096  # cleared when full: a model has a few dozen call shapes per kernel


def _spec(arg):
    # what Triton specialises a run-time argument on (plus the value of every scalar, and
    # a tensor's device: a compiled kernel is loaded on one GPU); a Gluon TMA descriptor
    # (unhashable) on its base's dtype, block shape, shared layout and padding (its shape
    # and strides are run-time arguments; its base is 16-byte aligned by construction)
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0, arg.get_device()
    if isinstance(arg, TensorDescriptor):
        base = arg.base
        return TensorDescriptor, base.dtype, base.get_device(), tuple(arg.block_shape), arg.layout, arg.padding
    return arg


def cached(call: KernelCall) -> Launch:
    """The cached :class:`Launch` for ``call``, keyed on the kernel, grid, compile-time
    values, options and every run-time argument's specialisation (a tensor's dtype,
    16-byte alignment and device, a scalar's value)."""
    key = (call.kernel, call.grid, *call.constexprs.items(), *call.options.items(), *map(_spec, call.args))
    entry = _LAUNCHES.get(key)
    if entry is None:
        if len(_LAUNCHES) >= _MAX_LAUNCHES:
            _LAUNCHES.clear()
        entry = _LAUNCHES[key] = Launch(call.kernel, call.grid, call.constexprs, **call.options)
    return entry


def launch(call: KernelCall | None) -> None:
    """Runs ``call`` through its cached :class:`Launch` (``None``: nothing to launch)."""
    if call is not None:
        cached(call)(*call.args)
