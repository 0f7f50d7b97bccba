"""The local runner, `pstrain run`: a TrainingJob as processes on this machine.

Modules: `supervisor` (pure lifecycle decisions), `metrics` (pure progress and summary),
`render` (what the user sees), `processes` (spawning, pipes, health probes, signals),
`runner` (the loop tying them together) and `cli` (`pstrain run`).
"""
