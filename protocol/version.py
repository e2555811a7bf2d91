"""Wire protocol version. Bump on any change to what crosses the network.

2: run announcements signed by the run's owner (locoswarm_runs), progress records and addresses
   signed by their peer (issue #17); version-1 peers cannot read either.
3: progress records carry ``groupmates``, the signed statement of who completed the last sync
   with the peer (issue #17, item 3); version-2 peers refuse the extra field.
4: the all-reduce ends with RECEIPT frames (issue #51, item 3), progress records may carry ``caps``
   (issue #53, item 10), bootstrap nodes sign a home run, peers serve shards and tokenizers over
   their own stream protocols (issue #52); version-3 peers abort on a RECEIPT and refuse ``caps``.
5: a RECEIPT entry carries the sender's alignment with the owner's Δ means (issue #51, item 4);
   version-4 peers cannot parse it.
6: an owner ends each all-reduce stream with a SEAL (its signature of the digest of the means it
   sent), a RECEIPT entry carries a refusal flag and that seal (issue #65, item 1); version-5
   peers read a SEAL where they expect a RECEIPT's end and fail the exchange.
"""

PROTOCOL_VERSION = 6
