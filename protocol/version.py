"""Wire protocol version. Bump on any change to what crosses the network.

2: run announcements signed by the run's owner (locoswarm_runs), progress records and addresses
   signed by their peer (issue #17); version-1 peers cannot read either.
3: progress records carry ``groupmates``, the signed statement of who completed the last sync
   with the peer (issue #17, item 3); version-2 peers refuse the extra field.
"""

PROTOCOL_VERSION = 3
