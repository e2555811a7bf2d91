"""Wire protocol version. Bump on any change to what crosses the network.

2: run announcements signed by the run's owner (locoswarm_runs), progress records and addresses
   signed by their peer (issue #17); version-1 peers cannot read either.
"""

PROTOCOL_VERSION = 2
