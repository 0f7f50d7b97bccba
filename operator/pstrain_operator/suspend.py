"""What suspending and resuming a job really do to its training, in words and numbers.

Pure. Without `spec.training.checkpoint.directory` nothing survives the pods: training
restarts from step 0 on resume and every step done so far is lost. With one, training
continues from the newest checkpoint, and only the steps after it are lost. The steps
are the operator's last reading of the global step (at most one progress interval old).
"""

from __future__ import annotations

from pstrain_api.model import TrainingJob, TrainingJobStatus


def _steps(n: int) -> str:
    return f"{n} step" + ("" if n == 1 else "s")


def suspended(job: TrainingJob, st: TrainingJobStatus) -> tuple[str, int]:
    """The suspend event's message and the global steps the suspension throws away."""
    step = st.progress.global_step if st.progress else 0
    directory = job.spec.training.checkpoint.directory
    ckpt = st.last_checkpoint.step if directory and st.last_checkpoint else None
    if ckpt is None:
        why = ("spec.training.checkpoint.directory is not set" if not directory
               else "no checkpoint was written yet")
        lost = step
        tail = f"; the {_steps(step)} done so far are lost" if step else ""
        return (f"suspended: deleting all pods; {why}, so training restarts from step 0 on "
                f"resume{tail}"), lost
    lost = max(0, step - ckpt)
    tail = f" ({_steps(lost)} after it are lost)" if lost else ""
    return (f"suspended: deleting all pods; on resume training continues from the "
            f"checkpoint at step {ckpt}{tail}"), lost


def resumed(job: TrainingJob, st: TrainingJobStatus) -> tuple[str, int | None]:
    """The resume event's message and the step training continues from (None when it
    is not known: a checkpoint directory the operator never saw a checkpoint in)."""
    directory = job.spec.training.checkpoint.directory
    if not directory:
        return ("resumed: recreating pods; training restarts from step 0 "
                "(spec.training.checkpoint.directory is not set)"), 0
    if st.last_checkpoint is None:
        return (f"resumed: recreating pods; training continues from the newest checkpoint "
                f"in {directory}, or from step 0 if there is none"), None
    return (f"resumed: recreating pods; training continues from the checkpoint at step "
            f"{st.last_checkpoint.step}"), st.last_checkpoint.step
