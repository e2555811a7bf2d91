"""Named run presets, shared by the CLI, tests, docker and docs."""

from __future__ import annotations

from protocol.manifest import RunManifest


def default_run() -> RunManifest:
    """The run a bare ``peer join`` and ``peer swarm`` train.

    A ~0.9M-parameter Llama-style byte-level LM on the Python standard library's sources,
    sized so that 3 peers sharing 2 CPU cores lower the validation loss visibly in minutes.
    """
    return RunManifest(name="default")


def tiny_run() -> RunManifest:
    """A very small run for tests: rounds take about a second on one CPU core."""
    return RunManifest(name="tiny").replace(
        model={"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2,
               "intermediate_size": 64, "max_seq_len": 64},
        data={"seq_len_tokens": 32, "validation_sequences": 16},
        inner_optimizer={"lr": 5e-3, "warmup_steps": 2, "decay_steps": 200, "batch_size_tokens": 256},
        sync={"inner_steps": 5, "matchmaking_time_s": 3.0, "allreduce_timeout_s": 30.0,
              "next_chunk_timeout_s": 5.0},
    )


PRESETS = {"default": default_run, "tiny": tiny_run}
