"""locoswarm's group all-reduce: a butterfly reduce-scatter plus all-gather of codec-compressed
pieces on hivemind's libp2p streams (frames: protocol/wire/allreduce.py; plan: pieces.py).

Why our own and not hivemind's ``AllReduceRunner``: the codecs (protocol/codecs/) must see
whole row-pieces of each tensor (low rank, top-k), every message must be validated against the
run's shapes before use, every byte is counted, and a failing groupmate is excluded by a stated rule.

The algorithm, for a group of n peers ordered as hivemind's matchmaking returned them:

1. Every tensor is cut into pieces of whole rows (dim 0) of about ``piece_elements`` elements;
   pieces are dealt to the *owners* (groupmates not in client mode) in contiguous runs of about
   equal size. Every peer derives the same plan from the shapes and the group.
2. Every peer sends each piece, encoded with its codec after adding its error-feedback residual,
   to the piece's owner (its own pieces stay local, uncompressed). Encoding is self-describing.
3. An owner screens each piece's contributions (peer/sync/screening.py: claimed tokens capped,
   norms clipped to a multiple of the median norm; NoLoCo: peer/sync/pairs.py), takes their
   token-weighted fp32 mean in sender order, encodes it with the codec's ``for_mean`` and decodes
   it itself, so owner and receivers hold bit-identical means. A non-finite mean is never sent.
4. Every peer writes the means into its tensors: DiLoCo's φ, bit-identical within the group.

Rules on failure (checked, never assumed):

* A sender whose HELLO or piece fails validation (version, group, index, length, codec data,
  shape, non-finite value), who stays silent for ``next_chunk_timeout`` or whose stream breaks is
  *excluded* by that owner: the owner's remaining means average the other senders only, with their
  weights, and each MEAN frame names the senders it includes. Every receiver gets the same bytes,
  so φ stays identical among the peers that complete.
* A receiver checks every mean against its own contribution (screening.py ``owner_mean_problem``;
  a NoLoCo pair: the owner's contribution it implies, its whole Δ's direction at the receipts,
  pairs.py). A refused φ mean, or any of a pair, is applied as this peer's own values; a refused Δ
  mean is a vote in its RECEIPT; the owner is named in the stats (struck where the norm failed).
* An owner ends each stream with a SEAL, its identity key's signature of the digest of the means
  it sent there; a receiver that finds no valid seal applies nothing of the round. Once a peer
  holds every mean it sends each owner a RECEIPT of what every owner sent it, with the owners'
  seals (peer/sync/receipts.py): an owner refused by more than half of the reports, or proven to
  have sealed different means for different receivers (equivocation), has its pieces applied as
  refused by every peer (Δ: zeros, each peer's own Δ there sent again next round, as its
  error-feedback residual or kept in θ by a blocking landing); a proven equivocator is named in
  ``AllreduceStats.equivocators`` (the averager ignores it from the next round), a groupmate
  whose receipt reports an unsealed digest in ``receipt_liars`` (its receipt is not read).
* A peer that misses any piece's mean (an owner died, aborted or sent something invalid) applies
  nothing from the round: :class:`~protocol.errors.PartialAverage` is raised, the tensors are left
  unchanged and the error-feedback residuals are rolled back. The caller falls back to its own
  pseudo-gradient.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import torch

from peer.sync.allreduce_stats import AllreduceStats
from peer.sync.pairs import PairOwner, PairTally, is_pair, keeps_own, partner_problem, receiver_problem
from peer.sync.pieces import GroupPlan
from peer.sync.receipts import MeanDigests, ReceiptExchange
from peer.sync.robust import piece_mean
from peer.sync.screening import MeanRefusal, SmallPieces, cap_weight, reference_rms, small_piece
from protocol import codecs
from protocol.errors import BadPayload, PartialAverage
from protocol.signing import PeerSigner
from protocol.wire import allreduce as frames, framing
from protocol.wire.pieces import Piece, piece_shape, piece_view

logger = logging.getLogger(__name__)


class GroupAllreduce(ReceiptExchange, PairOwner):
    """One all-reduce of one group, from this peer's side (sender to every owner, owner of its pieces).

    Args:
        plan: the group, pieces and codecs.
        tensors: this peer's payload, fp32, shapes as planned; overwritten with the means on success.
        weight: tokens behind this peer's contribution (> 0).
        compensate / stage: error feedback (peer/sync/error_feedback.py ``SyncFeedback``), the
            caller commits or rolls back: ``compensate(piece, x) -> x + e``; ``stage(piece, x, decoded)``.
        open_stream: ``await open_stream(peer_id) -> (reader, writer)`` to an owner.
        next_chunk_timeout: seconds a silent sender or owner is waited for.
        executor: runs encode/decode off the event loop (torch releases the GIL).
        max_weight: the most tokens one contribution may weigh (the run's ``H × batch_size_tokens``);
            a HELLO claiming more is cut to it. None: no cap.
        ignored: groupmates (indices) whose contributions this owner leaves out of its means from the
            start (peer/sync/screening.py ``Strikes``); they still receive the means.
        phi_from: index of the first tensor that is φ, not Δ (NoLoCo), or None: how a refused
            mean is replaced (zeros for Δ, own values for φ and in a pair) and which checks apply.
        distrusted: owners (indices) caught equivocating in an earlier round: their means are applied
            as refused without a check (pass them in ``ignored`` too).
        signer: this peer's identity key, which seals the means it sends as an owner (receipts.py).
        peer_key: a groupmate's libp2p peer id (base58) from its entry in ``plan.peer_ids``, whose
            key must have sealed its means (``str`` for hivemind's ``PeerID``).
        whole_delta: a Δ of one round's progress alone (protocol/specs.py ``delta_is_round_progress``): a
            pair's receiver judges its owner's whole Δ (pairs.py ``PairTally``), receipts the alignments.
        carry_skipped: a Δ piece the receipts skip is staged as this peer's residual; else in ``kept_rows``.
    """

    def __init__(
        self,
        plan: GroupPlan,
        tensors: Sequence[torch.Tensor],
        *,
        weight: float,
        compensate: Callable[[Piece, torch.Tensor], torch.Tensor],
        stage: Callable[[Piece, torch.Tensor, torch.Tensor | None], None],
        open_stream,
        next_chunk_timeout: float,
        executor: Executor | None = None,
        max_weight: float | None = None,
        ignored: frozenset[int] = frozenset(),
        phi_from: int | None = None,
        distrusted: frozenset[int] = frozenset(),
        whole_delta: bool = True,
        carry_skipped: bool = True,
        signer: PeerSigner,
        peer_key: Callable[[object], str] = str,
    ):
        if max_weight is not None and not max_weight > 0:
            raise ValueError(f"max_weight = {max_weight!r}: expected a number of tokens > 0 or None")
        self.plan, self.tensors, self.weight = plan, list(tensors), float(weight)
        self.max_weight = None if max_weight is None else float(max_weight)
        self.compensate, self.stage, self.open_stream = compensate, stage, open_stream
        self.signer, self.peer_key = signer, peer_key
        self.timeout, self.executor = next_chunk_timeout, executor
        self.stats = AllreduceStats()
        n, me = len(plan.peer_ids), plan.my_index
        self.my_pieces = [p for p in plan.pieces if p.owner == me]
        self.pieces_by_owner: dict[int, list[Piece]] = {}
        for p in plan.pieces:
            self.pieces_by_owner.setdefault(p.owner, []).append(p)
        # owner state for my pieces: contributions[piece.index][sender] -> (weight, fp32 tensor)
        self._contrib: dict[int, list[tuple[float, torch.Tensor] | None]] = {
            p.index: [None] * n for p in self.my_pieces
        }
        self._excluded: set[int] = set()
        for s in sorted(set(ignored) - {me}):
            self._excluded.add(s)
            self.stats.excluded[s] = "ignored: its contributions were clipped or dropped repeatedly"
        self._connected: set[int] = {me}
        self._changed = asyncio.Condition()
        self._mean_frames: dict[int, asyncio.Future] = {
            p.index: asyncio.get_running_loop().create_future() for p in self.my_pieces
        }
        self._mean_writers: set[asyncio.Task] = set()
        """Owner: the tasks writing this peer's MEAN frames back to each sender (:meth:`serve`)."""
        self.results: dict[int, torch.Tensor] = {}
        self.phi_from, self.pair, self.whole_delta = phi_from, is_pair(phi_from, n), whole_delta
        self._tallies: dict[int, PairTally] = {}  # a pair's receiver: per owner, its whole Δ so far
        self._reference: dict[bool, float] = {}  # :meth:`_rms`, the unit of the receivers' norm floor
        self._small: dict[int, SmallPieces] = {}  # per owner: its small Δ pieces' means, judged together
        self._sent: dict[int, torch.Tensor] = {}
        """Per piece sent to another owner: this peer's contribution as the owner decodes it (bf16 if lossy)."""
        self.distrusted, self.carry_skipped = distrusted, carry_skipped
        self._digests = MeanDigests()
        """Per owner, the digest of the MEAN payloads it sent this peer (this peer's own: it sent)."""
        self._seals: dict[int, tuple[bytes, bytes]] = {}
        self._own_seal_frame: asyncio.Future = asyncio.get_running_loop().create_future()
        """Owner: its SEAL frame, once every mean is made (None if one failed)."""
        self._unheard = frozenset(set(ignored) - {me})
        self._receipts: dict[int, frames.Receipt] = {}
        self._receipt_writers: dict[int, asyncio.StreamWriter] = {}
        """Streams to owners, kept open after their means until this peer's RECEIPT is written."""
        self._serving: set[int] = set()
        """Senders whose stream to this owner is still open (their RECEIPT may come)."""
        self._start = time.monotonic()
        self.stats.started_at = time.time()

    # ---- helpers ------------------------------------------------------------------------
    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _write(self, writer: asyncio.StreamWriter, payload: bytes) -> None:
        data = framing.frame(payload)
        writer.write(data)
        self.stats.bytes_sent += len(data)

    async def _read(self, reader: asyncio.StreamReader, max_bytes: int, timeout: float) -> bytes:
        payload = await framing.read_frame(reader, max_bytes=max_bytes, timeout=timeout)
        self.stats.bytes_received += framing.LENGTH.size + len(payload)
        return payload

    def _decode_checked(self, data, piece: Piece) -> torch.Tensor:
        shape = piece_shape(self.tensors[piece.tensor].shape, piece)
        value = codecs.decode(data, shape, seed=self.plan.seeds[piece.index])
        if tuple(value.shape) != shape or value.dtype != torch.float32:
            raise BadPayload(
                f"piece {piece.index} decoded to {value.dtype} {tuple(value.shape)}, expected float32 {shape}"
            )
        if not torch.isfinite(value).all():
            raise BadPayload(f"piece {piece.index} holds NaN or inf")
        return value

    async def _exclude(self, sender: int, reason: str) -> None:
        async with self._changed:
            self._exclude_locked(sender, reason)
            self._changed.notify_all()

    def _exclude_locked(self, sender: int, reason: str) -> None:
        """Leave ``sender`` out of this owner's remaining means (hold ``self._changed``)."""
        if sender not in self._excluded:
            self._excluded.add(sender)
            self.stats.excluded[sender] = reason
            logger.warning(
                "all-reduce %s: excluded groupmate %d (%s): %s",
                self.plan.group_id.hex()[:8],
                sender,
                self.plan.peer_ids[sender],
                reason,
            )

    # ---- owner side ---------------------------------------------------------------------
    async def serve(
        self, stream_peer_id, hello_payload: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Handle one sender's stream (its HELLO already read): read its pieces, write back the means."""
        n = len(self.plan.peer_ids)
        sender = None
        self.stats.bytes_received += framing.LENGTH.size + len(hello_payload)
        try:
            try:
                hello = frames.parse_hello(hello_payload, group_size=n)
                if hello.group_id != self.plan.group_id:
                    raise BadPayload("HELLO names another group")
                if self.plan.peer_ids[hello.sender] != stream_peer_id:
                    raise BadPayload(f"HELLO claims sender index {hello.sender}, which is not the stream's peer")
                if hello.sender == self.plan.my_index or hello.pieces != len(self.my_pieces):
                    raise BadPayload(f"HELLO announces {hello.pieces} pieces, this owner reduces {len(self.my_pieces)}")
            except (TimeoutError, BadPayload, asyncio.IncompleteReadError, ConnectionError) as exc:
                self._write(writer, frames.encode_abort(f"rejected: {exc!r}"))
                await writer.drain()
                return
            sender = hello.sender
            weight = self._capped(sender, hello.weight)
            if self.pair:  # its receiver judges the owner's whole Δ with this weight
                self._tallies.setdefault(sender, PairTally()).partner_weight = weight
            async with self._changed:
                self._connected.add(sender)
                self._serving.add(sender)
                self._changed.notify_all()
            send_task = asyncio.create_task(self._send_means(writer))
            self._mean_writers.add(send_task)
            try:
                for piece in self.my_pieces:
                    limit = frames.PIECE_HEADER.size + self.plan.max_piece_bytes[piece.index]
                    payload = await self._read(reader, limit, self.timeout)
                    data = frames.parse_piece(payload, expected_index=piece.index)
                    value = await self._off_loop(self._decode_checked, data, piece)
                    async with self._changed:
                        slots = self._contrib[piece.index]  # empty once reduced or released: too late
                        if sender not in self._excluded and slots:
                            slots[sender] = (weight, value)
                        self._changed.notify_all()
            except (TimeoutError, BadPayload, asyncio.IncompleteReadError, ConnectionError) as exc:
                if isinstance(exc, BadPayload) and sender not in self._excluded:
                    self.stats.dropped.add(sender)
                await self._exclude(sender, f"{type(exc).__name__}: {exc}")
            await send_task
            # Its RECEIPT, once it holds every mean (its other owners may be slower than this one).
            # The sender closes first, once it has read every mean: closing here could make the
            # p2p daemon drop the stream's tail before it reaches the sender.
            try:
                limit = frames.max_receipt_bytes(n)
                receipt = await self._read(reader, limit, 2 * self.timeout + 1.0)
                self._receipts[sender] = frames.parse_receipt(receipt, group_size=n)
                await asyncio.wait_for(reader.read(1), self.timeout)
            except (TimeoutError, BadPayload) as exc:
                logger.debug("no receipt from %s: %r", stream_peer_id, exc)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            logger.debug("stream from %s broke: %r", stream_peer_id, exc)
        finally:
            writer.close()
            if sender is not None:
                async with self._changed:
                    self._serving.discard(sender)
                    self._changed.notify_all()

    async def _send_means(self, writer: asyncio.StreamWriter) -> None:
        for piece in self.my_pieces:
            payload = await self._mean_frames[piece.index]
            if payload is None:
                self._write(writer, frames.encode_abort(f"piece {piece.index} could not be reduced"))
                await writer.drain()
                return
            self._write(writer, payload)
            await writer.drain()
        seal = await self._own_seal_frame
        self._write(writer, seal if seal is not None else frames.encode_abort("no seal: a mean failed"))
        await writer.drain()

    async def _reduce_my_pieces(self) -> None:
        """Owner: wait for every piece's contributions, reduce, publish MEAN frames in piece order."""
        n, me = len(self.plan.peer_ids), self.plan.my_index
        for piece in self.my_pieces:
            own = self.compensate(piece, piece_view(self.tensors[piece.tensor], piece).float())
            codec = self.plan.codecs[piece.index]
            if getattr(codec, "structured", False) and torch.isfinite(own).all():
                # top-k / low rank: the mean is re-encoded with n× the budget, which is exact only
                # if every contribution, this owner's included, went through the codec
                compensated = own
                _, own = await self._off_loop(self._roundtrip, piece, compensated)
                self.stage(piece, compensated, own)
            else:
                self.stage(piece, own, own)  # own rows stay exact: no residual
            if torch.isfinite(own).all():
                self._contrib[piece.index][me] = (self._capped(me, self.weight), own)
            else:  # never average a non-finite value, not even our own
                await self._exclude(me, f"own piece {piece.index} holds NaN or inf")
        whole = self._whole(self.my_pieces)
        for piece in self.my_pieces if whole else ():
            await self._wait_for(piece)
        away = self._partners_away() if whole else set()
        for piece in self.my_pieces:
            slots = self._contrib[piece.index]
            await self._wait_for(piece)
            # NoLoCo (peer/sync/pairs.py): a φ far off, a pair's Δ pointing away (this piece or whole)
            left_out: set[int] = set() if self.phi_from is None or piece.tensor >= self.phi_from else set(away)
            if self.phi_from is not None and (ours := slots[me]) is not None:
                phi = piece.tensor >= self.phi_from
                others = [(s, x) for s, x in enumerate(slots) if s != me and s not in self._excluded and x is not None]
                for s, (w, theirs) in others:
                    found = partner_problem(
                        theirs, ours[1], phi=phi, pair=self.pair, scale=ours[0] / w, reference_rms=self._rms(not phi)
                    )
                    if found is not None and found[1]:
                        self.stats.dropped.add(s)  # struck
                    if found is not None and phi:
                        await self._exclude(s, f"piece {piece.index}: {found[0]}")
                    elif found is not None:  # a Δ: left out of this piece only
                        left_out.add(s)
                        logger.info("all-reduce: piece %d: left out groupmate %d: %s", piece.index, s, found[0])
            included = [s not in self._excluded and s not in left_out and slots[s] is not None for s in range(n)]
            parts = [slots[s] for s in range(n) if included[s]]
            self.stats.partial_pieces += not all(included)
            senders = [s for s in range(n) if included[s]]
            payload, value, struck = await self._off_loop(self._mean_of, piece, parts, included)
            for position in struck:
                s = senders[position]
                self.stats.clipped[s] = self.stats.clipped.get(s, 0) + 1
            if struck:
                logger.info(
                    "all-reduce %s: piece %d: a strike for groupmates %s, over the strike bound of the median norm",
                    self.plan.group_id.hex()[:8],
                    piece.index,
                    [senders[p] for p in struck],
                )
            self.results[piece.index] = value
            self._digests.add(me, payload)
            self._mean_frames[piece.index].set_result(payload)
            self._contrib[piece.index] = []  # free the contributions
        self._own_seal_frame.set_result(self._own_seal())

    async def _wait_for(self, piece: Piece) -> None:
        """Owner: wait for every contribution to ``piece``; one silent for a next-chunk timeout is excluded."""
        slots, n, last_change = self._contrib[piece.index], len(self.plan.peer_ids), time.monotonic()
        async with self._changed:
            while waiting := [s for s in range(n) if s not in self._excluded and slots[s] is None]:
                silent = time.monotonic() - last_change
                if silent > self.timeout:
                    for s in waiting:
                        self._exclude_locked(
                            s, "never connected" if s not in self._connected else "sent nothing in time"
                        )
                    continue
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=self.timeout - silent + 0.05)
                    last_change = time.monotonic()
                except TimeoutError:
                    pass

    def _roundtrip(self, piece: Piece, x: torch.Tensor, codec=None) -> tuple[bytes, torch.Tensor]:
        codec = self.plan.codecs[piece.index] if codec is None else codec
        return codec.roundtrip(x, seed=self.plan.seeds[piece.index])

    def _rms(self, delta: bool) -> float:
        """This peer's own payload's RMS per value, of its Δ (True) or φ (False) tensors, computed once
        per kind (two executor threads may both compute it: the same value)."""
        if delta not in self._reference:
            split = len(self.tensors) if self.phi_from is None else self.phi_from
            self._reference[delta] = reference_rms(self.tensors[:split] if delta else self.tensors[split:])
        return self._reference[delta]

    def _capped(self, sender: int, weight: float) -> float:
        """``weight`` cut to :attr:`max_weight`; a cut is logged and counted once per sender."""
        capped = cap_weight(weight, self.max_weight)
        if capped != weight and sender not in self.stats.capped_weights:
            self.stats.capped_weights[sender] = weight
            logger.warning(
                "all-reduce %s: groupmate %d (%s) claims %.3g tokens, more than a round holds; weighted as %.0f",
                self.plan.group_id.hex()[:8],
                sender,
                self.plan.peer_ids[sender],
                weight,
                capped,
            )
        return capped

    def _mean_of(self, piece: Piece, parts, included: list[bool]) -> tuple[bytes, torch.Tensor, list[int]]:
        """The screened, weighted mean of ``parts`` (in sender order): its MEAN frame, its decoded
        value and the positions in ``parts`` over the strike factor (clipped, and struck).

        Raises:
            BadPayload: the mean is not finite (after the codec): the piece fails, nothing is sent.
        """
        acc, struck = piece_mean(parts)
        data, value = self._roundtrip(piece, acc, self.plan.mean_codecs[piece.index])
        if not torch.isfinite(value).all():
            raise BadPayload(f"the mean of piece {piece.index} is not finite")
        return frames.encode_mean(piece.index, included, data), value, struck

    # ---- sender side --------------------------------------------------------------------
    def _encode_contribution(self, piece: Piece) -> bytes:
        x = self.compensate(piece, piece_view(self.tensors[piece.tensor], piece).float())
        if self.plan.codecs[piece.index].lossy:
            data, decoded = self._roundtrip(piece, x)
            self.stage(piece, x, decoded)
            self._sent[piece.index] = decoded.to(torch.bfloat16)
        else:
            data = self.plan.codecs[piece.index].encode(x, seed=self.plan.seeds[piece.index])
            self.stage(piece, x, x)
            self._sent[piece.index] = x
        return frames.encode_piece(piece.index, data)

    def _checked_mean(self, owner: int, piece: Piece, value: torch.Tensor, included: list[bool]) -> torch.Tensor:
        """``value`` (the owner's decoded mean of ``piece``) if peer/sync/pairs.py ``receiver_problem``
        accepts it against this peer's contribution. A refused Δ mean is reported in this peer's RECEIPT,
        ``value`` kept until the receipts' verdict (peer/sync/receipts.py: more than half of the reports
        refusing skip the owner's pieces for everyone; a peer in client mode reads only its own); a refused φ
        mean (NoLoCo, whose replicas may differ) or any of a pair is replaced by this peer's own values."""
        mine = self._sent.pop(piece.index, None)
        if mine is None:
            return value
        mine, delta = mine.float(), self.phi_from is None or piece.tensor < self.phi_from
        votes = not keeps_own(not delta, self.pair)  # else: this peer's own values at once, no vote
        if votes:  # a Δ piece of a group: its alignment is reported (peer/sync/receipts.py)
            self._digests.align(owner, mine, value)
        kept = value if votes else mine
        if owner in self.distrusted:  # caught equivocating in an earlier round
            if votes:
                self._digests.refuse(owner)
            return kept
        problem = receiver_problem(
            value,
            mine,
            weight=self.weight,
            included=sum(included),
            max_weight=self.max_weight,
            phi=not delta,
            included_self=included[self.plan.my_index],
            reference_rms=self._rms(delta),
            pair=self.pair,
            tally=self._tallies.setdefault(owner, PairTally()) if self.pair and delta else None,
        )
        if problem is None:
            if votes and delta and small_piece(value):  # judged with the owner's other small pieces
                self._small.setdefault(owner, SmallPieces()).add(
                    value, mine, included=sum(included), included_self=included[self.plan.my_index]
                )
            return value
        self._refuse(owner, f"piece {piece.index}", problem, votes=votes)
        return kept

    def _judge_small(self, owner: int) -> None:
        """Once ``owner``'s last mean is in: its small Δ pieces judged together
        (peer/sync/screening.py ``SmallPieces``); a refusal is a vote in this peer's RECEIPT."""
        if (small := self._small.pop(owner, None)) is None:
            return
        problem = small.problem(weight=self.weight, max_weight=self.max_weight, reference_rms=self._rms(True))
        if problem is not None:
            self._refuse(owner, f"{small.pieces} small pieces", problem, votes=True, pieces=small.pieces)

    def _refuse(self, owner: int, what: str, problem: MeanRefusal, *, votes: bool, pieces: int = 1) -> None:
        """Count this peer's refusal of ``owner``'s means of ``what`` (a vote in its RECEIPT where
        ``votes``), strike it for a norm or φ check, and name it once in the stats and the log."""
        if votes:
            self._digests.refuse(owner)
        self.stats.refused_pieces += pieces
        if problem.strike:
            self.stats.struck_owners.add(str(self.plan.peer_ids[owner]))
        if str(self.plan.peer_ids[owner]) not in self.stats.refused:
            self.stats.refused[str(self.plan.peer_ids[owner])] = str(problem)  # stats cross process pipes
            # a vote alone decides nothing: a warning only for a strike (the receipts warn of a skip)
            (logger.warning if problem.strike or not votes else logger.info)(
                "all-reduce %s: refused the means of %s from owner %d (%s): %s; %s",
                self.plan.group_id.hex()[:8],
                what,
                owner,
                self.plan.peer_ids[owner],
                problem,
                "the group's receipts decide" if votes else "applying its replacement",
            )

    async def _exchange_with(self, owner: int) -> None:
        pieces = self.pieces_by_owner[owner]
        n = len(self.plan.peer_ids)
        reader, writer = await asyncio.wait_for(self.open_stream(self.plan.peer_ids[owner]), self.timeout)
        try:
            self._write(
                writer,
                frames.encode_hello(
                    group_id=self.plan.group_id, sender=self.plan.my_index, weight=self.weight, pieces=len(pieces)
                ),
            )

            async def send() -> None:
                for piece in pieces:
                    payload = await self._off_loop(self._encode_contribution, piece)
                    self._write(writer, payload)
                    await writer.drain()
                self.stats.send_seconds = max(self.stats.send_seconds, time.monotonic() - self._start)

            send_task = asyncio.create_task(send())
            try:
                if self._whole(pieces):  # its owner reduces once every piece is in: no mean before
                    await send_task
                for piece in pieces:
                    limit = frames.MEAN_HEADER.size + (n + 7) // 8 + self.plan.max_piece_bytes[piece.index]
                    payload = await self._read(reader, limit, 2 * self.timeout + 1.0)
                    if send_task.done() and (error := send_task.exception()) is not None:
                        raise error
                    included, data = frames.parse_mean(payload, expected_index=piece.index, group_size=n)
                    self._digests.add(owner, payload)
                    value = await self._off_loop(self._decode_checked, data, piece)
                    self.stats.partial_pieces += not all(included)
                    self.results[piece.index] = await self._off_loop(self._checked_mean, owner, piece, value, included)
                await self._off_loop(self._judge_small, owner)
                seal = await self._read(reader, frames.max_seal_bytes(), 2 * self.timeout + 1.0)
                self._take_seal(owner, seal)  # raises: the owner's means are not applied
                await send_task
            finally:
                send_task.cancel()
            self._receipt_writers[owner], writer = writer, None  # open until the RECEIPT (run())
        finally:
            if writer is not None:
                writer.close()

    async def run(self) -> AllreduceStats:
        """Run the whole exchange; on success the tensors hold the group means.

        Returns once this peer's own exchanges and reductions are done and the means it owes its
        senders are written (or a next-chunk timeout has passed), so the stats count every byte sent.

        Raises:
            PartialAverage: some piece's mean did not arrive valid; tensors unchanged.
        """
        owners = [o for o in self.pieces_by_owner if o != self.plan.my_index]
        tasks = [asyncio.create_task(self._exchange_with(o)) for o in owners]
        reducer = asyncio.create_task(self._reduce_my_pieces()) if self.my_pieces else None
        errors = []
        for owner, task in zip(owners, tasks):
            try:
                await task
            except Exception as exc:
                errors.append(f"owner {owner} ({self.plan.peer_ids[owner]}): {type(exc).__name__}: {exc}")
        if reducer is not None:
            try:
                await reducer
            except Exception as exc:
                errors.append(f"reducing own pieces: {type(exc).__name__}: {exc}")
                self.close()  # senders waiting for our means get an ABORT
        # serve()'s tasks may still be writing the means this peer owes: wait (one next-chunk timeout
        # in all) so that the stats the round's report reads count every byte this exchange sends.
        writing = [t for t in self._mean_writers if not t.done()]
        if writing:
            await asyncio.wait(writing, timeout=self.timeout)
        missing = [p.index for p in self.plan.pieces if p.index not in self.results]
        await self._exchange_receipts(send=not errors and not missing)
        self.stats.seconds = time.monotonic() - self._start
        if errors:
            raise PartialAverage("; ".join(errors))
        if missing:
            raise PartialAverage(f"no mean for pieces {missing[:8]}")
        self._judge_receipts()
        return self.stats

    def apply(self) -> None:
        """Write the means into the tensors (after :meth:`run` succeeded)."""
        for piece in self.plan.pieces:
            piece_view(self.tensors[piece.tensor], piece).copy_(self.results[piece.index])

    def release(self) -> None:
        """Drop what the exchange held of the model (the decoded means, the contributions to this
        owner's pieces, this peer's own as sent) once it is over, applied or not: the session object
        outlives its exchange (the averager keeps it a while for late streams of its group), its
        model-sized tensors need not."""
        self.results.clear()
        self._sent.clear()
        for index in self._contrib:
            self._contrib[index] = []

    def close(self) -> None:
        """Release senders still waiting for means (after a failure)."""
        for fut in [*self._mean_frames.values(), self._own_seal_frame]:
            if not fut.done():
                fut.set_result(None)
        for writer in self._receipt_writers.values():
            writer.close()
        self._receipt_writers.clear()
