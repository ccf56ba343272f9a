"""Build a mesh, place a model's parameters by rule, shard a batch and print the layout.

Command (no arguments: 8 fake CPU devices, a ``data=-1`` mesh, FSDP parameters, and
the scikit-learn digits images as the batch)::

    python -m recipes.sharding_demo
    python -m recipes.sharding_demo --mesh data=4,model=2 --rules replicated

Expected result: a mesh report (8 cpu devices in 1 process), the parameter table
(``params/Dense_0/kernel`` of shape (64, 512) sharded ``P(None, 'data')``, 16.0 KiB
per device; leaves under 4096 elements replicated), the batch table (1792 digits,
56.0 KiB of images per device), and a loss computed under ``jax.jit`` equal to the
same loss on one device::

    loss on 8 devices: 2.3702  (1 device: 2.3702)

Runs unchanged on several processes (``meshkit.distributed.initialize`` detects the
launch); only process 0 prints.
"""

from __future__ import annotations

import argparse

import meshkit
from recipes._args import recipe_parser, setup_errors_in_one_line


def parse_args() -> argparse.Namespace:
    parser = recipe_parser(__doc__)
    parser.add_argument("--mesh", default="data=-1", help="mesh axes, e.g. data=4,model=2")
    parser.add_argument("--rules", choices=["fsdp", "replicated"], default="fsdp")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with setup_errors_in_one_line():  # a launch that cannot work: say why, in a line
        meshkit.distributed.initialize(cpu_devices=args.cpu_devices)

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from sklearn.datasets import load_digits

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x_BxD: jax.Array) -> jax.Array:
            h_BxH = nn.relu(nn.Dense(512)(x_BxD))
            return nn.Dense(10)(h_BxH)

    mesh = meshkit.make_mesh(args.mesh)
    rules = meshkit.PartitionRules.fsdp("data", min_size=4096)
    if args.rules == "replicated":
        rules = meshkit.PartitionRules()

    # Parameters: shapes from eval_shape, shardings from the rules, then built in place.
    model = MLP()
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 64)))
    param_shardings = meshkit.infer_shardings(abstract, mesh, rules)
    params = jax.jit(model.init, out_shardings=param_shardings)(
        jax.random.key(0), jnp.zeros((1, 64))
    )

    # The batch: this process's rows of the digits set, as one global array.
    images, labels = load_digits(return_X_y=True)
    batch_sharding = meshkit.batch_sharding(mesh)
    data_size = mesh.shape.get("data", 1)
    global_batch = len(labels) // data_size * data_size
    rows = meshkit.data_shard(batch_sharding, global_batch).slice
    local = {
        "image": (np.asarray(images)[:global_batch] / 16.0).astype(np.float32)[rows],
        "label": np.asarray(labels)[:global_batch].astype(np.int32)[rows],
    }
    batch = meshkit.shard_batch(local, batch_sharding, global_batch_size=global_batch)

    def loss_fn(params, batch):
        logits = model.apply(params, batch["image"])
        assert isinstance(logits, jax.Array)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss = jax.jit(
        loss_fn,
        in_shardings=(param_shardings, batch_sharding),
        out_shardings=NamedSharding(mesh, P()),
    )(params, batch)
    reference = loss_fn(meshkit.to_host(params), meshkit.to_host(batch))

    if jax.process_index() == 0:
        print(meshkit.describe(mesh), end="\n\n")
        print("parameters:\n" + meshkit.describe(params, show_mesh=False), end="\n\n")
        print("batch:\n" + meshkit.describe(batch, show_mesh=False), end="\n\n")
        print(f"loss on {mesh.size} devices: {float(loss):.4f}  (1 device: {float(reference):.4f})")


if __name__ == "__main__":
    main()
