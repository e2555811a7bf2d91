"""Network sync of one round: transport, hivemind averager, group all-reduce, deadlines, adaptive codec."""
