#!/usr/bin/env bash
# Calibrate the NVML reader on a machine with an NVIDIA GPU: one command, under 8 minutes.
#
#   tests/gpu/calibrate.sh [OUTDIR [calibrate.py options]]   (default: $OUT, else ./gpu-calibration)
#
# Runs tests/gpu/calibrate.py (its docstring says what it records) with the
# interpreter that has PyTorch or CuPy and nvidia-ml-py ($PYTHON, default python3),
# from this checkout, installed or not. Where that interpreter lacks Twisted or
# prometheus_client (a GPU image), the wheels in $WHEELS (default: .whl/ in the
# checkout) are installed into a scratch folder first; nothing is fetched.
# Writes one JSON file per workload, summary.json and calibrate.log to OUTDIR.
# CALIBRATE_READER=sim runs it on the simulator. It changes no GPU setting.
set -uo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:-${OUT:-$PWD/gpu-calibration}}"
python="${PYTHON:-python3}"
wheels="${WHEELS:-$here/.whl}"
mkdir -p "$out"

# asked from / : in the checkout, its twisted/plugins folder would pass for Twisted
if ! (cd / && "$python" -c 'import twisted.internet, prometheus_client') 2>/dev/null; then
    if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
        echo "calibrate: $python lacks Twisted or prometheus_client, and $wheels holds no wheels" >&2
        exit 2
    fi
    site="$(mktemp -d)"
    # resolved, not every file: $WHEELS may hold wheels for several Python versions
    "$python" -m pip install -q --no-index --no-compile --target "$site" --find-links "$wheels" \
        twisted prometheus_client PyYAML nvidia-ml-py || exit 2
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! (cd / && "$python" -c 'import atopgpud_tw') 2>/dev/null; then
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$here"
fi

# the script keeps itself under 450 s; the timeout is a backstop
PYTHONUNBUFFERED=1 timeout -k 10 470 "$python" "$here/tests/gpu/calibrate.py" "$out" "${@:2}" 2>&1 | tee "$out/calibrate.log"
exit "${PIPESTATUS[0]}"
