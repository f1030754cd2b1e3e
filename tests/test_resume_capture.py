"""What a worker captures for resume with each batch, and that with `stateful=False` it
captures nothing (tests/test_resume.py covers the exactness of what is captured).

Each worker's init function replaces the worker's capture of its random state with one
that raises, so any capture shows as a batch error.
"""
from __future__ import annotations

import pytest
import torch
from _resume_cases import StateFailsDataset

from poolloader import PoolLoader
from poolloader.resume import keys as resume


def _capture_fails(*_args, **_kwargs):
    raise RuntimeError("a worker captured its random state")


def _no_capture_in_this_worker(_worker_id):
    resume.capture_rng = _capture_fails


@pytest.mark.parametrize("stateful", [True, False])
def test_stateful_false_captures_nothing_in_workers(stateful):
    # its state_dict() raises once item 5 was served: only a capture would call it
    loader = PoolLoader(StateFailsDataset(n=12, bad=5), batch_size=2, num_workers=2,
                        worker_init_fn=_no_capture_in_this_worker, stateful=stateful)
    it = iter(loader)
    if stateful:
        with pytest.raises(RuntimeError, match="captured its random state"):
            next(it)
        del it
        return
    got = [batch.view(-1).tolist() for batch in it]
    assert got == [[2 * k, 2 * k + 1] for k in range(6)]
    # no reply carried a record, and main kept none
    assert loader._resume_tracker.delivered == [None, None]
    assert loader._resume_tracker.latest == [(-1, None), (-1, None)]


def test_stateful_false_state_dict_is_empty_with_a_warning_naming_the_knob():
    loader = PoolLoader(torch.arange(10.0), batch_size=2, num_workers=2, stateful=False)
    it = iter(loader)
    next(it)
    with pytest.warns(UserWarning, match=r"stateful=False.*returns \{\}.*Pass stateful=True"):
        assert loader.state_dict() == {}
    assert loader.state_dict() == {}  # warned once
    assert len(list(it)) == 4
    with pytest.raises(ValueError, match="stateful must be True or False, got 'yes'"):
        PoolLoader(torch.arange(4.0), num_workers=1, stateful="yes")
