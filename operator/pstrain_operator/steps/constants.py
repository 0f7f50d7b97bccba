"""The reasons the reconcile steps write into conditions and events, and how soon a
pass asks to be run again. One place, so a reason is never spelled twice."""

# How soon to look again when nothing else (a pod or job event) wakes the operator.
REQUEUE_STARTING_S = 5.0
REQUEUE_RUNNING_S = 10.0  # progress is refreshed at least this often while Running
REQUEUE_CLEANUP_S = 5.0

# Reasons (machine-readable, CamelCase) used in conditions and events.
R_INVALID_SPEC = "InvalidSpec"
R_SPEC_VALID = "SpecValid"
R_PODS_CREATED = "PodsCreated"
R_CREATED_SERVICE = "CreatedService"
R_CREATED_PS = "CreatedPS"
R_WAITING_FOR_PS = "WaitingForPS"
R_STARTED_WORKERS = "StartedWorkers"
R_STARTED_CHIEF = "StartedChief"
R_ALL_STARTED = "AllReplicasStarted"
R_RESTARTING = "RestartingReplica"
R_RESTARTING_STALLED = "RestartingStalled"
R_WAITING_FOR_RESTART = "WaitingForRestartedReplicas"
R_CHIEF_SUCCEEDED = "ChiefSucceeded"
R_DEADLINE = "DeadlineExceeded"
R_SUSPENDED = "JobSuspended"
R_RESUMED = "JobResumed"
R_SPEC_REJECTED = "SpecChangeNotApplicable"
R_SPEC_APPLIED = "SpecApplied"
R_CLEANUP = "CleanedUpPods"
R_TTL = "TTLExpired"
R_UNEXPECTED_POD = "UnexpectedPod"
