"""The `__next__` of poolloader's multi-process iterators (PoolLoaderIter, and a
share_batches follower's FollowerIter), written once: DataLoader's, with the
iterator's ResumeTracker told how each call ended (a batch delivered, the epoch over,
or an exception: a batch a device stager already holds is not lost with it)."""
from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
from torch.utils.data.dataloader import _DatasetKind

from poolloader.resume.tracker import ResumeTracker

# The one adapter over torch's profiler internals: torch has no public "is anything
# recording" call. torch.autograd._profiler_enabled is the check torch's own datapipes
# make before entering record_function; the CUPTI monitor module, once imported, keeps
# its started monitor in _monitor_singleton (record_function feeds it annotations).
_CUPTI_MONITOR = "torch.profiler._cupti_monitor"


def _annotated() -> bool:
    """Whether torch's `record_function` would be seen: a profiler (torch.profiler or
    torch.autograd.profiler) is on, or torch's CUPTI monitor, which record_function
    feeds user annotations, has been started. Otherwise entering it only costs time
    (about 7 µs a call, a tenth of a ready batch's next())."""
    if torch.autograd._profiler_enabled():
        return True
    monitor = sys.modules.get(_CUPTI_MONITOR)
    return monitor is not None and getattr(monitor, "_monitor_singleton", None) is not None


class TrackedNext:
    """Mixed in before torch's iterator class. `_entering()` runs as a call starts and
    `_delivered(mark)` with its result after a batch (an iterator's statistics).

    `__next__` is torch's `_BaseDataLoaderIter.__next__` (the `_reset` of a first call,
    `_next_data`, `_num_yielded`, the IterableDataset length warning), with its
    `record_function(self._profile_name)` region entered only while a profiler can
    record it, as torch's datapipes do."""

    _resume: ResumeTracker
    _stager: Any
    # torch's _BaseDataLoaderIter's
    _profile_name: str
    _sampler_iter: Any
    _reset: Any
    _next_data: Any
    _num_yielded: int
    _dataset: Any
    _dataset_kind: Any
    _IterableDataset_len_called: Any
    _num_workers: int

    def __next__(self):
        mark = self._entering()
        try:
            if _annotated():
                with torch.autograd.profiler.record_function(self._profile_name):
                    data = self._next_counted()
            else:
                data = self._next_counted()
        except StopIteration:
            self._resume.finish()
            raise
        except BaseException:
            self._resume.raised(staged=self._stager is not None)
            raise
        self._resume.commit()
        self._delivered(mark)
        return data

    def _next_counted(self):
        """torch's __next__ inside its record_function region."""
        if self._sampler_iter is None:
            self._reset()
        data = self._next_data()
        self._num_yielded += 1
        if (self._dataset_kind == _DatasetKind.Iterable
                and self._IterableDataset_len_called is not None
                and self._num_yielded > self._IterableDataset_len_called):
            self._warn_length()
        return data

    def _warn_length(self) -> None:
        # torch's words; stacklevel 4: the caller of __next__
        warn_msg = (
            f"Length of IterableDataset {self._dataset} was reported to be "
            f"{self._IterableDataset_len_called}"
            f"(when accessing len(dataloader)), but {self._num_yielded} samples have been "
            "fetched. ")
        if self._num_workers > 0:
            warn_msg += (
                "For multiprocessing data-loading, this could be caused by not properly "
                "configuring the IterableDataset replica at each worker. Please see "
                "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                "for examples.")
        warnings.warn(warn_msg, stacklevel=4)

    def _entering(self) -> Any:
        return None

    def _delivered(self, mark: Any) -> None:
        pass
