"""LLaMA-family checkpoints in the transformers layout, checked against transformers.

The reference is transformers' own ``LlamaForCausalLM`` (and ``MistralForCausalLM``):
tiny random models saved by its ``save_pretrained`` load into meshkit with the same
logits, meshkit's export loads in transformers with the same logits, and import ->
export -> import is bit-exact. The arithmetic runs once at 1 device; the layouts (FSDP,
data x model) once at 8.

These tests need torch (its CPU build) and transformers, which ``nox -s tests``
installs; elsewhere they are skipped, saying so. The config refusals need neither.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshkit
from meshkit.models import greedy_generate, llama_from_hf, load_hf_params, save_hf_params

REFERENCE = "needs torch and transformers (nox -s tests installs them)"

TINY: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "grouped heads (Llama 3)": {"rope_theta": 500000.0},
    "tied embeddings (Llama 3.2)": {"tie_word_embeddings": True, "num_key_value_heads": 1},
    "llama3 rope scaling (Llama 3.1)": {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    },
    "every head its keys (Llama 2)": {"num_key_value_heads": 4, "rms_norm_eps": 1e-5},
    "heads wider than the model (Mistral NeMo)": {"head_dim": 16},  # 4 x 16 in a width of 32
}
TOKENS = np.random.default_rng(0).integers(0, 96, size=(2, 24)).astype(np.int32)


def reference():
    torch = pytest.importorskip("torch", reason=REFERENCE)
    transformers = pytest.importorskip("transformers", reason=REFERENCE)
    return torch, transformers


def saved_by_transformers(
    folder: Path,
    fields: dict[str, Any],
    *,
    mistral: bool = False,
    dtype: str = "float32",
    shard: str = "5GB",
) -> Any:
    """A random model of ``fields`` saved by transformers' ``save_pretrained``."""
    torch, transformers = reference()
    torch.manual_seed(0)
    config_type = transformers.MistralConfig if mistral else transformers.LlamaConfig
    model_type = transformers.MistralForCausalLM if mistral else transformers.LlamaForCausalLM
    extra = {"sliding_window": None} if mistral else {}
    model = model_type(config_type(**{**TINY, **fields, **extra}))
    with torch.no_grad():  # norms start at one: give them values a swap would show
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.uniform_(0.5, 1.5)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(folder, max_shard_size=shard)
    return model


def transformers_logits(model: Any) -> np.ndarray:
    torch, _ = reference()
    with torch.no_grad():
        return model.float()(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


PEAKED = {"initializer_range": 0.2, "eos_token_id": None}
"""Weights whose next-token choices are far from ties, and no token that ends generation."""


def transformers_greedy(model: Any, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    torch, _ = reference()
    with torch.no_grad():
        out = model.generate(
            torch.tensor(prompt, dtype=torch.long), max_new_tokens=new_tokens, do_sample=False
        )
    return out.numpy()[:, prompt.shape[1] :]


def meshkit_logits(model: nn.Module, params: Any) -> np.ndarray:
    return np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(TOKENS)), np.float32)


def initial_params(model: nn.Module) -> Any:
    return nn.unbox(model.init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32)))["params"]


def relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.once
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_checkpoint_saved_by_transformers_gives_its_logits(tmp_path: Path, variant: str):
    expected = transformers_logits(saved_by_transformers(tmp_path, VARIANTS[variant]))
    model = llama_from_hf(tmp_path)
    params = load_hf_params(tmp_path, initial_params(model))
    assert relative_difference(meshkit_logits(model, params), expected) <= 1e-4


@pytest.mark.once
def test_greedy_generation_with_a_cache_is_transformers_greedy_generation(tmp_path: Path):
    fields = {**VARIANTS["llama3 rope scaling (Llama 3.1)"], **PEAKED}
    prompt = TOKENS[:, :5]
    expected = transformers_greedy(saved_by_transformers(tmp_path, fields), prompt, 32)
    scanned = llama_from_hf(tmp_path, scan_layers=True)
    params = load_hf_params(tmp_path, initial_params(scanned))
    got = np.asarray(greedy_generate(scanned, params, prompt, 32))
    np.testing.assert_array_equal(got, expected)
    assert len(set(got[0].tolist())) > 4  # not one token over and over


@pytest.mark.once
def test_a_mistral_style_config_reads_as_llama(tmp_path: Path):
    expected = transformers_logits(saved_by_transformers(tmp_path, {}, mistral=True))
    model = llama_from_hf(tmp_path)
    params = load_hf_params(tmp_path, initial_params(model))
    assert relative_difference(meshkit_logits(model, params), expected) <= 1e-4


@pytest.mark.once
def test_a_bfloat16_checkpoint_is_read_as_it_is_or_cast(tmp_path: Path):
    reference_model = saved_by_transformers(
        tmp_path, VARIANTS["grouped heads (Llama 3)"], dtype="bfloat16"
    )
    kept = llama_from_hf(tmp_path)
    assert kept.param_dtype == jnp.bfloat16
    kept_params = load_hf_params(tmp_path, initial_params(kept))
    up = reference_model.model.layers[1].mlp.up_proj.weight.detach().float().numpy()
    read = np.asarray(kept_params["block_1"]["mlp"]["up"]["kernel"]).astype(np.float32)
    np.testing.assert_array_equal(read, up.T)  # bfloat16 both sides: the same bits
    cast = llama_from_hf(tmp_path, param_dtype=jnp.float32)
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: tensor 'model\.embed_tokens\.weight' is bfloat16, the "
        r"model's parameter float32; pass cast=True",
    ):
        load_hf_params(tmp_path, initial_params(cast))
    cast_params = load_hf_params(tmp_path, initial_params(cast), cast=True)
    expected = transformers_logits(reference_model)  # the bfloat16 weights, in float32
    assert relative_difference(meshkit_logits(cast, cast_params), expected) <= 1e-4


@pytest.mark.once
def test_an_export_loads_in_transformers_with_the_same_logits(tmp_path: Path):
    _, transformers = reference()
    fields = {**VARIANTS["llama3 rope scaling (Llama 3.1)"], "head_dim": 16}  # 4 x 16 > 32
    saved_by_transformers(tmp_path / "in", fields)
    model = llama_from_hf(tmp_path / "in")
    assert model.head_dim == 16
    params = load_hf_params(tmp_path / "in", initial_params(model))
    params = jax.tree.map(lambda x: x * 1.01, params)  # not the weights transformers wrote
    written = save_hf_params(params, model, tmp_path / "out", max_shard_bytes=20_000)
    assert {p.name for p in written} >= {"config.json", "model.safetensors.index.json"}
    assert len([p for p in written if p.suffix == ".safetensors"]) > 1
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == "LlamaForCausalLM"
    expected = transformers_logits(loaded)
    assert relative_difference(meshkit_logits(model, params), expected) <= 1e-4


@pytest.mark.once
def test_import_export_import_is_bit_exact_scanned_or_not(tmp_path: Path):
    saved_by_transformers(tmp_path / "in", VARIANTS["tied embeddings (Llama 3.2)"], shard="8KB")
    scanned = llama_from_hf(tmp_path / "in", scan_layers=True)
    first = load_hf_params(tmp_path / "in", initial_params(scanned))
    assert first["layers"]["attention"]["query"]["kernel"].shape == (2, 32, 4, 8)
    save_hf_params(first, scanned, tmp_path / "out", max_shard_bytes=8_000)
    plain = llama_from_hf(tmp_path / "out")
    again = load_hf_params(tmp_path / "out", initial_params(plain))
    for layer in range(2):
        for a, b in zip(
            jax.tree.leaves(jax.tree.map(lambda x, k=layer: x[k], first["layers"])),
            jax.tree.leaves(again[f"block_{layer}"]),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(again["embed"]["embedding"], first["embed"]["embedding"])
    reference_files = sorted(p.name for p in (tmp_path / "in").glob("*.safetensors"))
    assert len(reference_files) > 1  # the import read shards, through the index


NONE = dict.fromkeys(("vocab", "embed", "mlp", "heads", "kv_heads", "kv"))


@pytest.mark.once(8)
@pytest.mark.parametrize(
    ("mesh_shape", "table"),
    [
        ("data=8", {**NONE, "embed": "data"}),
        ("data=4,model=2", {**NONE, "heads": "model", "kv_heads": "model", "mlp": "model"}),
    ],
    ids=["fsdp", "data x model"],
)
def test_any_layout_reads_its_own_slices_and_gives_the_logits(
    tmp_path: Path, mesh_shape: str, table: dict[str, str | None], monkeypatch
):
    import optax

    from meshkit import train
    from meshkit.models import _hf_llama

    read_bytes = []
    reader = _hf_llama._Checkpoint.read

    def counted(self: Any, name: str, region: tuple[slice, ...]) -> np.ndarray:
        value = reader(self, name, region)
        read_bytes.append(value.nbytes)
        return value

    monkeypatch.setattr(_hf_llama._Checkpoint, "read", counted)

    fields = {**VARIANTS["grouped heads (Llama 3)"], **PEAKED}
    reference_model = saved_by_transformers(tmp_path, fields)
    expected = transformers_logits(reference_model)
    model = llama_from_hf(tmp_path)
    mesh = meshkit.make_mesh(mesh_shape)
    rules = meshkit.PartitionRules(logical=table)
    wrapped = train.linen_model(model, jnp.zeros((1, 8), jnp.int32))
    state = train.create_train_state(wrapped, optax.sgd(0.1), mesh, rules=rules)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state.params
    )
    params = load_hf_params(tmp_path, abstract)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(state.params), strict=True):
        assert got.sharding == want.sharding
    assert any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(params))
    # Each element read once: the devices that hold the same slice share one read.
    assert sum(read_bytes) == sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    assert relative_difference(meshkit_logits(model, params), expected) <= 1e-4
    generated = greedy_generate(model, params, TOKENS[:, :5], 16, rules=rules)
    np.testing.assert_array_equal(
        generated, transformers_greedy(reference_model, TOKENS[:, :5], 16)
    )


BASE = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "vocab_size": 96,
}


@pytest.mark.once
@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures ['GPT2LMHeadModel']"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"sliding_window": 4096}, "sliding_window=4096"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"head_dim": 0}, "head_dim=0"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling of type 'yarn'"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters of type"),
    ],
)
def test_a_config_meshkit_cannot_read_is_refused_naming_the_field(change: dict, named: str):
    with pytest.raises(ValueError, match=r"config\.json: ") as error:
        llama_from_hf({**BASE, **change})
    assert named in str(error.value)


@pytest.mark.once
def test_weights_that_do_not_fit_the_config_are_named(tmp_path: Path):
    model = llama_from_hf(BASE)
    params = initial_params(model)
    save_hf_params(params, model, tmp_path)
    wider = llama_from_hf({**BASE, "intermediate_size": 48})
    with pytest.raises(
        ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(64, 32\)"
    ):
        load_hf_params(tmp_path, initial_params(wider))
    deeper = llama_from_hf({**BASE, "num_hidden_layers": 2})
    with pytest.raises(
        ValueError, match=r"no tensor 'model\.layers\.1\.self_attn\.q_proj\.weight'"
    ):
        load_hf_params(tmp_path, initial_params(deeper))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors cannot be read as safetensors"):
        load_hf_params(tmp_path, params)


def read_logits_and_write_back(folder: str, out: str) -> np.ndarray:
    """In each of several processes: the checkpoint read under FSDP over every process's
    devices, its logits, and the weights written back (by process 0)."""
    import optax

    from meshkit import train

    model = llama_from_hf(folder)
    mesh = meshkit.make_mesh("data=-1")
    rules = meshkit.PartitionRules(logical={**NONE, "embed": "data"})
    state = train.create_train_state(
        train.linen_model(model, jnp.zeros((1, 8), jnp.int32)), optax.sgd(0.1), mesh, rules=rules
    )
    params = load_hf_params(folder, state.params)
    assert not any(leaf.is_fully_addressable for leaf in jax.tree.leaves(params))
    logits = jax.jit(model.apply)({"params": params}, jnp.asarray(TOKENS))
    save_hf_params(params, model, out, max_shard_bytes=20_000)
    return np.asarray(meshkit.to_host(logits))


@pytest.mark.multiprocess
def test_two_processes_read_their_slices_and_write_the_same_checkpoint(tmp_path: Path):
    from safetensors.numpy import load_file

    from meshkit.testing import run_processes

    reference_model = saved_by_transformers(
        tmp_path / "in", VARIANTS["grouped heads (Llama 3)"], shard="20KB"
    )
    expected = transformers_logits(reference_model)
    for logits in run_processes(
        read_logits_and_write_back, str(tmp_path / "in"), str(tmp_path / "out")
    ):
        assert relative_difference(logits, expected) <= 1e-4

    def tensors(folder: Path) -> dict[str, np.ndarray]:
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    written, original = tensors(tmp_path / "out"), tensors(tmp_path / "in")
    assert sorted(written) == sorted(original)
    for name, value in original.items():
        np.testing.assert_array_equal(written[name], value)


@pytest.mark.once  # the recipe picks its own 8 devices
def test_the_recipe_fine_tunes_its_checkpoint_and_writes_one_transformers_reads(tmp_path: Path):
    import subprocess
    import sys

    command = [sys.executable, "-m", "recipes.finetune_lm", "--no-progress", "--steps", "100"]
    out = subprocess.run(
        [*command, "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["test_loss"] < summary["test_loss_before"] - 0.75, summary
    assert summary["mesh"] == {"data": 4, "model": 2} and summary["train_step_compiles"] == 1
    finetuned = Path(summary["finetuned"])
    assert sorted(p.name for p in finetuned.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert f"The fine-tuned model is in {finetuned}" in out.stdout
    _, transformers = reference()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(finetuned)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(finetuned / "tokenizer.json")
    )
    ids = tokenizer("The with statement")["input_ids"]
    assert loaded.config.vocab_size == 512 and len(ids) > 2
    # The base, fine-tuned again at a shorter context: the export keeps the base's config.
    again_dir = str(tmp_path / "again")
    again = subprocess.run(
        [*command[:-1], "2", "--length", "64", "--hf-dir", summary["base"], "--workdir", again_dir],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    base_config = json.loads((Path(summary["base"]) / "config.json").read_text())
    config = json.loads((tmp_path / "again" / "finetuned" / "config.json").read_text())
    assert config == base_config and config["max_position_embeddings"] == 128
    missing = subprocess.run(
        [*command, "--workdir", str(tmp_path / "b"), "--hf-dir", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert missing.returncode == 2
    assert missing.stderr.splitlines()[-1].endswith(
        f"--hf-dir {tmp_path / 'none'}: no such file or folder"
    )


@pytest.mark.once
def test_regions_read_in_small_blocks_are_the_slices_of_what_safetensors_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    import ml_dtypes
    from safetensors.numpy import save_file

    from meshkit.models import _safetensors

    rng = np.random.default_rng(0)
    tensors = {
        "f32": rng.standard_normal((37, 5, 3)).astype(np.float32),
        "bf16": rng.standard_normal((64, 24)).astype(ml_dtypes.bfloat16),
        "i64": rng.integers(-9, 9, (11,)),
    }
    save_file(tensors, str(tmp_path / "w.safetensors"))
    monkeypatch.setattr(_safetensors, "BLOCK_BYTES", 100)  # blocks of a few rows
    weights = _safetensors.SafetensorsFile(tmp_path / "w.safetensors")
    regions = {
        "f32": [np.s_[:, :, :], np.s_[3:30, 1:4, :], np.s_[36:37, :, 2:3]],
        "bf16": [np.s_[:, 6:12], np.s_[10:50, :], np.s_[0:64, 23:24]],
        "i64": [(np.s_[2:9],)],
    }
    for name, cuts in regions.items():
        assert weights.tensors[name].dtype == tensors[name].dtype
        for cut in cuts:
            np.testing.assert_array_equal(weights.read(name, cut), tensors[name][cut])
    weights.close()
    whole = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(whole[:-100])
    with pytest.raises(
        ValueError, match=r"cut\.safetensors cannot be read as safetensors \(tensor"
    ):
        _safetensors.SafetensorsFile(tmp_path / "cut.safetensors")


@pytest.mark.once
def test_token_windows_pack_the_documents_exactly_and_alike_every_time(tmp_path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from meshkit import data

    texts = [
        f"Document {k}: " + "the with statement and the assert statement. " * k for k in range(1, 9)
    ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    eos = tokenizer.token_to_id("</s>")
    stream = np.concatenate([[*tokenizer.encode(t).ids, eos] for t in texts]).astype(np.int32)
    windows = data.token_windows(texts, tmp_path / "tokenizer.json", 16)
    again = data.token_windows(texts, tokenizer, 16)
    count = (len(stream) - 1) // 16
    assert len(windows) == len(again) == count > 3
    for k in range(count):
        np.testing.assert_array_equal(windows[k]["tokens"], stream[16 * k : 16 * k + 17])
        np.testing.assert_array_equal(again[k]["tokens"], windows[k]["tokens"])
    plain = Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    with pytest.raises(ValueError, match=r"pass eos_id=, the id to put after each document"):
        data.token_windows(["a"], plain, 4)
    with pytest.raises(ValueError, match=r"token_windows got 4 tokens, fewer than one window"):
        data.token_windows(["a", "a"], plain, 4, eos_id=0)
