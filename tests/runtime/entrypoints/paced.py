"""The digits task at a bounded pace: every batch costs at least `seconds_per_batch`.

For process tests that act while training runs (kill a worker at step 50, ...): the
plain digits task can finish 600 sync steps in under a second on a fast machine, before
the first progress event after step 1 (one a second) is printed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

from pstrain_runtime.examples.digits import make_task as make_digits
from pstrain_runtime.task import Batch, Task


def make_task(seconds_per_batch: float = 0.01) -> Task:
    task = make_digits()

    def batches(*args: Any, **kwargs: Any) -> Iterator[Batch]:
        for batch in task.batches(*args, **kwargs):
            time.sleep(seconds_per_batch)
            yield batch

    return dataclasses.replace(task, batches=batches)
