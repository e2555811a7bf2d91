"""``peer join`` as a group member that lies in its RECEIPTs (issue #65's attack), for
tests/security/test_lying_receipts_swarm.py: run as a script, it patches this process's receipts
(its forked averager inherits the patch) and then runs the real ``peer`` command line.

Each receipt it sends reports, for every owner, a false digest of that owner's means (the true one
with every bit flipped) with the owner's real seal (which does not match it), a refusal of every
owner and an alignment of 0: against the old rule, any second digest skipped the owner, and one
such member of four made every honest owner's pieces apply as zeros in most rounds. Everything else
it does is honest: its contributions and, as an owner, its means.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root, for ``tests``


def false_receipt(true):
    """What the liar sends instead of its true receipt ``true`` (a ``protocol.wire.allreduce.Receipt``)."""
    from protocol.wire import allreduce as frames

    return frames.Receipt(
        {o: bytes(b ^ 0xFF for b in d) for o, d in true.digests.items()},
        {o: 0.0 for o in true.digests},
        frozenset(true.digests),
        true.signatures,
    )


def patch() -> None:
    """Make every receipt this process (and its forked averager) sends a :func:`false_receipt`. Only
    what it sends lies: its own judgement of the group reads its true receipt, so its φ stays the
    honest peers' and everything else it does is honest."""
    from protocol.wire import allreduce as frames

    honest = frames.encode_receipt

    def lying(digests, alignments=None, *, refused=frozenset(), signatures=None):
        true = frames.Receipt(digests, dict(alignments or {}), frozenset(refused), dict(signatures or {}))
        false = false_receipt(true)
        return honest(false.digests, false.alignments, refused=false.refused, signatures=false.signatures)

    frames.encode_receipt = lying


if __name__ == "__main__":
    patch()
    from peer.cli import main

    main(prog_name="peer")
