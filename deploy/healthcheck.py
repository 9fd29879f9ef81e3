#!/usr/bin/env python3
"""Container health probe: exit 0 when ``$HEALTHCHECK_URL`` (or argv[1]) answers 200.

Plain ``urllib`` so the image needs neither curl nor wget. The gateway's ``/health`` is 503
while NATS is unreachable, which makes the container unhealthy until NATS is back.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main(argv: list[str]) -> int:
    """Probe the URL once; 0 = healthy, 1 = not."""
    url = argv[1] if len(argv) > 1 else os.environ.get("HEALTHCHECK_URL", "")
    if not url:
        print("qos-healthcheck: no URL (argv[1] or HEALTHCHECK_URL)", file=sys.stderr)
        return 1
    try:
        with urllib.request.urlopen(url, timeout=float(os.environ.get("HEALTHCHECK_TIMEOUT_S", 2))):
            return 0
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"qos-healthcheck: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
