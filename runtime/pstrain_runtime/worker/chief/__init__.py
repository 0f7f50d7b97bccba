"""The chief's duties (worker 0 trains like every worker, and also): initialises the
servers, fresh or from the latest checkpoint, and recovers restarted ones (`restore`);
reads the global step (kept by parameter server 0, one increment per applied update);
writes checkpoints every `checkpoint.intervalSteps`, when asked and at the end
(`checkpoint_schedule`); evaluates every `evalIntervalSteps` and at the end
(`evaluation`); reports progress events and status to server 0 for the operator
(`progress`); and finally marks the job done and shuts the servers down (`finish`).
`duties.ChiefDuties` gathers them for `Trainer`. Its events' scalars also go to
TensorBoard event files beside the checkpoints (`tensorboard`, attached by `replica`)."""

__all__: list[str] = []
