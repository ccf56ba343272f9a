"""ResNet and ViT: reference parameter counts, shapes, batch norm, dropout, sharded steps."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshkit
from meshkit import train
from meshkit.models import (
    MODELS,
    BasicBlock,
    Bottleneck,
    ResNet,
    ResNet18,
    ResNet34,
    ResNet50,
    Transformer,
    ViT,
    ViTSmall,
    ViTTiny,
)


def abstract_variables(module, size: int, batch: int = 1):
    return jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((batch, size, size, 3)))


def num_params(variables) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(variables["params"]))


def init(module, x) -> Any:
    """``module.init`` op by op: for these small models, faster than compiling it whole."""
    return module.init(jax.random.key(0), x)


def tiny_resnet(**kwargs) -> ResNet:
    return ResNet18(**{"num_classes": 10, "width": 8, "stem": "cifar", **kwargs})


def tiny_vit(**kwargs) -> ViT:
    defaults = {"patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64}
    return ViT(num_classes=10, **{**defaults, **kwargs})


# The reference models' parameter counts (ImageNet, 1000 classes, 224×224 inputs).
REFERENCE_COUNTS = [
    pytest.param(ResNet18(), 11_689_512, id="resnet18"),
    pytest.param(ResNet34(), 21_797_672, id="resnet34"),
    pytest.param(ResNet50(), 25_557_032, id="resnet50"),
    pytest.param(ViTTiny(patch_size=16, image_size=224), 5_717_416, id="vit-ti16"),
    pytest.param(ViTSmall(patch_size=16, image_size=224), 22_050_664, id="vit-s16"),
]


@pytest.mark.once
@pytest.mark.parametrize(("module", "expected"), REFERENCE_COUNTS)
def test_parameter_counts_match_the_reference_architectures(module, expected):
    assert num_params(abstract_variables(module, 224)) == expected


@pytest.mark.once
def test_batch_stats_are_the_running_mean_and_variance_of_every_batch_norm():
    variables = abstract_variables(ResNet50(), 224)
    stats = variables["batch_stats"]
    norms = [path for path, _ in jax.tree_util.tree_leaves_with_path(stats)]
    assert len(norms) == 2 * 53  # 53 batch norms (49 in blocks, 4 projections): mean + var
    assert num_params({"params": stats}) == 2 * 26_560  # torchvision: 26,560 BN channels


@pytest.mark.once
@pytest.mark.parametrize(
    ("module", "size"),
    [
        pytest.param(ResNet18(num_classes=10, stem="cifar"), 32, id="resnet18-cifar-32"),
        pytest.param(ResNet50(num_classes=10, stem="cifar"), 32, id="resnet50-cifar-32"),
        pytest.param(ResNet18(num_classes=10), 224, id="resnet18-224"),
        pytest.param(ResNet50(num_classes=10), 224, id="resnet50-224"),
        pytest.param(ViTTiny(num_classes=10), 32, id="vit-tiny-32"),
        pytest.param(ViTSmall(num_classes=10, pool="gap"), 32, id="vit-small-gap-32"),
        pytest.param(ViTTiny(num_classes=10, patch_size=16), 224, id="vit-tiny-224"),
    ],
)
def test_output_shapes(module, size):
    def logits(x):
        out, _ = module.init_with_output(jax.random.key(0), x, train=False)
        return out

    out = jax.eval_shape(logits, jnp.zeros((3, size, size, 3)))
    assert out.shape == (3, 10) and out.dtype == jnp.float32


@pytest.mark.once
def test_stems_and_feature_map_sizes():
    cifar = abstract_variables(ResNet18(stem="cifar"), 32)["params"]["stem_conv"]["kernel"]
    imagenet = abstract_variables(ResNet18(), 32)["params"]["stem_conv"]["kernel"]
    assert cifar.shape == (3, 3, 3, 64) and imagenet.shape == (7, 7, 3, 64)
    model = ResNet18(stem="cifar", width=4)
    _, state = jax.eval_shape(
        lambda x: model.init_with_output(
            jax.random.key(0), x, capture_intermediates=lambda m, _: m.name == "stage4_block2"
        ),
        jnp.zeros((1, 32, 32, 3)),
    )
    (features,) = state["intermediates"]["stage4_block2"]["__call__"]
    assert features.shape == (1, 4, 4, 32)  # 32 / 8 after three strided stages


@pytest.mark.once
@pytest.mark.parametrize(("block", "channels"), [(BasicBlock(4), 4), (Bottleneck(2), 8)])
def test_each_residual_block_starts_as_the_identity(block, channels):
    """With zero_init_residual the block's last batch-norm scale starts at 0: on
    non-negative inputs, out = in."""
    x = jnp.abs(jax.random.normal(jax.random.key(1), (2, 4, 4, channels)))
    block = block.clone(zero_init_residual=True)
    out, variables = block.init_with_output(jax.random.key(0), x)
    np.testing.assert_array_equal(out, x)
    last = "bn2" if isinstance(block, BasicBlock) else "bn3"
    assert not np.any(variables["params"][last]["scale"])
    assert np.all(variables["params"]["bn1"]["scale"] == 1)
    plain = block.clone(zero_init_residual=False)
    out, _ = plain.init_with_output(jax.random.key(0), x)
    assert not np.allclose(out, x)


@pytest.mark.once
def test_batch_norm_updates_in_training_and_uses_running_averages_in_evaluation():
    model = tiny_resnet(stage_sizes=(1, 1))
    images = jax.random.normal(jax.random.key(1), (6, 8, 8, 3)) * 3 + 1
    variables = init(model, images)
    apply = jax.jit(model.apply, static_argnames=("train", "mutable"))
    logits, updated = apply(variables, images, train=True, mutable=("batch_stats",))
    assert logits.shape == (6, 10)
    before, after = variables["batch_stats"], updated["batch_stats"]
    # The stem's batch norm sees the stem convolution's output: running mean and
    # variance move from (0, 1) a tenth of the way to the batch's (momentum 0.9).
    stem = jax.lax.conv_general_dilated(
        images,
        jnp.asarray(variables["params"]["stem_conv"]["kernel"]),
        window_strides=(1, 1),
        padding=((1, 1), (1, 1)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    stem = np.asarray(stem, np.float64)
    np.testing.assert_allclose(
        after["stem_bn"]["mean"], 0.1 * stem.mean(axis=(0, 1, 2)), rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(
        after["stem_bn"]["var"], 0.9 + 0.1 * stem.var(axis=(0, 1, 2)), rtol=1e-4, atol=1e-5
    )
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        assert not np.allclose(old, new)
    # Evaluation uses no batch statistics: an example's logits do not depend on the
    # rest of its batch. Training does.
    others = images.at[1:].set(images[1:] * 2 - 3)
    evaluated = apply(variables, images, train=False)
    np.testing.assert_allclose(
        apply(variables, others, train=False)[0], evaluated[0], rtol=1e-5, atol=1e-5
    )
    trained = apply(variables, others, train=True, mutable=("batch_stats",))[0]
    assert not np.allclose(trained[0], logits[0], atol=1e-4)


@pytest.mark.once
def test_vit_dropout_only_in_training():
    model = tiny_vit(depth=1, dropout_rate=0.5)
    images = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
    variables = init(model, images)
    # A non-zero head, so the logits show what dropout does to the features.
    variables["params"]["head"]["kernel"] = jnp.ones((32, 10))
    apply = jax.jit(model.apply, static_argnames="train")
    evaluation = apply(variables, images)
    np.testing.assert_array_equal(evaluation, apply(variables, images, train=False))

    def trained(seed):
        return apply(variables, images, train=True, rngs={"dropout": jax.random.key(seed)})

    np.testing.assert_array_equal(trained(0), trained(0))
    assert not np.allclose(trained(0), trained(1))
    assert not np.allclose(trained(0), evaluation)


@pytest.mark.once  # the same at any device count
def test_vit_head_starts_at_zero_and_class_token_versus_average_pool():
    images = jnp.ones((2, 8, 8, 3))
    token = init(tiny_vit(depth=1), images)["params"]
    gap = abstract_variables(tiny_vit(depth=1, pool="gap"), 8)["params"]
    assert token["pos_embedding"].shape == (1, 5, 32) and "cls_token" in token
    assert gap["pos_embedding"].shape == (1, 4, 32) and "cls_token" not in gap
    logits = jax.jit(tiny_vit(depth=1).apply)({"params": token}, images)
    np.testing.assert_array_equal(logits, np.zeros((2, 10)))


def test_bfloat16_compute_keeps_float32_parameters():
    for module, size in ((tiny_resnet(dtype=jnp.bfloat16), 8), (tiny_vit(dtype=jnp.bfloat16), 8)):
        out, variables = jax.eval_shape(
            lambda x, m=module: m.init_with_output(jax.random.key(0), x),
            jnp.zeros((2, size, size, 3)),
        )
        assert out.dtype == jnp.bfloat16
        assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}


@pytest.mark.once
@pytest.mark.parametrize(
    ("module", "shape", "message"),
    [
        (tiny_vit(patch_size=3), (1, 8, 8, 3), "patch_size=3 does not divide"),
        (tiny_vit(image_size=32), (1, 16, 16, 3), "built for 32×32 images"),
        (tiny_vit(num_heads=3), (1, 8, 8, 3), "not divisible by num_heads=3"),
        (tiny_vit(pool="max"), (1, 8, 8, 3), "pool must be 'token' or 'gap'"),
        (tiny_resnet(stem="tiny"), (1, 8, 8, 3), "stem must be 'imagenet' or 'cifar'"),
        (tiny_resnet(), (8, 8, 3), r"expects images of shape \(batch, height"),
    ],
)
def test_bad_configurations_say_what_to_change(module, shape, message):
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(module.init, jax.random.key(0), jnp.zeros(shape))


@pytest.mark.once
def test_models_are_registered_by_name():
    assert MODELS["resnet18"] is ResNet18 and MODELS["resnet50"] is ResNet50
    assert MODELS["vit_tiny"] is ViTTiny and MODELS["vit_small"] is ViTSmall
    assert MODELS["vit_tiny"](num_classes=3).num_classes == 3


# ----------------------------------------------------------------- sharded steps


def two_steps(module, mesh, rules):
    """Two SGD steps on a fixed batch of 16 random 8×8 images; the two losses and state."""
    sharding = meshkit.batch_sharding(mesh)
    rng = np.random.default_rng(0)
    batch = meshkit.shard_batch(
        {
            "image": rng.normal(size=(16, 8, 8, 3)).astype(np.float32),
            "label": rng.integers(0, 10, 16).astype(np.int32),
        },
        sharding,
    )
    model = train.linen_model(module, jnp.zeros((1, 8, 8, 3)))
    state = train.create_train_state(model, optax.sgd(0.1, momentum=0.9), mesh, rules=rules)
    step = train.make_train_step(
        train.classification_loss, train.state_shardings_of(state), sharding
    )
    losses = []
    for _ in range(2):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))  # one step at a time: no queue of collectives
    return losses, state


MODULES = [  # small enough to compile in seconds: one block per stage, one encoder block
    pytest.param(lambda: tiny_resnet(stage_sizes=(1, 1)), id="resnet"),
    pytest.param(lambda: tiny_vit(depth=1), id="vit"),
]


@pytest.mark.devices(8)  # on one device FSDP is the replicated layout
@pytest.mark.parametrize("make_module", MODULES)
def test_fsdp_step_matches_the_replicated_layout(make_module):
    """Two steps, replicated and FSDP over 8 devices."""
    mesh = meshkit.make_mesh("data=-1")
    rules = meshkit.PartitionRules.fsdp("data", min_size=512)
    replicated, _ = two_steps(make_module(), mesh, None)
    fsdp, state = two_steps(make_module(), mesh, rules)
    assert all(math.isfinite(loss) for loss in replicated) and replicated[1] != replicated[0]
    assert int(state.step) == 2
    np.testing.assert_allclose(fsdp, replicated, rtol=1e-5)
    sharded = [leaf for leaf in jax.tree.leaves(state.params) if "data" in leaf.sharding.spec]
    assert sharded


@pytest.mark.once
def test_token_ids_outside_the_vocabulary_are_named_or_poison_the_output():
    model = Transformer(vocab_size=16, num_layers=1, num_heads=2, embed_dim=8, mlp_dim=16)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    expected = r"token id 300 at position \(0, 2\), outside the vocabulary \[0, 16\)"
    with pytest.raises(ValueError, match=expected):
        model.apply(variables, jnp.array([[1, 2, 300, 4]]))
    apply = jax.jit(model.apply)  # traced ids: no host check, NaN instead of another row
    assert np.isnan(np.asarray(apply(variables, jnp.array([[1, 2, -5, 4]])))).any()
    assert np.isnan(np.asarray(apply(variables, jnp.array([[1, 2, 16, 4]])))).any()
    assert np.isfinite(np.asarray(apply(variables, jnp.array([[1, 2, 15, 0]])))).all()


@pytest.mark.once
def test_fit_names_an_out_of_vocabulary_token_id_with_its_row_and_position(tmp_path):
    """Under jit the model cannot raise: the step's loss is NaN, and fit's error names
    the id, where it is in the batch and the example it came from."""
    import optax

    import meshkit
    from meshkit import data, train

    tokens = np.random.default_rng(0).integers(0, 16, (64, 9)).astype(np.int32)
    mesh = meshkit.make_mesh("data=-1")
    sharding = meshkit.batch_sharding(mesh)
    probe = data.TrainPipeline(data.ArraySource({"tokens": tokens}), global_batch_size=8,
                               sharding=sharding)  # fmt: skip
    index = int(probe.global_indices(1)[3])  # read by the second step, at row 3
    tokens[index, 6] = 40
    pipeline = data.TrainPipeline(data.ArraySource({"tokens": tokens}), global_batch_size=8,
                                  sharding=sharding)  # fmt: skip
    model = train.linen_model(
        Transformer(vocab_size=16, num_layers=1, num_heads=2, embed_dim=8, mlp_dim=16),
        jnp.zeros((1, 8), jnp.int32),
    )
    state = train.create_train_state(model, optax.sgd(0.1), mesh)

    def loss_fn(params, state, batch, rng):
        logits, collections = train.apply_model(state, batch["tokens"][:, :-1], params=params)
        labels = batch["tokens"][:, 1:]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, train.LossOutput(collections, {})

    step = train.make_train_step(loss_fn, train.state_shardings_of(state), sharding)
    with pytest.raises(train.NonFiniteLossError) as info:
        train.fit(state, step, pipeline, num_steps=3, workdir=tmp_path,
                  logging=train.Logging(progress=False))  # fmt: skip
    message = str(info.value)
    assert message.startswith("Training stopped at step 2:"), message
    assert (
        "The batch of that step holds token ids outside [0, 16), the model's vocabulary: 1 "
        "of this process's 72 ids. The first is id 40 at position 6 of row 3 of the global "
        f"batch, source index {index} of ArraySource." in message
    ), message


@pytest.mark.once
def test_a_label_that_is_no_class_gives_a_nan_loss_not_the_last_class():
    from meshkit.train._step import _cross_entropy

    logits = jnp.array([[0.0, 1.0, 2.0]] * 4)
    losses = np.asarray(_cross_entropy(logits, jnp.array([0, 2, -1, 3])))
    assert np.isfinite(losses[:2]).all() and np.isnan(losses[2:]).all()


# --- the LLaMA architecture, against a numpy forward pass written from the papers ----


def _np_rms(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * scale


def _np_rope(x_BxLxHxK: np.ndarray, base: float) -> np.ndarray:
    """RoFormer's rotation, with complex numbers: pair ``(x_i, x_{i+K/2})`` as ``x_i + j
    x_{i+K/2}``, times ``exp(j p base^(-2i/K))`` at position ``p``."""
    half = x_BxLxHxK.shape[-1] // 2
    pairs = x_BxLxHxK[..., :half] + 1j * x_BxLxHxK[..., half:]
    theta = base ** (-2.0 * np.arange(half) / (2 * half))
    turn = np.exp(1j * np.arange(x_BxLxHxK.shape[1])[:, None] * theta[None, :])
    rotated = pairs * turn[None, :, None, :]
    return np.concatenate([rotated.real, rotated.imag], axis=-1)


def _np_llama(params: Any, tokens: np.ndarray, *, num_heads: int, base: float) -> np.ndarray:
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    embedding = p["embed"]["embedding"]
    x = embedding[tokens]
    layer = 0
    while f"block_{layer}" in p:
        block = p[f"block_{layer}"]
        attention = block["attention"]
        h = _np_rms(x, block["attention_norm"]["scale"])
        q = _np_rope(np.einsum("bld,dhk->blhk", h, attention["query"]["kernel"]), base)
        k = _np_rope(np.einsum("bld,dgk->blgk", h, attention["key"]["kernel"]), base)
        v = np.einsum("bld,dgk->blgk", h, attention["value"]["kernel"])
        group = num_heads // k.shape[2]
        k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
        logits = np.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(q.shape[-1])
        length = tokens.shape[1]
        logits = np.where(np.tril(np.ones((length, length), bool)), logits, -np.inf)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        mixed = np.einsum("bhqt,bthk->bqhk", weights, v)
        x = x + np.einsum("blhk,hkd->bld", mixed, attention["out"]["kernel"])
        mlp = block["mlp"]
        h = _np_rms(x, block["mlp_norm"]["scale"])
        gate = h @ mlp["gate"]["kernel"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ mlp["up"]["kernel"])) @ mlp["down"]["kernel"]
        layer += 1
    return _np_rms(x, p["final_norm"]["scale"]) @ embedding.T


@pytest.mark.once
def test_the_llama_architecture_matches_a_numpy_forward_pass_and_its_published_sizes():
    from meshkit.models import llama

    model = llama("8b", num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2, mlp_dim=48,
                  vocab_size=50, tie_embeddings=True, max_length=12, rope_base=100.0)  # fmt: skip
    tokens = np.random.default_rng(1).integers(0, 50, (3, 12))
    variables = model.init(jax.random.key(0), jnp.zeros((1, 12), jnp.int32))
    params = jax.tree.map(np.asarray, nn_unbox(variables["params"]))
    assert "bias" not in str(jax.tree_util.tree_structure(params))  # no biases anywhere
    assert params["block_0"]["attention"]["key"]["kernel"].shape == (32, 2, 8)  # 2 kv heads
    got = np.asarray(jax.jit(model.apply)(variables, jnp.asarray(tokens)))
    want = _np_llama(params, tokens, num_heads=4, base=100.0)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    # Rotary positions are relative: a query at m and a key at n meet in a product
    # that depends on m - n only.
    from meshkit.models._transformer import rotary_embedding

    q_K, k_K = np.random.default_rng(2).normal(size=(2, 16))
    q = rotary_embedding(jnp.broadcast_to(jnp.asarray(q_K, jnp.float32), (1, 9, 1, 16)))
    k = rotary_embedding(jnp.broadcast_to(jnp.asarray(k_K, jnp.float32), (1, 9, 1, 16)))
    products = np.asarray(jnp.einsum("bmhk,bnhk->mn", q, k))
    np.testing.assert_allclose(products[1:, 1:], products[:-1, :-1], atol=1e-4)
    assert np.ptp(np.diagonal(products, offset=2)) < 1e-4 and np.ptp(products[0]) > 0.1

    counts = {}
    for size in ("1b", "7b", "8b"):
        shapes = jax.eval_shape(llama(size, max_length=8, scan_layers=True).init, jax.random.key(0),
                                jnp.zeros((1, 8), jnp.int32))  # fmt: skip
        counts[size] = sum(x.size for x in jax.tree.leaves(shapes))
    assert counts == {"1b": 1_235_814_400, "7b": 6_738_415_616, "8b": 8_030_261_248}
    with pytest.raises(ValueError, match=r"num_kv_heads=3 must divide num_heads=4"):
        llama("1b", num_heads=4, num_kv_heads=3, embed_dim=32).init(
            jax.random.key(0), jnp.zeros((1, 4), jnp.int32)
        )


def nn_unbox(tree: Any) -> Any:
    import flax.linen as nn

    return nn.meta.unbox(tree)
