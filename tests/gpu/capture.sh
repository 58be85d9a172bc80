#!/usr/bin/env bash
# Capture what the daemon serves on a real NVIDIA GPU, for the record in tests/gpu/.
#
#   tests/gpu/capture.sh [OUTDIR]        (default: $OUT, else ./gpu-capture)
#
# Runs the daemon with --reader nvml for about 20 s while a small GPU workload runs
# (PyTorch if importable, else nothing: the idle GPU is still captured), and saves:
#   T and S replies in API versions 1 and 2, every second (replies.txt, raw *.bin),
#   nvidia-smi -q -x and nvidia-smi -L before and during the load, the daemon's log.
# It changes no GPU setting (no persistence, clocks, MIG or compute mode).
#
# Environment: CAPTURE_READER=sim runs the same steps on the simulator (to test this
# script without a GPU); CAPTURE_SECONDS (default 20); WHEELS=DIR installs the
# package offline from wheels (a machine without a network).
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:-${OUT:-$PWD/gpu-capture}}"
reader="${CAPTURE_READER:-nvml}"
seconds="${CAPTURE_SECONDS:-20}"
mkdir -p "$out"
cd "$here"

python="${PYTHON:-python3}"
if ! "$python" -c 'import atopgpud_tw, twisted' 2>/dev/null; then
    "$python" -m venv "$out/venv" --system-site-packages
    python="$out/venv/bin/python"
    if [ -n "${WHEELS:-}" ]; then
        "$python" -m pip install -q --no-index --find-links "$WHEELS" "$here"
    else
        "$python" -m pip install -q "$here"
    fi
fi

{
    echo "date: $(date -u +%FT%TZ)"
    echo "host: $(uname -a)"
    echo "reader: $reader"
    "$python" -c 'import twisted, sys; print("python:", sys.version.split()[0], "twisted:", twisted.__version__)'
    "$python" -c 'import pynvml; print("nvidia-ml-py:", getattr(pynvml, "__version__", "?"))' 2>/dev/null || true
} > "$out/environment.txt"

smi() { # name, then nvidia-smi arguments
    local name="$1"; shift
    if command -v nvidia-smi >/dev/null; then
        timeout 30 nvidia-smi "$@" > "$out/$name" 2>&1 || echo "nvidia-smi $* failed: $?" >> "$out/$name"
    fi
}
smi nvidia-smi-q-x-idle.xml -q -x
smi nvidia-smi-L.txt -L

socket="atopgpud-capture-$$"
"$python" -m atopgpud_tw --reader "$reader" --listen "unix:@$socket" > "$out/daemon.log" 2>&1 &
daemon=$!
workload=""
cleanup() {
    [ -n "$workload" ] && kill "$workload" 2>/dev/null || true
    kill -TERM "$daemon" 2>/dev/null || true
    wait "$daemon" 2>/dev/null || true
}
trap cleanup EXIT

if [ "$reader" != sim ] && "$python" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    "$python" - "$seconds" > "$out/workload.log" 2>&1 <<'PY' &
import sys, time, torch
end = time.time() + float(sys.argv[1])
a = torch.randn(4096, 4096, device="cuda")
while time.time() < end:
    for _ in range(20):
        a = torch.tanh(a @ a)          # bursts of work...
    torch.cuda.synchronize()
    time.sleep(0.3)                    # ...with gaps, as inference has
print("workload done")
PY
    workload=$!
else
    echo "no workload (torch with CUDA not available, or the simulator)" > "$out/workload.log"
fi

"$python" - "$socket" "$seconds" "$out" <<'PY'
import socket, struct, sys, time
name, seconds, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
deadline = time.time() + 30
while True:
    try:
        s = socket.socket(socket.AF_UNIX)
        s.connect(b"\0" + name.encode())
        break
    except OSError:
        if time.time() > deadline:
            raise SystemExit("the daemon did not start: see daemon.log")
        time.sleep(0.2)
s.settimeout(5)

def ask(request):
    s.sendall(request)
    head = b""
    while len(head) < 4:
        head += s.recv(4 - len(head))
    (word,) = struct.unpack(">I", head)
    body = b""
    while len(body) < (word & 0xFFFFFF):
        body += s.recv((word & 0xFFFFFF) - len(body))
    return head + body

with open(f"{out}/replies.txt", "w") as text, open(f"{out}/replies.bin", "wb") as raw:
    end = time.time() + seconds
    while time.time() < end:
        for request in (b"T\x01", b"T\x02", b"S\x01", b"S\x02"):
            reply = ask(request)
            raw.write(request + reply)
            text.write(f"{time.time():.3f} {request[:1].decode()}{request[1]} v{reply[0]} {reply[4:].decode('ascii', 'replace')}\n")
        time.sleep(1)
PY
smi nvidia-smi-q-x-load.xml -q -x
echo "captured into $out"
