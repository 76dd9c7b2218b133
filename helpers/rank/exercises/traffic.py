"""Inside a rank: what the learner's code asked the process groups to do, counted where every call ends up.

However a learner reaches torch.distributed (``dist.all_reduce``, ``from torch.distributed import all_reduce as ar``,
``dist.all_reduce_coalesced``, ``dist.all_gather_object``, ``dist.batch_isend_irecv`` with ``dist.P2POp``), the
work lands in a method of the ``ProcessGroup`` object, so :class:`Traffic` wraps those methods on the class (never
``dist.isend`` itself: ``P2POp`` checks that its op *is* ``dist.isend``). A collective that reaches the group below
Python (``torch.distributed._functional_collectives``) still advances the group's sequence number, which every call,
point-to-point or collective, advances by one: more steps of that number than calls seen are collectives unseen.

Example::

    with Traffic() as traffic:
        answer(tensor)
    traffic.sent_bytes, traffic.collectives(), traffic.elements("allreduce")
"""
from __future__ import annotations

import torch
import torch.distributed as dist

try:
    from torch._C._distributed_c10d import ProcessGroup
except ImportError:  # pragma: no cover - torch built without distributed
    ProcessGroup = None

P2P = ("send", "recv", "recv_anysource")
# every ProcessGroup method that moves data between ranks (those a torch version lacks are skipped)
COLLECTIVES = ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base",
               "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single",
               "all_gather_single_coalesced", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
               "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
               "all_to_all_single", "gather", "gather_into_tensor", "gather_single", "scatter")
NOT_DATA = ("barrier", "monitored_barrier")  # synchronise, move nothing: allowed anywhere
UNSEEN = "collective below torch.distributed's Python functions"

# the ProcessGroup method -> the torch.distributed function a learner knows it by
DIST_NAMES = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced", "allgather": "all_gather",
              "_allgather_base": "all_gather_into_tensor", "allgather_coalesced": "all_gather_coalesced",
              "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
              "_reduce_scatter_base": "reduce_scatter_tensor", "alltoall": "all_to_all",
              "alltoall_base": "all_to_all_single", "all_gather_single": "all_gather_into_tensor",
              "reduce_scatter_single": "reduce_scatter_tensor"}


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


INPUT_FIRST = P2P + NOT_DATA + ("allreduce", "allreduce_coalesced", "broadcast", "reduce")


def _payload(name: str, args) -> tuple[int, int]:
    """(elements, bytes) this call contributes: the tensors of its input argument, the first (send, all-reduce,
    broadcast, reduce) or, for the gathers, scatters and all-to-alls, whose outputs come first, the second."""
    inputs = (args[0] if args else ()) if name in INPUT_FIRST or len(args) < 2 else args[1]
    tensors = list(_tensors(inputs))
    return sum(t.numel() for t in tensors), sum(t.numel() * t.element_size() for t in tensors)


class Traffic:
    """A context in which every ProcessGroup call of this process is recorded as ``(op, elements, bytes)``."""

    def __init__(self):
        self.calls: list[tuple[str, int, int]] = []
        self._saved: dict[str, object] = {}
        self._seq0, self._default, self._on_default, self.unseen = None, None, 0, 0

    @staticmethod
    def _sequence() -> int | None:
        try:
            return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
        except Exception:  # noqa: BLE001 - an older torch, or no default group: the seen calls still count
            return None

    def __enter__(self) -> "Traffic":
        for name in P2P + COLLECTIVES + NOT_DATA:
            real = getattr(ProcessGroup, name, None)
            if real is None:
                continue
            # restored as the class held it: pybind11 keeps a method as an ``instancemethod`` descriptor, and
            # getattr on the class returns the bare function, which set back would no longer bind ``self``
            self._saved[name] = ProcessGroup.__dict__[name]

            def wrapped(group, *args, _name=name, _real=real, **kwargs):
                elements, size = _payload(_name, args)
                self.calls.append((_name, elements, size))
                self._on_default += group is self._default
                return _real(group, *args, **kwargs)
            setattr(ProcessGroup, name, wrapped)
        try:
            self._default = dist.distributed_c10d._get_default_group()
        except Exception:  # noqa: BLE001 - no default group
            self._default = None
        self._seq0 = self._sequence()
        return self

    def __exit__(self, *exc) -> None:
        seq = self._sequence()
        self.unseen = 0 if seq is None or self._seq0 is None else max(0, seq - self._seq0 - self._on_default)
        for name, real in self._saved.items():
            setattr(ProcessGroup, name, real)
        self._saved.clear()

    @property
    def sent_bytes(self) -> int:
        return sum(size for name, _, size in self.calls if name == "send")

    def collectives(self) -> list[str]:
        """The data-moving collectives called, by their torch.distributed names (sorted, once each)."""
        names = {DIST_NAMES.get(name, name) for name, _, _ in self.calls if name in COLLECTIVES}
        return sorted(names) + ([UNSEEN] if self.unseen else [])

    def elements(self, op: str) -> list[int]:
        """The elements of each call of ProcessGroup method ``op``, in order."""
        return [n for name, n, _ in self.calls if name == op]
