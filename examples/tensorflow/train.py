"""A TensorFlow 2 parameter-server program that knows nothing about pstrain.

It is the program of examples/tf-ps.yaml (docs/tensorflow.md): TensorFlow's own
`ParameterServerStrategy` with a custom training loop, as in TensorFlow's parameter
server training tutorial. Everything it knows about the job comes from `TF_CONFIG`,
which pstrain gives every replica:

- a parameter server or a worker starts a `tf.distribute.Server` and serves until it is
  stopped (it never exits by itself; pstrain stops it once the chief has succeeded);
- the chief is the coordinator: it places the variables on the parameter servers,
  schedules training steps on the workers, prints the loss and exits 0.

The model is a logistic regression on synthetic data (features drawn at random, labels
from a fixed hidden weight vector), so the program needs no data set and its loss falls
visibly within a few hundred steps.

    python train.py [--steps N] [--batch-size N] [--learning-rate X]

In a TrainingJob it is mounted from a ConfigMap:

    kubectl create configmap tf-ps-program --from-file=train.py=examples/tensorflow/train.py
"""

from __future__ import annotations

import argparse
import os

# Workers and parameter servers: a failed call to a peer returns to the caller (the
# coordinator retries it) instead of waiting; TensorFlow's tutorial sets it on every task.
os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")

import tensorflow as tf  # noqa: E402 (after GRPC_FAIL_FAST, which TensorFlow reads once)

FEATURES = 16
SEED = 0


def serve(resolver: tf.distribute.cluster_resolver.TFConfigClusterResolver) -> None:
    """A parameter server or worker: TensorFlow's in-process server, until stopped."""
    server = tf.distribute.Server(
        resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id,
        protocol=resolver.rpc_layer or "grpc", start=True)
    print(f"{resolver.task_type} {resolver.task_id} serving at {server.target}", flush=True)
    server.join()


def batches(batch_size: int, pipeline: int) -> tf.data.Dataset:
    """Endless batches of (features, label), different for each worker's `pipeline`:
    label 1 where the hidden weights (the same everywhere) say so."""
    hidden = tf.random.stateless_normal([FEATURES, 1], seed=[SEED, 1])

    def batch(step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        seed = tf.stack([tf.constant(SEED + 2 + pipeline, tf.int64), step])
        x = tf.random.stateless_normal([batch_size, FEATURES], seed=seed)
        return x, tf.cast(tf.matmul(x, hidden) > 0, tf.float32)

    return tf.data.Dataset.counter().map(batch).prefetch(2)


def coordinate(resolver: tf.distribute.cluster_resolver.TFConfigClusterResolver,
               steps: int, batch_size: int, learning_rate: float) -> float:
    """The chief: variables on the parameter servers, steps on the workers; the last
    step's loss."""
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        weights = tf.Variable(tf.zeros([FEATURES, 1]), name="weights")
        bias = tf.Variable(tf.zeros([1]), name="bias")

    @tf.function
    def per_worker_dataset() -> tf.distribute.DistributedDataset:
        return strategy.distribute_datasets_from_function(
            lambda context: batches(batch_size, context.input_pipeline_id))

    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset))

    @tf.function
    def step(iterator: tf.distribute.DistributedIterator) -> tf.Tensor:
        def replica_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                logits = tf.matmul(x, weights) + bias
                loss = tf.reduce_mean(
                    tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits))
            grad_w, grad_b = tape.gradient(loss, [weights, bias])
            weights.assign_sub(learning_rate * grad_w)
            bias.assign_sub(learning_rate * grad_b)
            return loss

        x, y = next(iterator)
        return strategy.run(replica_step, args=(x, y))

    loss = None
    for number in range(1, steps + 1):
        loss = coordinator.schedule(step, args=(iterator,))
        if number % 100 == 0 or number == steps:
            coordinator.join()  # wait for the steps scheduled so far
            print(f"step {number}/{steps} loss {float(loss.fetch()):.4f}", flush=True)
    coordinator.join()
    return float(loss.fetch()) if loss is not None else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=0.5)
    args = parser.parse_args()
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("ps", "worker"):
        serve(resolver)
        return
    loss = coordinate(resolver, args.steps, args.batch_size, args.learning_rate)
    print(f"done: {args.steps} steps, loss {loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
