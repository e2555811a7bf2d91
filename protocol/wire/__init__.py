"""What peers send each other on libp2p streams, frame by frame.

Three stream protocols, one framing: every frame is ``u32 big-endian length`` + payload, and the
payload's first byte is its kind. The kinds of the three protocols are disjoint, so a frame sent on
the wrong stream is rejected by its kind. Every parser bounds a declared length before anything is
allocated, raises only :class:`protocol.errors.BadPayload`, and never unpickles.

allreduce.py: a group all-reduce (peer/sync/allreduce.py); kinds 1-4 (HELLO, PIECE, MEAN, ABORT)
framing.py: the length-prefixed frames every stream protocol shares
pieces.py: row pieces of a payload: a list of tensors cut into pieces and dealt to owners
pipeline.py: a stage call (peer/pipeline/rpc.py); kinds 32-34 (STAGE_REQUEST, STAGE_REPLY, STAGE_ERROR)
state.py: a joiner's state download (peer/state/); kinds 16-19 (REQUEST, MISSING, META, CHUNK)
"""
