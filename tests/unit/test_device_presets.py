"""The real-size presets: their parameter counts and the computed memory per micro-batch."""

import types

import pytest
import torch

from peer.train.device import training_memory_bytes
from peer.train.model import ATTENTION, build_model, parameter_count, spec_parameter_count
from protocol.manifest import dump_toml, load_manifest
from protocol.presets import PRESETS


def tokenizer(vocab):
    return types.SimpleNamespace(vocab_size=vocab, bos_id=vocab - 3, eos_id=vocab - 2, pad_id=vocab - 1)


@pytest.mark.parametrize(
    "name,low,high", [("llama-125m", 115e6, 135e6), ("llama-350m", 330e6, 370e6), ("llama-1b", 0.95e9, 1.15e9)]
)
def test_presets_have_the_sizes_they_are_named_for(name, low, high):
    m = PRESETS[name]()
    assert m.name == name
    with torch.device("meta"):  # the model as transformers builds it, without allocating it
        model = build_model(m.model, tokenizer(m.data.vocab_size))
    n = parameter_count(model)
    assert n == spec_parameter_count(m.model, m.data.vocab_size)
    assert low <= n <= high
    assert model.config._attn_implementation == ATTENTION  # SDPA, causal without a mask
    assert m.data.seq_len_tokens <= m.model.max_seq_len and m.batch_sequences >= 32


@pytest.mark.parametrize("name", ["tiny", "default"])
def test_the_count_matches_a_built_model(name):
    m = PRESETS[name]()
    assert spec_parameter_count(m.model, 259) == parameter_count(build_model(m.model))


def test_a_run_file_names_a_preset_by_its_sections(tmp_path):
    m = PRESETS["llama-350m"]()
    path = tmp_path / "run.toml"
    path.write_text(dump_toml(m))
    assert load_manifest(path).run_id == m.run_id


def test_memory_grows_with_the_micro_batch_and_states_are_20_bytes_a_parameter():
    m = PRESETS["llama-125m"]()
    n = spec_parameter_count(m.model, m.data.vocab_size)
    kw = dict(
        params=n,
        layers=m.model.num_layers,
        hidden=m.model.hidden_size,
        intermediate=m.model.intermediate_size,
        vocab_size=m.data.vocab_size,
        seq_len=m.data.seq_len_tokens,
    )
    states, one = training_memory_bytes(micro_batch=1, **kw)
    _, eight = training_memory_bytes(micro_batch=8, **kw)
    assert states == 20 * n and eight == 8 * one
    assert 2 * 2**30 < states + one < 4 * 2**30  # ~3.2 GiB at one sequence: fits an 8 GiB card
