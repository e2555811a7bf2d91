#!/bin/sh
# Container entry point: optional uplink cap, optional identity seed, then the command.
#   UPLINK_RATE=20mbit   cap this container's egress on $UPLINK_DEV (default eth0) with a token
#                        bucket (tc tbf), as a home uplink would; needs `cap_add: [NET_ADMIN]`
#   IDENTITY_SEED=FILE   copy FILE to /data/identity.key (mode 0600) if that does not exist yet
set -eu
if [ -n "${UPLINK_RATE:-}" ]; then
    dev="${UPLINK_DEV:-eth0}"
    if ! tc qdisc replace dev "$dev" root tbf rate "$UPLINK_RATE" burst "${UPLINK_BURST:-64kb}" \
            latency "${UPLINK_LATENCY:-200ms}"; then
        echo "locoswarm: cannot cap the uplink of $dev to $UPLINK_RATE: give the container NET_ADMIN" \
             "(compose: cap_add: [NET_ADMIN]) or unset UPLINK_RATE" >&2
        exit 78
    fi
    echo "locoswarm: uplink of $dev capped at $UPLINK_RATE (tc tbf)" >&2
fi
if [ -n "${IDENTITY_SEED:-}" ] && [ ! -e /data/identity.key ]; then
    install -m 600 "$IDENTITY_SEED" /data/identity.key
fi
exec "$@"
