"""Entry points that get the contract wrong in every way a user can, for the tests of
configuration errors (pstrain_runtime.task.load_task)."""
