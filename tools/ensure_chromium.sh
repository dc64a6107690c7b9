#!/usr/bin/env bash
# The browser test (tests/book/test_offline_math.py) needs a headless Chromium. Install it
# when we may (as root, or with password-less sudo); otherwise say in one line what to install.
set -euo pipefail
for name in chromium chromium-browser google-chrome; do
    if command -v "$name" >/dev/null 2>&1; then exit 0; fi
done
if [ "$(id -u)" = 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    echo "make test needs Chromium for the browser test: install it as root" \
         "('apt-get install chromium' on Debian/Ubuntu) and run make test again." >&2
    exit 1
fi
echo "--- installing chromium (Debian package)"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium >/dev/null
command -v chromium >/dev/null 2>&1 || { echo "apt-get did not install chromium" >&2; exit 1; }
