"""Fine-tune a Llama-family checkpoint (transformers layout) on a text file, and write it back.

Command (no arguments: no download anywhere. The recipe trains a byte-level BPE
tokenizer of 512 tokens on the Python reference's topic texts, makes a tiny random
LLaMA for it, 2 layers of width 128 with grouped key and value heads, and saves both in
the transformers layout in ``<workdir>/base``; then it fine-tunes that checkpoint as it
would a downloaded one: 300 steps of 8 windows of 128 tokens on 8 fake CPU devices as
a ``data=4 × model=2`` mesh)::

    python -m recipes.finetune_lm

Expected result, in about a minute on a 2-core machine: a progress bar, the held-out
loss before and after (nats per token; before: about ln 512 = 6.2, after: below
``TARGET_LOSS``, 4.0; measured 3.31 with Python 3.11.7, whose text it is), where the
fine-tuned checkpoint is, then a JSON summary, e.g.::

    held-out loss 6.278 -> 3.313 nats per token over 161 windows
    The fine-tuned model is in workdir/finetune_lm/finetuned (transformers layout: ...)
    {"base": ".../base", ..., "test_loss_before": 6.27..., "test_loss": 3.31..., ...}

Other runs::

    python -m recipes.finetune_lm --hf-dir ~/models/Llama-3.2-1B --text notes.txt \\
        --mesh data=2,model=4 --length 512
    python -m recipes.finetune_lm --plan           # plan the layout on these devices first
    python -m meshkit.launch -n 2 -d 4 -- python -m recipes.finetune_lm   # as 2 hosts

``--hf-dir`` takes any checkpoint ``meshkit.models.llama_from_hf`` reads, with its
``tokenizer.json``; its weights are read straight into the layout of ``--mesh`` and
``LOGICAL_RULES`` (each process only its devices' slices). The learning rate defaults
to 3e-3 for the recipe's own random base and 2e-5 for a checkpoint of ``--hf-dir``.
The last tenth of the text is held out. Rerunning with the same ``--workdir`` resumes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import meshkit
from recipes._args import (
    add_training_options,
    fit_options,
    hyperparameters,
    learning_rate_schedule,
    make_mesh,
    non_negative_float,
    positive_float,
    positive_int,
    recipe_parser,
    run_errors_in_one_line,
    run_summary,
    setup_errors_in_one_line,
    start_run,
    write_summary,
)
from recipes.transformer_lm import LOGICAL_RULES as TRANSFORMER_RULES
from recipes.transformer_lm import choose_layout, create_state

LOGICAL_RULES: dict[str, str | None] = {**TRANSFORMER_RULES, "kv_heads": "model"}
"""The byte-level Transformer recipe's table (FSDP over ``data``; heads, MLP and
vocabulary over ``model``), with the grouped key and value heads over ``model`` too."""

TARGET_LOSS = 4.0
"""Held-out nats per token the default run ends below (a test checks it)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = recipe_parser(__doc__, workdir="workdir/finetune_lm", progress=True, resumes=True)
    parser.add_argument(
        "--hf-dir",
        type=Path,
        help="the checkpoint to fine-tune (default: "
        "a tiny random LLaMA the recipe makes in <workdir>/base)",
    )
    parser.add_argument(
        "--text",
        type=Path,
        help="UTF-8 text to fine-tune on (default: the Python reference's topic texts)",
    )
    parser.add_argument("--mesh", default="data=4,model=2", help="mesh axes: data and model")
    parser.add_argument(
        "--plan", action="store_true", help="plan the layouts of these devices for --plan-for first"
    )
    parser.add_argument("--plan-for", default="h100", help="the accelerator --plan sizes for")
    parser.add_argument("--length", type=positive_int, default=128, help="tokens per window")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="global batch size")
    parser.add_argument("--steps", type=positive_int, default=300)
    parser.add_argument(
        "--learning-rate", type=positive_float, help="default: 3e-3, or 2e-5 with --hf-dir"
    )
    parser.add_argument("--weight-decay", type=non_negative_float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=positive_int, default=100)
    add_training_options(parser)
    parser.set_defaults(lr_schedule="cosine", warmup_steps=None, layout=None)
    args = parser.parse_args(argv)
    if args.learning_rate is None:
        args.learning_rate = 2e-5 if args.hf_dir else 3e-3
    if args.warmup_steps is None:
        args.warmup_steps = min(30, args.steps // 10)
    for flag, path in (("--hf-dir", args.hf_dir), ("--text", args.text)):
        if path is not None and not path.exists():
            parser.error(f"{flag} {path}: no such file or folder")
    if args.hf_dir is not None and not (args.hf_dir / "tokenizer.json").exists():
        parser.error(f"--hf-dir {args.hf_dir} has no tokenizer.json beside its weights")
    return args


def make_base(folder: Path, train_text: str, length: int) -> None:
    """A BPE tokenizer trained on ``train_text`` and a tiny random LLaMA for it, both
    written to ``folder`` in the transformers layout (what a download would hold)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from meshkit.models import llama, save_hf_params

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([train_text], trainer)
    module = llama(
        "8b",
        num_layers=2,
        embed_dim=128,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=384,
        vocab_size=tokenizer.get_vocab_size(),
        max_length=length,
    )
    tokens = jnp.zeros((1, length), jnp.int32)
    params = nn.unbox(jax.jit(module.init)(jax.random.key(0), tokens))["params"]
    save_hf_params(params, module, folder)
    if jax.process_index() == 0:
        tokenizer.save(str(folder / "tokenizer.json"))


def reference_text() -> str:
    """The Python reference's topic texts (``help("with")`` and the other pages), which
    ship with every Python: the byte-level Transformer recipe's text."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def read_model(folder: Path, length: int) -> tuple[Any, Any]:
    """The checkpoint's model as its config describes it (what the export writes back),
    and the same in float32 with the run's context length (what is trained)."""
    import jax.numpy as jnp

    from meshkit.models import llama_from_hf

    with setup_errors_in_one_line():
        checkpoint = llama_from_hf(folder)
    if length > checkpoint.max_length:
        raise SystemExit(
            f"--length {length} is longer than the checkpoint's context "
            f"(max_position_embeddings {checkpoint.max_length}): pass a shorter --length."
        )
    return checkpoint, checkpoint.clone(max_length=length, param_dtype=jnp.float32)


def next_token_loss(params: Any, state: Any, batch: Any, rng: Any) -> tuple[Any, Any]:
    """Mean cross-entropy of each next token, in nats."""
    import optax

    from meshkit import train

    tokens_BxL1 = batch["tokens"]
    logits_BxLxV, collections = train.apply_model(
        state, tokens_BxL1[:, :-1], params=params, rng=rng
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, tokens_BxL1[:, 1:])
    return loss.mean(), train.LossOutput(collections=collections, metrics={})


def next_token_metrics(state: Any, batch: Any) -> dict[str, Any]:
    """Per window: the mean next-token cross-entropy (nats)."""
    import optax

    from meshkit import train

    tokens_BxL1 = batch["tokens"]
    logits_BxLxV, _ = train.apply_model(state, tokens_BxL1[:, :-1])
    nll_BxL = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, tokens_BxL1[:, 1:])
    return {"loss": nll_BxL.mean(axis=-1)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with setup_errors_in_one_line():
        meshkit.distributed.initialize(cpu_devices=args.cpu_devices)

    import jax
    import optax

    from meshkit import data, evaluate, train
    from meshkit.models import load_hf_params, save_hf_params

    text = args.text.read_text("utf-8") if args.text else reference_text()
    cut = len(text) * 9 // 10  # the last tenth held out, tokenized on its own
    mesh = make_mesh(args.mesh)
    start_run(args, mesh)  # a changed rerun stops here; a finished one ends here
    base = args.hf_dir or args.workdir / "base"
    if args.hf_dir is None and not (base / "tokenizer.json").exists():
        make_base(Path(base), text[:cut], args.length)
    if jax.process_count() > 1:  # process 0 wrote the base: every process reads it after
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("finetune_lm: the base is written")
    checkpoint, module = read_model(Path(base), args.length)
    tokenizer = Path(base) / "tokenizer.json"
    train_source = data.token_windows([text[:cut]], tokenizer, args.length, name="train")
    test_source = data.token_windows([text[cut:]], tokenizer, args.length, name="test")

    schedule = learning_rate_schedule(args)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=args.weight_decay)
    )
    rules = meshkit.PartitionRules(logical=LOGICAL_RULES)
    layout = choose_layout(args, module, tx)
    data_axes = ("data",)
    if layout is not None:  # the plan's mesh, rules, remat policy and micro-batches
        mesh, data_axes = layout.make_mesh(), layout.data_axes
        rules = layout.rules or meshkit.PartitionRules()
        module = module.clone(remat=layout.remat)
        args.microbatches = layout.microbatches
    state = create_state(module, tx, mesh, seed=args.seed, precision=args.precision, rules=rules)
    state = state.replace(params=load_hf_params(base, state.params, cast=True))  # to float32
    batch_sharding = meshkit.batch_sharding(mesh, data_axes)
    pipeline = data.TrainPipeline(
        train_source, global_batch_size=args.batch_size, sharding=batch_sharding, seed=args.seed
    )
    eval_pipeline = data.EvalPipeline(
        test_source, global_batch_size=args.batch_size, sharding=batch_sharding
    )
    before = evaluate.full_eval(next_token_metrics, state, eval_pipeline).metrics["loss"]
    step = train.make_train_step(
        next_token_loss,
        train.state_shardings_of(state),
        batch_sharding,
        microbatches=args.microbatches,
    )
    with run_errors_in_one_line():
        result = train.fit(
            state,
            step,
            pipeline,
            num_steps=args.steps,
            workdir=args.workdir,
            evaluation=train.Evaluation(eval_pipeline, per_example_fn=next_token_metrics),
            checkpoints=train.Checkpoints(every=args.checkpoint_every),
            **fit_options(args, schedule),
        )
    after = result.eval_metrics.get("loss")
    finetuned = args.workdir / "finetuned"
    save_hf_params(result.state.params, checkpoint, finetuned, dtype=checkpoint.param_dtype)
    if jax.process_index() == 0:
        shutil.copyfile(tokenizer, finetuned / "tokenizer.json")
        print(
            f"held-out loss {before:.3f} -> {after:.3f} nats per token over "
            f"{len(test_source)} windows"
        )
        print(
            f"The fine-tuned model is in {finetuned} (transformers layout: config.json, "
            "model.safetensors, tokenizer.json)",
            flush=True,
        )
    summary = {
        "base": str(base),
        "model": {
            "num_layers": module.num_layers,
            "embed_dim": module.embed_dim,
            "num_heads": module.num_heads,
            "num_kv_heads": module.num_kv_heads,
            "vocab_size": module.vocab_size,
            "length": args.length,
        },
        "mesh": dict(mesh.shape),
        "processes": jax.process_count(),
        "hyperparameters": hyperparameters(args, "weight_decay"),
        **run_summary(result),
        "test_loss_before": before,
        "test_loss": after,
        "target_loss": TARGET_LOSS,
        "test_windows": result.eval_metrics.get("count"),
        "finetuned": str(finetuned),
    }
    write_summary(args.workdir, summary)
    return train.PREEMPTED_EXIT_CODE if result.preempted else 0


if __name__ == "__main__":
    sys.exit(main())
