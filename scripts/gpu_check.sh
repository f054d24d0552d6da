#!/usr/bin/env bash
# The one GPU check of issue 18: run from the repository root on a machine with an NVIDIA GPU (written for an H200,
# 16 cores; about 8 minutes, most of it installing torch when the machine has none).
#
#   scripts/gpu_check.sh            # output under $OUT (default ./gpu_check_out): gpu_check.log, pytest.log, decode_*.jsonl
#
# 1. environment: a venv (.venv-gpu) over the machine's Python and its CUDA torch. On the lent H200 (no registry
#    reachable) the other packages come from .gpu-wheels/, built here by scripts/gpu_wheels.py and carried
#    (device run, carry [".gpu-wheels"]); elsewhere torch==2.13.0 and the project install from PyPI (or $WHEELHOUSE).
# 2. the GPU tests: tests/gpu/ (engine and KV transfer; and the device plumbing tests) with -x, under a time limit.
# 3. a short decode benchmark (benchmarks/engine_decode_step.py): step time at batch 1/16/64 with CUDA graphs and
#    eagerly, against the memory-bandwidth bound (weight + KV bytes / $PD_GPU_BANDWIDTH_GBPS, default 4800 GB/s: H200).
# 4. UCX: the transports ucx_info lists, and UCX_TLS.
# Exit status: the first failing step's (the later steps still run and print what they can).
set -uo pipefail

OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PD_GPU_BANDWIDTH_GBPS="${PD_GPU_BANDWIDTH_GBPS:-4800}"
PYTHON="${PYTHON:-$( [ -x /opt/torch/.venv/bin/python3 ] && echo /opt/torch/.venv/bin/python3 || echo python3)}"
VENV="${VENV:-$PWD/.venv-gpu}"
status=0
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
fail() { echo "FAILED: $*"; [ "$status" -ne 0 ] || status=1; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || fail "nvidia-smi"
"$PYTHON" --version

step "environment"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv --system-site-packages "$VENV" || { fail "venv"; exit "$status"; }
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --progress-bar off --disable-pip-version-check --retries 1 --timeout 30)
has_cuda_torch() {  # any CUDA build of torch: the lent image has its own (2.11 + CUDA 13), the project pins 2.13.0 on CPU
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null
}
if [ -d .gpu-wheels ]; then
    # offline (the lent machine reaches no registry): the wheels scripts/gpu_wheels.py gathered, carried here
    timeout 240 "${PIP[@]}" --no-index --no-deps .gpu-wheels/*.whl || fail "pip install .gpu-wheels"
    timeout 120 "${PIP[@]}" --no-index --no-deps --no-build-isolation -e . \
        || { echo "editable install failed: using PYTHONPATH"; export PYTHONPATH="$PWD:$PWD/gen${PYTHONPATH:+:$PYTHONPATH}"; }
else
    if [ -n "${WHEELHOUSE:-}" ]; then
        PIP+=(--no-index --find-links "$WHEELHOUSE")
    fi
    if has_cuda_torch; then
        echo "using the installed torch"
    else
        timeout 420 "${PIP[@]}" "torch==2.13.0" || fail "pip install torch==2.13.0"
    fi
    timeout 240 "${PIP[@]}" -e . "pytest>=8" "pytest-asyncio>=0.24" || fail "pip install -e . pytest pytest-asyncio"
fi
"$PY" - <<'EOF' || { fail "torch sees no CUDA GPU"; exit "$status"; }
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
assert torch.cuda.is_available(), "no CUDA GPU visible to torch"
p = torch.cuda.get_device_properties(0)
print(f"{p.name}: {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, capability {p.major}.{p.minor}")
EOF

step "GPU tests"
timeout 330 "$PY" -m pytest -x -q -rs -p no:cacheprovider -p no:randomly tests/test_engine_device.py tests/gpu/ \
    2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || fail "GPU tests (exit $rc; 124: time limit)"

step "decode step vs the ${PD_GPU_BANDWIDTH_GBPS} GB/s bound"
for mode in graphs eager; do
    for dtype in bfloat16 float32; do
        extra=()
        [ "$mode" = eager ] && extra=(--enforce-eager)
        echo "--- synthetic:llama-65m $dtype, $mode"
        timeout 120 "$PY" benchmarks/engine_decode_step.py --device cuda --model synthetic:llama-65m --dtype "$dtype" \
            --batches 1,16,64 --context 512 --steps 30 --bandwidth-gbps "$PD_GPU_BANDWIDTH_GBPS" "${extra[@]}" \
            | tee -a "$OUT/decode_${mode}_${dtype}.txt" || fail "decode benchmark $mode $dtype"
    done
done

step "UCX transports"
echo "UCX_TLS=${UCX_TLS:-<unset: UCX picks>}"
UCX_INFO="$(command -v ucx_info || true)"
if [ -z "$UCX_INFO" ]; then
    UCX_INFO="$("$PY" - <<'EOF' 2>/dev/null
import pathlib
try:
    import libucx
except ImportError:
    raise SystemExit
found = sorted(pathlib.Path(libucx.__file__).parent.rglob("ucx_info"))
print(found[0] if found else "")
EOF
)"
fi
if [ -n "$UCX_INFO" ] && [ -x "$UCX_INFO" ]; then
    # the wheel's binary finds its libucp beside it (lib/), not on the loader's path
    ucx_lib="$(dirname "$UCX_INFO")/../lib"
    LD_LIBRARY_PATH="$ucx_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$UCX_INFO" -v | head -2
    LD_LIBRARY_PATH="$ucx_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$UCX_INFO" -d | grep -E "Transport|Device" | sort | uniq -c
else
    echo "ucx_info not found (neither on PATH nor in the libucx wheel)"
fi
"$PY" -c 'import ucxx; print("ucxx", ucxx.__version__)' || fail "import ucxx"

step "done: exit $status"
exit "$status"
