"""The locoswarm peer: inner training, outer algorithms, transports, CLI."""
