"""The steps of one reconcile pass, each a pure function in a module named for it.

`reconcile.decide` runs them in this order:

- `observation`: what the pass starts from (our pods, the status to build on);
- `finished`: a finished job only cleans up; `finish` ends a job;
- `suspended`: no pods while suspended; a resume starts the clock again;
- `spec_change`: a change that cannot be applied live is refused;
- `deadline`: activeDeadlineSeconds;
- `refused_creates`: back off creates the API server refuses, give up in bounded time;
- `scale`: a scale removes workers; pods of no replica go; the worker set;
- `disruptions`: pods deleted or evicted from outside;
- `failures`: failed replicas are restarted, or fail the job;
- `success`: the chief completed;
- `stall_watchdog`: no progress for stallTimeoutSeconds;
- `start_order`: create what is missing, in order;
- `status`: phase, progress and when to look again.

Shared by the steps: `state` (the pass so far), `counts` (replica counts in the status),
`checkpoint_wait` (a pass that waits for a checkpoint), `constants` (reasons, delays),
`invalid_spec` (the InvalidSpec condition).
"""
