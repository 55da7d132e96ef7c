"""Counting the places where a decoding step would wait for the device.

On a GPU, the host waits for the device whenever it reads a tensor's values (`.item()`,
`bool(t)`, `.tolist()`, `.cpu()`) or runs an op whose output size depends on the values (a
boolean-mask index, `nonzero`, `masked_select`): every such point is a host sync that stalls the
launch queue. `HostSyncs` counts them wherever the code runs, a CPU included, by what is asked
for, not by what the device does: a CPU test can then hold the step's count down for every
family, and a benchmark can show where they are (`by_site`).
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READS = {
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.item.default,
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
}
_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default}


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices or ())


class HostSyncs(TorchDispatchMode):
    """Context manager: `count` host syncs while active, `by_site` where (file:line:function of
    the innermost fastdllm frame)."""

    def __init__(self, sites: bool = False):
        super().__init__()
        self.count, self.sites, self.by_site = 0, sites, collections.Counter()
        self._tolist = None

    def _record(self, what: str) -> None:
        self.count += 1
        if self.sites:
            here = next(
                (
                    f
                    for f in reversed(traceback.extract_stack()[:-2])
                    if "/fastdllm/" in f.filename and "host_syncs" not in f.filename
                ),
                None,
            )
            where = f"{here.filename.rsplit('/fastdllm/', 1)[-1]}:{here.lineno} {here.name}" if here else "?"
            self.by_site[f"{where} ({what})"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            self._record(func.__name__)
        elif func in _INDEXING and _bool_index(args):
            self._record("boolean index")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        # .tolist() reads the values without passing through the dispatcher
        self._tolist = original = torch.Tensor.tolist
        mode = self

        def tolist(t):
            mode._record("tolist")
            return original(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)
