#!/bin/sh
# envbuild entrypoint: node-local, per-job caches, then the user's command.
# shellcheck source=/dev/null  # env.sh is linted on its own
. /opt/envbuild/env.sh
if [ "$#" -eq 0 ]; then
    set -- /bin/bash
fi
exec "$@"
