#!/usr/bin/env bash
# `make pdf` needs XeLaTeX (with the LaTeX packages Sphinx's LaTeX writer uses), latexmk, the
# GNU FreeFont OpenType fonts (Sphinx's XeLaTeX default: Greek and math symbols in prose and
# code) and, for its tests, poppler-utils (pdftotext, pdfinfo, pdfimages). Install them from
# the distribution's packages when we may (as root, or with password-less sudo); otherwise say
# in one line what to install.
set -euo pipefail
PACKAGES="texlive-xetex texlive-latex-recommended texlive-latex-extra texlive-fonts-recommended
          fonts-freefont-otf latexmk poppler-utils"
missing=""
for tool in xelatex latexmk pdftotext pdfinfo pdfimages; do
    command -v "$tool" >/dev/null 2>&1 || missing="$missing $tool"
done
# The fonts and the LaTeX packages have no command: ask kpsewhich and fc-list for one of each.
if [ -z "$missing" ]; then
    for sty in fncychap.sty titlesec.sty tabulary.sty fontspec.sty; do
        kpsewhich "$sty" >/dev/null 2>&1 || missing="$missing $sty"
    done
    [ -n "$(fc-list FreeSerif family 2>/dev/null)" ] || missing="$missing FreeSerif"
fi
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    echo "make pdf needs TeX and poppler (missing:$missing): install them as root with" \
         "'apt-get install --no-install-recommends" $PACKAGES"' (Debian/Ubuntu) and run it again." >&2
    exit 1
fi
echo "--- installing TeX and poppler-utils (Debian packages; missing:$missing)"
export DEBIAN_FRONTEND=noninteractive
# Wait for another apt (e.g. the Chromium install) instead of failing on its lock.
APT_OPTS="-o DPkg::Lock::Timeout=900"
$SUDO apt-get $APT_OPTS update -qq
# shellcheck disable=SC2086
$SUDO apt-get $APT_OPTS install -y -qq --no-install-recommends $PACKAGES >/dev/null
for tool in xelatex latexmk pdftotext pdfinfo pdfimages; do
    command -v "$tool" >/dev/null 2>&1 || { echo "apt-get did not install $tool" >&2; exit 1; }
done
