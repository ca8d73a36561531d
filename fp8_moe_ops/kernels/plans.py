"""Launch plans: a forward's launches recorded once and replayed on later calls.

At decode the three or four kernels of an experts forward (one or two of a GEMM op's)
take microseconds each on the GPU, so the CPU's work per call decides a step's time.
A forward builds its launches over its *sources* (the call's tensors as the kernels
read them), its output and the buffers of one workspace allocation (:class:`Layout`).
A call of an argument signature (the second: :func:`planned`) runs the forward and
records it as a :class:`LaunchPlan`: per kernel, the compiled binary's launcher and its
full argument list, each tensor argument replaced by its source (:class:`_Source`).  A
later call with the same signature (the caller keys its plans on every tensor's dtype,
shape, strides, device and 16-byte alignment and every other argument's value: the ops'
tables are :class:`Plans`, which find a plan through a C++ guard of the tensors'
metadata once one exists; :mod:`.moe_list` keys its own) makes its sources with the
same function, allocates the output and one workspace and hands each launcher its list
with the sources' addresses filled in: no launch config, grid, view or cache key is
computed again.  A Gluon GEMM's TMA descriptors (:mod:`.ws_gemm`) are recorded as their
base's source with their shape and strides; a replay hands the launcher a descriptor on
the new base address, from which Triton's launcher builds the ``CUtensorMap`` as on any
launch.  A forward of no launches (no rows) gets no plan.

**Replays as CUDA graphs.**  A launch through Triton's launcher takes 4-6.5 µs of CPU,
a CUDA graph's launch 2-3 µs whatever its kernels (``bench/host_parts.py``, an H100's
host).  Where the forward's first launch is the only one that reads the call's own
tensors (the ``fed`` sources and the output: it writes their addresses to the
workspace's ``addresses`` buffer, and the later launches read them from there:
:mod:`.experts`), a plan replays its later launches as a graph captured once: per call,
one launch and the graph's (through the driver's ``cuGraphLaunch``: :data:`_DRIVER_LAUNCH`).
A graph holds every other address it was captured with:
the other sources' (the weights), so a plan keeps a graph per CUDA stream, thread and
those addresses, captured on the second call that brings them (a first one runs as any
replay); and its workspace's, which is one allocation that every plan's graphs share per
device, stream and thread (calls there run one after another: :func:`_arena`), grown
(and the graphs on it captured again) when a plan needs more.  While the current stream
is being captured (a CUDA graph of the caller's) a replay launches every kernel with its
own workspace, as without graphs.  :data:`GRAPHS` (False: every replay launches every
kernel) is there for benchmarks to compare the two in one process;
:func:`release_graph_workspaces` frees the shared workspaces.

Users: :mod:`.experts` (the experts ops, :class:`~.experts.StackedPlans`), :mod:`.gemms`
(the GEMM ops, :class:`~.gemms.GemmPlans`), :mod:`.moe_list` (the list op).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import operator
import threading
from typing import NamedTuple

import torch
from triton.runtime import driver

from .._checks import keep_newest, meta_key, metadata_guard
from ..functional import cdiv
from . import ws_gemm
from .launch import KernelCall, TensorDescriptor, cached

__all__ = ["Layout", "LaunchPlan", "planned", "Plans", "release_graph_workspaces"]

_ALIGN = 256  # bytes from one workspace buffer to the next (the kernels need 16)
GRAPHS = True  # whether plans that can replay their later launches as CUDA graphs do


class Layout(NamedTuple):
    """The workspace: its buffers as (name, dtype, shape, strides, byte offset), and its
    size in bytes."""

    buffers: list
    nbytes: int

    @classmethod
    def of(cls, bufs: list) -> Layout:
        """The layout of ``bufs`` ((name, dtype, shape) contiguous, or (name, dtype,
        shape, strides)), in order, each at a multiple of 256 bytes."""
        buffers, offset = [], 0
        for name, dt, shape, *strides in bufs:
            strides = strides[0] if strides else tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            buffers.append((name, dt, shape, strides, offset))
            extent = 1 + sum((n - 1) * st for n, st in zip(shape, strides))  # elements from the first to the last
            offset += cdiv(extent * dt.itemsize, _ALIGN) * _ALIGN
        return cls(buffers, offset)

    def views(self, ws: torch.Tensor) -> list[torch.Tensor]:
        """The buffers as typed views of ``ws`` (``nbytes`` uint8), in order."""
        return [ws.view(dt).as_strided(shape, strides, off // dt.itemsize)
                for _, dt, shape, strides, off in self.buffers]


class _Source(int):
    """A tensor argument's place in a recorded call: an index into the sources of a
    replay (the call's own tensors in the recorded order, the output, the workspace's
    buffers)."""


class _Address(int):
    """A replay's address where Triton's launcher asks a descriptor's base for it."""

    def data_ptr(self) -> int:
        return int(self)


class _Descriptor(NamedTuple):
    """What Triton's CUDA launcher reads of a TMA descriptor argument (its base's
    ``data_ptr()``, shape, strides, padding; from Triton 3.7 also whether float32 is
    rounded to tf32, which the package's e4m3 and bf16 descriptors never ask): a
    replay's descriptor on a new address."""

    base: _Address
    shape: tuple
    strides: tuple
    padding: str
    round_f32_to_tf32: bool = False


class _Described(NamedTuple):
    """A TMA descriptor argument's place in a recorded call: the :class:`_Source` of its
    base, and its shape, strides and padding (which the plan's key fixes)."""

    source: int
    shape: tuple
    strides: tuple
    padding: str

    def at(self, address: int) -> _Descriptor:
        return _Descriptor(_Address(address), self.shape, self.strides, self.padding)


def _template(call: KernelCall, sources: dict) -> tuple | None:
    """``call.args`` with each tensor replaced by its :class:`_Source` and each descriptor
    by its :class:`_Described`; None where one is none of the sources'."""
    template = []
    for a in call.args:
        if isinstance(a, (torch.Tensor, TensorDescriptor)):
            source = sources.get(id(a if isinstance(a, torch.Tensor) else a.base))
            if source is None:
                return None
            if isinstance(a, TensorDescriptor):
                source = _Described(source, tuple(a.shape), tuple(a.strides), a.padding)
            a = source
        template.append(a)
    return tuple(template)


class LaunchPlan:
    """The recorded launches of one forward, replayable on any call whose sources have
    the same names, dtypes, shapes, strides, 16-byte alignment and scalar arguments
    (the caller keys plans on what decides those).  The output is allocated as the
    recorded one: like the first source (``hidden``), or of its recorded shape and dtype
    where it differs (a GEMM op's).

    On a GPU each launcher is called directly with the sources' addresses; under the
    Triton interpreter the recorded calls are replayed through the JIT (the tests)."""

    __slots__ = ("_steps", "_layout", "device", "_offsets", "_constants", "_described", "_out", "_baked",
                 "_graphs")

    def __init__(self, steps: list, layout: Layout, device: int | None, constants: list | None = None,
                 described: list | None = None, out: tuple | None = None, baked: list | None = None):
        # device: the GPU the launchers were compiled for; None: replays through the JIT;
        # out: None (the output is like the first source), or its (shape, dtype);
        # baked: where the launches after the first may run as a CUDA graph, the sources
        # whose addresses the graph holds (indices into a replay's inputs), else None
        self._steps, self._layout, self.device, self._constants = steps, layout, device, constants
        self._described, self._out, self._baked = described, out, baked
        self._offsets = [off for *_, off in layout.buffers]
        # (stream, thread, baked addresses) -> None once seen, then (its graph, the generation
        # of the workspace it uses: _arena, its executable's handle or None), or after a
        # failed capture [calls left before it is tried again, the wait it began with], or
        # _FAILED after its last try
        self._graphs: dict = {}

    @classmethod
    def record(cls, names: list, env: dict, layout: Layout, calls: list[KernelCall],
               fed: tuple = ()) -> LaunchPlan | None:
        """The plan of a forward just run (:func:`.experts.experts_forward`'s results; ``names``:
        the keys of its ``sources``, in the order a replay passes them), or None where
        it cannot have one: no launches, one tensor object as two sources, a tensor argument
        that is none of the sources, a launcher compiled for another device.  ``fed``:
        the sources that only the first launch reads where the workspace has an
        ``addresses`` buffer (it hands their addresses and the output's to the others
        there): the plan then replays its later launches as CUDA graphs."""
        buffers = [name for name, *_ in layout.buffers]
        if not calls:
            return None
        sources = {}
        for i, name in enumerate([*names, "out", *buffers]):
            t = env.get(name)
            if t is None:
                continue
            if id(t) in sources:
                return None  # one object as two sources: which one a kernel reads is ambiguous (experts._distinct)
            sources[id(t)] = _Source(i)
        templates = [_template(call, sources) for call in calls]
        if None in templates:
            return None
        out, first = env["out"], env[names[0]]
        out = None if (out.shape, out.dtype) == (first.shape, first.dtype) else (tuple(out.shape), out.dtype)
        entries = [cached(call) for call in calls]
        compiled = [entry.compiled() for entry in entries]
        if all(c is None for c in compiled):  # the interpreter (which runs no Gluon kernel: no descriptors)
            return cls(list(zip(entries, templates)), layout, None, out=out)
        device = driver.active.get_current_device()
        if any(c is None or c[1] != device for c in compiled):
            return None  # a launcher compiled for another device (the launch cache keys on the tensors' device)
        # a replay's values: the sources' addresses (in _Source order), every launch's
        # other arguments, then the descriptors on those addresses; each launch picks its
        # argument list from them
        full = [entry.full_args(template) for entry, template in zip(entries, templates)]
        constants = [a for args in full for a in args if type(a) not in (_Source, _Described)]
        described = [a for args in full for a in args if type(a) is _Described]
        n_sources = len(names) + 1 + len(buffers)
        n_constants = n_descriptors = 0
        steps = []
        for args, entry, (how, _) in zip(full, entries, compiled):
            picks = []
            for a in args:
                if type(a) is _Source:
                    picks.append(int(a))
                elif type(a) is _Described:
                    picks.append(n_sources + len(constants) + n_descriptors)
                    n_descriptors += 1
                else:
                    picks.append(n_sources + n_constants)
                    n_constants += 1
            steps.append((*how, entry.grid, _picker(picks)))  # launcher, head, packed (launch.Direct), ...
        baked = None
        if fed and "addresses" in buffers and len(steps) > 1:
            # a later launch that takes a fed source or the output must read it through the
            # addresses (``ADDRS`` set): a graph holds the addresses it was captured with;
            # else no graphs
            handed = {i for i, name in enumerate(names) if name in fed} | {len(names)}
            taken = {int(a) if type(a) is _Source else a.source
                     for call, template in zip(calls[1:], templates[1:]) if not call.constexprs.get("ADDRS")
                     for a in template if type(a) in (_Source, _Described)}
            if not handed & taken:
                baked = [i for i, name in enumerate(names) if name not in fed]
        return cls(steps, layout, device, constants, described, out, baked)

    def run(self, inputs: list, hidden: torch.Tensor, aligned: bool = False) -> torch.Tensor | None:
        """The forward on ``inputs`` (the sources' values, in the recorded order);
        None when the current CUDA device is not the plan's, or, given ``aligned``, when
        an input's address is not a multiple of 16 bytes (a caller that keyed the plan
        on everything but the addresses, knowing the recorded inputs were aligned)."""
        device = self.device
        if device is not None and driver.active.get_current_device() != device:
            return None
        values = [None if t is None else t.data_ptr() for t in inputs]
        if aligned and functools.reduce(operator.or_, filter(None, values), 0) & 15:
            return None
        if self._out is None:
            out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
        else:
            out = torch.empty(self._out[0], dtype=self._out[1], device=hidden.device)
        if device is None:
            ws = torch.empty(self._layout.nbytes, dtype=torch.uint8, device=hidden.device)
            tensors = [*inputs, out, *self._layout.views(ws)]
            for entry, template in self._steps:
                entry(*(tensors[a] if type(a) is _Source else a for a in template))
            return out
        stream = driver.active.get_current_stream(device)
        arena = None  # the workspace the graphs on this stream and thread share, and its generation
        baked = self._baked
        if baked is not None and GRAPHS:
            thread = threading.get_ident()
            key = (stream, thread, *[values[i] for i in baked])
            state = self._graphs.get(key, _UNSEEN)
            if state is _UNSEEN:  # a first call of these addresses: no graph yet
                if len(self._graphs) >= _MAX_GRAPHS:
                    self._graphs.clear()  # (a graph still running is freed when it completes)
                self._graphs[key] = None
            elif not torch.cuda.is_current_stream_capturing():
                kind = type(state)  # (read below where arena is set)
                if kind is list:  # its capture failed: tried again after a wait
                    state[0] -= 1
                    if state[0] <= 0:
                        arena = _arena((device, stream, thread), self._layout.nbytes, hidden.device)
                elif state is not _FAILED:
                    arena = _arena((device, stream, thread), self._layout.nbytes, hidden.device)
        if arena is None:
            ws = torch.empty(self._layout.nbytes, dtype=torch.uint8, device=hidden.device)
        else:
            ws = arena[0]
        base = ws.data_ptr()
        values.append(out.data_ptr())
        values += [base + off for off in self._offsets]
        values += self._constants
        values += [d.at(values[d.source]) for d in self._described]
        graph = None
        if arena is not None:
            if kind is tuple and state[1] == arena[1]:
                graph = state[0]
            else:  # not captured yet, on an earlier workspace of this stream and thread, or failed
                graph = self._capture(values, device)
                if graph is not None:
                    state = self._graphs[key] = (graph, arena[1], _executable(graph))
                else:  # every launch; the capture tried again after a longer wait, up to a last try
                    wait = _RETRY_WAIT_GROWTH * state[1] if kind is list else _FIRST_RETRY_WAIT
                    self._graphs[key] = [wait, wait] if wait <= _LAST_RETRY_WAIT else _FAILED
        _launch(self._steps if graph is None else self._steps[:1], stream, values)
        if graph is not None:
            launch = _DRIVER_LAUNCH if _DRIVER_LAUNCH is not None else _driver_launch()
            if launch and state[2] is not None:
                error = launch(state[2], stream)
                if error:
                    raise RuntimeError(f"cuGraphLaunch of a launch plan's CUDA graph failed: {_error_name(error)}")
            else:
                graph.replay()
        return out

    @property
    def graphs(self) -> int:
        """How many CUDA graphs of its launches the plan holds."""
        return sum(type(g) is tuple for g in self._graphs.values())

    def _capture(self, values: list, device: int) -> torch.cuda.CUDAGraph | None:
        """The launches after the first on ``values``, captured as a CUDA graph on this
        device's capture stream of the current stream's priority (:func:`_capture_stream`),
        one capture at a time; None where capture fails."""
        graph = torch.cuda.CUDAGraph()
        with _CAPTURE_LOCK:
            side = _capture_stream(device, torch.cuda.current_stream(device).priority)
            try:
                with torch.cuda.stream(side):
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        _launch(self._steps[1:], side.cuda_stream, values)
                    finally:
                        graph.capture_end()
            except RuntimeError:
                return None
        return graph


# The driver's cuGraphLaunch (ctypes): a call whose graph is launched through it takes 2-4 µs
# of CPU less than through CUDAGraph.replay() (an H100's host, bench/host_ab.py); None until
# looked up, False where the driver cannot be loaded (graphs then replay through torch, as
# those whose executable torch does not give).  Benchmarks set it to False to compare.
_DRIVER_LAUNCH = None
_LIBCUDA: list = []  # [the driver library (ctypes), or None where it cannot be loaded], once looked for


def _libcuda():
    """The CUDA driver library through ``ctypes``, or None."""
    if not _LIBCUDA:
        try:
            _LIBCUDA.append(ctypes.CDLL("libcuda.so.1"))
        except OSError:
            _LIBCUDA.append(None)
    return _LIBCUDA[0]


def _driver_launch():
    """The driver's ``cuGraphLaunch`` (looked up once into :data:`_DRIVER_LAUNCH`), or False."""
    global _DRIVER_LAUNCH
    if _DRIVER_LAUNCH is None:
        launch = getattr(_libcuda(), "cuGraphLaunch", False)
        if launch:
            launch.argtypes, launch.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
        _DRIVER_LAUNCH = launch
    return _DRIVER_LAUNCH


def _executable(graph: torch.cuda.CUDAGraph) -> int | None:
    """The handle of ``graph``'s executable (instantiated at its capture's end), or None
    where torch does not give it (before 2.9)."""
    try:
        return graph.raw_cuda_graph_exec()
    except (AttributeError, RuntimeError):
        return None


def _error_name(error: int) -> str:
    """A CUDA driver error code with its name (``cuGetErrorName``) where the driver gives it."""
    name = ctypes.c_char_p()
    get = getattr(_libcuda(), "cuGetErrorName", None)
    if get is not None and get(ctypes.c_int(error), ctypes.byref(name)) == 0 and name.value:
        return f"CUDA driver error {error} ({name.value.decode()})"
    return f"CUDA driver error {error}"


_ARENAS: dict = {}  # (device, stream, thread) -> (the workspace the plans' graphs there use, its generation)
_MAX_ARENAS = 16  # kept per process (device, stream and thread), for threads alive when the last was made
_ARENA_STEP = 1 << 20  # bytes an arena's size is a multiple of
_ARENA_LOCK = threading.Lock()  # held while the arenas are added or freed
_OUT_OF_MEMORY: dict = {}  # key -> the least arena size whose allocation failed there (none as large until released)
_GENERATIONS = itertools.count()
_CAPTURE_STREAMS: dict = {}  # (device, priority) -> the stream graphs are captured on
_CAPTURE_LOCK = threading.Lock()  # one capture at a time on a device's capture streams


def _capture_stream(device: int, priority: int):
    """The stream the plans' graphs of ``priority`` are captured on, on ``device`` (made on
    first use, under :data:`_CAPTURE_LOCK`; capture cannot use the legacy default stream).
    Made through the driver (``cuStreamCreateWithPriority``, non-blocking), not taken from
    torch's stream pool, whose 32 streams per priority other code of the process may be
    using at the same time: work it queued on ours while a capture ran would land in the
    graph.  Torch's pool is the fallback where the driver cannot be reached or the
    thread's current context is not the device's (not kept: a later capture tries again).  Of the
    caller's priority, as the graph's kernels keep the priority of the stream they were
    captured on (torch instantiates graphs to run their nodes at their own priorities)."""
    side = _CAPTURE_STREAMS.get((device, priority))
    if side is None:
        cuda, handle, current = _libcuda(), ctypes.c_void_p(), ctypes.c_int(-1)
        flags, level = ctypes.c_uint(1), ctypes.c_int(priority)  # non-blocking
        # (made in the thread's current context: only where that is the device's)
        if cuda is not None and cuda.cuCtxGetDevice(ctypes.byref(current)) == 0 and current.value == device \
                and cuda.cuStreamCreateWithPriority(ctypes.byref(handle), flags, level) == 0:
            side = _CAPTURE_STREAMS[(device, priority)] = torch.cuda.ExternalStream(
                handle.value, device=torch.device("cuda", device))
        else:
            side = torch.cuda.Stream(device, priority=priority)
    return side


def _arena(key: tuple, nbytes: int, device: torch.device) -> tuple[torch.Tensor, int] | None:
    """The workspace every plan's graphs use on ``key``'s device, stream and thread (calls
    there run one after another), at least ``nbytes`` long, and its generation (a new
    one each time it is replaced by a larger one, twice the size where that can be had,
    or freed: a graph captured on another generation is captured again); None where there is none
    to be had (the call then launches every kernel on a workspace of its own): an
    allocation for as many bytes ran out of memory for this key (the arena it would
    have replaced stays, for the plans it holds), or ``_MAX_ARENAS`` are kept for threads
    that are all alive (ended threads' arenas are freed whenever a new stream or thread
    asks for one).  Allocated on the
    call's stream from another thread: where this thread's allocations go to a private
    pool (``torch.cuda.use_mem_pool``, or the warm-up of ``torch.compile``'s CUDA graph
    trees), one that the pool's owner does not know of would be freed under the graphs
    by its next reset; another thread's allocations come from the caching allocator's
    own pool.  A freed arena goes back to its stream, where it is reused only after what
    is queued there."""
    arena = _ARENAS.get(key)
    if arena is not None and arena[0].numel() >= nbytes:
        return arena
    with _ARENA_LOCK:
        arena = _ARENAS.get(key)  # (another thread may have released them all meanwhile)
        least = -(-nbytes // _ARENA_STEP) * _ARENA_STEP
        if least >= _OUT_OF_MEMORY.get(key, least + 1):
            return None
        if arena is None:  # a new stream or thread: ended threads' arenas are freed first
            # (a thread that Python did not start is listed from its first arena on, as a
            # dummy that counts as alive: the helper thread's constructor asks for the
            # current thread)
            alive = {t.ident for t in threading.enumerate()}
            for ended in [k for k in _ARENAS if k[2] not in alive]:
                del _ARENAS[ended]
            for ended in [k for k in _OUT_OF_MEMORY if k[2] not in alive]:
                del _OUT_OF_MEMORY[ended]
            if len(_ARENAS) >= _MAX_ARENAS:
                return None
        sizes = dict.fromkeys((max(least, 2 * arena[0].numel() if arena is not None else 0), least))
        stream, made = torch.cuda.current_stream(device), []

        def allocate():  # the first size that can be had (doubled, else what the plan needs)
            try:
                with torch.cuda.stream(stream):
                    for size in sizes:
                        try:
                            made.append(torch.empty(size, dtype=torch.uint8, device=device))
                            return
                        except torch.OutOfMemoryError as e:
                            error = e
                    made.append(error)
            except BaseException as e:  # (handled below, in the caller's thread)
                made.append(e)

        helper = threading.Thread(target=allocate)
        try:
            helper.start()
        except RuntimeError:  # no thread to be had (a thread limit, the interpreter's shutdown)
            return None
        helper.join()
        if isinstance(made[0], torch.OutOfMemoryError):
            if len(_OUT_OF_MEMORY) >= _MAX_GRAPHS:
                _OUT_OF_MEMORY.clear()
            _OUT_OF_MEMORY[key] = min(least, _OUT_OF_MEMORY.get(key, least))
            return None
        if isinstance(made[0], BaseException):
            raise made[0]
        _OUT_OF_MEMORY.pop(key, None)
        arena = _ARENAS[key] = (made[0], next(_GENERATIONS))
        return arena


def release_graph_workspaces() -> None:
    """Frees the workspaces the plans' CUDA graphs use (a later call of a graph
    captures it again on a new one), and forgets where one could not be allocated."""
    with _ARENA_LOCK:
        _ARENAS.clear()
        _OUT_OF_MEMORY.clear()


def _launch(steps: list, stream: int, values: list) -> None:
    """Each recorded step's launcher called on ``stream`` with its arguments picked from
    ``values``."""
    for launcher, head, packed, grid, pick in steps:
        if packed:
            launcher(grid[0], grid[1], grid[2], stream, *head, pick(values))
        else:
            launcher(grid[0], grid[1], grid[2], stream, *head, *pick(values))


def _picker(positions: list):
    """``values -> tuple(values[i] for i in positions)``, in C (``operator.itemgetter``
    returns a bare item for one position)."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    return lambda values: tuple(values[i] for i in positions)


_MAX_PLANS = 4096  # signatures per table; cleared when full (a model has a handful)
_MAX_GRAPHS = 1024  # graphs (and addresses seen once) per plan; cleared when full (a model has one per layer)
_UNSEEN = object()
# After a key's failed capture its 8th call tries again, after a second failure its 64th,
# after a third its 512th; after a fourth it launches every kernel for good (a capture that
# raises may leave torch's caching allocator keeping the state of a capture under way, so
# a key is not tried forever)
_FIRST_RETRY_WAIT = 8
_RETRY_WAIT_GROWTH = 8
_LAST_RETRY_WAIT = 512
_FAILED = object()


def planned(states: dict, key, sources: dict, hidden: torch.Tensor, forward, fed: tuple = ()) -> torch.Tensor:
    """One call through a table of plans (``states``: signature key -> None once seen, then
    its :class:`LaunchPlan`, or False where it cannot have one).  A signature's first
    call runs ``forward()`` (as :func:`.experts.experts_forward` returns them, on ``sources``), its second
    also records the launches, later calls replay them.  Recording on the second call
    keeps a signature seen once (a token count that never comes back) from paying for a
    plan it never replays.  ``fed``: as :meth:`LaunchPlan.record` takes it."""
    state = states.get(key, _UNSEEN)
    if isinstance(state, LaunchPlan):
        out = state.run(list(sources.values()), hidden)
        if out is not None:
            return out
    out, env, layout, calls = forward()
    if state is _UNSEEN:
        if len(states) >= _MAX_PLANS:
            states.clear()
        states[key] = None
    elif state is None:
        states[key] = LaunchPlan.record(list(sources), env, layout, calls, fed) or False
    return out


class Plans:
    """The CUDA calls of one op through its launch plans: ``plans(args)`` (the op's
    arguments in schema order, the first its input rows) runs ``check`` on the first call
    of each :func:`~fp8_moe_ops._checks.meta_key`, and :func:`planned` under that key and
    the ``FP8_MOE_GLUON`` setting (:func:`.ws_gemm.mode`: it decides which kernel runs a
    prefill GEMM, so a plan recorded under one setting is not replayed under another).
    An op's table says how its sources and forward come from its arguments
    (:meth:`sources`, :meth:`forward`; the sources named as the arguments they come
    from, :attr:`ARG_NAMES`) and what its cheap key holds (:meth:`cheap_key`).

    :func:`meta_key` reads five attributes of each tensor in Python: 4-5 µs of CPU a call
    on the CPU machine for an experts op's seven to nine, about 10 µs on the H200's host.
    So once a key has a plan, a call whose sources are the arguments themselves (or views
    at their addresses; no strided argument copied dense) and all 16-byte aligned is
    remembered under a cheaper key (the first argument's shape, the other arguments'
    values, which optional tensors are given, the setting) with a C++ guard of its
    tensors' metadata (:func:`metadata_guard`: dtype, device, shape, strides, dispatch
    keys, requires_grad).  A later call under that key whose tensors pass the guard and
    whose addresses are 16-byte aligned has the plan's meta_key and replays the plan at
    once; any other call takes the path above.  A few guards per cheap key (one model
    may pass Parameters in one layer and plain tensors in another); none where torch
    offers no such guard.  A meta_key whose calls cannot be guarded (copied or unaligned
    sources: both fixed by the key) is marked once, so its later calls skip that
    attempt."""

    GUARDS_PER_KEY = 4
    MAX_KEYS = 256  # cheap keys; cleared when full (a model has a handful)
    ARG_NAMES: tuple = ()
    FED: tuple = ()  # the sources a forward's first launch hands on (LaunchPlan.record's fed)

    def __init__(self, check):
        self._check = check
        self.states: dict = {}  # (meta_key, FP8_MOE_GLUON) -> plan state (planned)
        self._replays: dict = {}  # cheap key -> [(guard, tensors of args, sources of args, plan)], newest last
        self._keyed_only: set = set()  # (meta_key, FP8_MOE_GLUON) keys whose calls cannot be guarded

    def cheap_key(self, args: tuple, gluon) -> tuple:
        """The key of the guards: every argument but the tensors, which optional tensors
        are given, the first tensor's shape and ``gluon`` (the setting)."""
        raise NotImplementedError

    def sources(self, args: tuple) -> dict:
        """The tensors the kernels read, by argument name (None for an absent one)."""
        raise NotImplementedError

    def forward(self, args: tuple, sources: dict) -> tuple:
        """The forward on ``sources``: (out, env, layout, calls), as :func:`planned` takes."""
        raise NotImplementedError

    def __call__(self, args: tuple) -> torch.Tensor:
        hidden = args[0]
        gluon = ws_gemm.mode()  # the GEMMs a forward launches depend on it: plans are kept per setting
        try:
            cheap = self.cheap_key(args, gluon)
            remembered = self._replays.get(cheap, ())
        except (TypeError, LookupError):  # an argument the checks below refuse, naming it (a bare int or one
            cheap, remembered = None, ()   # value as block size, an unhashable value)
        guarded = False  # whether a remembered call's guard passed (its plan did not replay)
        for guard, tensors_of, sources_of, plan in reversed(remembered):
            if guard(*tensors_of(args)):
                out = plan.run(sources_of(args), hidden, aligned=True)
                if out is not None:
                    return out
                guarded = True  # unaligned, or another current device: the keyed path
                break
        key = (meta_key(args), gluon)
        try:
            known = key in self.states
        except TypeError:  # an unhashable argument: the checks name it
            self._check(*args)
            raise
        if not known:
            self._check(*args)
        sources = self.sources(args)
        out = planned(self.states, key, sources, hidden, lambda: self.forward(args, sources), self.FED)
        plan = self.states.get(key)
        if isinstance(plan, LaunchPlan) and not guarded and cheap is not None and key not in self._keyed_only:
            if not self._remember(cheap, args, sources, plan):
                if len(self._keyed_only) >= self.MAX_KEYS:
                    self._keyed_only.clear()
                self._keyed_only.add(key)
        return out

    def _remember(self, cheap: tuple, args: tuple, sources: dict, plan: LaunchPlan) -> bool:
        """Remembers the call under ``cheap`` with a guard; False where it cannot."""
        at = {name: i for i, name in enumerate(self.ARG_NAMES)}
        for name, t in sources.items():
            a = args[at[name]]
            if t is None or a is None:
                if t is not a:
                    return False
            # a GPU plan reads its sources' addresses: a view of the argument (UE8M0 scales
            # as bytes, flattened act scales) is the argument; the interpreter reads the
            # tensors themselves
            elif (t is not a if plan.device is None else t.data_ptr() != a.data_ptr()) or a.data_ptr() % 16:
                return False  # a source copied from its argument, or unaligned: replays take the keyed path
        given = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        guard = metadata_guard([args[i] for i in given])
        if guard is None:
            return False
        entry = (guard, operator.itemgetter(*given), _picker([at[name] for name in sources]), plan)
        keep_newest(self._replays, cheap, entry, self.GUARDS_PER_KEY, self.MAX_KEYS)
        return True
