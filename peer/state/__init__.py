"""State that outlives a round: checkpoints, state transfer to joiners, the re-sync rule."""
