"""Prepared stores: what is fixed for a binding is checked and packed once, a call packs only
what changes (input pointers and strides, slots, token count, ``num_local_only``, the barrier
lane) into a parameter buffer it owns and launches one kernel.

Contract:
- ``prepare(targets, *, ue8m0=True)`` takes the :class:`~vmmkv.ops.kv.KVTarget` s of one store
  call, of kinds ``vmmkv.ops.formats.STORE_KINDS``: ``("fp8_ds_mla",)``, ``("indexer_k",)``,
  ``("rows",)``, ``("fp8_ds_mla", "indexer_k")`` (both caches of a layer), and the same with
  ``"indexer_k_mxfp8"`` for ``"indexer_k"`` (whose scales are always powers of two: ``ue8m0``
  must stay True, ValueError otherwise) and with ``"fp8_ds_mla_ue8m0"`` for ``"fp8_ds_mla"``
  (power-of-two tile scales; ``ue8m0`` concerns the indexer only). Targets on a CUDA device
  give a :class:`PreparedStore`; CPU targets (host backend) a :class:`HostPreparedStore` with
  the same methods. ``prepare`` loads the kernels (compiles on the first use of a device: call
  it before CUDA-graph capture, e.g. when binding), allocates nothing on the device, keeps
  references to the targets (so to their tensors) and is local (not collective).
- ``store(inputs, slot_mapping, num_local_only=0)``: ``inputs`` in the order of the formats
  table: ``(kv_c, k_pe)``, ``(k,)``, ``(kv_c, k_pe, k)`` or ``(rows,)``. The kernel is picked
  by the kinds once, in ``prepare`` (``vmmkv.ops.launch.STORES``: each scale rule has its own
  compile-time kernel variant). Validated before the launch like the functional API
  (``vmmkv.ops.kv``): TypeError/ValueError naming the value got and what was expected; token
  count = ``slot_mapping.numel()``. One launch on torch's current stream; capture-safe. Zero
  tokens launch nothing.
- ``publish(inputs, slot_mapping, num_local_only, barrier, lane)``: the same stores and then the
  barrier of ``barrier`` (a :class:`~vmmkv.ops.barrier.DeviceBarrier` of the same device) on
  ``lane``, in the same launch: the last CTA to finish its stores runs the barrier exactly as
  ``barrier.arrive_and_wait(lane)`` does (same epochs, signal slots, timeout, diagnostic), so the
  two mix on one lane. Collective in effect: every rank publishes (or arrives) on a lane the
  same number of times; zero tokens still run the barrier. Capture-safe.
- Under ``torch.compile`` both methods call the custom ops ``vmmkv::prepared_store`` /
  ``vmmkv::prepared_publish``, which declare as mutated the targets' ``cache`` tensors, their
  error counters and (publish) the barrier's epochs and arrivals. With the cache contract of
  ``vmmkv.ops.kv`` (every target's ``cache`` is the one tensor over the whole own region) a
  compiled graph keeps store -> publish -> reads of any view of that tensor in order and never
  drops a publish. The ops name the prepared object by ``handle`` (a graph constant): keep the
  object alive as long as a compiled graph uses it.
- Not thread-safe: calls on one prepared object must not overlap (one parameter buffer).
- Host: ``store`` calls ``vmmkv.ops.host`` (synchronous); ``publish`` stores, then calls
  ``barrier.arrive_and_wait(lane)`` of whatever host barrier the caller passes (e.g. the
  cache's group barrier); only that call is collective.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vmmkv._util import require_int
from vmmkv.ops import barrier as _barrier
from vmmkv.ops import kv as _kv
from vmmkv.ops import launch as _launch
from vmmkv.ops.formats import FORMATS, INDEXER_KINDS, MLA_KINDS, STORE_KINDS
from vmmkv.ops.reference import check_store_input

__all__ = ["HostPreparedStore", "PreparedStore", "lookup", "prepare"]

log = logging.getLogger(__name__)

_THREADS = _kv._THREADS
_DeviceBarrier = _barrier.DeviceBarrier
# Row alignment the kernels need of each input (16-byte vector loads for fp8_ds_mla, 8 for k).
_INPUT_ALIGN = {"kv_c": 16, "k_pe": 16, "k": 8, "rows": 1}

_prepared: weakref.WeakValueDictionary[int, PreparedStore] = weakref.WeakValueDictionary()
_next_handle = itertools.count(1)


def prepare(
    targets: Sequence[_kv.KVTarget], *, ue8m0: bool = True
) -> PreparedStore | HostPreparedStore:
    """The prepared store of ``targets`` (see the module docstring)."""
    if isinstance(targets, _kv.KVTarget) or not isinstance(targets, (tuple, list)):
        raise TypeError(f"targets must be a tuple of KVTarget, got {type(targets).__name__}")
    targets = tuple(targets)
    for i, t in enumerate(targets):
        if not isinstance(t, _kv.KVTarget):
            raise TypeError(f"targets[{i}] must be a KVTarget, got {type(t).__name__}")
    kinds = tuple(t.kind for t in targets)
    if kinds not in STORE_KINDS:
        raise ValueError(f"targets must be of kinds {list(STORE_KINDS)}, got {kinds}")
    _kv._check_ue8m0(ue8m0, kinds)
    device = targets[0].device
    for i, t in enumerate(targets[1:], 1):
        if t.device != device:
            raise ValueError(f"targets[{i}] is on {t.device} but targets[0] is on {device}")
    if device.type == "cpu":
        return HostPreparedStore(targets, kinds, ue8m0)
    if device.type != "cuda":
        raise ValueError(f"targets must be on a CUDA device or the CPU, got {device}")
    return PreparedStore(targets, kinds, ue8m0)


def lookup(handle: int) -> PreparedStore:
    """The live prepared store of ``handle`` (how the custom ops name it)."""
    return _launch.lookup_handle(_prepared, handle, "prepared store", "PreparedStore")


def _unique(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for t in tensors:
        if not any(t is u for u in out):
            out.append(t)
    return out


class _Prepared:
    """What every prepared store keeps: its targets (checked by :func:`prepare`), their kinds,
    ``ue8m0``, the device and the names of the inputs, in the formats table's order."""

    def __init__(self, targets: tuple[_kv.KVTarget, ...], kinds: tuple[str, ...], ue8m0: bool):
        self.targets = targets
        self.kinds = kinds
        self.ue8m0 = ue8m0
        self.device = targets[0].device
        self._names = tuple(n for t in targets for n, _, _ in FORMATS[t.kind].inputs)


class PreparedStore(_Prepared):
    """Prepared stores into CUDA targets; made by :func:`prepare`."""

    def __init__(self, targets: tuple[_kv.KVTarget, ...], kinds: tuple[str, ...], ue8m0: bool):
        super().__init__(targets, kinds, ue8m0)
        self._prepare_checks(_kv._check_cuda(self.device), self.device)
        self._caches = _unique([t.cache for t in targets])
        self._counters = _unique([t.error_counter for t in targets])
        self._cache_ptrs = [c.data_ptr() for c in self._caches]
        self._counter_ptrs = [c.data_ptr() for c in self._counters]
        dests = tuple(t._dest for t in targets)
        self._store = _launch.PreparedLaunch(_launch.STORES[kinds], self.ordinal, _THREADS, dests)
        self._publish = _launch.PreparedLaunch(
            _launch.PUBLISHES[kinds], self.ordinal, _THREADS, dests
        )
        self.handle = next(_next_handle)
        _prepared[self.handle] = self

    def _prepare_checks(self, ordinal: int, device: torch.device) -> None:
        """What a call is checked against, fixed for the binding, and ``_values``. CPU tests
        and benchmarks/bench_store.py call it with ``ordinal`` -1 and the CPU."""
        self.ordinal = ordinal
        self.device = device
        # (name, dtype, width, row alignment in elements, alignment in bytes) per input
        specs = []
        for t in self.targets:
            for name, dtype, width in FORMATS[t.kind].inputs:
                w = t.entry_bytes if width is None else width
                a = _INPUT_ALIGN[name]
                specs.append((name, dtype, w, max(1, a // dtype.itemsize), a))
        self._specs = tuple(specs)
        t0 = self.targets[0]
        # the grid cap of both kernels (vmmkv.ops.launch.resident_grid); without a device (the
        # CPU tests, the host-cost benchmark's --cpu run) the launch limit _MAX_GRID
        self._max_grid = (
            _launch.resident_grid(
                (_launch.STORES[self.kinds], _launch.PUBLISHES[self.kinds]), ordinal, _THREADS
            )
            if ordinal >= 0
            else _kv._MAX_GRID
        )
        self._rows_fixed16 = self.kinds == ("rows",) and all(
            v % 16 == 0
            for v in (t0.entry_bytes, t0.offset_bytes, t0.block_stride, t0.entry_stride,
                      t0._cache_ptr)
        )  # fmt: skip
        self._values = _compile_values(self)

    def __repr__(self) -> str:
        return f"PreparedStore(kinds={self.kinds}, device={self.device}, handle={self.handle})"

    # -- per call --------------------------------------------------------------------------
    # self._values(inputs, slot_mapping, num_local_only) -> (tokens, grid, parameters): made by
    # _compile_values for this binding.

    def store(
        self, inputs: Sequence[torch.Tensor], slot_mapping: torch.Tensor, num_local_only: int = 0
    ) -> None:
        """Store ``inputs`` into every replica of the targets (see the module docstring)."""
        if torch.compiler.is_compiling():
            torch.ops.vmmkv.prepared_store(
                self._caches, self._counters, list(inputs), slot_mapping, self.handle,
                num_local_only,
            )  # fmt: skip
            return
        tokens, grid, values = self._values(inputs, slot_mapping, num_local_only)
        if tokens:
            self._store.launch(grid, *values)

    def publish(
        self,
        inputs: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        num_local_only: int,
        barrier: _barrier.DeviceBarrier,
        lane: int,
    ) -> None:
        """``store``, then ``barrier`` on ``lane``, in one launch (see the module docstring)."""
        if torch.compiler.is_compiling():
            if not isinstance(barrier, _barrier.DeviceBarrier):
                raise TypeError(f"barrier must be a DeviceBarrier, got {type(barrier).__name__}")
            torch.ops.vmmkv.prepared_publish(
                self._caches, self._counters, barrier.epochs, barrier.arrivals, list(inputs),
                slot_mapping, self.handle, barrier.handle, lane, num_local_only,
            )  # fmt: skip
            return
        if (
            type(barrier) is _DeviceBarrier
            and type(lane) is int
            and 0 <= lane < barrier.lanes
            and not barrier._blocked  # closed or broken: barrier_args raises why
        ):
            bar_args = barrier._args[lane]  # what barrier_args(lane) returns, without its checks
        else:
            self._check_barrier(barrier)
            bar_args = barrier.barrier_args(lane)  # raises: bad lane, closed or broken barrier
        if barrier.ordinal != self.ordinal:
            raise ValueError(f"barrier is on {barrier.device}, the targets on {self.device}")
        tokens, grid, values = self._values(inputs, slot_mapping, num_local_only)
        self._publish.launch(grid, *values, bar_args)

    def _check_barrier(self, barrier: object) -> None:
        if not isinstance(barrier, _barrier.DeviceBarrier):
            raise TypeError(
                f"barrier must be a vmmkv.ops.DeviceBarrier, got {type(barrier).__name__}"
            )

    def _check_op_tensors(self, caches: list[torch.Tensor], counters: list[torch.Tensor]) -> None:
        got = [c.data_ptr() for c in caches], [c.data_ptr() for c in counters]
        if got != (self._cache_ptrs, self._counter_ptrs):
            raise RuntimeError(
                f"vmmkv: a prepared store op got cache/counter tensors at {got} instead of "
                f"{(self._cache_ptrs, self._counter_ptrs)}: torch.compile replaced them by "
                f"copies (e.g. two targets' caches are different views of one storage). Give "
                f"every target the same cache tensor (the whole own region)."
            )


def _compile_values(p: PreparedStore) -> Callable[[Any, Any, Any], tuple[int, int, tuple]]:
    """``p._values(inputs, slot_mapping, num_local_only)``: validate one call and return the
    token count, the grid and the kernel's per-call parameters (without the barrier's).

    The function is generated for the binding (as ``dataclasses`` generates ``__init__``): each
    input's checks are written out with its constants, which costs a quarter less than a loop
    over ``p._specs``. Every tensor attribute is read once (dtype by identity, the device by
    ``get_device()`` against ``p.ordinal``); on any failed check ``p._explain_*`` raise the
    TypeError/ValueError of the functional API. The source holds only ints from the formats
    table and the targets."""
    n = len(p._specs)
    src = [
        "def _values(inputs, s, nlo):",
        "    if not (",
        "        isinstance(s, Tensor)",
        "        and ((sdt := s.dtype) is I64 or sdt is I32)",
        "        and len(sh := s.shape) == 1",
        f"        and s.get_device() == {int(p.ordinal)}",
        "        and (sh[0] <= 1 or s.stride()[0] == 1)",
        "    ):",
        "        explain_slots(s, device)",
        "    tokens = sh[0]",
        "    if type(nlo) is not int or not 0 <= nlo <= tokens:",
        "        require_int('num_local_only', nlo, 0, tokens)",
        f"    if not isinstance(inputs, (tuple, list)) or len(inputs) != {n}:",
        "        explain_inputs(inputs, names)",
        f"    {''.join(f'x{i}, ' for i in range(n))}= inputs",
    ]
    # no reference to p (the function is p's attribute: a cycle would outlive the last user)
    env: dict[str, Any] = {
        "Tensor": torch.Tensor, "I64": torch.int64, "I32": torch.int32, "device": p.device,
        "names": p._names, "require_int": require_int, "explain_slots": _explain_slots,
        "explain_inputs": _explain_inputs, "explain_input": _explain_input,
    }  # fmt: skip
    params = []
    for i, spec in enumerate(p._specs):
        _, dtype, width, row_align, align = spec
        env[f"D{i}"], env[f"S{i}"] = dtype, spec
        x, h, r, a = f"x{i}", f"h{i}", f"r{i}", f"a{i}"
        checks = [
            f"isinstance({x}, Tensor)",
            f"{x}.dtype is D{i}",
            f"len({h} := {x}.shape) == 2",
            f"{h}[1] == {int(width)}",
            f"{h}[0] >= tokens",
            f"({r} := {x}.stride())[1] == 1",
            f"{x}.get_device() == {int(p.ordinal)}",
            f"not ({a} := {x}.data_ptr()) % {int(align)}",
        ]
        if row_align > 1:
            checks.append(f"({h}[0] <= 1 or not {r}[0] % {int(row_align)})")
        src += ["    if not (", "        " + "\n        and ".join(checks), "    ):"]
        src.append(f"        explain_input(S{i}, {x}, tokens, device)")
        params += [a, f"{r}[0]"]
    # the grid of vmmkv.ops.kv._grid: one warp per token, at most p._max_grid CTAs, at least
    # one (a publish of zero tokens still runs the barrier)
    w, most = _kv._WARPS_PER_CTA, int(p._max_grid)
    src += [
        f"    grid = (tokens + {w - 1}) // {w}",
        f"    if grid > {most}:",
        f"        grid = {most}",
        "    elif not grid:",
        "        grid = 1",
    ]
    slots = ["s.data_ptr()", "sdt is I64", "tokens", "nlo"]
    if p.kinds == ("rows",):  # row bytes before the slots; 16-byte vectors when all aligned
        vec16 = "(a0 % 16 == 0 and (tokens <= 1 or r0[0] % 16 == 0))" if p._rows_fixed16 else "0"
        params += [str(int(p.targets[0].entry_bytes)), *slots, vec16]
    else:
        params += slots
        if any(k in INDEXER_KINDS for k in p.kinds):  # the stores that write an indexer view
            params.append(str(int(p.ue8m0)))
    src.append(f"    return tokens, grid, ({', '.join(params)},)")
    exec("\n".join(src), env)  # noqa: S102 -- our own text, see the docstring
    return env["_values"]


# the reasons of a failed check in _compile_values' function (each raises)


def _explain_slots(s: Any, device: torch.device) -> None:
    _kv._check_slots(s, device)
    raise AssertionError("slot_mapping: no reason found for a failed check")  # pragma: no cover


def _explain_inputs(inputs: Any, names: tuple[str, ...]) -> None:
    raise TypeError(
        f"inputs must be a tuple of {len(names)} tensors {names}, got {type(inputs).__name__} "
        f"{inputs!r:.80}"
    )


def _explain_input(spec: tuple, t: Any, tokens: int, device: torch.device) -> None:
    name, dtype, width, _, align = spec
    check_store_input(name, t, dtype, width, tokens=tokens, contiguous_rows=True, device=device)
    _kv._check_aligned(name, t, align)
    raise AssertionError(f"{name}: no reason found for a failed check")  # pragma: no cover


class HostPreparedStore(_Prepared):
    """Prepared stores into CPU targets (host backend) through ``vmmkv.ops.host``."""

    def __init__(self, targets: tuple[_kv.KVTarget, ...], kinds: tuple[str, ...], ue8m0: bool):
        from vmmkv.ops import host

        super().__init__(targets, kinds, ue8m0)
        # the host stores take every kind of their shape (the target's kind picks the scales)
        if len(kinds) == 2:
            self._fn = host.store_layer
        elif kinds[0] in MLA_KINDS:
            self._fn = host.store_ds_mla
        elif kinds[0] in INDEXER_KINDS:
            self._fn = host.store_indexer_k
        else:
            self._fn = host.publish_rows

    def __repr__(self) -> str:
        return f"HostPreparedStore(kinds={self.kinds})"

    def store(
        self, inputs: Sequence[torch.Tensor], slot_mapping: torch.Tensor, num_local_only: int = 0
    ) -> None:
        if not isinstance(inputs, (tuple, list)) or len(inputs) != len(self._names):
            raise TypeError(
                f"inputs must be a tuple of {len(self._names)} tensors {self._names}, got "
                f"{type(inputs).__name__}"
            )
        kw: dict[str, Any] = {"num_local_only": num_local_only}
        if any(k in INDEXER_KINDS for k in self.kinds):
            kw["ue8m0"] = self.ue8m0
        self._fn(*self.targets, *inputs, slot_mapping, **kw)

    def publish(
        self,
        inputs: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        num_local_only: int,
        barrier: Any,
        lane: int,
    ) -> None:
        """``store``, then ``barrier.arrive_and_wait(lane)`` (any host barrier object)."""
        if not callable(getattr(barrier, "arrive_and_wait", None)):
            raise TypeError(
                f"barrier must have an arrive_and_wait(lane) method, got {type(barrier).__name__}"
            )
        self.store(inputs, slot_mapping, num_local_only)
        barrier.arrive_and_wait(lane)


# ---------------------------------------------------------------------------------------------
# torch.library custom ops (torch.compile path; also callable directly, eager or under capture)


@torch.library.custom_op("vmmkv::prepared_store", mutates_args=("caches", "counters"))
def _op_prepared_store(
    caches: list[torch.Tensor],
    counters: list[torch.Tensor],
    inputs: list[torch.Tensor],
    slot_mapping: torch.Tensor,
    handle: int,
    num_local_only: int,
) -> None:
    p = lookup(handle)
    p._check_op_tensors(caches, counters)
    p.store(tuple(inputs), slot_mapping, num_local_only)


@_op_prepared_store.register_fake
def _(caches, counters, inputs, slot_mapping, handle, num_local_only):
    return None


@torch.library.custom_op(
    "vmmkv::prepared_publish", mutates_args=("caches", "counters", "epochs", "arrivals")
)
def _op_prepared_publish(
    caches: list[torch.Tensor],
    counters: list[torch.Tensor],
    epochs: torch.Tensor,
    arrivals: torch.Tensor,
    inputs: list[torch.Tensor],
    slot_mapping: torch.Tensor,
    handle: int,
    barrier_handle: int,
    lane: int,
    num_local_only: int,
) -> None:
    p = lookup(handle)
    p._check_op_tensors(caches, counters)
    bar = _barrier.lookup(barrier_handle)
    if epochs.data_ptr() != bar.epochs.data_ptr() or arrivals.data_ptr() != bar.arrivals.data_ptr():
        raise RuntimeError(
            "vmmkv::prepared_publish got epochs/arrivals other than its barrier's: "
            "torch.compile replaced them by copies"
        )
    p.publish(tuple(inputs), slot_mapping, num_local_only, bar, lane)


@_op_prepared_publish.register_fake
def _(caches, counters, epochs, arrivals, inputs, slot_mapping, handle, bh, lane, nlo):
    return None
