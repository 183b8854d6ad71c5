#!/usr/bin/env bash
# cibuildwheel before-test: a CPU-only torch (the CUDA one is gigabytes) and pytest.
set -euo pipefail
python -m pip install torch --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
python -m pip install pytest
