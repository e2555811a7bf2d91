"""A group all-reduce over unix sockets (no hivemind) in which chosen groupmates lie.

The same seam as tests/unit/test_allreduce.py: every peer is a real :class:`GroupAllreduce`
session with a unix socket server; an attacker is an honest session whose payload and claimed
weight (its HELLO) are the attacker's choice. Attackers are in client mode by default (they reduce
no pieces), so what is checked is what honest owners make of their contributions.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric import rsa

from peer.sync.allreduce import GroupAllreduce
from peer.sync.error_feedback import SyncFeedback, keeps_residuals
from peer.sync.pieces import GroupPlan
from peer.sync.robust import piece_mean
from protocol import codecs
from protocol.manifest import CompressionSpec
from protocol.signing import PeerSigner
from protocol.wire import allreduce as frames, framing
from protocol.wire.pieces import piece_shape, plan_pieces
from tests.security.lying_peer import false_receipt


async def run_group(
    payloads,
    weights,
    *,
    owners=None,
    max_weight=None,
    spec=CompressionSpec(),
    piece_elements=64,
    timeout=1.0,
    ignored=frozenset(),
    liars=None,
    phi_from=None,
    distrusted=frozenset(),
    sending=None,
    feedback=None,
    whole_delta=True,
    carry_skipped=True,
    mean_of=None,
    lying_receipts=frozenset(),
):
    """Run one all-reduce of ``payloads`` (one list of tensors per peer) claiming ``weights``; every
    owner leaves the groupmates ``ignored`` (indices) out of its means. An owner in ``liars``
    (index → ``forge(honest mean) -> tensor``) sends ``forge`` of each mean it computes instead;
    ``phi_from``: tensors from that index on are NoLoCo's φ; ``distrusted``: owners whose means every
    peer applies as refused; ``sending``: index → ``make(session)`` returning that owner's
    ``_send_means(writer)`` (an equivocator's); ``feedback``: per peer its
    :class:`~peer.sync.error_feedback.ErrorFeedback` (the run's hooks, as the averager wires them;
    committed where the run succeeded, else rolled back), or None: no error feedback;
    ``whole_delta``: every session's (a blocking sync's True); ``carry_skipped``: every session's
    (an overlapped sync's True, a blocking one's False); ``mean_of``: index → ``make(session)``
    returning that owner's ``_mean_of(piece, parts, included)`` (a liar that forges per piece);
    ``lying_receipts``: groupmates whose RECEIPTs report a false digest for every owner, with the
    owner's real seal, a refusal of every owner and an alignment of 0 (issue #65's attack).

    Returns:
        (sessions, outcomes): every session (tensors hold the means where its run succeeded)
        and what each ``run()`` returned or raised.
    """
    n = len(payloads)
    owners = list(range(n)) if owners is None else list(owners)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [str(Path(tmp) / f"peer{i}.sock") for i in range(n)]
        sessions: list[GroupAllreduce | None] = [None] * n
        ready = [asyncio.Event() for _ in range(n)]

        def handler(i):
            async def handle(reader, writer):
                payload = await framing.read_frame(reader, max_bytes=frames.MAX_HELLO_BYTES, timeout=5)
                hello = frames.parse_hello(payload, group_size=frames.MAX_GROUP_SIZE)
                await asyncio.wait_for(ready[i].wait(), 5)
                await sessions[i].serve(hello.sender, payload, reader, writer)

            return handle

        servers = [await asyncio.start_unix_server(handler(i), path=paths[i]) for i in owners]
        shapes = [t.shape for t in payloads[0]]
        pieces = plan_pieces(shapes, owners=owners, piece_elements=piece_elements)
        shapes_of_pieces = [piece_shape(shapes[p.tensor], p) for p in pieces]
        piece_codecs = [codecs.make_codec(spec, s) for s in shapes_of_pieces]

        async def open_stream(peer_id):
            return await asyncio.open_unix_connection(paths[peer_id])

        for i in range(n):
            plan = GroupPlan(
                group_id=b"g" * 8,
                peer_ids=tuple(range(n)),
                my_index=i,
                pieces=pieces,
                codecs=piece_codecs,
                mean_codecs=[c.for_mean(n) for c in piece_codecs],
                max_piece_bytes=[codecs.max_encoded_bytes(s) for s in shapes_of_pieces],
                seeds=[p.index for p in pieces],
            )
            hooks = None
            if feedback is not None:
                hooks = SyncFeedback(feedback[i], range(len(shapes)), shapes, phi_from, feeds=keeps_residuals(spec))
            sessions[i] = GroupAllreduce(
                plan,
                [t.clone() for t in payloads[i]],
                weight=weights[i],
                compensate=hooks.compensate if hooks else lambda piece, x: x,
                stage=hooks.stage if hooks else lambda *a: None,
                open_stream=open_stream,
                next_chunk_timeout=timeout,
                max_weight=max_weight,
                ignored=ignored,
                phi_from=phi_from,
                distrusted=distrusted,
                whole_delta=whole_delta,
                carry_skipped=carry_skipped,
                signer=signers(n)[i],
                peer_key=lambda index: signers(n)[index].peer_id,
            )
            if sending and i in sending:  # an owner that equivocates: its MEAN frames per stream
                sessions[i]._send_means = sending[i](sessions[i])
            if liars and i in liars:
                sessions[i]._mean_of = _lying(sessions[i], liars[i])
            if mean_of and i in mean_of:
                sessions[i]._mean_of = mean_of[i](sessions[i])
            if i in lying_receipts:
                sessions[i]._digests.receipt = _false_receipt(sessions[i]._digests.receipt)
            ready[i].set()
        try:
            outcomes = await asyncio.gather(*(s.run() for s in sessions), return_exceptions=True)
            for i, (s, outcome) in enumerate(zip(sessions, outcomes)):
                if not isinstance(outcome, BaseException):
                    s.apply()
                if feedback is not None:
                    (feedback[i].rollback if isinstance(outcome, BaseException) else feedback[i].commit)()
                s.close()
        finally:
            for server in servers:
                server.close()
        return sessions, outcomes


_SIGNERS: list[PeerSigner] = []


def signers(n: int) -> list[PeerSigner]:
    """``n`` identity keys (RSA-2048, as peer/net/identity.py makes), made once per test process:
    groupmate i seals its means with the i-th, and its peer id is that key's."""
    while len(_SIGNERS) < n:
        _SIGNERS.append(PeerSigner(rsa.generate_private_key(public_exponent=65537, key_size=2048)))
    return _SIGNERS[:n]


def _false_receipt(honest):
    """``MeanDigests.receipt`` of a receiver that lies about every owner's means."""
    return lambda signatures: false_receipt(honest(signatures))


def _lying(session, forge):
    """``session._mean_of`` of an owner that sends ``forge(honest mean)``, encoded as a real mean."""
    honest = session._mean_of

    def mean_of(piece, parts, included):
        _, value, clipped = honest(piece, parts, included)
        data, forged = session._roundtrip(piece, forge(value), session.plan.mean_codecs[piece.index])
        return frames.encode_mean(piece.index, included, data), forged, clipped

    return mean_of


def owner_means(payloads, pieces, weights=None):
    """What honest owners send for ``pieces`` (a plan's): per piece, peer/sync/robust.py ``piece_mean``
    of every payload's rows of it (sender order, ``weights`` or equal), written into tensors of the
    payloads' shapes; rows of no piece stay zero."""
    weights = [1.0] * len(payloads) if weights is None else weights
    out = [torch.zeros_like(t, dtype=torch.float32) for t in payloads[0]]
    for piece in pieces:
        rows = slice(piece.start, piece.stop)
        parts = [(float(w), _rows(p[piece.tensor])[rows].float()) for p, w in zip(payloads, weights)]
        _rows(out[piece.tensor])[rows] = piece_mean(parts)[0]
    return out


def _rows(t):
    """``t``, a 0-d tensor as one row (a view): the pieces of a scalar parameter."""
    return t.view(1) if t.dim() == 0 else t
