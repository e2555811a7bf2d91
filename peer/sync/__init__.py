"""Network sync of one round: transport, hivemind averager, group all-reduce, deadlines, adaptive codec.

adaptive.py: adaptive compression: per tensor, the codec that fits a sync into its time budget
allreduce.py: the group all-reduce: butterfly reduce-scatter and all-gather on libp2p streams
allreduce_stats.py: :class:`AllreduceStats`: what one all-reduce did, from one peer's side
averager.py: hivemind's DecentralizedAverager with locoswarm's own all-reduce
background.py: one sync at a time in a background thread
deadlines.py: sync deadlines that follow the swarm
error_feedback.py: error feedback: what a sync's Δ lost, carried into the next contribution
group_key.py: hivemind's group key manager, changed: group bits kept, lookups rate-limited
hivemind_limits.py: hivemind's protobuf stream handlers, bounded
membership.py: this peer's view of who is live, from the progress records
pairs.py: screening inside a pair (NoLoCo's groups of two)
pieces.py: the plan of one all-reduce: pieces, their owners, codecs and seeds
receipts.py: equivocation proven: owners seal their means, receivers compare the seals
robust.py: robust aggregation of one piece's contributions: the owner's mean
screening.py: screening of the contributions an owner of pieces sums
suspicion_store.py: this peer's memory of misbehaving groupmates, kept across restarts
transport.py: transports: a group's mean pseudo-gradient, over the network
"""
