"""Test and benchmark tooling, not shipped in the wheel: network-namespace lab, chaos harness,
in-process simulation (which calls the swarm's own algorithm code)."""
