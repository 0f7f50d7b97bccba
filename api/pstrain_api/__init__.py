"""pstrain's shared core: the TrainingJob API, names, the cluster spec, the CRD and the
CLI. Imports neither kopf, kubernetes, grpc nor torch."""

__version__ = "0.1.0"
