#!/usr/bin/env bash
# One run on a machine with an NVIDIA GPU: install the wheel as docs/install.md says
# (pip into a venv, offline from wheels), check the installed daemon end to end on
# the real NVML reader, then record the calibration workloads (tests/gpu/calibrate.sh).
#
#   tests/gpu/device_check.sh [OUTDIR]     (default: $OUT, else ./gpu-device-check)
#
# WHEELS (default .whl/ in the checkout): the project's wheel and its dependencies'.
# DEVICE_READER=sim runs the same steps on the simulator; CALIBRATE_SECONDS (default 30)
# is the seconds per busy workload. It changes no GPU setting.
set -uo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:-${OUT:-$PWD/gpu-device-check}}"
wheels="${WHEELS:-$here/.whl}"
reader="${DEVICE_READER:-nvml}"
mkdir -p "$out"
log="$out/install-check.log"
say() { echo "== $*" | tee -a "$log"; }

say "host: $(uname -r), python: $(python3 --version 2>&1), date: $(date -u +%FT%TZ)"
command -v nvidia-smi >/dev/null && nvidia-smi -L >> "$log" 2>&1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=driver_version,name,mig.mode.current --format=csv >> "$log" 2>&1

# 1. pip into a venv, as docs/install.md: the venv sees the system's packages only for the
#    GPU workload (torch); the daemon's own dependencies are the wheels'.
venv="$out/venv"
python3 -m venv --system-site-packages "$venv" >> "$log" 2>&1 || { say "venv failed"; exit 2; }
"$venv/bin/pip" install -q --no-index --find-links "$wheels" --ignore-installed \
    "$(ls "$wheels"/atopgpud_tw-*.whl | tail -n 1)" >> "$log" 2>&1 || { say "pip install failed"; exit 2; }
say "installed: $("$venv/bin/atopgpud" --version | tr '\n' ' ')"
ls "$venv/share/atopgpud_tw/systemd" >> "$log" 2>&1

# 2. the installed daemon on the real reader: atop's socket, /metrics, the probes, atopgpu
socket="atopgpud-device-$$"
port=$((20000 + $$ % 20000))
"$venv/bin/atopgpud" --reader "$reader" --listen "unix:@$socket" --metrics "tcp:$port:interface=127.0.0.1" \
    --metrics-processes > "$out/daemon.log" 2>&1 &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null' EXIT
for _ in $(seq 100); do "$venv/bin/atopgpu" --connect "unix:@$socket" --json > /dev/null 2>&1 && break; sleep 0.2; done
load=""
torch_python=""
for candidate in python3 /opt/torch/.venv/bin/python3; do
    if "$candidate" -c 'import torch' 2>/dev/null; then torch_python="$candidate"; break; fi
done
if [ "$reader" = nvml ] && [ -n "$torch_python" ]; then
    "$torch_python" -c '
import time, torch
a = torch.randn(4096, 4096, device="cuda"); end = time.time() + 12
while time.time() < end:
    a = torch.tanh(a @ a); torch.cuda.synchronize()
' > "$out/load.log" 2>&1 &
    load=$!
fi
sleep 3
"$venv/bin/atopgpu" --connect "unix:@$socket" > "$out/atopgpu.txt" 2>&1; say "atopgpu: $?"
"$venv/bin/atopgpu" --connect "unix:@$socket" --watch 2 --count 3 > "$out/atopgpu-watch.txt" 2>&1; say "atopgpu --watch: $?"
"$venv/bin/atopgpu" --connect "unix:@$socket" --json > "$out/atopgpu.json" 2>&1; say "atopgpu --json: $?"
"$venv/bin/atopgpu" --connect "unix:@$socket" --health --metrics-url "http://127.0.0.1:$port/metrics" \
    > "$out/atopgpu-health.txt" 2>&1; say "atopgpu --health: $?"
for page in metrics -/healthy -/ready; do
    "$venv/bin/python" -c '
import sys, urllib.request, urllib.error
try:
    r = urllib.request.urlopen(sys.argv[1], timeout=10); code, body = r.status, r.read()
except urllib.error.HTTPError as e:
    code, body = e.code, e.read()
sys.stdout.buffer.write(body); print(f"\n# status {code}", file=sys.stderr)
' "http://127.0.0.1:$port/$page" > "$out/page-${page//[^a-z]/}.txt" 2>> "$log"
done
[ -n "$load" ] && wait "$load"
kill -TERM "$daemon"; wait "$daemon"; say "daemon exit: $? (143: ended by the SIGTERM it was sent, as twistd does)"
trap - EXIT

# 3. the calibration workloads, with the interpreter that has PyTorch (the lent machine's
#    is a venv of its own, /opt/torch/.venv; the system's python3 has none)
say "calibrating with ${torch_python:=$venv/bin/python}"
CALIBRATE_READER="$reader" PYTHON="$torch_python" WHEELS="$wheels" \
    "$here/tests/gpu/calibrate.sh" "$out/calibration" --seconds "${CALIBRATE_SECONDS:-30}" > /dev/null 2>&1
say "calibrate: $?"
rm -rf "$venv"
