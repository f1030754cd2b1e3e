"""The `__next__` of poolloader's multi-process iterators (PoolLoaderIter, and a
share_batches follower's FollowerIter), written once: DataLoader's, with the
iterator's ResumeTracker told how each call ended (a batch delivered, the epoch over,
or an exception: a batch a device stager already holds is not lost with it)."""
from __future__ import annotations

from typing import Any

from poolloader.resume.tracker import ResumeTracker


class TrackedNext:
    """Mixed in before torch's iterator class. `_entering()` runs as a call starts and
    `_delivered(mark)` with its result after a batch (an iterator's statistics)."""

    _resume: ResumeTracker
    _stager: Any

    def __next__(self):
        mark = self._entering()
        try:
            data = super().__next__()
        except StopIteration:
            self._resume.finish()
            raise
        except BaseException:
            self._resume.raised(staged=self._stager is not None)
            raise
        self._resume.commit()
        self._delivered(mark)
        return data

    def _entering(self) -> Any:
        return None

    def _delivered(self, mark: Any) -> None:
        pass
