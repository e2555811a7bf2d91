"""Pipeline stages: a model split across peers (issue #19; DiLoCoX arXiv 2506.21263, SWARM arXiv 2301.11913).

peer.py: a peer serving one stage: its inner loop and its link to the other stages
routing.py: which replica of the next stage a micro-batch goes to
rpc.py: stage calls: a micro-batch's forward and backward in one exchange on a libp2p stream
stage_loop.py: the inner loop of a peer serving one stage
stages.py: one stage of the run's Llama model: a contiguous run of its transformer blocks
"""
