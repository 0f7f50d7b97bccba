"""pstrain benchmarks: `python -m bench` measures the machine's limits, the transport,
a parameter-server step against gloo all-reduce, training throughput against DDP and a
single process, the operator against the Kubernetes emulator, and (with a GPU) the
worker step on CUDA. Not part of the test suite."""
