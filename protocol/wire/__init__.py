"""What peers send each other on libp2p streams, frame by frame.

Three stream protocols, one framing (:mod:`protocol.wire.framing`): every frame is
``u32 big-endian length`` + payload, and the payload's first byte is its kind.

* :mod:`protocol.wire.allreduce`: a group all-reduce (peer/sync/allreduce.py); kinds 1-4
  (HELLO, PIECE, MEAN, ABORT).
* :mod:`protocol.wire.state`: a joiner's state download (peer/state/); kinds 16-19 (REQUEST,
  MISSING, META, CHUNK).
* :mod:`protocol.wire.pipeline`: a micro-batch's forward and backward through the next pipeline
  stage (peer/pipeline/rpc.py); kinds 32-34 (STAGE_REQUEST, STAGE_REPLY, STAGE_ERROR).

The kinds of the three protocols are disjoint, so a frame sent on the wrong stream is rejected by
its kind. Every parser bounds a declared length before anything is allocated, raises only
:class:`protocol.errors.BadPayload`, and never unpickles.
"""
