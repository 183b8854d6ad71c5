#!/usr/bin/env bash
# cibuildwheel test-command: run the suite against the wheel cibuildwheel installed.
set -euo pipefail
cd "$1"
python -m pytest tests -ra
