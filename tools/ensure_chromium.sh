#!/usr/bin/env bash
# The monitor's browser tests drive Debian's Chromium. Install it where it is missing and this
# user may (root with apt-get); elsewhere say so: those tests then skip, naming the reason.
set -u
if command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] || [ -n "${CLOSEDLOOP_CHROMIUM:-}" ]; then
    exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's chromium for the monitor's browser tests (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -q && apt-get install -y -q chromium; } >/tmp/closedloop-chromium.log 2>&1 \
        || echo "warning: could not install chromium (see /tmp/closedloop-chromium.log); browser tests will skip"
else
    echo "note: no chromium and no root apt-get; the monitor's browser tests will skip (install Debian's chromium)"
fi
exit 0
